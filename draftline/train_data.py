"""Training data for the draft: hidden-state shards -> speculators' packed batches.

Upstream stages write safetensors shards (``hidden_states`` [tokens, slots, H] with the aux
slots in order and the post-norm final slot last, ``input_ids``, ``loss_mask``,
``sample_offsets``, ``sample_ids``) and a split index whose rows are
``(shard_index, sample_row_in_shard, length)``.  This module turns one index row into one
sample in speculators' training convention and reuses speculators' own pieces for the rest:
``shift_batch`` (token/target alignment), ``MultipackDistributedBatchSamplerV2`` (packing by
token budget, seeded per epoch) and ``create_collate_fn`` (concatenate + pad to the budget).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from speculators.train.data import create_collate_fn, shift_batch
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "ShardSampleDataset",
    "load_split",
    "load_vocab_mapping",
    "make_sampler",
    "epoch_batches",
    "plan_steps",
    "steps_in_epochs",
    "make_loader",
]

SPLITS = ("train", "validation")


def load_split(index_path: str | Path, split: str) -> torch.Tensor:
    """Rows ``(shard_index, sample_row_in_shard, length)`` of one split: int64 [n, 3]."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rows = load_file(str(index_path))[split]
    if rows.dtype != torch.int64 or rows.dim() != 2 or rows.shape[1] != 3:
        raise ValueError(f"{index_path}: {split!r} must be int64 [n, 3], got "
                         f"{rows.dtype} {list(rows.shape)}")
    return rows


def load_vocab_mapping(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``d2t`` int64 [draft_vocab] (target = draft + d2t[draft]) and ``t2d`` bool [target_vocab]."""
    tensors = load_file(str(path))
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise ValueError(f"{path}: need d2t int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    if int(t2d.sum()) != d2t.numel():
        raise ValueError(f"{path}: t2d selects {int(t2d.sum())} tokens, d2t has {d2t.numel()}")
    targets = torch.arange(d2t.numel()) + d2t  # [draft_vocab] target ids
    if not bool(t2d[targets].all()):
        raise ValueError(f"{path}: d2t maps draft ids to targets that t2d does not select")
    return d2t, t2d


class ShardSampleDataset(Dataset):
    """One split-index row -> one speculators training sample (already shifted by one).

    Shards are memory-mapped through ``safe_open`` and only the sample's token rows are
    read and converted, so a worker never holds more than one sample of hidden states.
    Items: ``input_ids`` [T-1] long, ``hidden_states`` [T-1, num_aux*H],
    ``verifier_last_hidden_states`` [T-1, H], ``loss_mask`` [T-1] long, ``lengths`` [1],
    ``position_ids`` [T-1] (speculators' shift drops one token per sample).
    """

    def __init__(self, shard_paths: Sequence[str | Path], rows: torch.Tensor,
                 num_aux_slots: int = 3, hidden_dtype: torch.dtype = torch.float32):
        self.shard_paths = [str(p) for p in shard_paths]
        self.rows = rows.tolist()  # [(shard, row, length)], plain ints for cheap indexing
        self.num_aux_slots = num_aux_slots
        self.hidden_dtype = hidden_dtype
        self._handles: dict[int, object] = {}
        self._offsets = self._read_offsets()
        self._check_rows()

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def lengths(self) -> list[int]:
        """Token count of each item after the shift: what packing has to fit."""
        return [length - 1 for _, _, length in self.rows]

    def __getstate__(self) -> dict:
        # safe_open handles cannot be pickled into DataLoader workers; each reopens its own.
        return {**self.__dict__, "_handles": {}}

    def _read_offsets(self) -> dict[int, list[int]]:
        offsets = {}
        for shard in sorted({shard for shard, _, _ in self.rows}):
            if not 0 <= shard < len(self.shard_paths):
                raise ValueError(f"split index names shard {shard}, only "
                                 f"{len(self.shard_paths)} shard paths were given")
            handle = self._handle(shard)
            offsets[shard] = handle.get_tensor("sample_offsets").tolist()
            self._check_slots(shard, handle.get_slice("hidden_states").get_shape())
        return offsets

    def _check_slots(self, shard: int, shape: list[int]) -> None:
        if len(shape) != 3 or shape[1] != self.num_aux_slots + 1:
            raise ValueError(f"{self.shard_paths[shard]}: hidden_states {shape}, expected "
                             f"[tokens, {self.num_aux_slots + 1} slots, hidden]")

    def _check_rows(self) -> None:
        for shard, row, length in self.rows:
            offsets = self._offsets[shard]
            if not 0 <= row < len(offsets) - 1:
                raise ValueError(f"{self.shard_paths[shard]} has no sample row {row}")
            if offsets[row + 1] - offsets[row] != length or length < 2:
                raise ValueError(f"{self.shard_paths[shard]} row {row}: index says {length} "
                                 f"tokens, shard holds {offsets[row + 1] - offsets[row]} "
                                 "(need >= 2 for the one-token shift)")

    def _handle(self, shard: int):
        if shard not in self._handles:
            self._handles[shard] = safe_open(self.shard_paths[shard], framework="pt")
        return self._handles[shard]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        shard, row, length = self.rows[index]
        start = self._offsets[shard][row]
        handle = self._handle(shard)
        slots = handle.get_slice("hidden_states")[start:start + length]  # [T, aux+1, H]
        slots = slots.to(self.hidden_dtype)
        sample = {
            # [T, aux, H] -> [T, aux*H]: the same layout as torch.cat(aux slots, dim=-1).
            "hidden_states": slots[:, :-1, :].reshape(length, -1),
            "verifier_last_hidden_states": slots[:, -1, :].contiguous(),  # [T, H]
            "input_ids": handle.get_slice("input_ids")[start:start + length].to(torch.long),
            "loss_mask": handle.get_slice("loss_mask")[start:start + length].to(torch.long),
            "lengths": torch.tensor([length], dtype=torch.long),
            "position_ids": torch.arange(length, dtype=torch.long),
        }
        return shift_batch(sample)


def make_sampler(lengths: Sequence[int], max_tokens: int,
                 seed: int) -> MultipackDistributedBatchSamplerV2:
    """speculators' packing sampler for a single process; its order depends on seed + epoch."""
    return MultipackDistributedBatchSamplerV2(
        batch_max_length=max_tokens, lengths=list(lengths), num_replicas=1, rank=0, seed=seed
    )


def epoch_batches(sampler: MultipackDistributedBatchSamplerV2, epoch: int) -> list[np.ndarray]:
    """Sample indices of each packed batch of one epoch, in training order."""
    sampler.set_epoch(epoch)
    return list(sampler)


def steps_in_epochs(sampler: MultipackDistributedBatchSamplerV2, epochs: int) -> int:
    """Optimizer steps in ``epochs`` passes (the packing, so the count, varies per epoch)."""
    return sum(len(epoch_batches(sampler, epoch)) for epoch in range(epochs))


def plan_steps(sampler: MultipackDistributedBatchSamplerV2, start_step: int,
               total_steps: int) -> list[tuple[int, np.ndarray]]:
    """``(epoch, sample indices)`` for global steps ``start_step .. total_steps - 1``.

    The plan is a pure function of the sampler's seed and the step range, which is what
    makes a resumed run see exactly the batches an uninterrupted run would have seen.
    """
    plan: list[tuple[int, np.ndarray]] = []
    step, epoch = 0, 0
    while step < total_steps:
        batches = epoch_batches(sampler, epoch)
        if not batches:
            raise ValueError("the split packs into zero batches")
        for batch in batches[: total_steps - step]:
            if step >= start_step:
                plan.append((epoch, batch))
            step += 1
        epoch += 1
    return plan


def make_loader(dataset: ShardSampleDataset, batches: Sequence[np.ndarray], max_tokens: int,
                num_workers: int = 0) -> DataLoader:
    """Load the planned batches in order, packed by speculators' collate to [1, max_tokens]."""
    return DataLoader(
        dataset,
        batch_sampler=[batch.tolist() for batch in batches],
        collate_fn=create_collate_fn(max_tokens),
        num_workers=num_workers,
        pin_memory=False,
    )
