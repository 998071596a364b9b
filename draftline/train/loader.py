"""Training data for the draft: hidden-state shards -> speculators' packed batches, at GPU speed.

Upstream stages write safetensors shards (layout and keys: ``draftline.formats``; ``hidden_states`` [tokens, slots, H] with the aux
slots in order and the post-norm final slot last, ``input_ids``, ``loss_mask``,
``sample_offsets``, ``sample_ids``) and a split index whose rows are
``(shard_index, sample_row_in_shard, length)``.  speculators' conventions are kept exactly:
``shift_batch`` (token/target alignment) and ``create_collate_fn`` (concatenate, pad to the
budget, truncate ``lengths``).  Which samples make up each step is ``draftline.train.packing``'s
plan (packed to fill the token budget, seeded per epoch), which replaced speculators'
``MultipackDistributedBatchSamplerV2`` (0.92-0.93 fill at the benchmark dims).

Two ways to load the same batches:

* ``make_loader``: the reference -- ``ShardSampleDataset`` items (one shifted sample each)
  through a ``DataLoader`` and speculators' own collate.  Tests compare against it.
* ``PackedLoader``: the training path.  At ~65k tokens/s (Llama-3.1-8B dims, one H200, bf16)
  the draft eats ~2 GB/s of hidden states, which per-sample tensors, a float32 conversion,
  collate's concatenate + pad and a pin copy on the CPU do not keep up with.  So: shards are
  memory-mapped and read through zero-copy views (``MappedShard``); each planned batch is
  packed by background threads straight from the page cache into a reusable, pinned
  [1, max_tokens, ...] buffer in the shards' own dtype (one CPU copy per byte, bf16 stays
  bf16); on CUDA the thread that packed a batch also copies it to the GPU on a side stream
  and casts it there (``staging="workers"``), so the training thread only waits on the
  batch's event.  ``staging="consumer"`` is the earlier way (kept to time both in one
  process): the training thread copies batch i+1 while batch i is in use, which makes it wait
  for batch i+1's packing and for the copy's pageable ``lengths`` (a stream sync) before it
  gets batch i.

fp8 shards (``formats.HIDDEN_SCALES`` beside float8_e4m3fn hidden states) travel as stored:
one byte per value plus a float32 scale per token and slot, packed into the batch's
``SCALE_KEYS`` buffers and dequantized where the batch is cast (on the GPU in training).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import math
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from speculators.train.data import create_collate_fn, shift_batch
from torch.utils.data import DataLoader, Dataset

from draftline import formats
from draftline.train.packing import StepPlanner

__all__ = [
    "HIDDEN_KEYS",
    "SCALE_KEYS",
    "dequantize_batch",
    "MappedShard",
    "ShardSampleDataset",
    "PackedLoader",
    "default_loader_threads",
    "STAGINGS",
    "fit_lengths",
    "make_sampler",
    "epoch_batches",
    "plan_steps",
    "steps_in_epochs",
    "make_loader",
]

# speculators' batch keys (shift_batch, collate, the draft's forward); the shard's own keys
# are draftline.formats'.
HIDDEN_KEYS = ("hidden_states", "verifier_last_hidden_states")
# fp8 shards only, float32 [1, max_tokens, num_aux] and [1, max_tokens]: the packed scales of
# HIDDEN_KEYS, consumed (and dropped from the batch) when it is dequantized.
SCALE_KEYS = ("hidden_states_scales", "verifier_last_hidden_states_scales")
TOKEN_KEYS = ("input_ids", "loss_mask", "position_ids")  # int64 [1, max_tokens] each
SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}
# Copied as raw bits through numpy, which has neither type.
RAW_DTYPES = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}
# 4 packing threads measured on an H200 host (16 cores): 2.8-4.5 GB/s of hidden states from
# a cold disk (its plain sequential read: 1.8-2.1 GB/s), 22 GB/s from the page cache, against
# ~2 GB/s consumed at 65k tokens/s; more would only add pinned buffers.
MAX_DEFAULT_THREADS = 4
# Who copies a packed batch to the GPU: the packing thread (workers) or the thread that
# trains (consumer, the loader before issue 33).  The same on CPU, where nothing is copied.
STAGINGS = ("workers", "consumer")


# --------------------------------------------------------------------------- shards


class MappedShard:
    """A safetensors file memory-mapped once; its tensors are zero-copy views of the map.

    Why not ``safe_open(...).get_slice``: it copies every slice into a fresh tensor, which
    the packer would then copy again.  The format is a little-endian u64 header length, a
    JSON header (dtype, shape, data_offsets per tensor) and the raw data.  The map is
    copy-on-write (``ACCESS_COPY``) only so that torch gets a writable buffer; nothing
    writes to it, so pages stay shared with the page cache.
    """

    def __init__(self, path: str | Path):
        self.path = str(path)
        with open(self.path, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_len))
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        self._data_start = 8 + header_len
        self.entries = {k: v for k, v in header.items() if k != "__metadata__"}

    def shape(self, name: str) -> list[int]:
        return list(self._entry(name)["shape"])

    def _entry(self, name: str) -> dict:
        if name not in self.entries:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        return self.entries[name]

    def tensor(self, name: str) -> torch.Tensor:
        """The stored tensor as a view of the map (a copy only if stored misaligned)."""
        entry = self._entry(name)
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        begin, end = (self._data_start + o for o in entry["data_offsets"])
        if end == begin:
            return torch.empty(entry["shape"], dtype=dtype)
        if begin % dtype.itemsize:  # safetensors sorts by dtype size, so this is rare
            return torch.frombuffer(bytearray(self._map[begin:end]), dtype=dtype).view(
                entry["shape"])
        count = (end - begin) // dtype.itemsize
        return torch.frombuffer(self._map, dtype=dtype, count=count, offset=begin).view(
            entry["shape"])

    def will_need(self, name: str, first_row: int, num_rows: int) -> None:
        """Ask the kernel to start reading rows of ``name`` now (readahead, no blocking).

        Issued when a batch is planned, so a cold-cache read overlaps the packing of the
        batches before it instead of faulting page by page.
        """
        entry = self._entry(name)
        row_bytes = math.prod(entry["shape"][1:]) * SAFETENSORS_DTYPES[entry["dtype"]].itemsize
        start = self._data_start + entry["data_offsets"][0] + first_row * row_bytes
        aligned = start - start % mmap.PAGESIZE
        length = min(start + num_rows * row_bytes, len(self._map)) - aligned
        if length > 0 and hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_WILLNEED, aligned, length)


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a numpy array (bf16 and fp8 as their raw bit patterns).

    Why numpy on the packing threads: numpy copies single-threaded with the GIL released,
    while a torch op on a second Python thread starts its own OpenMP team, which on a busy
    CPU spins against the compute threads (measured: 150 -> 235 ms per CPU step).
    """
    if tensor.dtype in RAW_DTYPES:
        return tensor.view(RAW_DTYPES[tensor.dtype]).numpy()
    return tensor.numpy()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src through numpy; bf16 or fp8 <-> another dtype (numpy has neither) via torch.

    The torch fallback only serves splits that mix bf16 and float32 shards.
    """
    if dst.dtype != src.dtype and (dst.dtype in RAW_DTYPES or src.dtype in RAW_DTYPES):
        dst.copy_(src)
    else:
        numpy_view(dst)[...] = numpy_view(src)


@dataclasses.dataclass
class _ShardViews:
    hidden: torch.Tensor  # [tokens, slots, H], stored dtype
    input_ids: torch.Tensor  # [tokens] int64
    loss_mask: torch.Tensor  # [tokens] uint8
    file: MappedShard
    scales: torch.Tensor | None = None  # [tokens, slots] float32, fp8 shards only


def _open_views(path: str) -> _ShardViews:
    shard = MappedShard(path)
    scales = (shard.tensor(formats.HIDDEN_SCALES) if formats.HIDDEN_SCALES in shard.entries
              else None)
    return _ShardViews(shard.tensor(formats.HIDDEN_STATES), shard.tensor(formats.INPUT_IDS),
                       shard.tensor(formats.LOSS_MASK), shard, scales)


class ShardSampleDataset(Dataset):
    """One split-index row -> one speculators training sample (already shifted by one).

    Shards are memory-mapped (``MappedShard``).  ``__getitem__`` is the reference
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
        self._views: dict[int, _ShardViews] = {}
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

    def _shard(self, shard: int) -> _ShardViews:
        if shard not in self._views:
            self._views[shard] = _open_views(self.shard_paths[shard])
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

    def _locate(self, index: int) -> tuple[_ShardViews, int, int]:
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
        _copy(hidden, views.hidden[start:start + count, :aux])
        _copy(batch["verifier_last_hidden_states"][0, rows], views.hidden[ahead, aux])
        if views.scales is not None:
            _copy(batch[SCALE_KEYS[0]][0, rows], views.scales[start:start + count, :aux])
            _copy(batch[SCALE_KEYS[1]][0, rows], views.scales[ahead, aux])
        _copy(batch["input_ids"][0, rows], views.input_ids[ahead])
        _copy(batch["loss_mask"][0, rows], views.loss_mask[ahead])
        numpy_view(batch["position_ids"][0, rows])[...] = np.arange(1, count + 1)
        return count


# --------------------------------------------------------------------------- sampling


def make_sampler(lengths: Sequence[int], max_tokens: int, seed: int, rank: int = 0,
                 world_size: int = 1) -> StepPlanner:
    """The step planner (``draftline.train.packing``); its order depends on seed + epoch.

    ``max_tokens`` is one process's budget.  With several processes (torchrun) each passes
    its rank: the planner packs once for all of them and deals rank r its own batches.
    """
    return StepPlanner(lengths, max_tokens, seed, rank, world_size)


def epoch_batches(sampler: StepPlanner, epoch: int) -> list[np.ndarray]:
    """Sample indices of each packed batch of one epoch, in training order."""
    return sampler.batches(epoch)


def steps_in_epochs(sampler: StepPlanner, epochs: int) -> int:
    """Optimizer steps in ``epochs`` passes (the packing, so the count, varies per epoch)."""
    return sum(len(epoch_batches(sampler, epoch)) for epoch in range(epochs))


def plan_steps(sampler: StepPlanner, start_step: int,
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
    """Reference path: the planned batches through speculators' collate, [1, max_tokens]."""
    return DataLoader(
        dataset,
        batch_sampler=[batch.tolist() for batch in batches],
        collate_fn=create_collate_fn(max_tokens),
        num_workers=num_workers,
        pin_memory=False,
    )


# --------------------------------------------------------------------------- packed path


def dequantize_batch(batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A packed fp8 batch (HIDDEN_KEYS float8_e4m3fn plus SCALE_KEYS) with its hidden states
    in ``dtype`` and the scales dropped: what the draft's forward takes. Runs where the batch
    is (the GPU: one byte per value crossed the host-to-device copy)."""
    out = {k: v for k, v in batch.items() if k not in SCALE_KEYS}
    hidden, scales = batch["hidden_states"], batch[SCALE_KEYS[0]]  # [1, T, aux*H], [1, T, aux]
    per_slot = hidden.view(*hidden.shape[:2], scales.shape[-1], -1)  # [1, T, aux, H]
    out["hidden_states"] = formats.dequantize(per_slot, scales, dtype).view(hidden.shape)
    out["verifier_last_hidden_states"] = formats.dequantize(
        batch["verifier_last_hidden_states"], batch[SCALE_KEYS[1]], dtype)  # [1, T, H]
    return out


def fit_lengths(lengths: Sequence[int], max_tokens: int) -> list[int]:
    """speculators' collate rule for ``lengths``: keep them while they fit, cut the last."""
    fitted, used = [], 0
    for length in lengths:
        if length + used >= max_tokens:
            fitted.append(max_tokens - used)
            break
        fitted.append(length)
        used += length
    return fitted


def default_loader_threads(device: str) -> int:
    """Packing threads from the CPUs this process may run on (affinity, not the host's).

    CUDA: up to ``MAX_DEFAULT_THREADS``, one core left to the thread that drives the GPU.
    CPU training: none (pack inline), since every core is busy with the model's own math
    and the step, not one memcpy per batch, is the bottleneck there.
    """
    if not str(device).startswith("cuda"):
        return 0
    cpus = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1)
    return max(1, min(MAX_DEFAULT_THREADS, cpus - 1))


class _InlineExecutor:
    """``threads=0``: pack in the consumer's thread (no overlap; simplest to debug)."""

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(fn(*args))
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


@dataclasses.dataclass
class _Slot:
    """One reusable host batch buffer and the event that says the GPU is done reading it."""

    buffers: dict[str, torch.Tensor]
    batch: dict[str, torch.Tensor] | None = None
    copied: torch.cuda.Event | None = None  # set once the batch was staged to the GPU


def _slot_layout(max_tokens: int, aux_width: int, hidden: int,
                 dtype: torch.dtype) -> list[tuple[str, torch.dtype, int]]:
    """(name, dtype, elements) of one slot's buffers (fp8: their scales too)."""
    scales = ([(SCALE_KEYS[0], formats.SCALE_DTYPE, max_tokens * (aux_width // hidden)),
               (SCALE_KEYS[1], formats.SCALE_DTYPE, max_tokens)]
              if dtype == torch.float8_e4m3fn else [])
    return [("hidden_states", dtype, max_tokens * aux_width),
            ("verifier_last_hidden_states", dtype, max_tokens * hidden),
            *scales, *[(key, torch.int64, max_tokens) for key in TOKEN_KEYS]]


def _allocate_slots(count: int, max_tokens: int, aux_width: int, hidden: int,
                    dtype: torch.dtype, pin: bool) -> list[_Slot]:
    """All slots carved out of one host allocation.

    One allocation because pinning is slow and the pinned allocator rounds each request up
    to a power of two; 64-byte alignment keeps every view aligned for its dtype.
    """
    layout = _slot_layout(max_tokens, aux_width, hidden, dtype)
    sizes = [-(-n * d.itemsize // 64) * 64 for _, d, n in layout]
    flat = torch.empty(count * sum(sizes), dtype=torch.uint8, pin_memory=pin)
    slots, offset = [], 0
    for _ in range(count):
        buffers = {}
        for (name, elem_dtype, numel), size in zip(layout, sizes):
            view = flat[offset:offset + numel * elem_dtype.itemsize].view(elem_dtype)
            wide = name in HIDDEN_KEYS or name == SCALE_KEYS[0]
            buffers[name] = view.view(1, max_tokens, -1) if wide else view.view(1, max_tokens)
            offset += size
        slots.append(_Slot(buffers))
    return slots


class PackedLoader:
    """The planned batches, packed from the shards and delivered on ``device``.

    Yields speculators' batch dicts ([1, max_tokens, ...] plus ``lengths``) in plan order,
    identical to ``make_loader``'s except that hidden states arrive in ``hidden_dtype``
    (None: the stored dtype; float32 for fp8 shards), cast (fp8: dequantized) on the device.
    ``threads`` background threads (None: ``default_loader_threads``) pack up to ``prefetch``
    batches ahead into a ring of ``prefetch + 2`` reusable buffers (pinned on CUDA).  On
    CUDA, ``staging`` (``STAGINGS``) says who copies a packed batch to the GPU: ``workers``,
    the thread that packed it (side stream, then the cast there; up to ``prefetch`` batches
    wait on the GPU), or ``consumer``, the thread iterating (one batch ahead).

    ``primed_at``: the ``time.perf_counter()`` at which the first ``prefetch`` batches were
    all ready (packed, and staged where the workers stage), i.e. the end of the start-up;
    None until then.

    Contract: on CPU a yielded batch may be a view of a ring buffer and is valid until the
    next one is requested (the training loop never keeps one longer).  On CUDA every batch
    is its own device allocation.
    """

    def __init__(self, dataset: ShardSampleDataset, batches: Sequence[np.ndarray],
                 max_tokens: int, device: str | torch.device = "cpu",
                 hidden_dtype: torch.dtype | None = None, threads: int | None = None,
                 prefetch: int | None = None, staging: str = "workers"):
        if staging not in STAGINGS:
            raise ValueError(f"staging must be one of {STAGINGS}, got {staging!r}")
        self.dataset = dataset
        self.batches = [np.asarray(b).tolist() for b in batches]
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        self.hidden_dtype = hidden_dtype
        self.threads = default_loader_threads(str(self.device)) if threads is None else threads
        self.prefetch = max(1, self.threads + 1 if prefetch is None else prefetch)
        self.staging = staging
        self.primed_at: float | None = None

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if not self.batches:
            return iter(())
        if not self._cuda:
            return self._on_host()
        return self._staged_by_workers() if self.staging == "workers" else self._staged()

    def _new_slots(self) -> list[_Slot]:
        hidden = self.dataset.hidden_size
        return _allocate_slots(self.prefetch + 2, self.max_tokens,
                               self.dataset.num_aux_slots * hidden, hidden,
                               self.dataset.storage_dtype, pin=self._cuda)

    def _fill(self, slot: _Slot, indices: list[int]) -> _Slot:
        if slot.copied is not None:
            slot.copied.synchronize()  # the previous batch in this slot has left for the GPU
        used, lengths = 0, []
        for index in indices:
            lengths.append(self.dataset.lengths[index])
            if used < self.max_tokens:
                used += self.dataset.copy_into(index, slot.buffers, used, self.max_tokens)
        for buffer in slot.buffers.values():
            # collate pads with zeros; stale rows from the slot's last batch could be NaN
            # bit patterns, and NaN * (loss mask 0) is still NaN.
            numpy_view(buffer[0, used:])[...] = 0
        slot.batch = {**slot.buffers, "lengths": torch.tensor(
            fit_lengths(lengths, self.max_tokens), dtype=torch.long)}
        return slot

    def _filled_slots(self, finish: Callable[[_Slot], object] | None = None) -> Iterator:
        """Filled slots in plan order, ``prefetch`` batches packing ahead; with ``finish``,
        what ``finish(slot)`` returned for each, run on the packing thread after the fill.

        Batch i goes into slot i % (prefetch + 2) and is submitted when the consumer comes
        back after batch i - prefetch, so the slot's previous batch (i - prefetch - 2) is
        done with on CPU; on CUDA it may still be in flight, which its event covers.
        """
        slots = self._new_slots()
        executor = (concurrent.futures.ThreadPoolExecutor(self.threads, "draftline-pack")
                    if self.threads > 0 else _InlineExecutor())
        pending: collections.deque = collections.deque()
        planned = iter(enumerate(self.batches))

        def work(slot: _Slot, indices: list[int]):
            filled = self._fill(slot, indices)
            return filled if finish is None else finish(filled)

        def submit() -> None:
            item = next(planned, None)
            if item is None:
                return
            number, indices = item
            for index in indices:
                self.dataset.will_need(index)  # start disk reads now, ahead of the copy
            pending.append(executor.submit(work, slots[number % len(slots)], indices))

        self.primed_at = None
        try:
            for _ in range(self.prefetch):
                submit()
            self._watch_priming(list(pending))
            while pending:
                yield pending.popleft().result()
                submit()
        finally:
            executor.shutdown(wait=True, cancel_futures=True)

    def _watch_priming(self, futures: list[concurrent.futures.Future]) -> None:
        """Set ``primed_at`` when the last of the first batches is ready (on its thread)."""
        left, lock = [len(futures)], threading.Lock()

        def done(_future: concurrent.futures.Future) -> None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    self.primed_at = time.perf_counter()

        for future in futures:
            future.add_done_callback(done)

    def _cast(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if SCALE_KEYS[0] in batch:
            return dequantize_batch(batch, self.hidden_dtype or torch.float32)
        if self.hidden_dtype is None:
            return batch
        return {k: v.to(self.hidden_dtype) if k in HIDDEN_KEYS else v for k, v in batch.items()}

    def _on_host(self) -> Iterator[dict[str, torch.Tensor]]:
        slots = self._filled_slots()
        try:
            for slot in slots:
                yield self._cast(slot.batch)
        finally:
            slots.close()  # stop the packing threads now if the consumer stops early

    def _staged(self) -> Iterator[dict[str, torch.Tensor]]:
        """Copy batch i+1 to the GPU on a side stream while batch i is being used."""
        stream = torch.cuda.Stream(self.device)
        slots, pending = self._filled_slots(), None
        try:
            for slot in slots:
                staged = self._stage(slot, stream)
                if pending is not None:
                    yield self._consume(*pending)
                pending = staged
            if pending is not None:
                yield self._consume(*pending)
        finally:
            slots.close()

    def _staged_by_workers(self) -> Iterator[dict[str, torch.Tensor]]:
        """Each packing thread copies and casts its own batch on the side stream; this
        thread waits only on the event of the batch it asked for."""
        stream = torch.cuda.Stream(self.device)

        def stage_and_cast(slot: _Slot) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:
            with torch.cuda.device(self.device):  # a packing thread has no current device
                batch, ready = self._stage(slot, stream)
                with torch.cuda.stream(stream):
                    # Cast where the batch landed, off the compute stream; the event is
                    # re-recorded after the cast so the consumer waits for it too.
                    batch = self._cast(batch)
                    ready.record(stream)
            return batch, ready

        staged = self._filled_slots(stage_and_cast)
        try:
            for batch, ready in staged:
                yield self._receive(batch, ready)
        finally:
            staged.close()

    def _receive(self, batch: dict[str, torch.Tensor],
                 ready: torch.cuda.Event) -> dict[str, torch.Tensor]:
        """A batch staged on the side stream, safe to use on the current stream."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ready)
        for tensor in batch.values():
            tensor.record_stream(current)  # its memory is not reused while compute reads it
        return batch

    def _stage(self, slot: _Slot, stream: torch.cuda.Stream
               ) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:
        # Allocated on the side stream, so the allocator cannot hand out memory that
        # compute-stream kernels still use; record_stream in _consume covers the reverse.
        with torch.cuda.stream(stream):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in slot.batch.items()}
            ready = torch.cuda.Event()
            ready.record(stream)
        slot.copied = ready
        return batch, ready

    def _consume(self, batch: dict[str, torch.Tensor],
                 ready: torch.cuda.Event) -> dict[str, torch.Tensor]:
        return self._cast(self._receive(batch, ready))
