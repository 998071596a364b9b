"""fp8 batches: float8_e4m3fn hidden states packed with their scales, dequantized on the device.

fp8 shards (``formats.HIDDEN_SCALES`` beside float8_e4m3fn hidden states) travel as stored:
one byte per value plus a float32 scale per token and slot, packed into the batch's
``SCALE_KEYS`` buffers (``draftline.train.dataset``'s ``copy_into``) and dequantized where
the batch is cast (``draftline.train.loader``; on the GPU in training).  The arithmetic is
``formats.dequantize``'s, the same as the reference path's per sample.
"""

from __future__ import annotations

import torch

from draftline import formats

__all__ = ["SCALE_KEYS", "dequantize_batch"]

# fp8 shards only, float32 [1, max_tokens, num_aux] and [1, max_tokens]: the packed scales of
# the batch's hidden states (``hidden_states``, ``verifier_last_hidden_states``), consumed
# (and dropped from the batch) when it is dequantized.
SCALE_KEYS = ("hidden_states_scales", "verifier_last_hidden_states_scales")


def dequantize_batch(batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A packed fp8 batch (hidden states float8_e4m3fn plus SCALE_KEYS) with its hidden states
    in ``dtype`` and the scales dropped: what the draft's forward takes. Runs where the batch
    is (the GPU: one byte per value crossed the host-to-device copy)."""
    out = {k: v for k, v in batch.items() if k not in SCALE_KEYS}
    hidden, scales = batch["hidden_states"], batch[SCALE_KEYS[0]]  # [1, T, aux*H], [1, T, aux]
    per_slot = hidden.view(*hidden.shape[:2], scales.shape[-1], -1)  # [1, T, aux, H]
    out["hidden_states"] = formats.dequantize(per_slot, scales, dtype).view(hidden.shape)
    out["verifier_last_hidden_states"] = formats.dequantize(
        batch["verifier_last_hidden_states"], batch[SCALE_KEYS[1]], dtype)  # [1, T, H]
    return out
