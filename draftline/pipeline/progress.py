"""Progress of a stage's long loop: done/total, rate, ETA, one log line at a bounded interval.

Every stage that works through a known amount of work (tokenize's records, regenerate's
samples, extract's tokens, train's steps) reports it through ``Progress``, so the lines read
alike::

    extract 40960/131072 tok (2150 tok/s, ETA 0:00:42)
    train 5/10 steps (0.50 steps/s, 200 tok/s, ETA 0:00:10) | loss 1.2345 | ...

Rates count only the work this run does: what a resumed run found already done counts
toward ``done`` but not toward the rate, so the ETA is not flattered by earlier runs.
Standard library only.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable

INTERVAL_SECONDS = 30.0  # default: at most one line this often (a line per step: 0)
TOKENS = "tok"  # the unit whose rate is the tokens' rate

_log = logging.getLogger(__name__)


class Progress:
    """``done`` of ``total`` ``unit`` of one stage's work, and the tokens it took: the units
    themselves when ``unit`` is ``TOKENS``, else the ``tokens`` passed with each advance.

    ``total`` may be a callable, resolved when the first line is due: counting can cost a
    pass over the input, which short runs that never report should not pay.  ``quiet``
    never logs (an extraction replica, whose parent reports for all replicas).
    """

    def __init__(self, name: str, total: int | Callable[[], int], done: int = 0, *,
                 unit: str, interval: float = INTERVAL_SECONDS, quiet: bool = False,
                 logger: logging.Logger | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if interval < 0:
            raise ValueError(f"progress interval must be >= 0 seconds, got {interval}")
        self.name, self.unit, self.interval, self.quiet = name, unit, interval, quiet
        self._total = total
        self.done = self.first = done
        self.tokens = 0  # counted this run only
        self._log = logger or _log
        self._clock = clock
        self.start = self.last_line = self.last_work = clock()
        self._unlogged = False

    @property
    def total(self) -> int:
        if callable(self._total):
            self._total = int(self._total())
        return self._total

    def advance(self, n: int, tokens: int = 0, detail: str = "") -> None:
        """``n`` more units done (and ``tokens`` more tokens); log if a line is due."""
        self.advance_to(self.done + n, tokens, detail)

    def advance_to(self, done: int, tokens: int = 0, detail: str = "") -> None:
        """``done`` units done in all (``tokens`` more tokens); log if a line is due.
        ``detail`` is appended to the line (e.g. a step's loss)."""
        self.done = done
        self.tokens += tokens
        self.last_work = self._clock()
        self._unlogged = True
        if not self.quiet and self.last_work - self.last_line >= self.interval:
            self._emit(detail)

    def finish(self) -> None:
        """A last line for the work not yet reported (none when quiet or nothing new)."""
        if self._unlogged and not self.quiet:
            self._emit("")

    def _emit(self, detail: str) -> None:
        self.last_line = self._clock()
        self._unlogged = False
        self._log.info("%s", self.line() + (f" | {detail}" if detail else ""))

    def _elapsed(self) -> float:
        # Up to the last unit of work, so a rate read after the loop ends (for a manifest)
        # leaves out the shutdown that follows it.
        return max(self.last_work - self.start, 1e-9)

    def rate(self) -> float:
        """Units per second this run."""
        return (self.done - self.first) / self._elapsed()

    def tokens_per_second(self) -> float:
        """Tokens per second this run."""
        tokens = self.done - self.first if self.unit == TOKENS else self.tokens
        return tokens / self._elapsed()

    def eta_seconds(self) -> float | None:
        """Seconds left at this run's rate; None before any unit was done."""
        rate = self.rate()
        return max(self.total - self.done, 0) / rate if rate > 0 else None

    def line(self) -> str:
        """``NAME done/total UNIT (rate UNIT/s[, tokens tok/s], ETA h:mm:ss)``."""
        rates = [f"{_number(self.rate())} {self.unit}/s"]
        if self.unit != TOKENS and self.tokens:
            rates.append(f"{self.tokens_per_second():.0f} tok/s")
        eta = self.eta_seconds()
        rates.append("ETA " + ("?" if eta is None else str(datetime.timedelta(seconds=round(eta)))))
        return f"{self.name} {self.done}/{self.total} {self.unit} ({', '.join(rates)})"


def _number(rate: float) -> str:
    """Two decimals below 10 per second (steps), whole numbers above (tokens, records)."""
    return f"{rate:.2f}" if rate < 10 else f"{rate:.0f}"
