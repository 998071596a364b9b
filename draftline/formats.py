"""Tokenized samples on disk: one safetensors file of flat ids, masks and offsets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from draftline.pipeline.artifacts import atomic_path


def write_samples(path: str | Path, input_ids: list[list[int]], loss_masks: list[list[int]]) -> None:
    """Flat ``input_ids`` int64 [total], ``loss_mask`` uint8 [total], ``sample_offsets`` [n+1]."""
    lengths = torch.tensor([len(ids) for ids in input_ids], dtype=torch.int64)
    tensors = {
        "input_ids": torch.tensor([t for ids in input_ids for t in ids], dtype=torch.int64),
        "loss_mask": torch.tensor([m for mask in loss_masks for m in mask], dtype=torch.uint8),
        "sample_offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))


def read_samples(path: str | Path) -> tuple[list[list[int]], list[list[int]]]:
    tensors = load_file(str(path))
    offsets = tensors["sample_offsets"].tolist()
    ids, masks = tensors["input_ids"].tolist(), tensors["loss_mask"].tolist()
    spans = list(zip(offsets[:-1], offsets[1:]))
    return [ids[a:b] for a, b in spans], [masks[a:b] for a, b in spans]


def write_flat_samples(path: str | Path, input_ids: np.ndarray, loss_mask: np.ndarray,
                       offsets: np.ndarray) -> None:
    """The layout of :func:`write_samples` from flat arrays (no per-token Python objects)."""
    if not (len(input_ids) == len(loss_mask) == int(offsets[-1])) or offsets[0] != 0:
        raise ValueError(f"flat samples disagree: {len(input_ids)} ids, {len(loss_mask)} mask "
                         f"entries, offsets {offsets[0]}..{offsets[-1]}")
    tensors = {
        "input_ids": torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64)),
        "loss_mask": torch.from_numpy(np.ascontiguousarray(loss_mask, dtype=np.uint8)),
        "sample_offsets": torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.int64)),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))
