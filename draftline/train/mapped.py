"""Hidden-state shards memory-mapped for training: zero-copy tensor views and raw copies.

A shard (layout and keys: ``draftline.formats``) is mapped once (``MappedShard``) and read
through views of the map, so the packed loader (``draftline.train.loader``) copies each byte
once, from the page cache into its batch buffer.  ``numpy_view`` and ``copy_values`` are those
copies: numpy, with bf16 and fp8 moved as their raw bit patterns.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import struct
from pathlib import Path

import numpy as np
import torch

from draftline import formats

__all__ = [
    "SAFETENSORS_DTYPES",
    "RAW_DTYPES",
    "MappedShard",
    "numpy_view",
    "copy_values",
    "ShardViews",
    "open_views",
]

SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}
# Copied as raw bits through numpy, which has neither type.
RAW_DTYPES = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}


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


def copy_values(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src through numpy; bf16 or fp8 <-> another dtype (numpy has neither) via torch.

    The torch fallback only serves splits that mix bf16 and float32 shards.
    """
    if dst.dtype != src.dtype and (dst.dtype in RAW_DTYPES or src.dtype in RAW_DTYPES):
        dst.copy_(src)
    else:
        numpy_view(dst)[...] = numpy_view(src)


@dataclasses.dataclass
class ShardViews:
    """One shard's tensors, as views of its map."""

    hidden: torch.Tensor  # [tokens, slots, H], stored dtype
    input_ids: torch.Tensor  # [tokens] int64
    loss_mask: torch.Tensor  # [tokens] uint8
    file: MappedShard
    scales: torch.Tensor | None = None  # [tokens, slots] float32, fp8 shards only


def open_views(path: str) -> ShardViews:
    """Map the shard at ``path``; its scales only if it is an fp8 shard."""
    shard = MappedShard(path)
    scales = (shard.tensor(formats.HIDDEN_SCALES) if formats.HIDDEN_SCALES in shard.entries
              else None)
    return ShardViews(shard.tensor(formats.HIDDEN_STATES), shard.tensor(formats.INPUT_IDS),
                      shard.tensor(formats.LOSS_MASK), shard, scales)

