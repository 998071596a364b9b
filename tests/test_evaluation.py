"""Draft evaluation: alignment, statistics, baselines, the serving-style rollout, acceptance in
vLLM against the offline walk, vLLM loadability, the tau gate.

Default tier: synthetic data and a tiny random target/draft built here (about a minute, the
vLLM load check included).  `slow` tier: the gated smoke run EXP=tiny-trained (built by
`make target` / `make report EXP=tiny-trained`, or here when missing): the draft beats both
baselines, vLLM's own acceptance agrees with the offline simulation, the gate passes and catches a
draft with a shuffled d2t.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftline import errors, formats
from draftline.engine import EngineOptions
from draftline.evaluate import in_vllm, offline, rollout, stats
from draftline.evaluate.gate import failures as gate_failures, judge, versus_best_baseline
from draftline.evaluate.run import check_features
from draftline.regenerate import greedy
from draftline.train import vllm_parse
from harness.drafts import overfit_draft

from conftest import REPO, compose
from helpers import run_make

GATE = REPO / "tests/assets/tau_gate.json"


# --------------------------------------------------------------------------- synthetic data


def sample(ids: list[int], mask: list[int], target_next: list[int], hidden: int = 4) -> offline.Sample:
    T = len(ids)
    return offline.Sample(torch.tensor(ids), torch.tensor(mask, dtype=torch.bool),
                     torch.zeros(T, 3 * hidden), torch.tensor(target_next))


class Oracle:
    """Proposes the target's greedy tokens shifted by ``shift`` positions (0 = always right)."""

    name = "oracle"

    def __init__(self, shift: int = 0):
        self.shift = shift

    def propose(self, s: offline.Sample, starts: torch.Tensor, k: int) -> torch.Tensor:
        offsets = starts[:, None] + 1 + self.shift + torch.arange(k)[None, :]  # [S, k]
        offsets = offsets.clamp(max=len(s.input_ids) - 1)
        return s.target_next[offsets]


def test_scored_starts_lie_inside_replies():
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    # k=2: start t needs mask[t+1..t+3]; reply 2..6 gives t=1,2,3; reply 8..11 gives t=7,8.
    assert offline.valid_starts(mask, 2).tolist() == [1, 2, 3, 7, 8]
    assert offline.reply_starts(mask) == [2, 8]


def test_walk_moves_on_by_accepted_plus_one():
    mask = torch.tensor([0] + [1] * 12, dtype=torch.bool)
    starts = offline.valid_starts(mask, 2)  # t = 0 .. 9
    accepted = torch.tensor([2, 0, 0, 1, 0, 0, 0, 0, 0, 0])
    # t=0 (a=2) -> t=3 (a=1) -> t=5 (a=0) -> t=6 -> ... -> t=9 -> t=10 is not scored.
    assert starts[offline.walk(mask, starts, accepted)].tolist() == [0, 3, 5, 6, 7, 8, 9]


def test_the_walk_is_over_the_reply_window_not_the_samples_whole_mask():
    """A held-out reply is scored over its own window [a, b), whatever else the sample masks
    (another turn's reply): vLLM decodes that one reply, so the walk must take its steps only."""
    replies, k = flaky_replies(), 3
    steps = offline_steps(replies, k)
    widened = [(dataclasses.replace(s, loss_mask=torch.ones_like(s.loss_mask)), a, b) for s, a, b in replies]
    result = in_vllm.vllm_vs_offline(widened, as_vllm_measures(replies, steps), Flaky(), k, STATS)
    assert result["agrees"] and result["diverging_replies"] == 0
    assert result["shared_steps"] == sum(len(s) for s in steps)


class WrongAt:
    """The target's tokens, except always a wrong one at chain position ``at``: no step
    accepts more than ``at`` tokens, so the later positions are never reached."""

    name = "wrong-at"

    def __init__(self, at: int):
        self.at = at

    def propose(self, s: offline.Sample, starts: torch.Tensor, k: int) -> torch.Tensor:
        proposals = Oracle(0).propose(s, starts, k)
        proposals[:, self.at] = -1
        return proposals


def test_positions_no_step_reached_do_not_read_as_disagreeing():
    """k = 7 with every chain wrong at its third token: positions 4..7 have no rate in either
    walk (NaN). vLLM measuring exactly the offline walk must agree; a real difference at a
    reached position still must not."""
    replies, k, proposer = flaky_replies(), 7, WrongAt(2)
    steps = offline_steps(replies, k, proposer)
    assert max(max(s) for s in steps) == 2
    result = in_vllm.vllm_vs_offline(replies, as_vllm_measures(replies, steps), proposer, k, STATS)
    acceptance = result["vllm"]["acceptance"]
    assert acceptance[2] == 0 and all(rate != rate for rate in acceptance[3:])
    assert result["agrees"], result["vllm_acceptance_inside_offline_ci"]
    fewer = [[min(a, 1) for a in s] for s in steps]  # vLLM never accepting a second token
    assert not in_vllm.vllm_vs_offline(replies, as_vllm_measures(replies, fewer), proposer, k, STATS)["agrees"]


def test_empty_walks_and_proposals_stay_integer_tensors():
    nothing = offline.walk(torch.zeros(4, dtype=torch.bool), torch.tensor([0, 1]), torch.tensor([0, 0]))
    assert nothing.tolist() == [] and nothing.dtype == torch.long
    assert stats.Counts.from_lengths([], 3).at_least.dtype == torch.long
    bigram = offline.baseline_drafts(torch.tensor([0, 3, 1]), torch.ones(3, 3, dtype=torch.long))[1]
    none = bigram.propose(sample([0, 1, 2], [1, 1, 1], [1, 2, 0]), torch.tensor([0, 1]), 0)
    assert none.shape == (2, 0) and none.dtype == torch.long


def test_truth_is_the_greedy_token_of_each_proposed_position():
    # target_next[t] is the target's token for position t + 1; from start t the chain proposes
    # positions t+2 .. t+k+1, so its truth is target_next[t+1 .. t+k].
    s = sample(list(range(10)), [1] * 10, [100 + t for t in range(10)])
    assert offline.truth_for(s, torch.tensor([0, 3]), 3).tolist() == [[101, 102, 103], [104, 105, 106]]


def test_a_perfect_draft_gets_k_plus_one_and_an_off_by_one_draft_nothing():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (40,), generator=g).tolist()
    s = sample(ids, [0] * 5 + [1] * 35, torch.randint(0, 50, (40,), generator=g).tolist())
    perfect = offline.evaluate_offline([Oracle(0)], [s], 3, resamples=50, level=0.95, seed=0)["oracle"]
    assert perfect["tau"] == 4.0 and perfect["acceptance"] == [1.0, 1.0, 1.0]
    shifted = offline.evaluate_offline([Oracle(1)], [s], 3, resamples=50, level=0.95, seed=0)["oracle"]
    assert shifted["tau"] < 1.2


def test_on_policy_depth_counts_where_the_data_follows_the_greedy_path():
    # data x_{t+1} == target_next[t] everywhere except where the data continues with 99.
    ids = [0, 1, 2, 99, 4, 5, 6, 7]
    s = sample(ids, [1] * 8, [1, 2, 3, 4, 5, 6, 7, 8])
    assert offline.on_policy_depth(s, torch.tensor([0, 1, 3]), 3).tolist() == [2, 1, 3]


def test_summary_and_bootstrap():
    lengths = [torch.tensor([0, 1, 3]), torch.tensor([2, 2])]
    counts = stats.Counts.from_lengths(lengths, 3)
    summary = stats.summarize(counts.at_least.sum(0))
    assert summary["tau"] == pytest.approx(1 + 8 / 5)
    assert summary["acceptance"] == pytest.approx([4 / 5, 3 / 4, 1 / 3])
    assert summary["accepted_histogram"] == [1, 1, 2, 1]
    boot = stats.bootstrap(counts, 200, 0.95, seed=0)
    assert boot["tau_ci"][0] <= boot["tau"] <= boot["tau_ci"][1]
    same = stats.paired_difference(counts, counts, "tau", 200, 0.95, 0)
    assert same["agrees"] and same["difference"] == 0


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's and torch's default), in plain Python."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def reference_bootstrap(rows: list[list[int]], resamples: int, level: float, seed: int):
    """The percentile bootstrap written out in plain Python over the same resample draws
    (torch's generator picks the rows; everything after is independent of draftline/evaluate/)."""
    n = len(rows)
    picks = torch.randint(0, n, (resamples, n), generator=torch.Generator().manual_seed(seed)).tolist()
    taus, conditional = [], []
    for pick in picks:
        totals = [sum(rows[i][j] for i in pick) for j in range(len(rows[0]))]
        taus.append(1 + sum(totals[1:]) / max(totals[0], 1))
        conditional.append([totals[j] / max(totals[j - 1], 1) for j in range(1, len(totals))])

    lo, hi = (1 - level) / 2, 1 - (1 - level) / 2
    return ([quantile(taus, lo), quantile(taus, hi)],
            [[quantile([c[j] for c in conditional], lo), quantile([c[j] for c in conditional], hi)]
             for j in range(len(rows[0]) - 1)])


def random_lengths(samples: int, k: int, seed: int, skill: float) -> list[torch.Tensor]:
    """Accepted lengths per step: geometric-ish, higher ``skill`` accepts more."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(samples):
        steps = int(torch.randint(3, 12, (1,), generator=g))
        accepted = (torch.rand(steps, k, generator=g) < skill).long().cumprod(1).sum(1)
        out.append(accepted)
    return out


def test_bootstrap_cis_equal_a_plain_python_reference():
    counts = stats.Counts.from_lengths(random_lengths(40, 3, seed=1, skill=0.6), 3)
    boot = stats.bootstrap(counts, 300, 0.9, seed=5)
    tau_ci, acceptance_ci = reference_bootstrap(counts.at_least.tolist(), 300, 0.9, 5)
    assert boot["tau_ci"] == pytest.approx(tau_ci, abs=1e-12)
    assert torch.tensor(boot["acceptance_ci"]).sub(torch.tensor(acceptance_ci)).abs().max() < 1e-12
    assert boot["samples"] == 40 and boot["tau"] == stats.summarize(counts.at_least.sum(0))["tau"]
    # A narrower level gives a narrower interval around the point estimate.
    narrow = stats.bootstrap(counts, 300, 0.5, seed=5)
    assert boot["tau_ci"][0] < narrow["tau_ci"][0] < narrow["tau"] < narrow["tau_ci"][1] < boot["tau_ci"][1]


def test_identical_samples_give_a_ci_of_width_zero():
    counts = stats.Counts.from_lengths([torch.tensor([1, 2, 0])] * 10, 3)
    boot = stats.bootstrap(counts, 100, 0.95, seed=0)
    assert boot["tau_ci"] == pytest.approx([2.0, 2.0]) and boot["tau"] == pytest.approx(2.0)
    assert torch.allclose(torch.tensor(boot["acceptance_ci"], dtype=torch.double),
                          torch.tensor([[2 / 3, 2 / 3], [0.5, 0.5], [0.0, 0.0]], dtype=torch.double))


def test_a_paired_difference_with_a_known_gap_excludes_zero():
    """b is a with one accepted token fewer at every step that accepted any: tau(a) - tau(b) is
    the share of such steps, and the paired CI lies strictly above 0."""
    good = random_lengths(30, 3, seed=2, skill=0.7)
    worse = [(a - 1).clamp(min=0) for a in good]
    a, b = stats.Counts.from_lengths(good, 3), stats.Counts.from_lengths(worse, 3)
    steps = sum(len(x) for x in good)
    share = sum(int((x > 0).sum()) for x in good) / steps
    result = stats.paired_difference(a, b, "tau", 300, 0.95, seed=0)
    assert result["difference"] == pytest.approx(share)
    assert 0 < result["ci"][0] <= share <= result["ci"][1] and not result["agrees"]
    reverse = stats.paired_difference(b, a, "tau", 300, 0.95, seed=0)
    assert reverse["difference"] == pytest.approx(-share) and reverse["ci"][1] < 0 and not reverse["agrees"]
    first = stats.paired_difference(a, b, "p1", 300, 0.95, seed=0)
    assert first["statistic"] == "p1" and first["difference"] == pytest.approx(
        stats.summarize(a.at_least.sum(0))["acceptance"][0] - stats.summarize(b.at_least.sum(0))["acceptance"][0])
    assert not first["agrees"]
    same = stats.paired_difference(a, a, "tau", 300, 0.95, seed=0)
    assert same["difference"] == 0 and same["ci"] == [0, 0] and same["agrees"]
    with pytest.raises(ValueError, match="same units"):
        stats.paired_difference(a, stats.Counts.from_lengths(good[:-1], 3), "tau", 10, 0.95, 0)


def test_the_mean_paired_difference_over_runs_pairs_the_same_units_in_every_run():
    """One run: paired_difference itself. Several: the mean of the runs' differences, its CI
    from one set of unit picks shared by every run (a constant gap has a zero-width CI)."""
    good = random_lengths(30, 3, seed=2, skill=0.7)
    a = stats.Counts.from_lengths(good, 3)
    b = stats.Counts.from_lengths([(x - 1).clamp(min=0) for x in good], 3)
    single = stats.paired_difference(a, b, "tau", 300, 0.95, seed=4)
    one = stats.mean_paired_difference([(a, b)], "tau", 300, 0.95, seed=4)
    assert one["difference"] == pytest.approx(single["difference"])
    assert one["ci"] == pytest.approx(single["ci"]) and one["ci_width"] == pytest.approx(
        single["ci"][1] - single["ci"][0])
    two = stats.mean_paired_difference([(a, b), (b, b)], "tau", 300, 0.95, seed=4)
    assert two["difference"] == pytest.approx(single["difference"] / 2)
    assert two["per_run"] == pytest.approx([single["difference"], 0.0])
    assert two["ci"] == pytest.approx([x / 2 for x in single["ci"]])  # same picks in both runs
    assert (two["runs"], two["units"]) == (2, 30)
    with pytest.raises(ValueError, match="same units"):
        stats.mean_paired_difference([(a, b), (a, stats.Counts.from_lengths(good[:-1], 3))],
                                     "tau", 10, 0.95, 0)


def test_paired_ci_bounds_equal_a_plain_python_reference():
    good = random_lengths(25, 3, seed=6, skill=0.6)
    a = stats.Counts.from_lengths(good, 3)
    b = stats.Counts.from_lengths([(x - 1).clamp(min=0) for x in good], 3)
    result = stats.paired_difference(a, b, "tau", 300, 0.9, 1)
    picks = torch.randint(0, 25, (300, 25), generator=torch.Generator().manual_seed(1))
    diffs = [float(stats._statistic(a.at_least[p].sum(0).double(), "tau")
                   - stats._statistic(b.at_least[p].sum(0).double(), "tau")) for p in picks]
    assert result["ci"] == pytest.approx([quantile(diffs, 0.05), quantile(diffs, 0.95)], abs=1e-12)
    with pytest.raises(ValueError, match="^paired counts need the same units$"):
        stats.paired_difference(a, stats.Counts.from_lengths(good[:-1], 3), "tau", 10, 0.95, 0)


def test_counts_and_summary_of_known_lengths():
    counts = stats.Counts.from_lengths([torch.tensor([3, 3]), torch.tensor([0])], 3)
    assert counts.at_least.tolist() == [[2, 2, 2, 2], [1, 0, 0, 0]]
    summary = stats.summarize(counts.at_least.sum(0))
    assert summary["tau"] == pytest.approx(1 + 6 / 3) and summary["steps"] == 3
    assert summary["acceptance"] == pytest.approx([2 / 3, 1.0, 1.0])
    assert summary["accepted_histogram"] == [1, 0, 0, 2]
    assert stats.Counts.from_lengths([], 2).at_least.shape == (0, 3)


def test_per_position_rates_of_a_single_verification_step():
    """One verification step: each per-position rate is 0 or 1, that step's verdict (the
    step count is floored only against zero steps)."""
    k = 3
    s = sample([7, 1, 2, 3, 4], [0, 1, 1, 1, 1], [1, 2, 3, 4, 5])
    replies = offline.held_out_replies([s])
    steps = offline_steps(replies, k)
    assert len(steps) == 1 and len(steps[0]) == 1 and steps[0][0] > 0, steps
    result = in_vllm.vllm_vs_offline(replies, as_vllm_measures(replies, steps), Flaky(), k, STATS)
    expected = [float(steps[0][0] >= j) for j in range(1, k + 1)]
    assert result["vllm_unconditional"] == expected and result["offline_unconditional"] == expected


class Flaky:
    """The target's tokens, except one wrong token at chain position ``(7 t + salt) % 5`` of
    the chain from start t when that is < k: walks mix steps of every accepted length."""

    name = "flaky"

    def propose(self, s: offline.Sample, starts: torch.Tensor, k: int) -> torch.Tensor:
        proposals = Oracle(0).propose(s, starts, k)
        wrong_at = (starts * 7 + int(s.input_ids[0])) % 5
        rows = (wrong_at < k).nonzero().flatten()
        proposals[rows, wrong_at[rows]] = -1
        return proposals


def flaky_replies(n: int = 8) -> list[tuple[offline.Sample, int, int]]:
    g = torch.Generator().manual_seed(3)
    samples = []
    for i in range(n):
        target = torch.randint(0, 50, (24,), generator=g).tolist()
        ids = [i] + target[:-1]  # the data follows the target's greedy path: its own replies
        samples.append(sample(ids, [0, 0, 0] + [1] * 21, target))
    return offline.held_out_replies(samples)


def as_vllm_measures(replies, accepted_per_reply) -> list[dict]:
    """What serving.measure_replies returns: the decoded reply and each step's accepted count."""
    return [{"tokens": s.input_ids[a:b].tolist(), "accepted": list(acc)}
            for (s, a, b), acc in zip(replies, accepted_per_reply, strict=True)]


def offline_steps(replies, k: int, proposer=None) -> list[list[int]]:
    """Each reply's accepted count per step of the offline walk (``Flaky`` by default)."""
    proposer = Flaky() if proposer is None else proposer
    steps = []
    for s, a, b in replies:
        mask = torch.zeros_like(s.loss_mask)
        mask[a:b] = True
        sim = offline.simulate(proposer, [dataclasses.replace(s, loss_mask=mask)], k)[0]
        steps.append(sim.accepted[sim.steps].tolist())
    return steps


def test_vllm_and_offline_agree_when_vllm_takes_the_walks_steps():
    replies, k = flaky_replies(), 3
    steps = offline_steps(replies, k)
    assert {a for s in steps for a in s} == set(range(k + 1))  # steps of every accepted length
    result = in_vllm.vllm_vs_offline(replies, as_vllm_measures(replies, steps), Flaky(), k, STATS)
    assert result["replies"] == 8 and result["text_mismatches"] == 0 and result["diverging_replies"] == 0
    assert result["shared_steps"] == sum(len(s) for s in steps)
    assert result["paired_difference"]["difference"] == 0 and result["paired_difference"]["agrees"]
    assert result["vllm_tau_inside_offline_ci"] and all(result["vllm_acceptance_inside_offline_ci"])
    assert result["agrees"] and result["vllm"]["steps"] == result["shared_steps"]


def test_vllm_and_offline_disagree_when_vllm_accepts_what_the_walk_rejects():
    """vLLM accepting everything where the offline walk (the stored features) says otherwise:
    the verdict is "disagrees", with the first diverging step of each reply named."""
    replies, k = flaky_replies(), 3
    steps = offline_steps(replies, k)
    optimistic = [[k] * len(s) for s in steps]
    result = in_vllm.vllm_vs_offline(replies, as_vllm_measures(replies, optimistic), Flaky(), k, STATS)
    assert not result["agrees"] and not result["paired_difference"]["agrees"]
    assert result["paired_difference"]["difference"] > 0 and result["paired_difference"]["ci"][0] > 0
    assert result["diverging_replies"] == sum(1 for s in steps if min(s) < k)
    first = result["divergences"][0]
    reply = first["reply"]
    assert first["step"] == next(j for j, a in enumerate(steps[reply]) if a < k)
    assert first["vllm_accepted"] == k and first["offline_accepted"] == steps[reply][first["step"]]


def test_text_vllm_decoded_otherwise_is_counted_and_located():
    replies, k = flaky_replies(), 3
    measured = as_vllm_measures(replies, offline_steps(replies, k))
    measured[2]["tokens"] = measured[2]["tokens"][:5] + [99] + measured[2]["tokens"][6:]
    measured[5]["tokens"] = measured[5]["tokens"][:-2]
    result = in_vllm.vllm_vs_offline(replies, measured, Flaky(), k, STATS)
    assert result["text_mismatches"] == 2
    assert result["mismatched"][0] == {"reply": 2, "position": 5, "stored": replies[2][0].input_ids[8].item(),
                                       "vllm": 99, "stored_length": 21, "vllm_length": 21}
    assert result["mismatched"][1] == {"reply": 5, "position": 19, "stored": replies[5][0].input_ids[22].item(),
                                       "vllm": None, "stored_length": 21, "vllm_length": 19}
    with pytest.raises(ValueError, match="7 vLLM decodes for 8 replies"):
        in_vllm.vllm_vs_offline(replies, measured[:7], Flaky(), k, STATS)


def test_on_policy_fraction_counts_reached_positions_scored_on_the_greedy_context():
    sim = offline.Simulation(starts=torch.arange(4), accepted=torch.tensor([3, 0, 1, 2]),
                        depth=torch.tensor([3, 1, 2, 1]), steps=torch.tensor([0, 1, 2, 3]))
    # j=1: every step, all at depth >= 1; j=2: steps accepting >= 1 (0, 2, 3), depth >= 2 at 0 and 2;
    # j=3: steps accepting >= 2 (0, 3), depth 3 only at 0.
    assert offline.on_policy_summary([sim], 3)["fraction_by_position"] == pytest.approx([1.0, 2 / 3, 0.5])
    walked = dataclasses.replace(sim, steps=torch.tensor([1, 2]))
    fractions = offline.on_policy_summary([walked], 3)["fraction_by_position"]
    assert fractions[:2] == pytest.approx([1.0, 1.0]) and math.isnan(fractions[2])  # nothing reached 3
    assert offline.on_policy_summary([sim, walked], 3)["fraction_by_position"] == pytest.approx([1.0, 3 / 4, 0.5])


def test_offline_results_walk_steps_and_every_start_per_proposer():
    replies, k = flaky_replies(), 3
    samples = [s for s, _, _ in replies]
    results = offline.evaluate_offline([Flaky(), Oracle(0)], samples, k, **STATS)
    assert list(results) == ["flaky", "oracle"]
    sims = offline.simulate(Flaky(), samples, k)
    walked = stats.bootstrap(stats.Counts.from_lengths([s.accepted[s.steps] for s in sims], k), **STATS)
    every = stats.bootstrap(stats.Counts.from_lengths([s.accepted for s in sims], k), **STATS)
    flaky = results["flaky"]
    assert {key: flaky[key] for key in walked} == walked
    assert flaky["per_start"] == {key: every[key] for key in ("tau", "tau_ci", "acceptance", "steps")}
    assert flaky["per_start"]["steps"] == sum(len(s.starts) for s in sims) > flaky["steps"]
    assert flaky["on_policy"] == offline.on_policy_summary(sims, k)
    assert results["oracle"]["tau"] == k + 1 and results["oracle"]["on_policy"]["fraction_by_position"] == [1.0] * k


def test_the_verdict_needs_every_part_and_holds_at_the_ci_bounds():
    replies, k = flaky_replies(), 3
    steps = offline_steps(replies, k)
    # Identical replies: every CI has width 0, and vLLM's numbers sit exactly on its bounds.
    same = [replies[2]] * 6
    exact = in_vllm.vllm_vs_offline(same, as_vllm_measures(same, [steps[2]] * 6), Flaky(), k, STATS)
    assert exact["offline"]["tau_ci"][0] == exact["offline"]["tau_ci"][1] == exact["vllm"]["tau"]
    assert exact["vllm_tau_inside_offline_ci"] and all(exact["vllm_acceptance_inside_offline_ci"])
    assert exact["agrees"]
    # vLLM's own extra steps (past the walk) outside the CI: the shared steps agree, the whole does not.
    extra = in_vllm.vllm_vs_offline(replies, as_vllm_measures(replies, [s + [0, 0, 0] for s in steps]),
                               Flaky(), k, STATS)
    assert extra["paired_difference"]["agrees"] and extra["shared_steps"] == sum(map(len, steps))
    assert not extra["vllm_tau_inside_offline_ci"] and not extra["agrees"]
    assert extra["vllm"]["steps"] == extra["shared_steps"] + 3 * 8
    # One token fewer on one step of every other reply: vLLM's tau stays inside the offline CI,
    # but its first-position acceptance does not and the paired difference excludes 0.
    fewer = [list(s) for s in steps]
    for s in fewer[::2]:
        j = next(j for j, a in enumerate(s) if a in (1, 2))
        s[j] -= 1
    slight = in_vllm.vllm_vs_offline(replies, as_vllm_measures(replies, fewer), Flaky(), k, STATS)
    assert slight["vllm_tau_inside_offline_ci"] and not slight["vllm_acceptance_inside_offline_ci"][0]
    assert not slight["paired_difference"]["agrees"] and not slight["agrees"]


def test_every_number_of_the_verdict_has_its_value():
    replies, k = flaky_replies(), 3
    steps = offline_steps(replies, k)
    measured = as_vllm_measures(replies, [s + [1] for s in steps])  # one step past the walk per reply
    result = in_vllm.vllm_vs_offline(replies, measured, Flaky(), k, STATS)
    flat = [a for s in steps for a in s]
    walked = len(flat)
    assert result["offline"]["steps"] == walked and result["vllm"]["steps"] == walked + 8
    assert result["offline_unconditional"] == pytest.approx([sum(a >= j for a in flat) / walked for j in (1, 2, 3)])
    full = flat + [1] * 8
    assert result["vllm_unconditional"] == pytest.approx([sum(a >= j for a in full) / len(full) for j in (1, 2, 3)])
    assert [p["statistic"] for p in result["paired_by_position"]] == ["p1", "p2", "p3"]
    assert all(p["difference"] == 0 and p["agrees"] for p in result["paired_by_position"])
    wrong = as_vllm_measures(replies, [[k] * (len(s) + 1) for s in steps])
    diverged = in_vllm.vllm_vs_offline(replies, wrong, Flaky(), k, STATS)
    first = diverged["divergences"][0]
    assert first["of_steps"] == len(steps[first["reply"]])
    assert set(first) == {"reply", "step", "of_steps", "vllm_accepted", "offline_accepted"}


def test_first_difference_past_either_end():
    assert in_vllm.first_difference([1, 2, 3], [1, 2, 3]) == {}
    assert in_vllm.first_difference([1, 2], [1, 2, 7]) == {"position": 2, "stored": None, "vllm": 7,
                                                        "stored_length": 2, "vllm_length": 3}
    assert in_vllm.first_difference([1, 2, 3], [1]) == {"position": 1, "stored": 2, "vllm": None,
                                                     "stored_length": 3, "vllm_length": 1}


def test_statistics_with_single_steps_and_no_steps():
    one = stats.Counts.from_lengths([torch.tensor([2])], 3)  # one step, 2 accepted
    assert stats.summarize(one.at_least.sum(0))["tau"] == 3.0
    assert stats.summarize(torch.zeros(4, dtype=torch.long))["tau"] == 1.0
    nothing = stats.summarize(stats.Counts.from_lengths([torch.tensor([0])], 3).at_least.sum(0))["acceptance"]
    assert nothing[0] == 0.0 and math.isnan(nothing[1]) and math.isnan(nothing[2])
    assert stats.paired_difference(one, stats.Counts.from_lengths([torch.tensor([0])], 3), "tau", 20, 0.9, 0)[
        "difference"] == 2.0
    assert stats.paired_difference(one, stats.Counts.from_lengths([torch.tensor([0])], 3), "p1", 20, 0.9, 0)[
        "difference"] == 1.0
    boot = stats.bootstrap(one, 20, 0.9, 0)
    assert boot["tau_ci"] == [3.0, 3.0] and boot["acceptance_ci"][1] == [1.0, 1.0]


def test_paired_cis_follow_the_level_and_resample_all_units():
    good = random_lengths(30, 3, seed=4, skill=0.7)
    a = stats.Counts.from_lengths(good, 3)
    b = stats.Counts.from_lengths([(x - 1).clamp(min=0) for x in good], 3)
    wide, narrow = (stats.paired_difference(a, b, "tau", 400, level, 0)["ci"] for level in (0.95, 0.5))
    assert wide[0] < narrow[0] < narrow[1] < wide[1]
    # The same draws as a plain computation over every unit (index 0 included).
    picks = torch.randint(0, 30, (400, 30), generator=torch.Generator().manual_seed(0))
    diffs = [float(stats._statistic(a.at_least[p].sum(0).double(), "tau")
                   - stats._statistic(b.at_least[p].sum(0).double(), "tau")) for p in picks]
    assert wide[0] == pytest.approx(quantile(diffs, 0.025), abs=1e-12)


def test_valid_starts_of_short_samples_and_step_lengths_per_row():
    assert offline.valid_starts(torch.ones(4, dtype=torch.bool), 3).tolist() == []
    assert offline.valid_starts(torch.ones(5, dtype=torch.bool), 3).tolist() == [0]
    assert offline.valid_starts(torch.ones(5, dtype=torch.bool), 3).dtype == torch.long
    assert offline.valid_starts(torch.ones(2, dtype=torch.bool), 3).dtype == torch.long
    proposals = torch.tensor([[1, 2, 3], [1, 9, 3], [9, 2, 3]])
    assert offline.accepted_lengths(proposals, torch.tensor([[1, 2, 3]] * 3)).tolist() == [3, 1, 0]
    assert offline.accepted_lengths(proposals[:1], torch.tensor([[1, 2, 4]])).tolist() == [2]


def test_on_policy_depth_for_one_and_two_draft_tokens():
    s = sample([0, 1, 2, 99, 4, 5], [1] * 6, [1, 2, 3, 4, 5, 6])
    one = offline.on_policy_depth(s, torch.tensor([0, 1, 2]), 1)
    assert one.tolist() == [1, 1, 1] and one.dtype == torch.long
    assert offline.on_policy_depth(s, torch.tensor([0, 1, 2]), 2).tolist() == [2, 1, 2]
    assert offline.walk(torch.tensor([0, 1, 1, 1], dtype=torch.bool), torch.tensor([0, 1]), torch.tensor([0, 0])).dtype \
        == torch.long


def test_token_counts_over_several_shards_and_the_bigram_back_off(tmp_path):
    def shard(path, samples):
        ids = torch.cat([torch.tensor(x) for x, _ in samples])
        mask = torch.cat([torch.tensor(m, dtype=torch.uint8) for _, m in samples])
        offsets = torch.tensor([0] + [len(x) for x, _ in samples]).cumsum(0)
        save_file({formats.INPUT_IDS: ids, formats.LOSS_MASK: mask, formats.SAMPLE_OFFSETS: offsets}, str(path))
        return path

    first = shard(tmp_path / "a.safetensors", [([1, 2, 3], [0, 1, 1]), ([4, 4, 4], [1, 1, 1])])
    second = shard(tmp_path / "b.safetensors", [([5, 6], [1, 1]), ([2, 3, 2], [0, 0, 1])])
    rows = torch.tensor([[0, 0, 3], [1, 1, 3], [1, 0, 2]])  # (shard, row, length); shard 0 row 1 unused
    unigram, bigram = offline.count_tokens([first, second], rows, 8)
    assert unigram.dtype == torch.long and bigram.dtype == torch.long and bigram.shape == (8, 8)
    assert unigram.tolist() == [0, 0, 2, 1, 0, 1, 1, 0]  # 2,3 | 2 | 5,6
    assert {(i, j): int(bigram[i, j]) for i, j in bigram.to_dense().nonzero().tolist()} == {
        (1, 2): 1, (2, 3): 1, (3, 2): 1, (5, 6): 1}
    frequent, bigrams = offline.baseline_drafts(unigram, bigram)
    assert frequent.token == 2
    assert bigrams.table.tolist() == [2, 2, 3, 2, 2, 6, 2, 2]  # rows never a predecessor: the mode
    rect = torch.zeros(3, 3, dtype=torch.long)
    rect[0, 2] = 5  # 0 -> 2 only: argmax over the successors, not the predecessors
    assert offline.baseline_drafts(torch.tensor([0, 1, 0]), rect)[1].table.tolist() == [2, 1, 1]
    assert offline.baseline_drafts(torch.tensor([0, 1, 0]), rect.to_sparse())[1].table.tolist() == [2, 1, 1]

    s = sample([0, 5, 0], [1, 1, 1], [0, 0, 0])
    assert bigrams.propose(s, torch.tensor([0]), 0).shape == (1, 0)
    assert bigrams.propose(s, torch.tensor([0]), 2).tolist() == [[6, 2]]


def test_sparse_bigram_successors_are_dense_argmax_ties_included():
    """The sparse table's successors equal the dense argmax, ties broken to the lowest id."""
    generator = torch.Generator().manual_seed(0)
    dense = torch.randint(0, 3, (40, 40), generator=generator)  # many ties, some empty rows
    dense[5] = 0
    for fallback in (0, 7):
        assert torch.equal(offline._successors(dense.to_sparse(), fallback),
                           offline._successors(dense.clone(), fallback))


def test_token_counts_read_rows_by_shard_index_not_row_index(tmp_path):
    """Rows (shard, row, length) whose shard and row numbers differ: each shard is read for
    its own rows."""
    def shard(path, ids, mask):
        save_file({formats.INPUT_IDS: torch.tensor(ids),
                   formats.LOSS_MASK: torch.tensor(mask, dtype=torch.uint8),
                   formats.SAMPLE_OFFSETS: torch.tensor([0, len(ids)])}, str(path))
        return path

    first = shard(tmp_path / "a.safetensors", [1, 1], [1, 1])
    second = shard(tmp_path / "b.safetensors", [2, 3], [1, 1])
    unigram, _ = offline.count_tokens([first, second], torch.tensor([[1, 0, 2]]), 4)
    assert unigram.tolist() == [0, 0, 1, 1]


def test_baselines_from_training_counts(tmp_path):
    ids = torch.tensor([5, 1, 2, 1, 2, 1, 3, 7, 7, 7])
    mask = torch.tensor([0, 1, 1, 1, 1, 1, 1, 1, 1, 1], dtype=torch.uint8)
    shard = tmp_path / "shard.safetensors"
    save_file({formats.INPUT_IDS: ids, formats.LOSS_MASK: mask,
               formats.SAMPLE_OFFSETS: torch.tensor([0, 10])}, str(shard))
    unigram, bigram = offline.count_tokens([shard], torch.tensor([[0, 0, 10]]), 10)
    assert unigram.tolist()[1] == 3 and int(unigram.argmax()) == 1
    frequent, bigrams = offline.baseline_drafts(unigram, bigram)
    assert frequent.token == 1
    s = sample([0, 1, 9], [1, 1, 1], [0, 0, 0])
    # after 1 comes 2 (twice) before 3 (once); after 2 comes 1; 9 was never a predecessor -> mode 1
    assert bigrams.propose(s, torch.tensor([0]), 3).tolist() == [[2, 1, 2]]
    assert bigrams.propose(s, torch.tensor([1]), 2).tolist() == [[1, 2]]


# --------------------------------------------------------------------------- a tiny random pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny random target, and a random draft for it saved in speculators format."""
    from draftline.tiny import builders as tiny
    from draftline.tokenize import vocab
    from draftline.train.draft import build_draft

    root = tmp_path_factory.mktemp("pair")
    target_dir = tiny.build_tiny_llama(root / "target", hidden_size=64, num_layers=4, num_heads=2,
                                       num_kv_heads=1, intermediate_size=128)
    freq = torch.randint(0, 100, (512,), generator=torch.Generator().manual_seed(0))
    d2t, t2d = vocab.draft_vocab_mapping(freq, 128)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        draft = build_draft(target_dir, [1, 2, 3], d2t, t2d, num_speculative_tokens=3)
    draft.to(torch.bfloat16).save_pretrained(str(root / "draft"))
    return target_dir, root / "draft"


def test_serving_rollout_matches_speculators_ttt_forward(pair):
    """The serving-style rollout proposes exactly what speculators' training forward drafts."""

    target_dir, draft_dir = pair
    model = rollout.load_draft(draft_dir, target_dir)
    runner = rollout.DraftRunner(model)
    ours, theirs, _ = rollout_and_forward(model, runner, seed=1, length=48)
    assert torch.equal(ours, theirs)


def rollout_and_forward(model, runner, seed: int, length: int):
    """Proposals at every start of a random sample: the serving-style rollout's and the
    training forward's ([starts, 3] target ids each), and the sample and its starts."""
    from draftline.train.draft import set_attention

    set_attention(model, "sdpa")
    g = torch.Generator().manual_seed(seed)
    s = offline.Sample(torch.randint(0, 512, (length,), generator=g), torch.ones(length, dtype=torch.bool),
                       torch.randn(length, 3 * 64, generator=g), torch.zeros(length, dtype=torch.long))
    starts = torch.arange(length - 1)
    ours = rollout.Eagle3Draft(runner).propose(s, starts, 3)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        drafted = model(hidden_states=s.aux[None, :-1], input_ids=s.input_ids[None, 1:],
                        position_ids=torch.arange(length - 1)[None], ttt_steps=3)
    theirs = torch.stack([d[0] + model.d2t[d[0]] for d in drafted], -1)
    return ours, theirs, (s, starts)


def test_a_parallel_drafts_rollout_matches_its_training_forward(pair, tmp_path):
    """draftline issue 45: a parallel draft's training forward (mask token and fc(mask_hidden)
    at depths >= 1) proposes at every anchor what the serving-style rollout drafts the way
    vLLM's parallel_drafting lays it out; its save loads back as a parallel draft, and the
    engine's speculative config turns parallel drafting on for it."""
    from draftline import engine
    from draftline.tokenize import vocab
    from draftline.train.draft import build_draft
    from draftline.train.loop import _save_draft
    from draftline.train.parallel import ParallelDraft

    target_dir, sequential = pair
    freq = torch.randint(0, 100, (512,), generator=torch.Generator().manual_seed(0))
    d2t, t2d = vocab.draft_vocab_mapping(freq, 128)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        draft = build_draft(target_dir, [1, 2, 3], d2t, t2d, num_speculative_tokens=3,
                            draft_class=ParallelDraft)
    draft_dir = _save_draft(draft, tmp_path, "float32")
    assert json.loads((draft_dir / "config.json").read_text())["architectures"] == ["Eagle3DraftModel"]
    assert engine.speculative_config(draft_dir, 3)["parallel_drafting"] is True
    assert "parallel_drafting" not in engine.speculative_config(sequential, 3)
    model = rollout.load_draft(draft_dir, target_dir)
    runner = rollout.DraftRunner(model)
    assert runner.parallel and not rollout.DraftRunner(rollout.load_draft(sequential, target_dir)).parallel
    ours, theirs, (s, starts) = rollout_and_forward(model, runner, seed=2, length=40)
    assert torch.equal(ours, theirs)
    # the sequential rollout of the same weights drafts otherwise from depth 1 on
    runner.parallel = False
    assert not torch.equal(rollout.Eagle3Draft(runner).propose(s, starts, 3)[:, 1:], theirs[:, 1:])


@torch.no_grad()
def hf_states(target, tokens: torch.Tensor) -> tuple:
    """transformers' hidden_states for ``tokens`` (entry i = input of layer i, the last one
    post-norm) and its greedy next tokens: what extraction stores, in float32."""
    out = target(input_ids=tokens[None], output_hidden_states=True)
    return [h[0] for h in out.hidden_states], out.logits[0].argmax(-1)


@pytest.fixture(scope="module")
def decoded(pair, tmp_path_factory):
    """The target's own greedy replies to six prompts (vLLM without a draft), the samples
    extraction would store for them (transformers), a draft trained on them, and vLLM's
    speculative decoding of the prompts with that draft."""
    from transformers import AutoModelForCausalLM

    from draftline.speculative import jobs

    target_dir, _ = pair
    options = EngineOptions(target=str(target_dir), dtype="float32", max_model_len=256)
    stops = greedy.stop_token_ids(target_dir)
    prompts = [[0, 4, 60 + i, 70, 80, 6, 5] for i in range(6)]
    replies = jobs.generate_timed(options, None, None, prompts, [24] * 6, stops)["tokens"]
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    sequences = [torch.tensor(p + r) for p, r in zip(prompts, replies, strict=True)]
    draft_dir = overfit_draft(target_dir, target, sequences, [1, 2, 3],
                              tmp_path_factory.mktemp("overfit") / "draft")
    samples = {}
    for ids in ((1, 2, 3), (2, 3, 4)):
        samples[ids] = []
        for prompt, tokens in zip(prompts, sequences, strict=True):
            hidden, next_tokens = hf_states(target, tokens)
            mask = torch.zeros(len(tokens), dtype=torch.bool)
            mask[len(prompt):] = True
            samples[ids].append(offline.Sample(tokens, mask, torch.cat([hidden[i] for i in ids], -1), next_tokens))
    measured = jobs.measure_replies(options, draft_dir, 3, prompts, [24] * 6, stops)
    measured["draft"] = draft_dir
    return samples, measured, rollout.DraftRunner(rollout.load_draft(draft_dir, target_dir))


STATS = {"resamples": 200, "level": 0.95, "seed": 0}


@pytest.mark.vllm
def test_vllm_speculative_decoding_is_lossless_and_takes_the_simulated_steps(decoded):
    """On the target's own greedy text, vLLM's steps are the offline walk's, verdict for verdict."""
    samples, measured, runner = decoded
    replies = offline.held_out_replies(samples[(1, 2, 3)])
    result = in_vllm.vllm_vs_offline(replies, measured["replies"], rollout.Eagle3Draft(runner), 3, STATS)
    print({key: result[key] for key in ("text_mismatches", "diverging_replies", "shared_steps")},
          "vllm", round(result["vllm"]["tau"], 3), "offline", round(result["offline"]["tau"], 3))
    assert result["replies"] == 6 and result["text_mismatches"] == 0
    assert result["vllm"]["tau"] > 1.5, "the overfit draft must get tokens accepted"
    assert result["shared_steps"] > 20 and result["diverging_replies"] == 0
    assert result["paired_difference"]["difference"] == 0 and result["agrees"]
    # vLLM's own counters add up to the per-step record.
    counters = measured["counters"]
    assert counters["drafts"] == sum(len(r["accepted"]) for r in measured["replies"])
    assert counters["accepted"] == sum(sum(r["accepted"]) for r in measured["replies"])


@pytest.mark.vllm
def test_a_batched_decode_reads_each_requests_verdicts_as_one_at_a_time_does(pair, decoded):
    """The standard benchmarks decode all prompts at once and read each request's accepted
    counts from the tokens each step gave it (jobs.decode_batch); one request at a time, vLLM's
    counters give them directly. Same tokens, same verdicts, less each request's last step."""
    from draftline.speculative import jobs

    target_dir, _ = pair
    _, measured, _ = decoded
    draft_dir = measured["draft"]
    options = EngineOptions(target=str(target_dir), dtype="float32", max_model_len=256)
    prompts = [[0, 4, 60 + i, 70, 80, 6, 5] for i in range(6)]
    batched = jobs.run_job("decode-batch", {"draft": str(draft_dir), "k": 3, "prompts": prompts,
                                            "max_tokens": 24, "stop_ids": greedy.stop_token_ids(target_dir)},
                           options)
    assert batched["tokens"] == [r["tokens"] for r in measured["replies"]]
    assert batched["accepted"] == [r["accepted"][:-1] for r in measured["replies"]]
    assert sum(map(len, batched["accepted"])) > 20
    assert batched["counters"]["drafts"] == measured["counters"]["drafts"]


@pytest.mark.vllm
def test_vllm_and_offline_disagree_when_the_stored_features_are_wrong(decoded):
    """Features from the layer after each aux id (what an off-by-one extraction stores): the
    offline walk no longer takes vLLM's verdicts, and the agreement check says so."""
    samples, measured, runner = decoded
    good, shifted = samples[(1, 2, 3)], samples[(2, 3, 4)]
    wrong = [dataclasses.replace(g, aux=s.aux) for g, s in zip(good, shifted)]
    result = in_vllm.vllm_vs_offline(offline.held_out_replies(wrong), measured["replies"],
                                rollout.Eagle3Draft(runner), 3, STATS)
    print(result["divergences"], result["paired_difference"])
    assert result["diverging_replies"] > 0 and not result["agrees"]
    # The stage turns that verdict into its failure (on the target's own replies, as here).
    from draftline.evaluate.run import vllm_failures

    cfg = compose("tiny")
    failures = vllm_failures(cfg, {**result, "on_target_text": True})
    assert len(failures) == 1 and "disagrees with the offline estimate" in failures[0]
    assert vllm_failures(cfg, {**result, "on_target_text": False}) == []
    good = in_vllm.vllm_vs_offline(offline.held_out_replies(good), measured["replies"], rollout.Eagle3Draft(runner), 3, STATS)
    assert vllm_failures(cfg, {**good, "on_target_text": True}) == []
    mismatched = {**good, "on_target_text": True, "text_mismatches": 1, "mismatched": [{"reply": 0}]}
    assert "decoded 1 of 6 stored replies to other text" in vllm_failures(cfg, mismatched)[0]


def test_the_stage_fails_on_a_vllm_disagreement_or_other_text_without_an_engine():
    """draftline.evaluate.run.vllm_failures on synthetic verdicts: what turns vLLM's measurement into
    the stage's failure, in the default tier (the engine tier checks it on a real decode)."""
    from draftline.evaluate.run import vllm_failures

    cfg = compose("tiny")
    good = {"on_target_text": True, "replies": 6, "text_mismatches": 0, "mismatched": [], "agrees": True,
            "vllm": {"tau": 1.5, "acceptance": [0.4]}, "offline": {"tau": 1.5, "tau_ci": [1.4, 1.6],
            "acceptance_ci": [[0.3, 0.5]]}, "paired_difference": {"difference": 0.0, "ci": [0.0, 0.0]}}
    assert vllm_failures(cfg, None) == [] and vllm_failures(cfg, good) == []
    disagrees = {**good, "agrees": False}
    assert [f.split(" (")[0] for f in vllm_failures(cfg, disagrees)] == ["vLLM's tau 1.500"]
    assert "disagrees with the offline estimate" in vllm_failures(cfg, disagrees)[0]
    other_text = {**good, "text_mismatches": 1, "mismatched": [{"reply": 4}]}
    assert vllm_failures(cfg, other_text) == [
        "vLLM decoded 1 of 6 stored replies to other text (evaluate.vllm.max_text_mismatches=0); "
        "first differences: [{'reply': 4}]"]
    assert len(vllm_failures(cfg, {**disagrees, **other_text, "agrees": False})) == 2
    # Replies the target did not write (e.g. a fixed dataset's) are not held to either rule.
    assert vllm_failures(cfg, {**disagrees, **other_text, "agrees": False, "on_target_text": False}) == []
    relaxed = compose("tiny", "evaluate.vllm.require_agreement=false", "evaluate.vllm.max_text_mismatches=1")
    assert vllm_failures(relaxed, {**disagrees, **other_text, "agrees": False}) == []


def test_offline_evaluation_refuses_features_the_draft_does_not_expect(pair):
    _, draft_dir = pair
    assert check_features(draft_dir, {"aux_layer_ids": [1, 2, 3]}) == [1, 2, 3]
    with pytest.raises(ValueError, match="asks vLLM for aux layers"):
        check_features(draft_dir, {"aux_layer_ids": [2, 3, 4]})


@pytest.mark.vllm
def test_vllm_parses_and_loads_every_saved_tensor(pair):
    target_dir, draft_dir = pair
    report = in_vllm.check_vllm_load(draft_dir, target_dir, 3)
    saved = set(load_file(str(draft_dir / "model.safetensors")))
    assert report["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert report["model_class"] == "Eagle3LlamaForCausalLM"
    assert report["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert set(report["placed"]) == saved - {"t2d"} and report["ignored_by_vllm"] == ["t2d"]
    assert "model.layers.0.self_attn.qkv_proj.weight" in report["parameters"]


def test_what_vllm_reads_must_be_what_the_draft_was_built_with():
    seen = {"architectures": ["Eagle3LlamaForCausalLM"], "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
            "draft_vocab_size": 64}
    assert vllm_parse.check_reading(seen, (1, 2, 3), 64, "d") == seen
    for field, other in (("architectures", ["LlamaForCausalLM"]),
                         ("eagle_aux_hidden_state_layer_ids", [3, 2, 1]), ("draft_vocab_size", 65)):
        with pytest.raises(ValueError) as caught:
            vllm_parse.check_reading({**seen, field: other}, [1, 2, 3], 64, "runs/x/draft")
        assert str(caught.value) == (f"vLLM reads runs/x/draft as {({**seen, field: other})}, "
                                     f"expected {seen}")


def test_the_name_mapping_rejects_unknown_and_missing_tensors():
    params = {"model.fc.weight": torch.ones(2, 2), "lm_head.weight": torch.ones(2, 2)}
    ok = in_vllm.compare_loaded(params, {"fc.weight": torch.ones(2, 2), "lm_head.weight": torch.ones(2, 2),
                                    "t2d": torch.ones(3, dtype=torch.bool)})
    assert ok["ignored_by_vllm"] == ["t2d"]
    with pytest.raises(ValueError, match="does not have"):
        in_vllm.compare_loaded(params, {"fc_typo.weight": torch.ones(2, 2), "lm_head.weight": torch.ones(2, 2)})
    with pytest.raises(ValueError, match="no saved tensor filled"):
        in_vllm.compare_loaded(params, {"lm_head.weight": torch.ones(2, 2)})


def loaded_pair() -> tuple[dict, dict]:
    """Saved draft tensors and the parameters vLLM would hold after loading them."""
    g = torch.Generator().manual_seed(0)
    saved = {name: torch.randn(shape, generator=g) for name, shape in (
        ("fc.weight", (4, 12)), ("lm_head.weight", (6, 4)), ("layers.0.self_attn.q_proj.weight", (4, 4)),
        ("layers.0.self_attn.k_proj.weight", (2, 4)), ("layers.0.self_attn.v_proj.weight", (2, 4)),
        ("layers.0.mlp.gate_proj.weight", (3, 4)), ("layers.0.mlp.up_proj.weight", (3, 4)))}
    saved["d2t"] = torch.tensor([0, 3, 3])
    saved["t2d"] = torch.tensor([True, False, True])
    params = {"model.fc.weight": saved["fc.weight"].clone(),
              "lm_head.weight": torch.cat([saved["lm_head.weight"], torch.zeros(58, 4)]),  # padded rows
              "draft_id_to_target_id": saved["d2t"].clone(),
              "model.layers.0.self_attn.qkv_proj.weight": torch.cat(
                  [saved[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]),
              "model.layers.0.mlp.gate_up_proj.weight": torch.cat(
                  [saved["layers.0.mlp.gate_proj.weight"], saved["layers.0.mlp.up_proj.weight"]])}
    return params, saved


@pytest.mark.parametrize("saved, expected", [
    ("t2d", ("", "ignored")),
    ("d2t", ("draft_id_to_target_id", "direct")),
    ("fc.weight", ("model.fc.weight", "direct")),
    ("lm_head.weight", ("lm_head.weight", "direct")),
    ("norm.weight", ("model.norm.weight", "direct")),
    ("layers.0.self_attn.o_proj.weight", ("model.layers.0.self_attn.o_proj.weight", "direct")),
    ("layers.0.self_attn.q_proj.weight", ("model.layers.0.self_attn.qkv_proj.weight", "q_proj")),
    ("layers.0.self_attn.k_proj.weight", ("model.layers.0.self_attn.qkv_proj.weight", "k_proj")),
    ("layers.0.self_attn.v_proj.weight", ("model.layers.0.self_attn.qkv_proj.weight", "v_proj")),
    ("layers.0.mlp.gate_proj.weight", ("model.layers.0.mlp.gate_up_proj.weight", "gate_proj")),
    ("layers.0.mlp.up_proj.weight", ("model.layers.0.mlp.gate_up_proj.weight", "up_proj")),
    ("layers.0.mlp.down_proj.weight", ("model.layers.0.mlp.down_proj.weight", "direct")),
])
def test_saved_names_map_to_vllms_parameters(saved, expected):
    assert in_vllm.vllm_name(saved) == expected


def test_the_load_check_accepts_what_vllm_would_hold():
    params, saved = loaded_pair()
    report = in_vllm.compare_loaded(params, saved)
    assert report["ignored_by_vllm"] == ["t2d"] and len(report["placed"]) == 8
    assert report["parameters"] == sorted(params)


@pytest.mark.parametrize("tamper", ["direct", "padded", "stacked", "order", "d2t", "gate_up"])
def test_the_load_check_rejects_a_tampered_tensor(tamper):
    params, saved = loaded_pair()
    if tamper == "direct":
        params["model.fc.weight"][1, 2] += 1e-3
    elif tamper == "padded":
        params["lm_head.weight"][5, 0] = 0.0
    elif tamper == "stacked":
        params["model.layers.0.self_attn.qkv_proj.weight"][5, 3] *= -1
    elif tamper == "order":  # k and v stacked in the wrong order
        q, k, v = (saved[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
        params["model.layers.0.self_attn.qkv_proj.weight"] = torch.cat([q, v, k])
    elif tamper == "gate_up":  # up before gate
        params["model.layers.0.mlp.gate_up_proj.weight"] = torch.cat(
            [saved["layers.0.mlp.up_proj.weight"], saved["layers.0.mlp.gate_proj.weight"]])
    else:
        params["draft_id_to_target_id"][2] = 2
    with pytest.raises(ValueError, match="vLLM holds other values"):
        in_vllm.compare_loaded(params, saved)


def test_the_load_check_compares_in_the_saved_dtype_and_names_what_it_placed():
    params, saved = loaded_pair()
    saved = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in saved.items()}
    params = {n: t.to(torch.bfloat16).float() if t.is_floating_point() else t for n, t in params.items()}
    saved["scale"], params["model.scale"] = torch.tensor(0.5, dtype=torch.bfloat16), torch.tensor(0.5)
    report = in_vllm.compare_loaded(params, saved)  # vLLM holds float32 copies of bf16 saves
    assert report["placed"] == sorted(n for n in saved if n != "t2d")
    params["model.scale"] = torch.tensor(0.25)
    with pytest.raises(ValueError, match="scale: vLLM holds other values"):
        in_vllm.compare_loaded(params, saved)


# --------------------------------------------------------------------------- the gate


def test_the_gate_asset_records_measured_runs_with_a_margin():
    entry = json.loads(GATE.read_text())["tiny-trained"]
    assert entry["k"] == 3
    lowest = min(run["tau"] for run in entry["measured"])
    assert entry["tau_min"] < lowest - 0.05, "the floor needs a margin below every measured run"
    assert entry["tau_min"] > max(run["baseline_tau_max"] for run in entry["measured"]), \
        "the floor must sit above the baselines, or a collapsed draft would pass"


def _offline(tau: float, ci: list[float], bigram_ci: list[float], frequent_ci=(1.0, 1.1)) -> dict:
    return {"eagle3": {"tau": tau, "tau_ci": ci}, "bigram": {"tau": sum(bigram_ci) / 2, "tau_ci": bigram_ci},
            "most_frequent": {"tau": sum(frequent_ci) / 2, "tau_ci": list(frequent_ci)}}


ON = {"enabled": True, "off_because": None}
OFF = {"enabled": False, "off_because": "a random target"}


def test_the_gate_fails_below_the_floor():
    passed = judge({"tau_min": 1.5}, _offline(1.6, [1.55, 1.65], [1.3, 1.4]), "gate.json", ON)
    assert passed["checked"] and passed["passed"] and not gate_failures(passed)
    below = judge({"tau_min": 1.5}, _offline(1.4, [1.35, 1.45], [1.0, 1.1]), "gate.json", ON)
    assert not below["passed"] and below["baseline"]["passed"] and not below["floor"]["passed"]
    assert gate_failures(below) == ["tau 1.400 of the trained draft is below the floor 1.5 recorded "
                                    "in gate.json: the draft regressed"]


def test_the_baseline_gate_is_on_without_a_floor_and_fails_when_the_cis_overlap():
    # No floor recorded (a user's own run): the baseline check alone decides.
    overlap = judge(None, _offline(1.6, [1.52, 1.68], [1.45, 1.55]), "gate.json", ON)
    assert overlap["checked"] and not overlap["passed"] and not overlap["floor"]["checked"]
    (failure,) = gate_failures(overlap)
    assert failure.startswith("the draft's tau CI [1.520, 1.680] does not lie above the bigram "
                              "baseline's CI [1.450, 1.550]") and "evaluate.baseline_gate.off_because" in failure
    clear = judge(None, _offline(1.6, [1.56, 1.68], [1.45, 1.55]), "gate.json", ON)
    assert clear["passed"] and clear["baseline"]["best_tau_ci"] == [1.45, 1.55]
    # The best baseline is the one with the highest tau; every baseline's CI must lie below.
    frequent = judge(None, _offline(1.6, [1.56, 1.68], [1.3, 1.4], frequent_ci=(1.44, 1.58)), None, ON)
    assert frequent["baseline"]["best"] == "most_frequent" and not frequent["passed"]


def test_a_baseline_gate_turned_off_keeps_its_reason_and_what_it_would_have_said():
    verdict = judge(None, _offline(1.1, [1.07, 1.16], [1.25, 1.40]), None, OFF)
    assert not verdict["checked"] and verdict["passed"] and not gate_failures(verdict)
    assert verdict["baseline"]["off_because"] == "a random target" and not verdict["baseline"]["would_pass"]
    with_floor = judge({"tau_min": 1.5}, _offline(1.1, [1.07, 1.16], [1.25, 1.40]), "f.json", OFF)
    assert with_floor["checked"] and [f.split(" of ")[0] for f in gate_failures(with_floor)] == ["tau 1.100"]


def test_the_difference_to_the_best_baseline_pairs_the_same_samples():
    good = [torch.tensor([3, 2, 3]), torch.tensor([1, 3]), torch.tensor([2, 2, 2, 0])]
    poor = [torch.tensor([0, 1, 0]), torch.tensor([1, 0]), torch.tensor([0, 0, 1, 0])]
    offline = {}
    for name, lengths in (("eagle3", good), ("bigram", poor), ("most_frequent", [t * 0 for t in poor])):
        counts = stats.Counts.from_lengths(lengths, 3)
        offline[name] = {**stats.bootstrap(counts, 200, 0.95, 0), "counts_per_sample": counts.at_least.tolist()}
    result = versus_best_baseline(offline, 200, 0.95, 0)
    assert result["baseline"] == "bigram"
    assert result["difference"] == pytest.approx(offline["eagle3"]["tau"] - offline["bigram"]["tau"])
    assert result["ci"][0] <= result["difference"] <= result["ci"][1]


def test_the_baseline_gate_is_off_only_with_a_reason():
    from draftline.pipeline import config

    off = ["experiment=tiny-kimi"]  # a random target: its draft loses to bigram, said in its experiment
    assert "bigram" in config.compose(off).evaluate.baseline_gate.off_because
    config.check(config.compose(off))
    with pytest.raises(errors.UserConfigError, match="needs evaluate.baseline_gate.off_because"):
        config.check(config.compose([*off, "evaluate.baseline_gate.off_because=null"]))
    with pytest.raises(errors.UserConfigError, match="is not true or false"):
        config.check(config.compose(["experiment=tiny", "evaluate.baseline_gate.enabled=sometimes"]))
    for name in ("llama-3.1-8b", "qwen3-8b", "kimi-k2.5", "tiny-trained", "tiny"):  # on by default
        assert config.compose([f"experiment={name}"]).evaluate.baseline_gate.enabled is True


# --------------------------------------------------------------------------- the smoke run (slow)


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True)


@pytest.fixture(scope="module")
def smoke_run() -> Path:
    """runs/tiny-trained, evaluated: built here only when `make report EXP=tiny-trained` has not."""
    run = REPO / "runs/tiny-trained"
    if not (REPO / "runs/_assets/tiny-trained/build.json").exists():
        built = _run(sys.executable, "-m", "draftline.cli.trained_target", "experiment=tiny-trained")
        assert built.returncode == 0, built.stderr[-4000:]
    if not (run / "evaluate/manifest.json").exists():
        run_make("all", "EXP=tiny-trained", f"VENV={sys.prefix}", expect=0)
        stage = _run(sys.executable, "-m", "stages.evaluate", "experiment=tiny-trained")
        assert stage.returncode == 0, stage.stderr[-4000:]
    return run


@pytest.mark.slow
def test_trained_draft_beats_both_baselines(smoke_run):
    offline = json.loads((smoke_run / "evaluate/results.json").read_text())["offline"]
    for baseline in ("bigram", "most_frequent"):
        assert offline["eagle3"]["tau_ci"][0] > offline[baseline]["tau_ci"][1], baseline
    print({name: round(r["tau"], 3) for name, r in offline.items()})


@pytest.mark.slow
def test_the_gate_floor_lies_between_this_machines_draft_and_its_baseline(smoke_run):
    """The recorded floor checked against a run measured here and now, not against the
    numbers written into the asset: below the draft's whole tau CI (a good draft passes on
    this machine) and above the bigram baseline's (a draft collapsed to it fails the floor
    alone, whatever the CI rule)."""
    floor = json.loads(GATE.read_text())["tiny-trained"]["tau_min"]
    offline = json.loads((smoke_run / "evaluate/results.json").read_text())["offline"]
    print(f"floor {floor}, draft tau CI {offline['eagle3']['tau_ci']}, bigram CI {offline['bigram']['tau_ci']}")
    assert offline["bigram"]["tau_ci"][1] < floor < offline["eagle3"]["tau_ci"][0]


@pytest.mark.slow
def test_vllm_acceptance_agrees_with_the_offline_estimate(smoke_run):
    measured = json.loads((smoke_run / "evaluate/results.json").read_text())["in_vllm"]
    assert measured["on_target_text"], "EXP=tiny-trained evaluates on the target's own replies"
    print({"vllm": measured["vllm"]["tau"], "offline": measured["offline"]["tau"],
           "offline_ci": measured["offline"]["tau_ci"], "text_mismatches": measured["text_mismatches"]})
    assert measured["agrees"] and measured["vllm_tau_inside_offline_ci"], measured["paired_difference"]
    assert measured["replies"] > 20


def _broken_run(smoke_run: Path, tmp_path: Path) -> Path:
    """A copy of the run's manifests whose draft has a seeded permutation of d2t."""
    run = tmp_path / "run"
    for stage in ("tokenize", "regenerate", "extract", "prepare", "train"):
        shutil.copytree(smoke_run / stage, run / stage,
                        ignore=shutil.ignore_patterns("shard-*", "checkpoints", "samples.*", "chunks"))
    draft = json.loads((smoke_run / "train/manifest.json").read_text())["draft"]
    shutil.copytree(REPO / draft, tmp_path / "draft")
    tensors = load_file(str(tmp_path / "draft/model.safetensors"))
    perm = torch.randperm(len(tensors["d2t"]), generator=torch.Generator().manual_seed(0))
    targets = torch.arange(len(perm)) + tensors["d2t"]  # target id of each draft id
    tensors["d2t"] = targets[perm] - torch.arange(len(perm))  # draft id i -> another id's target
    save_file(tensors, str(tmp_path / "draft/model.safetensors"))
    return run


@pytest.mark.slow
def test_gate_passes_the_smoke_run_and_catches_a_shuffled_d2t(smoke_run, tmp_path):
    manifest = json.loads((smoke_run / "evaluate/manifest.json").read_text())
    assert manifest["gate"]["checked"] and manifest["gate"]["passed"]
    assert manifest["gate"]["baseline"]["checked"] and manifest["gate"]["floor"]["checked"]
    run = _broken_run(smoke_run, tmp_path)
    broken = _run(sys.executable, "-m", "stages.evaluate", "experiment=tiny-trained", f"run_dir={run}",
                  f"evaluate.draft={tmp_path / 'draft'}", "evaluate.vllm.enabled=false",
                  "evaluate.vllm_check=false")
    assert broken.returncode != 0 and "below the floor" in broken.stdout + broken.stderr
    assert not (run / "evaluate/manifest.json").exists()
    tau = json.loads((run / "evaluate/results.json").read_text())["offline"]["eagle3"]["tau"]
    print(f"shuffled d2t: tau {tau:.3f}")
    assert tau < json.loads(GATE.read_text())["tiny-trained"]["tau_min"]
