"""draftline.pipeline.progress: the one progress line of tokenize, regenerate, extract, train."""

from __future__ import annotations

import logging

import pytest

from draftline.pipeline.progress import TOKENS, Progress

LOGGER = "draftline.test_progress"


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def make(clock: Clock, *args, **kwargs) -> Progress:
    return Progress(*args, logger=logging.getLogger(LOGGER), clock=clock, **kwargs)


def test_a_line_at_most_once_per_interval_with_rate_and_eta(caplog):
    caplog.set_level(logging.INFO, LOGGER)
    clock = Clock()
    progress = make(clock, "extract", 1000, 200, unit=TOKENS, interval=30.0)
    clock.now += 10
    progress.advance(100)  # 10 s: not due yet
    assert lines(caplog) == []
    clock.now += 20
    progress.advance(200)
    # 300 tokens this run in 30 s (the 200 found done are not counted): 500 left at 10/s.
    assert lines(caplog) == ["extract 500/1000 tok (10 tok/s, ETA 0:00:50)"]
    clock.now += 29
    progress.advance(290)
    assert len(lines(caplog)) == 1
    assert progress.tokens_per_second() == pytest.approx(590 / 59)
    progress.finish()
    assert lines(caplog)[1] == "extract 790/1000 tok (10 tok/s, ETA 0:00:21)"
    progress.finish()  # nothing new since: no second final line
    assert len(lines(caplog)) == 2


def test_units_other_than_tokens_show_the_tokens_rate_and_a_detail(caplog):
    caplog.set_level(logging.INFO, LOGGER)
    clock = Clock()
    progress = make(clock, "train", 10, 4, unit="steps", interval=0.0)
    clock.now += 2
    progress.advance_to(5, 400, "loss 1.2345 | lr 3.00e-04")
    assert lines(caplog) == ["train 5/10 steps (0.50 steps/s, 200 tok/s, ETA 0:00:10) | "
                             "loss 1.2345 | lr 3.00e-04"]
    assert progress.rate() == 0.5 and progress.tokens_per_second() == 200.0
    assert progress.eta_seconds() == 10.0


def test_the_rate_is_read_at_the_last_work_not_later():
    clock = Clock()
    progress = make(clock, "regenerate", 8, unit="samples")
    clock.now += 4
    progress.advance(4, tokens=40)
    clock.now += 100  # e.g. the engine's shutdown after the loop
    assert progress.rate() == 1.0 and progress.tokens_per_second() == 10.0


def test_a_callable_total_is_counted_once_and_only_when_a_line_is_due(caplog):
    caplog.set_level(logging.INFO, LOGGER)
    clock, counted = Clock(), []

    def total() -> int:
        counted.append(1)
        return 50

    progress = make(clock, "tokenize", total, unit="records", interval=30.0)
    clock.now += 1
    progress.advance_to(10, detail="0 skipped")
    assert counted == []  # a short run never counts its input
    clock.now += 29
    progress.advance_to(30, detail="2 skipped")
    clock.now += 30
    progress.advance_to(40, detail="3 skipped")
    assert counted == [1]
    assert lines(caplog) == ["tokenize 30/50 records (1.00 records/s, ETA 0:00:20) | 2 skipped",
                             "tokenize 40/50 records (0.67 records/s, ETA 0:00:15) | 3 skipped"]


def test_quiet_never_logs_and_no_work_has_no_eta(caplog):
    caplog.set_level(logging.INFO, LOGGER)
    clock = Clock()
    quiet = make(clock, "extract", 0, unit=TOKENS, quiet=True, interval=0.0)
    quiet.advance(5)
    quiet.finish()
    assert lines(caplog) == []
    idle = make(clock, "regenerate", 4, 1, unit="samples")
    assert idle.eta_seconds() is None and idle.rate() == 0.0
    assert idle.line() == "regenerate 1/4 samples (0.00 samples/s, ETA ?)"
    idle.finish()  # nothing done this run: no line
    assert lines(caplog) == []
    with pytest.raises(ValueError, match="interval must be >= 0"):
        make(clock, "x", 1, unit="steps", interval=-1)
