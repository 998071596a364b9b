"""Every file that crosses a stage boundary, written and read here only.

* tokenized samples (tokenize, regenerate -> regenerate, extract): flat ids, masks, offsets;
* hidden-state shards (extract -> prepare, train, evaluate);
* the split index (prepare -> train, evaluate);
* the vocab mapping (tokenize, regenerate -> train, report);
* conversation records (tokenize -> regenerate with ``tokenize.reasoning=as_generated``, and the
  regenerated ones regenerate writes): one JSON object a line, ``where``, ``messages``, ``tools``.

Each key is named once below; a stage that spells one itself would silently read nothing
after a rename here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftline.pipeline.artifacts import atomic_path

# --------------------------------------------------------------------------- tokenized samples
INPUT_IDS = "input_ids"  # int64 [tokens], all samples back to back
LOSS_MASK = "loss_mask"  # uint8 [tokens], 1 on tokens the draft learns (assistant replies)
SAMPLE_OFFSETS = "sample_offsets"  # int64 [samples + 1]: sample i is [offsets[i], offsets[i+1])
# uint8 [tokens], only in tokenize's file when some sample has tool results: 1 on the unmasked
# tokens after a reply up to the next one when tool results are among them (regenerate's rule)
TOOL_RESULTS = "tool_results"


def write_samples(path: str | Path, input_ids: list[list[int]], loss_masks: list[list[int]]) -> None:
    """Flat ``input_ids`` int64 [total], ``loss_mask`` uint8 [total], ``sample_offsets`` [n+1]."""
    lengths = torch.tensor([len(ids) for ids in input_ids], dtype=torch.int64)
    tensors = {
        INPUT_IDS: torch.tensor([t for ids in input_ids for t in ids], dtype=torch.int64),
        LOSS_MASK: torch.tensor([m for mask in loss_masks for m in mask], dtype=torch.uint8),
        SAMPLE_OFFSETS: torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))


def read_samples(path: str | Path) -> tuple[list[list[int]], list[list[int]]]:
    tensors = load_file(str(path))
    offsets = tensors[SAMPLE_OFFSETS].tolist()
    ids, masks = tensors[INPUT_IDS].tolist(), tensors[LOSS_MASK].tolist()
    spans = list(zip(offsets[:-1], offsets[1:]))
    return [ids[a:b] for a, b in spans], [masks[a:b] for a, b in spans]


def read_tool_results(path: str | Path) -> list[list[int]] | None:
    """Per sample, the :data:`TOOL_RESULTS` marks; None when the file has none."""
    with safe_open(str(path), framework="pt") as fh:
        if TOOL_RESULTS not in fh.keys():
            return None
        marks, offsets = fh.get_tensor(TOOL_RESULTS).tolist(), fh.get_tensor(SAMPLE_OFFSETS).tolist()
    return [marks[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def write_flat_samples(path: str | Path, input_ids: np.ndarray, loss_mask: np.ndarray,
                       offsets: np.ndarray, tool_results: np.ndarray | None = None) -> None:
    """The layout of :func:`write_samples` from flat arrays (no per-token Python objects),
    plus :data:`TOOL_RESULTS` when given."""
    if not (len(input_ids) == len(loss_mask) == int(offsets[-1])) or offsets[0] != 0:
        raise ValueError(f"flat samples disagree: {len(input_ids)} ids, {len(loss_mask)} mask "
                         f"entries, offsets {offsets[0]}..{offsets[-1]}")
    if tool_results is not None and len(tool_results) != len(input_ids):
        raise ValueError(f"flat samples disagree: {len(input_ids)} ids, {len(tool_results)} tool marks")
    tensors = {
        INPUT_IDS: torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64)),
        LOSS_MASK: torch.from_numpy(np.ascontiguousarray(loss_mask, dtype=np.uint8)),
        SAMPLE_OFFSETS: torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.int64)),
    }
    if tool_results is not None:
        tensors[TOOL_RESULTS] = torch.from_numpy(np.ascontiguousarray(tool_results, dtype=np.uint8))
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))


# --------------------------------------------------------------------------- hidden-state shards
# A shard holds the samples' INPUT_IDS, LOSS_MASK and SAMPLE_OFFSETS as above, plus:
HIDDEN_STATES = "hidden_states"  # [tokens, num_slots, H]: aux slots in id order, final last
SAMPLE_IDS = "sample_ids"  # int64 [samples]: each sample's index in the samples file
SHARD_KEYS = (HIDDEN_STATES, INPUT_IDS, LOSS_MASK, SAMPLE_OFFSETS, SAMPLE_IDS)
# fp8 shards only: float32 [tokens, num_slots], one scale per token and slot; the state is
# HIDDEN_STATES (float8_e4m3fn) times its scale (``dequantize``).
HIDDEN_SCALES = "hidden_state_scales"
# The header metadata is one JSON string under this key (see write_shard for why).
SHARD_METADATA = "draftline"
FINGERPRINT = "fingerprint"  # hash of the inputs and config that made the shard
SLOTS_NOTE = "aux layer inputs in aux_layer_ids order, then final post-norm state"
FP8 = "float8_e4m3fn"
SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
               FP8: torch.float8_e4m3fn}
# float32, not bf16: a scale is 0.03% of a Kimi token's fp8 bytes either way (16 of 28,672 B
# for 4 slots), and float32 holds amax / 448 exactly as computed, so the quantized bytes do
# not depend on how a second rounding of the scale would be done on each device.
SCALE_DTYPE = torch.float32
FP8_MAX = 448.0  # largest finite float8_e4m3fn; the cast to it does not saturate (500 -> NaN)
QUANTIZE_ROWS = 4096  # rows quantized at once: bounds the float32 temporaries on a GPU
QUANTIZE_ROWS_CPU = 256  # on a CPU: a float32 chunk that stays in cache (1.7x faster, same bytes)


class NonFiniteHiddenStates(ValueError):
    """A captured hidden state is NaN or infinite: it fits no fp8 scale (nor any training)."""

    def __init__(self, shard: str, sample_id: int, slot: int, token: int, value: float):
        self.shard, self.sample_id, self.slot, self.token = shard, sample_id, slot, token
        super().__init__(f"{shard}: sample {sample_id}, slot {slot}, token {token}: hidden "
                         f"state {value} is not finite (the target's residual stream "
                         "overflowed or the engine produced NaN); nothing was written")


def is_quantized(save_dtype: str) -> bool:
    return save_dtype == FP8


def quantize_fp8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., H] (any float dtype) -> (float8_e4m3fn [..., H], float32 scales [...]).

    scale = amax(|row|) / 448 per row (1 for an all-zero row), computed in float32; a row
    holding NaN or inf gets a non-finite scale, which is how the shard writer finds it
    without reading the fp8 bytes. The same formula runs in the engine's worker
    (patches/speculators/0006); a test holds the two to the same bytes.
    """
    values = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=rows.device)
    scales = torch.empty(rows.shape[:-1], dtype=SCALE_DTYPE, device=rows.device)
    flat_rows, flat_values, flat_scales = rows.reshape(-1, rows.shape[-1]), values.view(
        -1, rows.shape[-1]), scales.view(-1)
    step = QUANTIZE_ROWS if rows.is_cuda else QUANTIZE_ROWS_CPU
    for start in range(0, flat_rows.shape[0], step):
        chunk = flat_rows[start:start + step].to(SCALE_DTYPE, copy=True)  # [n, H]
        # amax(|row|) = max(max, -min): one vectorized pass and no |row| temporary; NaN and
        # inf propagate as through abs().amax().
        low, high = torch.aminmax(chunk, dim=-1)  # [n]
        amax = torch.maximum(high, -low)
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
        flat_scales[start:start + step] = scale
        flat_values[start:start + step] = chunk.div_(scale[:, None]).clamp_(
            -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values, scales


def dequantize(values: torch.Tensor, scales: torch.Tensor | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored hidden states [..., H] (and their scales [...] for fp8) in ``dtype``.

    Without scales: a plain cast. With them: value * scale in float32, then ``dtype``, on
    whatever device the tensors are on (the loader calls it on the GPU).
    """
    if scales is None:
        return values.to(dtype)
    return (values.to(SCALE_DTYPE) * scales.to(SCALE_DTYPE)[..., None]).to(dtype)


def hidden_is_finite(values: torch.Tensor, scales: torch.Tensor | None) -> bool:
    """No NaN or inf among stored hidden states (fp8: among the values and the scales; torch
    has no isfinite for float8, and its only non-finite pattern is NaN, S.1111.111)."""
    if scales is None:
        return bool(torch.isfinite(values).all())
    nan = (values.view(torch.uint8) & 0x7F) == 0x7F
    return bool(torch.isfinite(scales).all()) and not bool(nan.any())


def stored_bytes_per_slot(save_dtype: str, hidden_size: int) -> int:
    """Bytes one token's slot takes in a shard: the values plus, for fp8, its scale."""
    scale = SCALE_DTYPE.itemsize if is_quantized(save_dtype) else 0
    return hidden_size * SAVE_DTYPES[save_dtype].itemsize + scale


def shard_metadata(fingerprint: str, aux_layer_ids: Sequence[int], hidden_size: int) -> dict[str, str]:
    """What a shard's header says about how it was made (all values strings)."""
    return {
        FINGERPRINT: fingerprint,
        "aux_layer_ids": str(list(aux_layer_ids)),
        "slots": SLOTS_NOTE,
        "hidden_size": str(hidden_size),
    }


def first_non_finite(probe: torch.Tensor) -> tuple[int, int, float] | None:
    """(token, slot, value) of the first NaN/inf in token order, or None. ``probe`` is the
    stored scales [tokens, slots] of an fp8 shard, else its values [tokens, slots, H];
    ``value`` is the scale, or the row's first bad value. Reduced per token first, so its
    temporaries are a few values per token, not a flag per element (an all-NaN sample of a
    long prompt would otherwise cost gigabytes before it is named). Rank 0's shard writer
    (draftline.extract.capture) names the same one."""
    if probe.shape[0] == 0:
        return None
    low, high = torch.aminmax(probe.reshape(probe.shape[0], -1), dim=-1)  # [tokens]
    bad_tokens = ~(torch.isfinite(low) & torch.isfinite(high))
    if not bool(bad_tokens.any()):
        return None
    token = int(bad_tokens.nonzero()[0])
    row = probe[token]  # [slots] or [slots, H]
    if row.dim() == 1:
        slot = int((~torch.isfinite(row)).nonzero()[0])
        return token, slot, float(row[slot])
    low, high = torch.aminmax(row, dim=-1)  # [slots]
    slot = int((~(torch.isfinite(low) & torch.isfinite(high))).nonzero()[0])
    values = row[slot]
    return token, slot, float(values[int((~torch.isfinite(values)).nonzero()[0])])


def non_finite_error(name: str, sample_ids: Sequence[int], offsets: Sequence[int], token: int,
                     slot: int, value: float) -> NonFiniteHiddenStates:
    """The error for a bad value at shard row ``token``, named by its sample and its row in it."""
    sample = max(i for i, start in enumerate(offsets[:-1]) if start <= token)
    return NonFiniteHiddenStates(name, int(sample_ids[sample]), slot, token - offsets[sample], value)


def _check_finite(name: str, sample_ids: Sequence[int], offsets: list[int],
                  hidden: torch.Tensor, scales: torch.Tensor | None) -> None:
    """Raise NonFiniteHiddenStates for the first NaN/inf (fp8: found through the scales)."""
    found = first_non_finite(scales if scales is not None else hidden)
    if found is not None:
        raise non_finite_error(name, sample_ids, offsets, *found)


def shard_rows(sample_ids: Sequence[int], input_ids: dict[int, Sequence[int] | torch.Tensor],
               loss_masks: dict[int, Sequence[int] | torch.Tensor]) -> dict[str, torch.Tensor]:
    """A shard's tensors beside its hidden states, for samples in ``sample_ids`` order:
    INPUT_IDS, LOSS_MASK, SAMPLE_OFFSETS (each sample's first row, then the total) and
    SAMPLE_IDS."""
    ids = [torch.as_tensor(input_ids[i], dtype=torch.int64) for i in sample_ids]
    offsets = [0]
    for row in ids:
        offsets.append(offsets[-1] + len(row))
    return {
        INPUT_IDS: torch.cat(ids),
        LOSS_MASK: torch.cat([torch.as_tensor(loss_masks[i], dtype=torch.uint8) for i in sample_ids]),
        SAMPLE_OFFSETS: torch.tensor(offsets, dtype=torch.int64),
        SAMPLE_IDS: torch.tensor(list(sample_ids), dtype=torch.int64),
    }


def pack_shard(sample_ids: Sequence[int], results: dict[int, dict],
               loss_masks: dict[int, Sequence[int] | torch.Tensor],
               save_dtype: str, name: str = "shard") -> dict[str, torch.Tensor]:
    """Concatenate per-sample results (in ``sample_ids`` order) into the shard's tensors.

    ``results[i]`` is what speculators' hidden-state generator returns for sample i: its
    "hidden_states" (one [T, H] tensor per slot) and "input_ids" [T]; a generator that
    quantized in its worker (``hidden_states_dtype="float8_e4m3fn"``) adds
    "hidden_states_scales" (one [T] float32 tensor per slot). fp8 results without scales are
    quantized here. A NaN or inf anywhere raises NonFiniteHiddenStates naming ``name``
    (the shard), the sample, the slot and the token.
    """
    quantized = is_quantized(save_dtype)
    slots, scales = [], []
    for sample_id in sample_ids:
        result = results[sample_id]
        slots.append(torch.stack(result["hidden_states"], dim=1))  # [T, num_slots, H]
        if "hidden_states_scales" in result:
            if not quantized:
                raise ValueError(f"sample {sample_id}: the generator returned fp8 scales, "
                                 f"save_dtype is {save_dtype}")
            scales.append(torch.stack(result["hidden_states_scales"], dim=1))  # [T, slots]
    if scales and len(scales) != len(slots):
        raise ValueError("some samples came with fp8 scales and some without")
    rows = shard_rows(sample_ids, {i: results[i]["input_ids"] for i in sample_ids}, loss_masks)
    hidden = torch.cat(slots)  # [tokens, num_slots, H]
    if quantized and not scales:
        hidden, scale = quantize_fp8(hidden)
    else:
        hidden, scale = hidden.to(SAVE_DTYPES[save_dtype]), torch.cat(scales) if scales else None
    _check_finite(name, sample_ids, rows[SAMPLE_OFFSETS].tolist(), hidden, scale)
    tensors = {HIDDEN_STATES: hidden.contiguous(), **rows}
    if scale is not None:
        tensors[HIDDEN_SCALES] = scale.to(SCALE_DTYPE).contiguous()
    return tensors


def write_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Atomic write. The metadata goes in as one JSON string: safetensors keeps header
    metadata in a hash map whose order changes per process, and several keys would make
    identical shards differ byte-wise between runs."""
    with atomic_path(path, fsync=True) as tmp:  # a power loss leaves no truncated shard
        save_file(tensors, str(tmp), metadata={SHARD_METADATA: json.dumps(metadata, sort_keys=True)})


def read_shard_identity(path: Path) -> tuple[dict, tuple[int, ...]]:
    """A shard's header metadata and its sample ids, without reading its hidden states."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = json.loads((handle.metadata() or {}).get(SHARD_METADATA, "{}"))
        return metadata, tuple(handle.get_tensor(SAMPLE_IDS).tolist())


def read_shard(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one shard (SHARD_KEYS, and HIDDEN_SCALES in an fp8 shard), whole and
    as stored."""
    with safe_open(str(path), framework="pt") as handle:
        keys = [*SHARD_KEYS, *([HIDDEN_SCALES] if HIDDEN_SCALES in handle.keys() else [])]
        return {key: handle.get_tensor(key) for key in keys}


def read_shard_rows(shard: Path, rows: Sequence[int], keys: Sequence[str]) -> list[dict]:
    """The given sample rows of one shard, only ``keys``: per row {key: tensor [T, ...]}.

    HIDDEN_STATES of an fp8 shard comes back dequantized (float32 [T, slots, H]); other
    shards' hidden states come as stored.
    """
    with safe_open(str(shard), framework="pt") as handle:
        offsets = handle.get_tensor(SAMPLE_OFFSETS)  # [samples + 1]
        slices = {key: handle.get_slice(key) for key in keys}
        scales = (handle.get_slice(HIDDEN_SCALES) if HIDDEN_STATES in keys
                  and HIDDEN_SCALES in handle.keys() else None)
        out = []
        for r in rows:
            span = slice(int(offsets[r]), int(offsets[r + 1]))
            row = {key: s[span] for key, s in slices.items()}
            if scales is not None:
                row[HIDDEN_STATES] = dequantize(row[HIDDEN_STATES], scales[span])
            out.append(row)
        return out


# --------------------------------------------------------------------------- split index
# One int64 [n, 3] table per split, rows (shard_index, sample_row_in_shard, length).
TRAIN = "train"
VALIDATION = "validation"
SPLITS = (TRAIN, VALIDATION)


def write_split_index(path: Path, train: torch.Tensor, validation: torch.Tensor) -> None:
    """Both splits' tables ([n, 3] and [m, 3] int64), written atomically."""
    with atomic_path(path) as tmp:
        save_file({TRAIN: train, VALIDATION: validation}, str(tmp))


def load_split(index_path: str | Path, split: str) -> torch.Tensor:
    """Rows ``(shard_index, sample_row_in_shard, length)`` of one split: int64 [n, 3]."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rows = load_file(str(index_path))[split]
    if rows.dtype != torch.int64 or rows.dim() != 2 or rows.shape[1] != 3:
        raise ValueError(f"{index_path}: {split!r} must be int64 [n, 3], got "
                         f"{rows.dtype} {list(rows.shape)}")
    return rows


# --------------------------------------------------------------------------- vocab mapping
D2T = "d2t"  # int64 [draft_vocab]: target id = draft id + d2t[draft id]
T2D = "t2d"  # bool [target_vocab]: the target ids the draft vocabulary keeps
TOKEN_FREQ = "token_freq"  # int64 [target_vocab]: masked-token counts the mapping came from


def write_vocab_mapping(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor,
                        token_freq: torch.Tensor | None = None) -> None:
    """Atomic write; the stages always record ``token_freq``, synthetic inputs may not."""
    tensors = {D2T: d2t, T2D: t2d}
    if token_freq is not None:
        tensors[TOKEN_FREQ] = token_freq
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))


def load_vocab_mapping(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``d2t`` int64 [draft_vocab] (target = draft + d2t[draft]) and ``t2d`` bool [target_vocab]."""
    tensors = load_file(str(path))
    d2t, t2d = tensors[D2T], tensors[T2D]
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise ValueError(f"{path}: need d2t int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    if int(t2d.sum()) != d2t.numel():
        raise ValueError(f"{path}: t2d selects {int(t2d.sum())} tokens, d2t has {d2t.numel()}")
    targets = torch.arange(d2t.numel()) + d2t  # [draft_vocab] target ids
    if not bool(t2d[targets].all()):
        raise ValueError(f"{path}: d2t maps draft ids to targets that t2d does not select")
    return d2t, t2d


def load_token_freq(path: str | Path) -> torch.Tensor:
    """The masked-token counts recorded beside the mapping: [target_vocab]."""
    return load_file(str(path))[TOKEN_FREQ]


# --------------------------------------------------------------------------- conversation records


def write_records(path: str | Path, records: Sequence[dict]) -> None:
    """One JSON object a line (``where``, ``messages`` in the chat format, ``tools`` if any)."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            for record in records:
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")


def read_records(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
