"""Per-step timing of training (``draftline.train.timing``): the wait for data, its
distribution, start-up apart from the steady state, and the loader's end of start-up."""

import json
import time

import torch

from draftline.train.timing import INPUT_BOUND_SHARE, StepClock, StepTime, distribution


class SlowLoader:
    """Batches 0..n-1; asking for batch i sleeps ``delays[i]`` seconds. Primed once the
    first ``prime_after`` batches are ready (0: from the start; None: never)."""

    def __init__(self, delays: list[float], prime_after: int | None = 0):
        self.delays, self.prime_after = delays, prime_after
        self.primed_at = time.perf_counter() if prime_after == 0 else None

    def __iter__(self):
        for number, delay in enumerate(self.delays):
            time.sleep(delay)
            if self.prime_after is not None and number + 1 == self.prime_after:
                self.primed_at = time.perf_counter()
            yield number


def run(clock: StepClock, loader, step_s: float = 0.0) -> list[int]:
    seen = []
    for batch in clock.timed(loader):
        time.sleep(step_s)
        seen.append(batch)
        clock.step_done()
    return seen


def test_the_distribution_gives_median_p90_max_and_total():
    found = distribution(float(v) for v in range(1, 11))
    assert found == {"p50": 5.5, "p90": 9.1, "max": 10.0, "total": 55.0}
    assert distribution([]) is None


def test_a_stalled_step_shows_in_the_wait_not_in_the_median():
    loader = SlowLoader([0.0] * 8 + [0.2] + [0.0])
    clock = StepClock("cpu", lambda: loader.primed_at)
    assert run(clock, loader, step_s=0.01) == list(range(10))  # every batch, in order
    waits = [s.wait_ms for s in clock.steps]
    assert waits[8] >= 200 and max(waits[:8] + waits[9:]) < 50
    steady = clock.summary()["steady"]
    assert steady["wait_ms"]["max"] >= 200 and steady["wait_ms"]["p50"] < 50
    assert steady["step_ms"]["max"] >= steady["wait_ms"]["max"]
    assert steady["idle_ms"] is None  # no CUDA events on CPU
    assert clock.summary()["input_bound"] is True


def test_input_bound_is_a_steady_wait_over_its_share_of_the_step_time():
    clock = StepClock("cpu")
    fed = [StepTime(1.0, 100.0, None, False)] * 9  # 1% waiting
    stalled = fed + [StepTime(30.0, 130.0, None, False)]  # 39 / 1030 = 3.8% waiting
    start = [StepTime(500.0, 600.0, None, True)]
    assert clock.summary(fed)["input_bound"] is False
    assert clock.summary(stalled)["input_bound"] is True
    assert clock.summary(start + fed)["input_bound"] is False  # start-up does not count
    assert INPUT_BOUND_SHARE == 0.03


def test_steps_before_the_first_full_prefetch_are_start_up():
    loader = SlowLoader([0.05, 0.05, 0.0, 0.0, 0.0], prime_after=2)
    clock = StepClock("cpu", lambda: loader.primed_at)
    run(clock, loader, step_s=0.02)
    assert [s.startup for s in clock.steps] == [True, True, False, False, False]
    summary = clock.summary()
    assert summary["startup"]["steps"] == 2 and summary["steady"]["steps"] == 3
    assert 0.1 <= summary["startup_seconds"] < 0.3  # two 50 ms batches and a 20 ms step
    assert summary["input_bound"] is False  # the slow start alone is not the steady state
    json.dumps(summary)  # what the train stage's manifest holds


def test_a_loader_that_never_primes_is_all_start_up():
    loader = SlowLoader([0.0] * 3, prime_after=None)
    clock = StepClock("cpu", lambda: loader.primed_at)
    run(clock, loader)
    summary = clock.summary()
    assert summary["startup"]["steps"] == 3 and summary["steady"]["steps"] == 0
    assert summary["startup_seconds"] is None and summary["input_bound"] is None


def test_the_benchmark_times_each_step_and_keeps_start_up_out_of_the_steady_rate(capsys):
    """benchmarks.train's timed_steps goes through StepClock: per-step waits, start-up steps
    out of the steady tokens/s; its table sets each disk run against resident and anchor."""
    from benchmarks.train import Dims, RunResult, print_summary, timed_steps

    dims = Dims(64, 224, 1, 1, 64, 512, 128, 1, 3)
    batch = {"lengths": torch.tensor([60, 40]), "input_ids": torch.zeros(1, 100)}
    loader = SlowLoader([0.0, 0.15, 0.0, 0.0, 0.0], prime_after=2)

    def step(_batch):
        time.sleep(0.01)
        return {"loss": 1.0}

    result = timed_steps("bf16 disk", step, "cpu", ({**batch} for _ in loader), dims,
                         warmup=1, steps=4, primed=lambda: loader.primed_at)
    assert len(result.wait_ms) == len(result.step_ms) == 4 and result.wait_ms[0] >= 150
    assert result.tokens == 400 and result.steady_tokens == 300  # the first timed step: start-up
    assert result.steady_tokens_per_second > result.tokens_per_second
    assert result.summary()["wait_ms"]["max"] >= 150
    resident = RunResult("bf16 resident", tokens=400, positions=400, seconds=0.04,
                         step_ms=[10.0] * 4, wait_ms=[0.0] * 4)
    anchor = RunResult("anchor (speculators)", tokens=200, positions=400, seconds=0.04,
                       step_ms=[10.0] * 4, wait_ms=[0.0] * 4)
    print_summary({"anchor (speculators)": anchor, "bf16 resident": resident,
                   "bf16 disk": result}, compare=False)
    out = capsys.readouterr().out
    assert "bf16 disk / resident: tokens/s" in out and "bf16 resident / anchor tokens/s: 2.000" in out
