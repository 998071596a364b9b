"""Rank 0's shard writer: captured rows into pinned shard buffers, shards written beside the
forwards (draftline issue 30; moved out of the speculators patch by issue 44).

The engine's worker (patches/speculators/0008) hooks the decoder layers; after every step it
hands this module the step's rows, already cast or quantized on the device
(:func:`draftline.formats.quantize_fp8`).  :class:`ShardWriter` copies them, with
non-blocking copies on a copy stream, into a host buffer (pinned on CUDA) at their requests'
offsets in the open shard, and a writer thread writes a finished shard with the writer the
driver named while the next shard's forwards fill the other buffer.  The driver gets counts,
timings and status back, never rows.  Nothing here imports vLLM: tests and benchmarks drive
it directly.

What no shard may do silently:

* **Non-finite rows.** Every step's rows get one flag per row, computed on the device (no
  sync) and kept at the row's place in the shard; a preempted request that starts over
  overwrites its rows and their flags together, so a NaN of an abandoned attempt does not
  condemn a shard whose recompute is finite, and a NaN that stays is never written:
  :meth:`ShardWriter.finish` reports the first bad (token, slot, value).
* **A slow or failing writer.** Waits for the writer have their own timeout
  (``writer_timeout_s``, not the ranks' capture-step one), and every writer error names the
  shard's file and its folder; the writes finished beside it are kept and reported by the
  next call.
* **Placement.** A request's span must lie inside the open shard.
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

import torch

from draftline import formats

__all__ = ["ShardWriteError", "ShardWriter", "WriterTimeout", "chunk_start", "row_flags"]

WriteFn = Callable[[str, dict, dict], Any]  # (path, tensors, metadata)


class ShardWriteError(RuntimeError):
    """Writing one shard failed: names the file, its folder and the cause."""

    def __init__(self, path: str, detail: str):
        self.path = path
        super().__init__(f"rank 0's shard writer: {path}: {detail} (storage: {os.path.dirname(path)})")


class WriterTimeout(ShardWriteError):
    """A shard's write outlasted ``extract.writer_timeout_s``: the storage is slower than the
    forwards, not a rank that hangs."""


def chunk_start(req_id: str, positions: torch.Tensor) -> int:
    """A prefill chunk's first position; its positions must be consecutive."""
    start = int(positions[0])
    expected = torch.arange(start, start + len(positions))
    if not torch.equal(positions.to(torch.long), expected):
        raise RuntimeError(f"{req_id}: non-contiguous positions in a prefill chunk")
    return start


def row_flags(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """bool [rows]: whether a row of the step holds a NaN or inf, on the rows' device, no sync.

    fp8 ``(values, scales)``: a row's scales are non-finite exactly when the row was; other
    dtypes: one min/max pass per row (NaN and inf survive both; isfinite over the whole
    values is 40x slower on a CPU thread)."""
    if len(parts) > 1:
        return ~torch.isfinite(parts[1]).all(dim=-1)
    values = parts[0]
    low, high = torch.aminmax(values.reshape(values.shape[0], -1), dim=-1)
    return ~(torch.isfinite(low) & torch.isfinite(high))


class _Buffer:
    """One shard's host memory: values [capacity, slots, hidden] in the storage dtype and,
    for fp8, scales [capacity, slots]; pinned on CUDA, so the copy stream's device-to-host
    copies run at the link's speed and do not block."""

    def __init__(self, capacity: int, num_slots: int, hidden: int, dtype: torch.dtype,
                 quantized: bool, pin: bool):
        self.values = torch.empty((capacity, num_slots, hidden), dtype=dtype, pin_memory=pin)
        self.scales = (torch.empty((capacity, num_slots), dtype=formats.SCALE_DTYPE, pin_memory=pin)
                       if quantized else None)
        self.write: Future | None = None  # the last write from this buffer
        self.path: str | None = None  # ... and its shard


@dataclasses.dataclass
class _Placed:
    """A request's span in the open shard and how many of its rows have been copied."""

    offset: int
    length: int
    have: int = 0


class ShardWriter:
    """Rank 0 writes the shards: see the module doc.

    ``write(path, tensors, metadata)`` writes one file (the driver names it,
    draftline.formats.write_shard); ``writer_timeout_s`` bounds every wait for it (None: no
    bound)."""

    def __init__(self, capacity: int, num_slots: int, hidden: int, storage_dtype: str,
                 device: torch.device, write: WriteFn, num_buffers: int = 2,
                 writer_timeout_s: float | None = None):
        if storage_dtype not in formats.SAVE_DTYPES:
            raise ValueError(f"the shard writer needs a storage dtype, got {storage_dtype!r}")
        if num_buffers < 1 or capacity < 1:
            raise ValueError(f"the shard writer needs buffers ({num_buffers}) of rows ({capacity})")
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.capacity, self.device, self.write = capacity, device, write
        self.writer_timeout_s = writer_timeout_s
        self.buffers = [_Buffer(capacity, num_slots, hidden, formats.SAVE_DTYPES[storage_dtype],
                                formats.is_quantized(storage_dtype), pin=cuda)
                        for _ in range(num_buffers)]
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="shard-writer")
        self.turn = 0
        self.shard: dict | None = None
        self.written: list[dict] = []  # finished writes not yet reported to the driver

    # ------------------------------------------------------------------ the open shard

    def begin(self, layout: dict) -> dict:
        """Open the next shard in the next buffer, once that buffer's last write is done.
        ``layout``: path, num_tokens, tensors and metadata (written beside the rows),
        values_key, scales_key."""
        if self.shard is not None:
            raise RuntimeError(f"shard {self.shard['path']} is still open")
        if not 0 < layout["num_tokens"] <= self.capacity:
            raise ValueError(f"shard {layout['path']} holds {layout['num_tokens']} tokens, the "
                             f"buffers {self.capacity}")
        buffer = self.buffers[self.turn % len(self.buffers)]
        self.turn += 1
        start = time.perf_counter()
        self._collect(buffer)
        waited = time.perf_counter() - start
        for other in self.buffers:  # a failed write surfaces at the next call, not later
            if other.write is not None and other.write.done():
                self._collect(other)
        self.shard = {**layout, "buffer": buffer, "placed": {},
                      "bad": torch.zeros(layout["num_tokens"], dtype=torch.bool, device=self.device)}
        return {"waited_s": waited, "written": self._report()}

    def place(self, placement: dict[str, tuple[int, int]]) -> None:
        """Requests' spans in the open shard: {req_id: (offset, length)}, inside it."""
        if self.shard is None:
            raise RuntimeError("no shard is open to place requests in")
        size = self.shard["num_tokens"]
        for req_id, (offset, length) in placement.items():
            if not (0 <= offset and 0 < length and offset + length <= size):
                raise ValueError(f"{req_id}: rows [{offset}, {offset + length}) do not lie in shard "
                                 f"{self.shard['path']} of {size} rows")
            self.shard["placed"][req_id] = _Placed(int(offset), int(length))

    def copy_step(self, req_ids: list[str], counts: list[int], positions: torch.Tensor,
                  parts: tuple[torch.Tensor, ...]) -> None:
        """One step's stored rows (on the device; ``parts``: values, and scales for fp8) into
        the shard buffer at their requests' offsets, and their row flags, without waiting."""
        shard = self.shard
        flags = row_flags(parts)
        spans, offset = [], 0  # [source row, shard row, rows], adjacent ones merged
        for req_id, count in zip(req_ids, counts, strict=True):
            placed = shard["placed"].get(req_id)
            if placed is None:
                raise RuntimeError(f"{req_id}: scheduled, but not placed in the open shard")
            start = chunk_start(req_id, positions[offset : offset + count])
            if start == 0:
                placed.have = 0  # a preempted request starts over: its rows and flags are rewritten
            if placed.have != start or start + count > placed.length:
                raise RuntimeError(f"{req_id}: chunk at {start} of {count} rows, {placed.have} of "
                                   f"{placed.length} copied")
            placed.have += count
            source, target = offset, placed.offset + start
            if spans and spans[-1][0] + spans[-1][2] == source and spans[-1][1] + spans[-1][2] == target:
                spans[-1][2] += count
            else:
                spans.append([source, target, count])
            offset += count
        for source, target, count in spans:  # on the compute stream, beside the rows
            shard["bad"][target : target + count] = flags[source : source + count]
        buffer = shard["buffer"]
        pairs = [(parts[0], buffer.values)] + ([(parts[1], buffer.scales)] if len(parts) > 1 else [])
        if self.stream is None:  # CPU: the "device" is this host; a plain copy
            for source, target, count in spans:
                for part, host in pairs:
                    host[target : target + count].copy_(part[source : source + count])
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for source, target, count in spans:
                for part, host in pairs:
                    host[target : target + count].copy_(part[source : source + count], non_blocking=True)
        for part, _ in pairs:  # the allocator keeps them until the copies are done
            part.record_stream(self.stream)

    def take(self, req_ids: list[str]) -> dict[str, int]:
        """Rows copied per finished request (the driver checks them against its prompts)."""
        placed = self.shard["placed"]
        return {r: placed[r].have for r in req_ids if r in placed}

    def finish(self) -> dict:
        """Close the open shard: hand it to the writer thread, or, when a row is NaN or inf,
        drop it and report the first bad (token, slot, value); it is never written."""
        shard, self.shard = self.shard, None
        if shard is None:
            raise RuntimeError("no shard is open to finish")
        spans = sorted((p.offset, p.length, p.have, r) for r, p in shard["placed"].items())
        covered = 0
        for offset, length, have, req_id in spans:
            if offset != covered or have != length:
                raise RuntimeError(f"{shard['path']}: {req_id} at {offset} has {have} of {length} rows, "
                                   f"the shard is filled to {covered}")
            covered += length
        if covered != shard["num_tokens"]:
            raise RuntimeError(f"{shard['path']}: {covered} of {shard['num_tokens']} rows")
        copied = self.stream.record_event() if self.stream is not None else None
        buffer = shard["buffer"]
        bad = shard["bad"]
        if bool(bad.any()):
            if copied is not None:
                copied.synchronize()
            token = int(bad.nonzero()[0])
            rows = slice(token, token + 1)
            probe = buffer.scales[rows] if buffer.scales is not None else buffer.values[rows]
            found = formats.first_non_finite(probe)
            if found is None:  # the flags and the rows disagree: never write, never pass
                raise RuntimeError(f"{shard['path']}: row {token} was flagged non-finite, but its "
                                   "copy in the shard buffer is finite")
            return {"non_finite": (token, found[1], found[2]), "written": self._report()}
        buffer.path = shard["path"]
        buffer.write = self.pool.submit(self._write, shard, buffer, copied)
        return {"non_finite": None, "written": self._report()}

    def flush(self) -> dict:
        """Wait for every write and report them; after a failed one, the others are still
        waited for and kept (the next call reports them), then the first error is raised."""
        start = time.perf_counter()
        errors = []
        for buffer in self.buffers:
            try:
                self._collect(buffer)
            except ShardWriteError as error:
                errors.append(error)
        if errors:
            for other in errors[1:]:  # every failed shard is named, the first raised
                errors[0].add_note(f"and: {other}")
            raise errors[0]
        return {"waited_s": time.perf_counter() - start, "written": self._report()}

    def drop(self) -> None:
        """Forget the open shard (a failed batch); its buffer is free again."""
        self.shard = None

    # ------------------------------------------------------------------ the writer thread

    def _write(self, shard: dict, buffer: _Buffer, copied) -> dict:
        """On the writer thread: wait for the shard's copies, then write the file."""
        start = time.perf_counter()
        if copied is not None:
            copied.synchronize()
        ready = time.perf_counter()
        rows = slice(0, shard["num_tokens"])
        tensors = {**shard["tensors"], shard["values_key"]: buffer.values[rows]}
        if buffer.scales is not None:
            tensors[shard["scales_key"]] = buffer.scales[rows]
        try:
            self.write(shard["path"], tensors, shard["metadata"])
        except Exception as error:
            raise ShardWriteError(shard["path"], f"writing it failed: {type(error).__name__}: {error}") from error
        return {"path": shard["path"], "copy_wait_s": ready - start,
                "write_s": time.perf_counter() - ready, "finished_unix": time.time()}

    def _collect(self, buffer: _Buffer) -> None:
        """Wait for the buffer's last write (at most ``writer_timeout_s``) and keep its record;
        its error, named, otherwise."""
        if buffer.write is None:
            return
        try:
            record = buffer.write.result(timeout=self.writer_timeout_s)
        except FutureTimeout:
            raise WriterTimeout(
                buffer.path, f"still being written after extract.writer_timeout_s={self.writer_timeout_s} s: "
                "the storage is slower than the forwards fill a buffer (raise the timeout, or write to "
                "faster storage)") from None
        except ShardWriteError:
            buffer.write = None
            raise
        except Exception as error:  # anything else the thread raised, still named
            buffer.write = None
            raise ShardWriteError(buffer.path, f"{type(error).__name__}: {error}") from error
        buffer.write = None
        self.written.append(record)

    def _report(self) -> list[dict]:
        written, self.written = self.written, []
        return written
