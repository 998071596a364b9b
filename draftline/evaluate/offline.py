"""How many tokens a trained EAGLE-3 draft would get accepted: offline, and in vLLM itself.

Offline (``evaluate_offline``): greedy chain drafting simulated on the held-out split's stored
hidden states, for the trained draft and two frequency baselines, scored against the target's
greedy tokens.  In vLLM (``vllm_vs_offline``): vLLM's own greedy speculative decoding of the
held-out prompts (draftline.speculative.jobs), step by step, against the offline walk of the same
replies.  Loadability (``check_vllm_load``): vLLM's own config parser and Eagle3 loader read
the saved draft and place every tensor.

Alignment (positions are 0-based token indices of one held-out sample ``x_0..x_{T-1}``):

* Stored rows at position ``t``: ``g_t`` = inputs of the aux decoder layers (concatenated in
  ``eagle_aux_hidden_state_layer_ids`` order, [3H]) and ``f_t`` = the final post-norm state.
  ``y_t = argmax(lm_head(f_t))`` is the target's greedy token for position ``t+1``.
* A verification step that ends with context ``x_0..x_{t+1}`` ("start ``t``"): the draft's
  first step reads ``fc(g_t)`` combined with ``embed(x_{t+1})`` at rope position ``t``
  (vLLM's EagleProposer: target positions, input ids shifted left by one, the last one the
  token just sampled).  It proposes ``d_1`` for position ``t+2``; step ``j`` reads the
  draft's own pre-norm output of step ``j-1`` and ``embed(d_{j-1})`` at position ``t+j-1``
  and proposes ``d_j`` for position ``t+1+j``.  Every step attends to the first-step keys of
  positions ``<= t`` (the draft's KV cache of real features) plus its own chain's keys --
  speculators' TTT mask, and vLLM's cache during a proposal.
* ``d_j`` is accepted iff ``d_1..d_{j-1}`` were and ``d_j == y_{t+j}``; the step yields
  ``accepted + 1`` tokens (the bonus token is the target's own).
* Scored starts: ``x_{t+1}..x_{t+k+1}`` all assistant tokens (``loss_mask``): the context
  ends inside a reply and every token the step proposes lies inside it (``t+k+1 <= T-1``).
* Steps: a decoding loop does not visit every start.  Per reply (first token at ``r``) the
  walk starts at ``t = r - 1`` and moves on by ``accepted + 1``, as the real loop does, until
  the next start is not scored.  tau = mean of ``accepted + 1`` over the walk's steps (tokens
  per verification step, vLLM's "mean acceptance length"); ``per_start`` also reports the
  mean over every scored start, which weights easy stretches more and reads higher.
* ``y_{t+j}`` for ``j >= 2`` is the target's greedy token after the *data* prefix
  ``x_{..t+j}``; at serving it follows ``x_{..t+1}, d_1, ..`` instead.  The two agree where
  the data is the target's own greedy text (then the walk takes exactly vLLM's steps and
  verdicts, which ``vllm_vs_offline`` checks; ``regenerate.replies=target`` makes the data
  the target's own); on other text the offline number is teacher-forced beyond the first
  position (as speculators' ``cond_acc``), ``on_policy`` reports how often the stored context
  was the greedy one, and vLLM's tau on the held-out prompts shows the resulting gap.

Confidence intervals: percentile bootstrap over held-out *samples* (steps within a sample are
correlated, so samples are the independent unit), seeded.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from draftline import formats
from draftline.evaluate.stats import Counts, bootstrap
from draftline.regenerate.greedy import reply_spans

log = logging.getLogger(__name__)
ALIGNMENT = (
    "start t: context x_0..x_{t+1}; draft step 1 = fc(aux_t) + embed(x_{t+1}) at position t; "
    "step j>1 = own pre-norm hidden + embed(d_{j-1}) at position t+j-1; d_j proposes position "
    "t+1+j and is accepted iff all earlier were and d_j == argmax(lm_head(final_{t+j})); "
    "starts scored where x_{t+1}..x_{t+k+1} are assistant tokens; tau averages the steps a "
    "decoding loop takes (each reply from its first token, moving on by accepted + 1)")


# --------------------------------------------------------------------------- held-out data


@dataclasses.dataclass
class Sample:
    """One held-out sample: its tokens, mask, aux features and the target's greedy tokens."""

    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    aux: torch.Tensor  # [T, num_aux * H] float32, aux slots concatenated in id order
    target_next: torch.Tensor  # [T] int64: y_t = argmax lm_head(final_t), the token for t+1


@torch.no_grad()
def greedy_tokens(final: torch.Tensor, head: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """argmax(lm_head(final)) per row: final [T, H], head [V, H] -> int64 [T] (chunked: big V)."""
    out = [(final[i:i + chunk].float() @ head.T).argmax(-1) for i in range(0, len(final), chunk)]
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


def load_heldout(shards: Sequence[str | Path], rows: torch.Tensor, head: torch.Tensor,
                 max_samples: int | None = None) -> list[Sample]:
    """Held-out samples from index rows int64 [n, 3] = (shard, row in shard, length)."""
    rows = rows[:max_samples] if max_samples else rows
    samples = []
    for shard_index in rows[:, 0].unique().tolist():
        mine = rows[rows[:, 0] == shard_index]
        for row, data in zip(mine.tolist(), formats.read_shard_rows(
                Path(shards[shard_index]), mine[:, 1].tolist(),
                (formats.HIDDEN_STATES, formats.INPUT_IDS, formats.LOSS_MASK)), strict=True):
            hidden = data[formats.HIDDEN_STATES]  # [T, num_aux + 1, H]
            if hidden.shape[0] != row[2]:
                raise ValueError(f"shard {shard_index} row {row[1]}: length {hidden.shape[0]} != index {row[2]}")
            samples.append(Sample(
                input_ids=data[formats.INPUT_IDS].long(), loss_mask=data[formats.LOSS_MASK].bool(),
                aux=hidden[:, :-1].float().flatten(1),
                target_next=greedy_tokens(hidden[:, -1], head)))
    return samples


def valid_starts(loss_mask: torch.Tensor, k: int) -> torch.Tensor:
    """Starts t whose step lies inside a reply: loss_mask[t+1 .. t+k+1] all set; int64 [S]."""
    T = loss_mask.numel()
    if T < k + 2:
        return torch.empty(0, dtype=torch.long)
    windows = loss_mask.long().unfold(0, k + 1, 1)[1:]  # [T-k-1, k+1]: window of t starts at t+1
    return (windows.sum(-1) == k + 1).nonzero().flatten()


def truth_for(sample: Sample, starts: torch.Tensor, k: int) -> torch.Tensor:
    """Target greedy tokens the chain from each start must match: [S, k], row t = y_{t+1..t+k}."""
    offsets = starts[:, None] + 1 + torch.arange(k)[None, :]  # [S, k]
    return sample.target_next[offsets]


def accepted_lengths(proposals: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Accepted prefix length per step: proposals/truth [S, k] -> int64 [S] in 0..k."""
    return (proposals == truth).long().cumprod(-1).sum(-1)


def on_policy_depth(sample: Sample, starts: torch.Tensor, k: int) -> torch.Tensor:
    """How many chain positions the stored context matches the greedy path: int64 [S] in 1..k.

    d_1 is always scored on the right context; d_j (j >= 2) is scored exactly only while
    x_{t+2..t+j} == y_{t+1..t+j-1} (the data followed the target's greedy tokens).
    """
    if k == 1:
        return torch.ones(len(starts), dtype=torch.long)
    offsets = starts[:, None] + 1 + torch.arange(k - 1)[None, :]  # [S, k-1]
    follows = sample.input_ids[offsets + 1] == sample.target_next[offsets]  # [S, k-1]
    return 1 + follows.long().cumprod(-1).sum(-1)


# --------------------------------------------------------------------------- baselines


class MostFrequentDraft:
    """Always proposes the training split's most frequent assistant token."""

    name = "most_frequent"

    def __init__(self, token: int):
        self.token = token

    def propose(self, sample: Sample, starts: torch.Tensor, k: int) -> torch.Tensor:
        return torch.full((len(starts), k), self.token, dtype=torch.long)  # [S, k]


class BigramDraft:
    """Rolls out argmax next-token counts of the training split (unigram mode if unseen)."""

    name = "bigram"

    def __init__(self, table: torch.Tensor):
        self.table = table  # [V] int64: most frequent successor of each token

    def propose(self, sample: Sample, starts: torch.Tensor, k: int) -> torch.Tensor:
        previous = sample.input_ids[starts + 1]  # [S]: x_{t+1}, the context's last token
        out = []
        for _ in range(k):
            previous = self.table[previous]
            out.append(previous)
        return torch.stack(out, -1) if out else torch.empty(len(starts), 0, dtype=torch.long)


def count_tokens(shards: Sequence[str | Path], rows: torch.Tensor,
                 vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assistant-token counts of the rows: unigram [V], bigram [V, V] (previous -> masked next).

    The bigram is a sparse COO tensor: only pairs that occur are held. A dense [V, V] table
    would take V**2 * 8 bytes: 19 GB at SmolLM2's 49,152 tokens, 214 GB at Kimi-K2.5's 163,840.
    """
    unigram = torch.zeros(vocab, dtype=torch.long)
    codes, counts = [], []
    for shard_index in rows[:, 0].unique().tolist():
        mine = rows[rows[:, 0] == shard_index][:, 1].tolist()
        for data in formats.read_shard_rows(Path(shards[shard_index]), mine,
                                            (formats.INPUT_IDS, formats.LOSS_MASK)):
            ids, mask = data[formats.INPUT_IDS].long(), data[formats.LOSS_MASK].bool()
            unigram += torch.bincount(ids[mask], minlength=vocab)
            pairs = ids[:-1] * vocab + ids[1:]  # [T-1], pair (x_i, x_{i+1}) as one code
            found, times = torch.unique(pairs[mask[1:]], return_counts=True)
            codes.append(found)
            counts.append(times)
    codes_all = torch.cat(codes) if codes else torch.zeros(0, dtype=torch.long)
    pairs, where = torch.unique(codes_all, return_inverse=True)
    totals = torch.zeros(len(pairs), dtype=torch.long).index_add_(
        0, where, torch.cat(counts) if counts else torch.zeros(0, dtype=torch.long))
    bigram = torch.sparse_coo_tensor(torch.stack([pairs // vocab, pairs % vocab]), totals,
                                     (vocab, vocab)).coalesce()
    return unigram, bigram


def _successors(bigram: torch.Tensor, fallback: int) -> torch.Tensor:
    """[V]: each token's most frequent successor (ties: the lowest id, as argmax picks), or
    ``fallback`` for a token never seen as a predecessor; ``bigram`` dense or sparse."""
    if not bigram.is_sparse:
        table = bigram.argmax(-1)  # [V]
        table[bigram.sum(-1) == 0] = fallback
        return table
    bigram = bigram.coalesce()
    previous, following = bigram.indices()
    values = bigram.values()
    table = torch.full((bigram.shape[0],), fallback, dtype=torch.long)
    # Sort by successor, then count (descending), then predecessor, each sort stable: the first
    # entry of every predecessor is then its argmax with argmax's tie-break.
    order = torch.sort(following, stable=True).indices
    order = order[torch.sort(-values[order], stable=True).indices]
    order = order[torch.sort(previous[order], stable=True).indices]
    rows, cols = previous[order], following[order]
    first = torch.ones(len(rows), dtype=torch.bool)
    first[1:] = rows[1:] != rows[:-1]
    table[rows[first]] = cols[first]
    return table


def baseline_drafts(unigram: torch.Tensor, bigram: torch.Tensor) -> list:
    """The two reference drafts built from training-split counts."""
    mode = int(unigram.argmax())
    # a token never seen as a predecessor backs off to the unigram
    return [MostFrequentDraft(mode), BigramDraft(_successors(bigram, mode))]


# --------------------------------------------------------------------------- offline


def reply_starts(loss_mask: torch.Tensor) -> list[int]:
    """Positions r where an assistant reply begins (loss_mask turns on)."""
    mask = loss_mask.long()
    return (((mask[1:] == 1) & (mask[:-1] == 0)).nonzero().flatten() + 1).tolist()


def walk(loss_mask: torch.Tensor, starts: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """The steps a decoding loop takes through each reply: indices into ``starts``, int64 [W].

    The first step of a reply has context up to its first token (start r - 1); each step
    moves the context on by accepted + 1 tokens; a reply's walk ends at the first start that
    is not scored (its step would run past the reply).
    """
    index = {t: i for i, t in enumerate(starts.tolist())}
    visited = []
    for r in reply_starts(loss_mask):
        t = r - 1
        while t in index:
            visited.append(index[t])
            t += int(accepted[index[t]]) + 1
    return torch.tensor(visited, dtype=torch.long)


@dataclasses.dataclass
class Simulation:
    """One proposer on one sample: every scored start, and the loop's walk through them."""

    starts: torch.Tensor  # [S] scored starts t
    accepted: torch.Tensor  # [S] accepted draft tokens of the step at each start
    depth: torch.Tensor  # [S] on-policy depth of each start (see on_policy_depth)
    steps: torch.Tensor  # [W] indices into starts: the steps a decoding loop takes


def simulate(proposer, samples: Sequence[Sample], k: int) -> list[Simulation]:
    """Proposals, verdicts and the loop's walk for every sample."""
    out = []
    for sample in samples:
        starts = valid_starts(sample.loss_mask, k)
        accepted = accepted_lengths(proposer.propose(sample, starts, k), truth_for(sample, starts, k))
        out.append(Simulation(starts, accepted, on_policy_depth(sample, starts, k),
                              walk(sample.loss_mask, starts, accepted)))
    return out


def on_policy_summary(sims: Sequence[Simulation], k: int) -> dict:
    """On the walk's steps: how often position j was scored on the true greedy context, if reached."""
    accepted = torch.cat([s.accepted[s.steps] for s in sims])
    depth = torch.cat([s.depth[s.steps] for s in sims])
    reached = [(accepted >= j - 1) for j in range(1, k + 1)]
    return {"fraction_by_position": [float((depth[r] >= j).float().mean()) if r.any() else float("nan")
                                     for j, r in zip(range(1, k + 1), reached, strict=True)]}


def evaluate_offline(proposers: Sequence, samples: Sequence[Sample], k: int, *, resamples: int,
                     level: float, seed: int) -> dict:
    """tau and acceptance (bootstrap CIs) of every proposer, each walking its own steps.

    ``tau`` averages over the steps a decoding loop takes (tokens per verification step, as
    vLLM counts it); ``per_start`` averages over every scored start instead, which weights
    easy stretches more (a loop crosses them in few steps) and so reads higher.
    """
    results = {}
    for proposer in proposers:
        sims = simulate(proposer, samples, k)
        counts = Counts.from_lengths([s.accepted[s.steps] for s in sims], k)
        result = bootstrap(counts, resamples, level, seed)
        # [samples][k + 1]: what a comparison of two drafts on the same samples pairs
        result["counts_per_sample"] = counts.at_least.tolist()
        per_start = bootstrap(Counts.from_lengths([s.accepted for s in sims], k), resamples, level, seed)
        result["per_start"] = {key: per_start[key] for key in ("tau", "tau_ci", "acceptance", "steps")}
        result["on_policy"] = on_policy_summary(sims, k)
        results[proposer.name] = result
        log.info("%s: tau %.3f [%.3f, %.3f] over %d steps, acceptance %s",  # pragma: no mutate
                 proposer.name, result["tau"], *result["tau_ci"], result["steps"],  # pragma: no mutate
                 [round(a, 3) for a in result["acceptance"]])  # pragma: no mutate
    return results


def greedy_coverage(samples: Sequence[Sample], t2d: torch.Tensor, k: int) -> float:
    """Share of the scored target tokens that the draft vocabulary can propose at all."""
    hits = total = 0
    for sample in samples:
        starts = valid_starts(sample.loss_mask, k)
        truth = truth_for(sample, starts, k)
        hits += int(t2d[truth].sum())
        total += truth.numel()
    return hits / max(total, 1)


def held_out_replies(samples: Sequence[Sample], limit: int | None = None) -> list[tuple[Sample, int, int]]:
    """(sample, a, b) per assistant reply: prompt = input_ids[:a], reply = input_ids[a:b]."""
    replies = [(sample, a, b) for sample in samples for a, b in reply_spans(sample.loss_mask.tolist())]
    return replies[:limit]
