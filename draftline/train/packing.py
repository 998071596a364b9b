"""Step planning: which samples go into each optimizer step, packed to fill its token budget.

speculators 0.3.0's ``MultipackDistributedBatchSamplerV2`` (the planner before this one) packs
consecutive samples of a shuffled epoch and closes a step at the first sample that does not
fit, so a step's slack is whatever the next sample happened to overshoot by: measured fill
(real tokens / token budget) 0.93 at Llama-3.1-8B benchmark dims and 0.92 at Kimi-K2.5 dims.
The draft computes on the padding too, so fill is throughput.

Here each step is packed from a *window* of the shuffled epoch (the next ``window`` samples
not yet placed):

1. the earliest sample in the window opens the step (so no sample waits longer than the
   window: every step places the oldest one), then the following ones in shuffled order join
   while they fit;
2. best fit: the longest window sample that fits the remaining gap joins, until none fits;
3. swaps: a sample of the step (not the one that opened it) is traded for a longer window
   sample that still fits, the trade that closes the most gap first, a few times.

A step's composition stays random (it opens with the window's oldest samples, in shuffled
order); only its last few places are chosen for their length.  The epoch's last steps, where the
window runs dry, are the least full and stay last.  Fill (``python -m benchmarks.packing``):
0.999 at both benchmark dims, 0.988 on the embedded run (432 samples in 512-token steps), 0.9998
on a synthetic kimi-k2.5 shape (samples up to 4,096 tokens, 8,192-token steps).

Several ranks: the epoch is packed once into bins of one rank's budget, consecutive bins form
a global step, and rank r takes bin r of each step; the bin count is made a multiple of the
world size by splitting the epoch's last bins (those hold the least anyway), so every rank gets
the same number of steps and the shares of a step are disjoint and cover it.

Determinism: the plan is a function of (lengths, budget, seed, epoch, world size, window) only;
the shuffle is ``numpy.random.default_rng([seed, epoch])`` (speculators used ``seed + epoch``,
which makes seed 1's epoch 0 seed 0's epoch 1).

Global steps over epochs (the training loop's view, the end of this module): ``plan_steps``
lists ``(epoch, sample indices)`` for a range of global steps, epoch after epoch, so a resumed
run replays exactly the batches an uninterrupted one would have seen; ``steps_in_epochs``
counts the steps of whole epochs (the count varies per epoch).
"""

from __future__ import annotations

import bisect
import heapq
import logging
from collections.abc import Sequence

import numpy as np

__all__ = [
    "PACKING",
    "StepPlanner",
    "fill_of",
    "pack_bins",
    "step_fills",
    "make_sampler",
    "epoch_batches",
    "steps_in_epochs",
    "plan_steps",
]

log = logging.getLogger(__name__)

# Recorded in a training run's spec and key: a checkpoint planned by another planner is not
# resumed (its remaining steps would come from a different plan).
PACKING = "window-fill-1"
WINDOW = 512  # samples a step may be drawn from (count); see benchmarks/packing.py for fills
MAX_SWAPS = 4  # trades per step (count); the gap is usually closed after one or two


class _Window:
    """The samples not yet placed, by stream position (oldest first) and by length.

    Keys are ``length * n + position``: one sorted list of ints answers "longest sample of at
    most g tokens" with a bisect, ties broken by position, so the result is deterministic.
    """

    def __init__(self, lengths: np.ndarray, order: np.ndarray):
        self.lengths = lengths  # [n] tokens per stream position (already in shuffled order)
        self.order = order  # [n] dataset index per stream position
        self.n = len(lengths)
        self.by_length: list[int] = []
        self.oldest: list[int] = []  # heap of positions, stale entries skipped
        self.inside = np.zeros(self.n, dtype=bool)
        self.next = 0  # next stream position to enter

    def __len__(self) -> int:
        return len(self.by_length)

    def refill(self, size: int) -> None:
        while len(self) < size and self.next < self.n:
            self.add(self.next)
            self.next += 1

    def add(self, position: int) -> None:
        bisect.insort(self.by_length, int(self.lengths[position]) * self.n + position)
        heapq.heappush(self.oldest, position)
        self.inside[position] = True

    def remove(self, position: int) -> int:
        key = int(self.lengths[position]) * self.n + position
        del self.by_length[bisect.bisect_left(self.by_length, key)]
        self.inside[position] = False
        return int(self.lengths[position])

    def peek_oldest(self) -> int | None:
        while self.oldest and not self.inside[self.oldest[0]]:
            heapq.heappop(self.oldest)
        return self.oldest[0] if self.oldest else None

    def longest_within(self, gap: int) -> int | None:
        """Position of the longest sample of at most ``gap`` tokens, or None."""
        index = bisect.bisect_left(self.by_length, (gap + 1) * self.n) - 1
        return self.by_length[index] % self.n if index >= 0 else None


def _pack_one(window: _Window, budget: int) -> list[int]:
    """Stream positions of one bin (see the module docstring's three steps)."""
    first = window.peek_oldest()
    bin_ = [first]
    gap = budget - window.remove(first)
    while (oldest := window.peek_oldest()) is not None and window.lengths[oldest] <= gap:
        bin_.append(oldest)
        gap -= window.remove(oldest)
    gap = _best_fit(window, bin_, gap)
    for _ in range(MAX_SWAPS):
        if gap == 0 or not _swap(window, bin_, gap):
            break
        gap = _best_fit(window, bin_, budget - int(window.lengths[bin_].sum()))
    return bin_


def _best_fit(window: _Window, bin_: list[int], gap: int) -> int:
    while gap > 0 and (found := window.longest_within(gap)) is not None:
        bin_.append(found)
        gap -= window.remove(found)
    return gap


def _swap(window: _Window, bin_: list[int], gap: int) -> bool:
    """Trade one sample (not the first) for the longest window sample that still fits."""
    best_gain, best = 0, None
    for slot in range(1, len(bin_)):
        length = int(window.lengths[bin_[slot]])
        found = window.longest_within(length + gap)
        if found is not None and (gain := int(window.lengths[found]) - length) > best_gain:
            best_gain, best = gain, (slot, found)
    if best is None:
        return False
    slot, found = best
    window.remove(found)
    window.add(bin_[slot])
    bin_[slot] = found
    return True


def _split(bin_: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A bin of >= 2 samples as two, longest first to the lighter half (LPT)."""
    halves: list[list[int]] = [[], []]
    loads = [0, 0]
    for index in sorted(bin_.tolist(), key=lambda i: (-lengths[i], i)):
        lighter = loads.index(min(loads))
        halves[lighter].append(index)
        loads[lighter] += int(lengths[index])
    return np.array(halves[0], dtype=np.int64), np.array(halves[1], dtype=np.int64)


def _divisible(bins: list[np.ndarray], lengths: np.ndarray, world_size: int) -> list[np.ndarray]:
    """``bins`` made a multiple of ``world_size`` long by splitting the last splittable ones."""
    bins = list(bins)
    while len(bins) % world_size:
        at = next((i for i in range(len(bins) - 1, -1, -1) if len(bins[i]) > 1), None)
        if at is None:
            dropped = len(bins) % world_size
            log.warning("packing: %d sample(s) left over for %d ranks, each alone in its step "
                        "and too few to give every rank one: left out of this epoch",
                        sum(len(b) for b in bins[-dropped:]), world_size)
            return bins[:-dropped]
        bins[at:at + 1] = _split(bins[at], lengths)
    return bins


def pack_bins(lengths: Sequence[int], budget: int, seed: int, epoch: int,
              window: int = WINDOW) -> list[np.ndarray]:
    """Dataset indices of each bin of ``budget`` tokens for one epoch, in training order.

    Samples longer than the budget count as the budget (collate cuts them) and fill a bin
    alone.  Every sample is in exactly one bin.
    """
    clipped = np.minimum(np.asarray(lengths, dtype=np.int64), budget)
    order = np.random.default_rng([seed, epoch]).permutation(len(clipped))
    stream = _Window(clipped[order], order)
    bins = []
    while True:
        stream.refill(window)
        if not len(stream):
            return bins
        bins.append(order[np.array(_pack_one(stream, budget), dtype=np.int64)])


def step_fills(batches: Sequence[np.ndarray], lengths: Sequence[int] | np.ndarray,
               budget: int) -> np.ndarray:
    """[steps] real tokens / token budget of each batch (a sample over the budget counts as
    the budget: collate cuts it there)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.array([np.minimum(lengths[b], budget).sum() / budget for b in batches])


def fill_of(batches: Sequence[np.ndarray], lengths: Sequence[int] | np.ndarray,
            budget: int) -> float:
    """Real tokens / token budget over ``batches``."""
    return float(step_fills(batches, lengths, budget).mean())


class StepPlanner:
    """This rank's batches of each epoch: ``batches(epoch)`` -> [dataset indices per step].

    ``max_tokens`` is one rank's budget.  The last epoch asked for is cached (planning an
    epoch of ~100k samples takes about a second).
    """

    def __init__(self, lengths: Sequence[int], max_tokens: int, seed: int, rank: int = 0,
                 world_size: int = 1, window: int = WINDOW):
        if max_tokens < 1 or window < 1:
            raise ValueError(f"max_tokens ({max_tokens}) and window ({window}) must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not one of {world_size} ranks")
        if min(lengths, default=1) < 1:
            raise ValueError(f"every sample needs at least one token, got {min(lengths)}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.max_tokens, self.seed, self.window = max_tokens, seed, window
        self.rank, self.world_size = rank, world_size
        self._cached: tuple[int, list[list[np.ndarray]]] | None = None

    def steps(self, epoch: int) -> list[list[np.ndarray]]:
        """Every rank's batch of each global step: ``[step][rank]`` -> dataset indices."""
        if self._cached is None or self._cached[0] != epoch:
            bins = pack_bins(self.lengths, self.max_tokens, self.seed, epoch, self.window)
            bins = _divisible(bins, self.lengths, self.world_size)
            ranks = self.world_size
            self._cached = (epoch, [bins[i:i + ranks] for i in range(0, len(bins), ranks)])
        return self._cached[1]

    def batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's sample indices of each packed batch of one epoch, in training order."""
        return [step[self.rank] for step in self.steps(epoch)]


# --------------------------------------------------------------------------- steps over epochs


def make_sampler(lengths: Sequence[int], max_tokens: int, seed: int, rank: int = 0,
                 world_size: int = 1) -> StepPlanner:
    """The training loop's planner: ``StepPlanner`` with the default window; its order
    depends on seed + epoch.

    ``max_tokens`` is one process's budget.  With several processes (torchrun) each passes
    its rank: the planner packs once for all of them and deals rank r its own batches.
    """
    return StepPlanner(lengths, max_tokens, seed, rank, world_size)


def epoch_batches(sampler: StepPlanner, epoch: int) -> list[np.ndarray]:
    """Sample indices of each packed batch of one epoch, in training order
    (``sampler.batches``; ``plan_steps`` needs nothing else of a sampler)."""
    return sampler.batches(epoch)


def steps_in_epochs(sampler: StepPlanner, epochs: int) -> int:
    """Optimizer steps in ``epochs`` passes (the packing, so the count, varies per epoch)."""
    return sum(len(epoch_batches(sampler, epoch)) for epoch in range(epochs))


def plan_steps(sampler: StepPlanner, start_step: int,
               total_steps: int) -> list[tuple[int, np.ndarray]]:
    """``(epoch, sample indices)`` for global steps ``start_step .. total_steps - 1``.

    The plan is a pure function of the sampler's seed and the step range, which is what
    makes a resumed run see exactly the batches an uninterrupted run would have seen.
    """
    plan: list[tuple[int, np.ndarray]] = []
    step, epoch = 0, 0
    while step < total_steps:
        batches = epoch_batches(sampler, epoch)
        if not batches:
            raise ValueError("the split packs into zero batches")
        for batch in batches[: total_steps - step]:
            if step >= start_step:
                plan.append((epoch, batch))
            step += 1
        epoch += 1
    return plan
