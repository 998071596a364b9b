"""Per-step timing of a training loop: how long each step waited for its batch.

A step is input-bound when the device sits idle while the host waits for data.  Two figures
per step say so: the host's wait (wall time between asking the loader for the next batch and
getting it) and, on CUDA, the device's idle time (from the previous step's last kernel to this
step's first, read off two CUDA events on the compute stream).  A median hides a few long
stalls, so the summary gives p50, p90 and max, and keeps the start-up steps (those whose batch
was asked for before the loader had ever filled its prefetch) apart from the steady state a
run of thousands of steps spends its time in.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

__all__ = ["INPUT_BOUND_SHARE", "StepClock", "StepTime", "distribution"]

# A steady state that spends more than this share of its step time waiting for data is
# reported input-bound (issue 33's aim: from disk >= 0.97 of the resident rate).
INPUT_BOUND_SHARE = 0.03


@dataclasses.dataclass
class StepTime:
    wait_ms: float  # host: asking for the batch -> holding it
    step_ms: float  # host: asking for the batch -> the step's metrics read back
    idle_ms: float | None  # device idle before the step's first kernel; None: not measured
    startup: bool  # the batch was asked for before the loader's first full prefetch


def distribution(values: Iterable[float]) -> dict[str, float] | None:
    """p50, p90, max and total of ``values`` (ms); None when there are none."""
    array = np.asarray(list(values), dtype=np.float64)
    if not array.size:
        return None
    return {"p50": float(np.percentile(array, 50)), "p90": float(np.percentile(array, 90)),
            "max": float(array.max()), "total": float(array.sum())}


class StepClock:
    """Times the steps of a loop over ``batches``.

    Use: ``for batch in clock.timed(batches): step(batch); clock.step_done()``.
    ``primed`` returns the ``time.perf_counter()`` at which the loader first held its whole
    prefetch (None until then); without it every step counts as steady state.
    """

    def __init__(self, device: str | torch.device,
                 primed: Callable[[], float | None] | None = None):
        self.cuda = torch.device(device).type == "cuda"
        self.primed = primed
        self.steps: list[StepTime] = []
        self.started: float | None = None  # first request for a batch
        self._asked = 0.0  # perf_counter when the current step asked for its batch
        self._waited = 0.0  # ms the current step waited for it
        self._startup = False
        self._last_end: torch.cuda.Event | None = None  # previous step's last kernel
        self._begin: torch.cuda.Event | None = None  # this step's first kernel

    def timed(self, batches: Iterable) -> Iterator:
        iterator = iter(batches)
        while True:
            self._asked = time.perf_counter()
            if self.started is None:
                self.started = self._asked
            self._startup = self._before_priming(self._asked)
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self._waited = (time.perf_counter() - self._asked) * 1e3
            self._begin = self._event()
            yield batch

    def _before_priming(self, when: float) -> bool:
        if self.primed is None:
            return False
        primed = self.primed()
        return primed is None or when < primed

    def _event(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step_done(self) -> StepTime:
        """Close the step begun by the last batch ``timed`` yielded; return its times."""
        idle = None
        if self._last_end is not None and self._begin is not None:
            self._begin.synchronize()  # done already: the step read its metrics back
            idle = self._last_end.elapsed_time(self._begin)
        self._last_end = self._event()
        step = StepTime(self._waited, (time.perf_counter() - self._asked) * 1e3, idle,
                        self._startup)
        self.steps.append(step)
        return step

    def startup_seconds(self) -> float | None:
        """Time from the first request to the loader's first full prefetch (None: unknown)."""
        primed = self.primed() if self.primed is not None else None
        if primed is None or self.started is None:
            return None
        return max(0.0, primed - self.started)

    def summary(self, steps: Iterable[StepTime] | None = None) -> dict:
        """The start-up and steady-state distributions, and whether the run is input-bound."""
        chosen = list(self.steps if steps is None else steps)
        startup = [s for s in chosen if s.startup]
        steady = [s for s in chosen if not s.startup]
        return {"startup_seconds": self.startup_seconds(),
                "startup": _part(startup), "steady": _part(steady),
                "input_bound": _input_bound(steady)}


def _part(steps: list[StepTime]) -> dict:
    idle = [s.idle_ms for s in steps if s.idle_ms is not None]
    return {"steps": len(steps),
            "wait_ms": distribution(s.wait_ms for s in steps),
            "step_ms": distribution(s.step_ms for s in steps),
            "idle_ms": distribution(idle)}


def _input_bound(steps: list[StepTime]) -> bool | None:
    """The steady state waited more than INPUT_BOUND_SHARE of its time (None: no steps)."""
    if not steps:
        return None
    total = sum(s.step_ms for s in steps)
    return total > 0 and sum(s.wait_ms for s in steps) / total > INPUT_BOUND_SHARE
