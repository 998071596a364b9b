"""Training data from extraction shards: validated, split by sample, indexed for the trainer.

The index rows are (shard_index, sample_row_in_shard, length); the trainer memory-maps the
shards and reads only the rows it needs, so no sample is copied or pickled here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from draftline import formats


def validate_shard(path: Path, num_slots: int, hidden_size: int) -> list[tuple[int, int, int, int]]:
    """Check one shard's shapes, offsets and values; return (sample_id, row, length, masked)."""
    shard = formats.read_shard(path)
    hidden = shard[formats.HIDDEN_STATES]  # [tokens, num_slots, hidden]
    ids = shard[formats.INPUT_IDS]  # [tokens]
    mask = shard[formats.LOSS_MASK]  # [tokens]
    offsets = shard[formats.SAMPLE_OFFSETS]  # [samples + 1]
    sample_ids = shard[formats.SAMPLE_IDS]  # [samples]
    scales = shard.get(formats.HIDDEN_SCALES)  # [tokens, num_slots] float32, fp8 shards only
    tokens = ids.shape[0]
    if hidden.shape != (tokens, num_slots, hidden_size):
        raise ValueError(f"{path}: hidden_states {tuple(hidden.shape)}")
    if (scales is None) != (hidden.dtype != torch.float8_e4m3fn):
        raise ValueError(f"{path}: {hidden.dtype} hidden states "
                         f"{'without' if scales is None else 'with'} {formats.HIDDEN_SCALES}")
    if scales is not None and scales.shape != (tokens, num_slots):
        raise ValueError(f"{path}: {formats.HIDDEN_SCALES} {tuple(scales.shape)}, expected "
                         f"{(tokens, num_slots)}")
    if not (mask.shape[0] == tokens and int(offsets[-1]) == tokens):
        raise ValueError(f"{path}: offsets/mask do not cover {tokens} tokens")
    if not formats.hidden_is_finite(hidden, scales):
        raise ValueError(f"{path}: non-finite hidden states")
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    if min(lengths) <= 0:
        raise ValueError(f"{path}: empty sample")
    masked = [int(mask[a:b].sum()) for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    return [(int(s), row, n, m) for row, (s, n, m) in enumerate(zip(sample_ids.tolist(), lengths, masked))]


def is_validation(sample_id: int, fraction: float, seed: int) -> bool:
    """A stable per-sample coin: the same sample lands in the same split on every rerun."""
    digest = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_rows(rows: list[tuple[int, int, int, int, int]], fraction: float, seed: int,
               min_validation: int) -> tuple[list, list]:
    """rows: (shard, sample_id, row, length, masked). Samples without masked tokens are dropped."""
    usable = [r for r in rows if r[4] > 0]
    validation = [r for r in usable if is_validation(r[1], fraction, seed)]
    if len(validation) < min_validation:  # tiny runs: take the lowest-hash samples
        ranked = sorted(usable, key=lambda r: hashlib.sha256(f"{seed}:{r[1]}".encode()).digest())
        validation = ranked[:min_validation]
    chosen = {r[1] for r in validation}
    train = [r for r in usable if r[1] not in chosen]
    if not train:
        raise ValueError("no training samples left after the validation split")
    return train, validation


def write_index(path: Path, train: list, validation: list) -> None:
    """The split index of rows (shard, sample_id, row, length, masked), as formats keeps it."""
    def table(rows: list) -> torch.Tensor:  # [n, 3]: shard, row in shard, length
        return torch.tensor([[r[0], r[2], r[3]] for r in rows], dtype=torch.int64).reshape(-1, 3)

    formats.write_split_index(path, table(train), table(validation))
