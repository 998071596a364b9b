"""Parallel drafting (P-EAGLE, draftline issue 45): an EAGLE-3 draft that proposes its k
tokens in one forward, trained the way vLLM 0.16's proposer runs it.

vLLM (``speculative_config: {method: eagle3, parallel_drafting: true}``; v1/spec_decode/
eagle.py, model_executor/models/llama_eagle3.py) lays out one draft forward per step: the
accepted positions and the first slot as in EAGLE-3 (the next token's embedding beside
``fc(aux)``), then k - 1 masked slots at the next positions, each with the embedding of the
mask token (``ptd_token_id`` in the draft's layer config) beside ``fc(mask_hidden)`` (a learned
[3H] vector in place of the three aux layers). Attention is causal: a masked slot sees the real
prefix up to its anchor, the first slot and the earlier masked slots of the same anchor. Slot j
proposes the token j + 1 after the anchor's next one; no slot reads the draft's own output.

Training is therefore the TTT rollout with two inputs changed at depths >= 1: the mask token
instead of the previous depth's token, and ``fc(mask_hidden)`` instead of the previous depth's
output. The rollout's attention (a depth sees depth 0 up to its anchor and its own anchor's
earlier depths) and positions (anchor + depth) are already what vLLM's layout gives.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from speculators.models.eagle3.attention import create_combined_mask_mod, extend_mask_for_draft_tokens
from speculators.models.eagle3.core import compute_metrics
from torch.nn.attention.flex_attention import create_block_mask
from transformers import DynamicCache

from draftline.train.draft import Eagle3DraftModel

__all__ = ["MASK_HIDDEN", "MASK_TOKEN", "METHODS", "ParallelDraft", "draft_class", "is_parallel", "mask_token"]

MASK_HIDDEN = "mask_hidden"  # the weight's name: vLLM loads any weight whose name holds it
MASK_TOKEN = "ptd_token_id"  # in transformer_layer_config, where vLLM reads the layer config
METHODS = ("eagle3", "parallel")  # train.method: sequential EAGLE-3, or parallel drafting


def mask_token(verifier_text: dict) -> int:
    """The mask token: the verifier's pad token, else its first eos (a token the replies do
    not hold inside them, so its embedding means "a slot to fill")."""
    for key in ("pad_token_id", "eos_token_id"):
        value = verifier_text.get(key)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int) and value >= 0:
            return value
    raise ValueError("the verifier's config names no pad or eos token to use as the mask token")


def is_parallel(draft_dir: str | Path) -> bool:
    """Whether a saved draft drafts in parallel (its layer config names the mask token)."""
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    return MASK_TOKEN in config.get("transformer_layer_config", {})


class ParallelDraft(Eagle3DraftModel):
    """``Eagle3DraftModel`` plus ``mask_hidden`` [3H], trained as vLLM's proposer drafts in
    parallel (the module doc). Saved in speculators' format with ``mask_hidden`` beside the
    other tensors, under the architecture name speculators' own drafts have."""

    @classmethod
    def layer_config_fields(cls, verifier_text: dict) -> dict:
        """The mask token, where vLLM reads it: the draft's layer config."""
        return {MASK_TOKEN: mask_token(verifier_text)}

    def __init__(self, config, t2d: torch.Tensor, d2t: torch.Tensor):
        super().__init__(config, t2d=t2d, d2t=d2t)
        layer = config.transformer_layer_config
        if getattr(layer, MASK_TOKEN, None) is None:
            raise ValueError(f"a parallel draft needs {MASK_TOKEN} in its transformer_layer_config")
        self.mask_token_id = int(getattr(layer, MASK_TOKEN))
        self.mask_hidden = torch.nn.Parameter(torch.randn(3 * self.hidden_size) * layer.initializer_range)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """speculators' save; config.json's ``architectures`` says ``Eagle3DraftModel`` (what
        transformers writes is this class's name), as every EAGLE-3 draft of the format."""
        result = super().save_pretrained(save_directory, *args, **kwargs)
        path = Path(save_directory) / "config.json"
        config = json.loads(path.read_text())
        config["architectures"] = [Eagle3DraftModel.__name__]
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return result

    def mask_features(self, dtype: torch.dtype) -> torch.Tensor:
        """``fc(mask_hidden)`` [H]: what every masked slot reads beside the mask token."""
        return self.fc(self.mask_hidden.to(dtype))

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor,
                lengths: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                verifier_last_hidden_states: torch.Tensor | None = None, ttt_steps: int = 3,
                ttt_step_loss_decay: float = 1.0, **kwargs):
        """The packed batch's proposals at every depth (and with targets, the summed loss and
        speculators' per-depth metrics), depth d >= 1 reading the mask inputs."""
        device, total = hidden_states.device, hidden_states.shape[1]
        if lengths is None:
            lengths = torch.tensor([total], dtype=torch.long, device=device)
        if position_ids is None:
            position_ids = torch.arange(1, total + 1, dtype=torch.long, device=device)[None]
        cache = DynamicCache(config=self.config.transformer_layer_config)
        attention = create_block_mask(create_combined_mask_mod(lengths.to(device), total), B=None, H=None,
                                      Q_LEN=total, KV_LEN=total, device=device)
        real = self.fc(hidden_states)  # [1, T, H]: depth 0 reads the target's features
        masked = self.mask_features(real.dtype).expand_as(real)
        mask_ids = torch.full_like(input_ids, self.mask_token_id)
        with_loss = verifier_last_hidden_states is not None
        if with_loss:
            with torch.no_grad():
                targets = self.verifier_lm_head(verifier_last_hidden_states)
            loss = torch.zeros((), device=device)
            correct = (loss_mask.clone() if loss_mask is not None
                       else torch.ones(1, total, dtype=torch.bool, device=device))
            metrics = {}
        proposals = []
        for depth in range(ttt_steps):
            with torch.no_grad():
                embeds = self.embed_tokens(input_ids if depth == 0 else mask_ids)
            x = torch.cat([embeds, real if depth == 0 else masked], dim=-1)
            rotary = self.rotary_emb(x, position_ids)
            where = torch.arange(depth * total, (depth + 1) * total, dtype=torch.long, device=device)
            for layer in self.layers:
                x = layer(x, attention_mask=attention, position_ids=position_ids, past_key_values=cache,
                          cache_position=where, position_embeddings=rotary, **kwargs)
            logits = self.lm_head(self.norm(x))
            if with_loss:
                depth_loss, depth_metrics = compute_metrics(logits, targets, loss_mask, correct, depth,
                                                            ttt_step_loss_decay)
                loss = loss + depth_loss
                metrics.update(depth_metrics)
            proposals.append(logits.argmax(-1).detach())
            attention = extend_mask_for_draft_tokens(attention)
            position_ids = position_ids + 1
        if with_loss:
            metrics["loss"] = loss.detach().clone()
            return proposals, loss, metrics
        return proposals


def draft_class(method: str) -> type[Eagle3DraftModel]:
    """The draft's class for ``train.method`` (ValueError naming the choices)."""
    if method not in METHODS:
        raise ValueError(f"train.method={method!r}: one of {', '.join(METHODS)}")
    return ParallelDraft if method == "parallel" else Eagle3DraftModel
