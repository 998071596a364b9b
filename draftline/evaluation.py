"""How many tokens a trained EAGLE-3 draft would get accepted: offline, and in vLLM itself.

Offline (``evaluate_offline``): greedy chain drafting simulated on the held-out split's stored
hidden states, for the trained draft and two frequency baselines, scored against the target's
greedy tokens.  In vLLM (``vllm_vs_offline``): vLLM's own greedy speculative decoding of the
held-out prompts (draftline.serving), step by step, against the offline walk of the same
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
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from draftline.regeneration import reply_spans

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


def read_rows(shard: Path, rows: Sequence[int], keys: Sequence[str]) -> list[dict]:
    """The given sample rows of one shard, only ``keys``: per row {key: tensor [T, ...]}."""
    with safe_open(str(shard), framework="pt") as handle:
        offsets = handle.get_tensor("sample_offsets")  # [samples + 1]
        slices = {key: handle.get_slice(key) for key in keys}
        return [{key: s[int(offsets[r]):int(offsets[r + 1])] for key, s in slices.items()}
                for r in rows]


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
        for row, data in zip(mine.tolist(), read_rows(
                Path(shards[shard_index]), mine[:, 1].tolist(),
                ("hidden_states", "input_ids", "loss_mask")), strict=True):
            hidden = data["hidden_states"]  # [T, num_aux + 1, H]
            if hidden.shape[0] != row[2]:
                raise ValueError(f"shard {shard_index} row {row[1]}: length {hidden.shape[0]} != index {row[2]}")
            samples.append(Sample(
                input_ids=data["input_ids"].long(), loss_mask=data["loss_mask"].bool(),
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
    """Assistant-token counts of the rows: unigram [V], bigram [V, V] (previous -> masked next)."""
    unigram = torch.zeros(vocab, dtype=torch.long)
    bigram = torch.zeros(vocab * vocab, dtype=torch.long)
    for shard_index in rows[:, 0].unique().tolist():
        mine = rows[rows[:, 0] == shard_index][:, 1].tolist()
        for data in read_rows(Path(shards[shard_index]), mine, ("input_ids", "loss_mask")):
            ids, mask = data["input_ids"].long(), data["loss_mask"].bool()
            unigram += torch.bincount(ids[mask], minlength=vocab)
            pairs = ids[:-1] * vocab + ids[1:]  # [T-1], pair (x_i, x_{i+1})
            bigram += torch.bincount(pairs[mask[1:]], minlength=vocab * vocab)
    return unigram, bigram.view(vocab, vocab)


def baseline_drafts(unigram: torch.Tensor, bigram: torch.Tensor) -> list:
    """The two reference drafts built from training-split counts."""
    mode = int(unigram.argmax())
    table = bigram.argmax(-1)  # [V]
    table[bigram.sum(-1) == 0] = mode  # never seen as a predecessor: back off to the unigram
    return [MostFrequentDraft(mode), BigramDraft(table)]


# --------------------------------------------------------------------------- the EAGLE-3 draft


# pragma: no mutate start  (loads a saved draft: exercised by the rollout and vLLM tests)
def load_draft(draft_dir: str | Path, target_dir: str | Path):
    """The saved draft (speculators format) as float32 modules, verifier weights from ``target_dir``.

    The verifier path recorded at training time may not exist here (another host, a copied
    repo), so the evaluated target's directory replaces it; the draft's own tensors (including
    its embed_tokens copy, which vLLM loads too) come from model.safetensors.
    """
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    from draftline.train_model import Eagle3DraftModel

    draft_dir = Path(draft_dir)
    config = Eagle3SpeculatorConfig.from_pretrained(str(draft_dir))
    config.speculators_config.verifier.name_or_path = str(Path(target_dir).absolute())
    tensors = load_file(str(draft_dir / "model.safetensors"))
    model = Eagle3DraftModel(config, t2d=tensors["t2d"].bool(), d2t=tensors["d2t"].long())
    state = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if not (not unexpected):
        raise ValueError(f"{draft_dir}: tensors the draft has no place for: {unexpected}")
    if set(missing) > {"verifier_lm_head.weight", "embed_tokens.weight"}:
        raise ValueError(f"{draft_dir}: missing draft tensors {missing}")
    return model.float().eval()


# pragma: no mutate end
def num_speculative_tokens(draft_dir: str | Path) -> int:
    """k as the draft's config proposes it (what `vllm serve <draft dir>` drafts)."""
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    methods = config["speculators_config"]["proposal_methods"]
    return int(methods[0]["speculative_tokens"])


def draft_aux_layer_ids(draft_dir: str | Path) -> list[int]:
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    return [int(i) for i in config["eagle_aux_hidden_state_layer_ids"]]


# pragma: no mutate start  (serving-style draft rollout: tested against speculators' own forward)
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@dataclasses.dataclass
class DraftCache:
    """The draft's KV cache of first-step (real-feature) positions, per decoder layer."""

    keys: list[torch.Tensor]  # per layer [P, kv_heads, D], roped
    values: list[torch.Tensor]  # per layer [P, kv_heads, D]

    @property
    def length(self) -> int:
        return self.keys[0].shape[0]


class DraftRunner:
    """The draft run as vLLM 0.16 serves it (llama_eagle3.py + v1/spec_decode/eagle.py).

    Written from the module weights, not through speculators' training forward, so that the
    test comparing the two checks the TTT rollout against an independent serving-style one.
    Layer 0: ``input_layernorm(embed)`` and ``hidden_norm(hidden)`` concatenated into q/k/v,
    residual = the un-normed hidden (``norm_before_residual`` = the normed one); later layers
    are plain Llama layers; the next step reads the pre-norm output, logits read the normed.
    """

    def __init__(self, model):
        self.model = model
        self.layers = list(model.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads = attn.config.num_attention_heads
        self.kv_heads = attn.config.num_key_value_heads
        self.norm_before_residual = bool(model.config.norm_before_residual)
        self.d2t = model.d2t  # [draft_vocab]

    def new_cache(self) -> DraftCache:
        empty = torch.empty(0, self.kv_heads, self.head_dim)
        return DraftCache([empty] * len(self.layers), [empty] * len(self.layers))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, 1, D] for positions [S] (the draft's own rotary embedding)."""
        dummy = torch.zeros(1, dtype=torch.float32)
        cos, sin = self.model.rotary_emb(dummy, positions[None])  # [1, S, D] each
        return cos[0, :, None], sin[0, :, None]

    def _qkv(self, attn, x: torch.Tensor, positions: torch.Tensor):
        """Roped q [S, heads, D] and k, v [S, kv_heads, D] of inputs x [S, in]."""
        S = x.shape[0]
        q = attn.q_proj(x).view(S, self.heads, self.head_dim)
        k = attn.k_proj(x).view(S, self.kv_heads, self.head_dim)
        v = attn.v_proj(x).view(S, self.kv_heads, self.head_dim)
        cos, sin = self._rope(positions)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def _attend(self, q, ctx_k, ctx_v, ctx_len, own_k, own_v) -> torch.Tensor:
        """Each query s sees ctx rows [0, ctx_len[s]) and its own chain keys.

        q [S, heads, D]; ctx_k/v [P, kv, D]; ctx_len [S]; own_k/v [S, m, kv, D] -> [S, heads*D].
        """
        group = self.heads // self.kv_heads
        ctx_k, ctx_v = ctx_k.repeat_interleave(group, 1), ctx_v.repeat_interleave(group, 1)
        own_k, own_v = own_k.repeat_interleave(group, 2), own_v.repeat_interleave(group, 2)
        scale = self.head_dim ** -0.5
        ctx_scores = torch.einsum("shd,phd->shp", q, ctx_k) * scale  # [S, heads, P]
        visible = torch.arange(ctx_k.shape[0])[None, :] < ctx_len[:, None]  # [S, P]
        ctx_scores = ctx_scores.masked_fill(~visible[:, None, :], float("-inf"))
        own_scores = torch.einsum("shd,smhd->shm", q, own_k) * scale  # [S, heads, m]
        weights = torch.softmax(torch.cat([ctx_scores, own_scores], -1), -1)
        P = ctx_k.shape[0]
        out = (torch.einsum("shp,phd->shd", weights[..., :P], ctx_v)
               + torch.einsum("shm,smhd->shd", weights[..., P:], own_v))  # [S, heads, D]
        return out.flatten(1)

    def _layer_input(self, index: int, layer, hidden, embeds):
        """(attention input, residual) of decoder layer ``index``."""
        if index > 0:
            return layer.input_layernorm(hidden), hidden
        normed = layer.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([layer.input_layernorm(embeds), normed], -1), residual

    def _forward(self, hidden, embeds, positions, cache: DraftCache, ctx_len, own: list | None,
                 store: bool):
        """One draft step for S queries; returns the pre-norm output [S, H] and new (k, v) per layer.

        ``store``: append this step's keys to the cache (first-step positions); otherwise the
        keys are chain keys, attended through ``own`` (per layer [S, m, kv, D] pairs).
        """
        new_kv = []
        for index, layer in enumerate(self.layers):
            x, residual = self._layer_input(index, layer, hidden, embeds)
            q, k, v = self._qkv(layer.self_attn, x, positions)
            if store:
                cache.keys[index] = torch.cat([cache.keys[index], k])
                cache.values[index] = torch.cat([cache.values[index], v])
                own_k = own_v = k.new_empty(len(q), 0, self.kv_heads, self.head_dim)
            else:
                own_k = torch.cat([own[index][0], k[:, None]], 1)
                own_v = torch.cat([own[index][1], v[:, None]], 1)
            attn = self._attend(q, cache.keys[index], cache.values[index], ctx_len, own_k, own_v)
            hidden = residual + layer.self_attn.o_proj(attn)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            new_kv.append((k, v))
        return hidden, new_kv

    def _tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy draft token per row, as a target id: [S, H] -> int64 [S]."""
        draft_ids = self.model.lm_head(self.model.norm(hidden)).argmax(-1)
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def prefill(self, aux: torch.Tensor, next_ids: torch.Tensor, cache: DraftCache):
        """First step at positions P..P+N-1: aux [N, 3H], next_ids [N] (x_{t+1} per position t).

        Appends N positions to ``cache``; returns (pre-norm output [N, H], d_1 per position [N]).
        """
        P, N = cache.length, aux.shape[0]
        positions = torch.arange(P, P + N)
        hidden = self.model.fc(aux)  # [N, H]
        embeds = self.model.embed_tokens(next_ids)  # [N, H]
        out, _ = self._forward(hidden, embeds, positions, cache, positions + 1, None, store=True)
        return out, self._tokens(out)

    @torch.no_grad()
    def chains(self, hidden: torch.Tensor, first: torch.Tensor, starts: torch.Tensor,
               cache: DraftCache, k: int) -> torch.Tensor:
        """Roll out k proposals per start: hidden/first = prefill rows of the starts ([S, H], [S]).

        Step j reads its previous step's pre-norm output and token at position start + j - 1,
        sees cache rows <= start and its own chain; returns target ids [S, k].
        """
        proposals = [first]
        S = len(starts)
        own = [(cache.keys[i].new_empty(S, 0, self.kv_heads, self.head_dim),) * 2
               for i in range(len(self.layers))]
        for j in range(1, k):
            embeds = self.model.embed_tokens(proposals[-1])
            hidden, new_kv = self._forward(hidden, embeds, starts + j, cache, starts + 1, own,
                                           store=False)
            own = [(torch.cat([o[0], kv[0][:, None]], 1), torch.cat([o[1], kv[1][:, None]], 1))
                   for o, kv in zip(own, new_kv, strict=True)]
            proposals.append(self._tokens(hidden))
        return torch.stack(proposals, -1)


class Eagle3Draft:
    """The trained draft as an offline proposer: prefill the sample, chain from every start."""

    name = "eagle3"

    def __init__(self, runner: DraftRunner):
        self.runner = runner

    def propose(self, sample: Sample, starts: torch.Tensor, k: int) -> torch.Tensor:
        cache = self.runner.new_cache()
        # Position t reads aux_t and x_{t+1}: the last position has no next token.
        hidden, first = self.runner.prefill(sample.aux[:-1], sample.input_ids[1:], cache)
        return self.runner.chains(hidden[starts], first[starts], starts, cache, k)


# --------------------------------------------------------------------------- statistics


# pragma: no mutate end
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
        result = bootstrap(Counts.from_lengths([s.accepted[s.steps] for s in sims], k),
                           resamples, level, seed)
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


# --------------------------------------------------------------------------- live loop


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


def held_out_replies(samples: Sequence[Sample], limit: int | None = None) -> list[tuple[Sample, int, int]]:
    """(sample, a, b) per assistant reply: prompt = input_ids[:a], reply = input_ids[a:b]."""
    replies = [(sample, a, b) for sample in samples for a, b in reply_spans(sample.loss_mask.tolist())]
    return replies[:limit]


def first_difference(stored: Sequence[int], produced: Sequence[int]) -> dict:
    """Where two token sequences part: the position and both tokens (None past an end)."""
    for i in range(max(len(stored), len(produced))):
        a = stored[i] if i < len(stored) else None
        b = produced[i] if i < len(produced) else None
        if a != b:
            return {"position": i, "stored": a, "vllm": b, "stored_length": len(stored),
                    "vllm_length": len(produced)}
    return {}


def vllm_vs_offline(replies: Sequence[tuple[Sample, int, int]], measured: Sequence[dict],
                    proposer, k: int, stats: dict) -> dict:
    """vLLM's own speculative decoding of each held-out prompt vs the offline walk of its reply.

    ``measured[i]`` is vLLM's decode of reply i's prompt (draftline.serving.measure_replies):
    its tokens and the accepted draft tokens of every verification step.  Where the stored
    reply is the target's own greedy reply (``regenerate.replies=target``) vLLM reproduces it
    token for token (``text_mismatches`` counts and locates the replies where it did not) and
    verifies exactly the contexts the offline walk scores, so on the steps both take (vLLM
    also takes a last step that would run past the stored reply, which the walk cannot score)
    they give the same verdicts.  They agree when vLLM's tau and its acceptance at every
    position lie inside the offline CIs and the paired tau difference on the shared steps has
    a CI containing 0.  ``divergences`` lists, per reply, the first step where the verdicts
    differ (a near-tie in the draft's numerics flips one; from there on the two walks visit
    other positions, so later steps are not compared one to one).
    """
    if len(replies) != len(measured):
        raise ValueError(f"{len(measured)} vLLM decodes for {len(replies)} replies")
    full, shared, offline, mismatches, divergences = [], [], [], [], []
    for index, ((sample, a, b), decoded) in enumerate(zip(replies, measured, strict=True)):
        mask = torch.zeros_like(sample.loss_mask)
        mask[a:b] = True
        sim = simulate(proposer, [dataclasses.replace(sample, loss_mask=mask)], k)[0]
        walk_steps = sim.accepted[sim.steps]
        steps = torch.tensor(decoded["accepted"], dtype=torch.long)
        n = min(len(steps), len(walk_steps))
        differ = (steps[:n] != walk_steps[:n]).nonzero().flatten()
        if len(differ):  # after one other verdict the two visit other positions
            j = int(differ[0])
            divergences.append({"reply": index, "step": j, "of_steps": n,
                                "vllm_accepted": int(steps[j]), "offline_accepted": int(walk_steps[j])})
        full.append(steps)
        shared.append(steps[:n])
        offline.append(walk_steps[:n])
        stored = sample.input_ids[a:b].tolist()
        if decoded["tokens"] != stored:
            mismatches.append({"reply": index, **first_difference(stored, decoded["tokens"])})
    vllm_counts = Counts.from_lengths(full, k)
    shared_counts, off_counts = Counts.from_lengths(shared, k), Counts.from_lengths(offline, k)
    vllm_result, off_result = bootstrap(vllm_counts, **stats), bootstrap(off_counts, **stats)
    paired = paired_difference(shared_counts, off_counts, "tau", **stats)
    positions = [paired_difference(shared_counts, off_counts, f"p{j}", **stats)
                 for j in range(1, k + 1)]
    inside = off_result["tau_ci"][0] <= vllm_result["tau"] <= off_result["tau_ci"][1]
    inside_by_position = [lo <= rate <= hi for rate, (lo, hi) in
                          zip(vllm_result["acceptance"], off_result["acceptance_ci"], strict=True)]
    totals = vllm_counts.at_least.sum(0)
    return {"replies": len(full), "text_mismatches": len(mismatches), "mismatched": mismatches,
            "diverging_replies": len(divergences), "divergences": divergences,
            "shared_steps": int(shared_counts.at_least[:, 0].sum()),
            "vllm": vllm_result, "offline": off_result,
            # accepted at position j per verification step: vLLM's own per-position rate
            "vllm_unconditional": [float(totals[j]) / max(int(totals[0]), 1) for j in range(1, k + 1)],
            "offline_unconditional": [float(off_counts.at_least[:, j].sum()) /
                                      max(int(off_counts.at_least[:, 0].sum()), 1) for j in range(1, k + 1)],
            "paired_difference": paired, "paired_by_position": positions,
            "vllm_tau_inside_offline_ci": inside, "vllm_acceptance_inside_offline_ci": inside_by_position,
            "agrees": inside and all(inside_by_position) and paired["agrees"]}


# --------------------------------------------------------------------------- vLLM loadability


def vllm_name(name: str) -> tuple[str, str]:
    """Where vLLM 0.16's Eagle3LlamaForCausalLM.load_weights puts a saved tensor.

    Returns (parameter name, kind): the replica of its mapping --
    t2d skipped, d2t -> draft_id_to_target_id, lm_head kept, the rest under ``model.``
    with q/k/v stacked into qkv_proj and gate/up into gate_up_proj.
    """
    if "t2d" in name:
        return "", "ignored"
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id"), "direct"
    if "lm_head" not in name:
        name = "model." + name
    for part, stacked in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                          (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
        if part in name:
            return name.replace(part, stacked), part.strip(".")
    return name, "direct"


def compare_loaded(params: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> dict:
    """Check every saved tensor landed (by value) in vLLM's parameters and every parameter was filled."""
    filled: set[str] = set()
    placed, ignored = [], []
    stacks: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in sorted(saved.items()):
        target, kind = vllm_name(name)
        if kind == "ignored":
            ignored.append(name)
            continue
        if target not in params:
            raise ValueError(f"saved tensor {name} maps to {target}, which vLLM's draft does not have")
        if kind == "direct":
            # Vocab-parallel layers may pad rows to a multiple of 64: compare the saved rows.
            held = params[target][: tensor.shape[0]] if tensor.dim() else params[target]
            if not torch.equal(held, tensor):  # by value (torch.equal promotes dtypes)
                raise ValueError(f"{name}: vLLM holds other values")
            filled.add(target)
        else:
            stacks.setdefault(target, []).append((kind, tensor))
        placed.append(name)
    order = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}
    for target, parts in stacks.items():
        stacked = torch.cat([t for _, t in sorted(parts, key=lambda p: order[p[0]])])
        if not torch.equal(params[target], stacked):
            raise ValueError(f"{target}: vLLM holds other values")
        filled.add(target)
    unfilled = sorted(set(params) - set(filled))
    if unfilled:
        raise ValueError(f"vLLM draft parameters no saved tensor filled: {unfilled}")
    return {"placed": placed, "ignored_by_vllm": ignored, "parameters": sorted(filled)}


# pragma: no mutate start  (vLLM child-process load check: the vLLM tier tests it, `make mutation` does not)
def _vllm_load_in_process(draft_dir: str, target_dir: str, k: int, trust_remote_code: bool) -> dict:
    """vLLM's own path: EngineArgs -> VllmConfig (speculators config parsing), get_model(draft)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.transformers_utils.config import get_config

    parsed = get_config(draft_dir, trust_remote_code=False)
    engine = EngineArgs(model=target_dir, speculative_config={"model": draft_dir, "method": "eagle3",
                                                           "num_speculative_tokens": k},
                        trust_remote_code=trust_remote_code, enforce_eager=True)
    vllm_config = engine.create_engine_config()
    with tempfile.TemporaryDirectory() as rendezvous:
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{rendezvous}/init")
        ensure_model_parallel_initialized(1, 1)
        with set_current_vllm_config(vllm_config):
            model = get_model(vllm_config=vllm_config,
                              model_config=vllm_config.speculative_config.draft_model_config)
    params = {n: p.detach().cpu() for n, p in model.named_parameters()}
    saved = load_file(str(Path(draft_dir) / "model.safetensors"))
    # vLLM casts to its model dtype when loading; compare in that dtype.
    saved = {k: v.to(params[vllm_name(k)[0]].dtype) if vllm_name(k)[0] in params else v
             for k, v in saved.items()}
    return {
        "model_class": type(model).__name__,
        "architectures": list(parsed.architectures or []),
        "eagle_aux_hidden_state_layer_ids": list(parsed.eagle_aux_hidden_state_layer_ids or []),
        "draft_vocab_size": int(parsed.draft_vocab_size),
        "num_speculative_tokens": int(vllm_config.speculative_config.num_speculative_tokens),
        "method": vllm_config.speculative_config.method,
        **compare_loaded(params, saved),
    }


def check_vllm_load(draft_dir: str | Path, target_dir: str | Path, k: int, *,
                    trust_remote_code: bool = False, timeout: float = 900) -> dict:
    """Run the vLLM load check in a child process (vLLM sets up process-global state).

    Raises with the child's output when vLLM cannot parse or load the draft.
    """
    command = [sys.executable, "-m", "draftline.evaluation", "vllm-load",
               str(Path(draft_dir).absolute()), str(Path(target_dir).absolute()), str(k)]
    if trust_remote_code:
        command.append("--trust-remote-code")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                            cwd=Path(__file__).resolve().parents[1])
    if result.returncode != 0:
        raise RuntimeError(f"vLLM could not load {draft_dir}:\n{result.stderr[-6000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    """``python -m draftline.evaluation vllm-load DRAFT TARGET K [--trust-remote-code]``: one JSON line."""
    if len(argv) < 4 or argv[0] != "vllm-load":
        raise SystemExit(main.__doc__)
    report = _vllm_load_in_process(argv[1], argv[2], int(argv[3]), "--trust-remote-code" in argv[4:])
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
# pragma: no mutate end
