"""Statistics of acceptance: per-position counts, tau, seeded bootstrap CIs over samples and the
paired difference of two proposers on the same units.
"""

from __future__ import annotations

import dataclasses

import torch


# --------------------------------------------------------------------------- statistics


@dataclasses.dataclass
class Counts:
    """Per-sample sufficient statistics: steps, and steps with >= j accepted for j = 0..k."""

    at_least: torch.Tensor  # [samples, k + 1] int64; column 0 = number of steps

    @classmethod
    def from_lengths(cls, lengths: list[torch.Tensor], k: int) -> "Counts":
        rows = [(a[:, None] >= torch.arange(k + 1)[None, :]).long().sum(0) for a in lengths]
        return cls(torch.stack(rows) if rows else torch.zeros(0, k + 1, dtype=torch.long))


def summarize(at_least: torch.Tensor) -> dict:
    """tau and per-position conditional acceptance from summed counts [k + 1]."""
    steps = int(at_least[0])
    k = len(at_least) - 1
    tau = 1 + float(at_least[1:].sum()) / max(steps, 1)
    conditional = [float(at_least[j]) / float(at_least[j - 1]) if at_least[j - 1] else float("nan")
                   for j in range(1, k + 1)]
    return {"tau": tau, "acceptance": conditional, "steps": steps,
            "accepted_histogram": [int(at_least[j] - (at_least[j + 1] if j < k else 0))
                                   for j in range(k + 1)]}


def bootstrap(counts: Counts, resamples: int, level: float, seed: int) -> dict:
    """Point estimates plus percentile-bootstrap CIs over samples (rows of ``counts``)."""
    point = summarize(counts.at_least.sum(0))
    n = counts.at_least.shape[0]
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, n, (resamples, n), generator=generator)  # [B, n]
    totals = counts.at_least[picks].sum(1).double()  # [B, k + 1]
    taus = 1 + totals[:, 1:].sum(-1) / totals[:, 0].clamp(min=1)  # [B]
    conditional = totals[:, 1:] / totals[:, :-1].clamp(min=1)  # [B, k]
    lo, hi = (1 - level) / 2, 1 - (1 - level) / 2
    q = torch.tensor([lo, hi], dtype=torch.double)
    point["tau_ci"] = torch.quantile(taus, q).tolist()
    point["acceptance_ci"] = torch.quantile(conditional, q, dim=0).T.tolist()
    point["samples"] = n
    return point


# --------------------------------------------------------------------------- paired difference


def _statistic(totals: torch.Tensor, which: str) -> torch.Tensor:
    """tau or conditional acceptance at position j ("p1", "p2", ...) from counts [..., k + 1]."""
    if which == "tau":
        return 1 + totals[..., 1:].sum(-1) / totals[..., 0].clamp(min=1)
    j = int(which[1:])
    return totals[..., j] / totals[..., j - 1].clamp(min=1)


def paired_difference(a: Counts, b: Counts, which: str, resamples: int, level: float,
                      seed: int) -> dict:
    """a - b of one statistic, with a paired percentile-bootstrap CI (rows = the same units).

    They agree when the CI contains 0.
    """
    if a.at_least.shape != b.at_least.shape:
        raise ValueError("paired counts need the same units")
    n = a.at_least.shape[0]
    picks = torch.randint(0, n, (resamples, n), generator=torch.Generator().manual_seed(seed))
    diffs = (_statistic(a.at_least[picks].sum(1).double(), which)
             - _statistic(b.at_least[picks].sum(1).double(), which))  # [B]
    lo, hi = torch.quantile(diffs, torch.tensor([(1 - level) / 2, (1 + level) / 2],
                                                dtype=torch.double)).tolist()
    point = float(_statistic(a.at_least.sum(0).double(), which)
                  - _statistic(b.at_least.sum(0).double(), which))
    return {"statistic": which, "difference": point, "ci": [lo, hi], "agrees": lo <= 0 <= hi}


def mean_paired_difference(pairs: list[tuple[Counts, Counts]], which: str, resamples: int,
                           level: float, seed: int) -> dict:
    """The mean over runs (e.g. training seeds) of a - b, each pair (a, b) on the same units,
    with a percentile-bootstrap CI that resamples the units with the same picks in every
    pair (the units, such as held-out replies, are shared by all runs). It covers the units'
    sampling noise for these runs; the spread between runs is in ``per_run``."""
    if not pairs or any(a.at_least.shape != b.at_least.shape for a, b in pairs):
        raise ValueError("paired counts need the same units")
    n = pairs[0][0].at_least.shape[0]
    if any(a.at_least.shape[0] != n for a, _ in pairs):
        raise ValueError("every run must be measured on the same units")
    picks = torch.randint(0, n, (resamples, n), generator=torch.Generator().manual_seed(seed))
    diffs = torch.stack([_statistic(a.at_least[picks].sum(1).double(), which)
                         - _statistic(b.at_least[picks].sum(1).double(), which)
                         for a, b in pairs]).mean(0)  # [B]
    lo, hi = torch.quantile(diffs, torch.tensor([(1 - level) / 2, (1 + level) / 2],
                                                dtype=torch.double)).tolist()
    per_run = [float(_statistic(a.at_least.sum(0).double(), which)
                     - _statistic(b.at_least.sum(0).double(), which)) for a, b in pairs]
    return {"statistic": which, "difference": sum(per_run) / len(per_run), "ci": [lo, hi],
            "ci_width": hi - lo, "per_run": per_run, "runs": len(pairs), "units": n}
