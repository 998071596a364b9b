"""Hidden-state shards as speculators' training samples, and the reference loader over them.

Upstream stages write safetensors shards (layout and keys: ``draftline.formats``; ``hidden_states``
[tokens, slots, H] with the aux slots in order and the post-norm final slot last, ``input_ids``,
``loss_mask``, ``sample_offsets``, ``sample_ids``) and a split index whose rows are
``(shard_index, sample_row_in_shard, length)``.  speculators' conventions are kept exactly:
``shift_batch`` (token/target alignment) and ``create_collate_fn`` (concatenate, pad to the
budget, truncate ``lengths``).

``ShardSampleDataset`` reads the split's rows from memory-mapped shards
(``draftline.train.mapped``) two ways: ``__getitem__``, one shifted sample per item, and
``copy_into``, the same sample written straight into a packed batch's buffers (what
``draftline.train.loader.PackedLoader`` fills its batches with).  ``make_loader`` is the
reference: the items through a ``DataLoader`` and speculators' own collate; tests hold the
packed loader to it.  Which samples make up each step is ``draftline.train.packing``'s plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from speculators.train.data import create_collate_fn, shift_batch
from torch.utils.data import DataLoader, Dataset

from draftline import formats
from draftline.train.fp8 import SCALE_KEYS
from draftline.train.mapped import ShardViews, copy_values, numpy_view, open_views

__all__ = ["ShardSampleDataset", "make_loader"]


class ShardSampleDataset(Dataset):
    """One split-index row -> one speculators training sample (already shifted by one).

    Shards are memory-mapped (``mapped.MappedShard``).  ``__getitem__`` is the reference
    per-sample path: ``input_ids`` [T-1] long, ``hidden_states`` [T-1, num_aux*H] in
    ``hidden_dtype`` (speculators' default float32), ``verifier_last_hidden_states`` [T-1, H],
    ``loss_mask`` [T-1] long, ``lengths`` [1], ``position_ids`` [T-1] (speculators' shift
    drops one token per sample).  ``copy_into`` is the packed path: the same shifted sample
    written into batch buffers, hidden states kept in the stored dtype.
    """

    def __init__(self, shard_paths: Sequence[str | Path], rows: torch.Tensor,
                 num_aux_slots: int = 3, hidden_dtype: torch.dtype = torch.float32):
        self.shard_paths = [str(p) for p in shard_paths]
        self.rows = rows.tolist()  # [(shard, row, length)], plain ints for cheap indexing
        self._lengths = [length - 1 for _, _, length in self.rows]
        self.num_aux_slots = num_aux_slots
        self.hidden_dtype = hidden_dtype
        self._views: dict[int, ShardViews] = {}
        self._offsets = self._read_offsets()
        self._check_rows()

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def lengths(self) -> list[int]:
        """Token count of each item after the shift: what packing has to fit."""
        return self._lengths

    @property
    def hidden_size(self) -> int:
        return self._shard(self.rows[0][0]).hidden.shape[-1]

    @property
    def storage_dtype(self) -> torch.dtype:
        """One dtype for every shard this split reads (as ``torch.cat`` would promote); fp8
        shards only with fp8 shards (their scales have no place in a bf16 batch)."""
        dtypes = {self._shard(shard).hidden.dtype for shard in self._offsets}
        if torch.float8_e4m3fn in dtypes and len(dtypes) > 1:
            raise ValueError(f"the split mixes fp8 shards with {sorted(map(str, dtypes))}: "
                             "extract every shard with one extract.save_dtype")
        result = dtypes.pop()
        for dtype in dtypes:
            result = torch.promote_types(result, dtype)
        return result

    def __getstate__(self) -> dict:
        # mmaps cannot be pickled into DataLoader workers; each worker maps its own.
        return {**self.__dict__, "_views": {}}

    def _shard(self, shard: int) -> ShardViews:
        if shard not in self._views:
            self._views[shard] = open_views(self.shard_paths[shard])
        return self._views[shard]

    def _read_offsets(self) -> dict[int, list[int]]:
        offsets = {}
        for shard in sorted({shard for shard, _, _ in self.rows}):
            if not 0 <= shard < len(self.shard_paths):
                raise ValueError(f"split index names shard {shard}, only "
                                 f"{len(self.shard_paths)} shard paths were given")
            views = self._shard(shard)
            offsets[shard] = views.file.tensor(formats.SAMPLE_OFFSETS).tolist()
            self._check_slots(shard, list(views.hidden.shape))
        return offsets

    def _check_slots(self, shard: int, shape: list[int]) -> None:
        if len(shape) != 3 or shape[1] != self.num_aux_slots + 1:
            raise ValueError(f"{self.shard_paths[shard]}: hidden_states {shape}, expected "
                             f"[tokens, {self.num_aux_slots + 1} slots, hidden]")
        views = self._shard(shard)
        if (views.scales is None) != (views.hidden.dtype != torch.float8_e4m3fn):
            raise ValueError(f"{self.shard_paths[shard]}: fp8 hidden states come with "
                             f"{formats.HIDDEN_SCALES}, other dtypes without")
        if views.scales is not None and list(views.scales.shape) != shape[:2]:
            raise ValueError(f"{self.shard_paths[shard]}: {formats.HIDDEN_SCALES} "
                             f"{list(views.scales.shape)}, expected {shape[:2]}")

    def _check_rows(self) -> None:
        for shard, row, length in self.rows:
            offsets = self._offsets[shard]
            if not 0 <= row < len(offsets) - 1:
                raise ValueError(f"{self.shard_paths[shard]} has no sample row {row}")
            if offsets[row + 1] - offsets[row] != length or length < 2:
                raise ValueError(f"{self.shard_paths[shard]} row {row}: index says {length} "
                                 f"tokens, shard holds {offsets[row + 1] - offsets[row]} "
                                 "(need >= 2 for the one-token shift)")

    def _locate(self, index: int) -> tuple[ShardViews, int, int]:
        shard, row, length = self.rows[index]
        return self._shard(shard), self._offsets[shard][row], length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        views, start, length = self._locate(index)
        span = slice(start, start + length)
        slots = formats.dequantize(views.hidden[span], None if views.scales is None
                                   else views.scales[span], self.hidden_dtype)  # [T, aux+1, H]
        sample = {
            # [T, aux, H] -> [T, aux*H]: the same layout as torch.cat(aux slots, dim=-1).
            "hidden_states": slots[:, :-1, :].reshape(length, -1),
            "verifier_last_hidden_states": slots[:, -1, :].clone(),  # [T, H], not the map
            "input_ids": views.input_ids[start:start + length].clone(),
            "loss_mask": views.loss_mask[start:start + length].to(torch.long),
            "lengths": torch.tensor([length], dtype=torch.long),
            "position_ids": torch.arange(length, dtype=torch.long),
        }
        return shift_batch(sample)

    def will_need(self, index: int) -> None:
        views, start, length = self._locate(index)
        views.file.will_need(formats.HIDDEN_STATES, start, length)

    def copy_into(self, index: int, batch: dict[str, torch.Tensor], offset: int,
                  limit: int) -> int:
        """Write the shifted sample into ``batch`` at [offset, ...); return tokens written.

        ``batch`` holds [1, max_tokens, ...] buffers; the sample is cut at ``limit`` exactly
        as speculators' collate cuts the concatenation.  Shift: token t+1's id, mask and
        final hidden state go with token t's aux hidden states; positions start at 1.
        """
        views, start, length = self._locate(index)
        count = min(length - 1, limit - offset)
        rows, ahead = slice(offset, offset + count), slice(start + 1, start + 1 + count)
        aux = self.num_aux_slots
        hidden = batch["hidden_states"][0, rows].view(count, aux, -1)  # [n, aux, H]
        copy_values(hidden, views.hidden[start:start + count, :aux])
        copy_values(batch["verifier_last_hidden_states"][0, rows], views.hidden[ahead, aux])
        if views.scales is not None:
            copy_values(batch[SCALE_KEYS[0]][0, rows], views.scales[start:start + count, :aux])
            copy_values(batch[SCALE_KEYS[1]][0, rows], views.scales[ahead, aux])
        copy_values(batch["input_ids"][0, rows], views.input_ids[ahead])
        copy_values(batch["loss_mask"][0, rows], views.loss_mask[ahead])
        numpy_view(batch["position_ids"][0, rows])[...] = np.arange(1, count + 1)
        return count



def make_loader(dataset: ShardSampleDataset, batches: Sequence[np.ndarray], max_tokens: int,
                num_workers: int = 0) -> DataLoader:
    """Reference path: the planned batches through speculators' collate, [1, max_tokens]."""
    return DataLoader(
        dataset,
        batch_sampler=[batch.tolist() for batch in batches],
        collate_fn=create_collate_fn(max_tokens),
        num_workers=num_workers,
        pin_memory=False,
    )
