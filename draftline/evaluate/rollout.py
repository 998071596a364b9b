"""The trained EAGLE-3 draft, re-run as vLLM serves it: load a saved draft, roll it out step
by step with its KV cache (``DraftRunner``), as a proposer for the offline walk (``Eagle3Draft``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftline.evaluate.offline import Sample


# --------------------------------------------------------------------------- the EAGLE-3 draft


# pragma: no mutate start  (loads a saved draft: exercised by the rollout and vLLM tests)
def load_draft(draft_dir: str | Path, target_dir: str | Path):
    """The saved draft (speculators format) as float32 modules, verifier weights from ``target_dir``.

    The verifier path recorded at training time may not exist here (another host, a copied
    repo), so the evaluated target's directory replaces it; the draft's own tensors (including
    its embed_tokens copy, which vLLM loads too) come from model.safetensors.
    """
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    from draftline.train.draft import Eagle3DraftModel

    draft_dir = Path(draft_dir)
    config = Eagle3SpeculatorConfig.from_pretrained(str(draft_dir))
    config.speculators_config.verifier.name_or_path = str(Path(target_dir).absolute())
    tensors = load_file(str(draft_dir / "model.safetensors"))
    kind = Eagle3DraftModel
    if "mask_hidden" in tensors:  # a parallel draft (draftline.train.parallel)
        from draftline.train.parallel import ParallelDraft as kind
    model = kind(config, t2d=tensors["t2d"].bool(), d2t=tensors["d2t"].long())
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
        # A parallel draft's later slots read the mask token and fc(mask_hidden), not the
        # previous slot's token and output (vLLM's parallel_drafting; draftline.train.parallel).
        self.parallel = hasattr(model, "mask_hidden")

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

        Step j reads its previous step's pre-norm output and token at position start + j - 1
        (a parallel draft: the mask token and fc(mask_hidden) instead), sees cache rows
        <= start and its own chain; returns target ids [S, k].
        """
        proposals = [first]
        S = len(starts)
        own = [(cache.keys[i].new_empty(S, 0, self.kv_heads, self.head_dim),) * 2
               for i in range(len(self.layers))]
        if self.parallel:
            mask_embeds = self.model.embed_tokens(torch.full_like(first, self.model.mask_token_id))
            mask_hidden = self.model.mask_features(torch.float32).expand(S, -1)
        for j in range(1, k):
            if self.parallel:
                embeds, hidden = mask_embeds, mask_hidden
            else:
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
# pragma: no mutate end
