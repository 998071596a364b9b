"""Training data for the draft: planned batches packed from hidden-state shards, at GPU speed.

Which samples make up each step is ``draftline.train.packing``'s plan (packed to fill the
token budget, seeded per epoch), which replaced speculators'
``MultipackDistributedBatchSamplerV2`` (0.92-0.93 fill at the benchmark dims).  The samples
come from ``draftline.train.dataset.ShardSampleDataset``; ``PackedLoader`` delivers the same
batches as that module's reference ``make_loader`` (speculators' ``shift_batch`` and
``create_collate_fn``), faster.

At ~65k tokens/s (Llama-3.1-8B dims, one H200, bf16) the draft eats ~2 GB/s of hidden states,
which per-sample tensors, a float32 conversion, collate's concatenate + pad and a pin copy on
the CPU do not keep up with.  So: shards are memory-mapped and read through zero-copy views
(``draftline.train.mapped``); each planned batch is packed by background threads straight
from the page cache into a reusable, pinned [1, max_tokens, ...] buffer in the shards' own
dtype (one CPU copy per byte, bf16 stays bf16); on CUDA the thread that packed a batch also
copies it to the GPU on a side stream and casts it there (``staging="workers"``), so the
training thread only waits on the batch's event.  ``staging="consumer"`` is the earlier way
(kept to time both in one process): the training thread copies batch i+1 while batch i is in
use, which makes it wait for batch i+1's packing and for the copy's pageable ``lengths`` (a
stream sync) before it gets batch i.

fp8 shards travel as stored and are dequantized where the batch is cast (on the GPU in
training): ``draftline.train.fp8``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from draftline import formats
from draftline.train.dataset import ShardSampleDataset
from draftline.train.fp8 import SCALE_KEYS, dequantize_batch
from draftline.train.mapped import numpy_view

__all__ = [
    "HIDDEN_KEYS",
    "PackedLoader",
    "default_loader_threads",
    "STAGINGS",
    "fit_lengths",
]

# speculators' batch keys (shift_batch, collate, the draft's forward); the shard's own keys
# are draftline.formats', an fp8 batch's scales draftline.train.fp8's SCALE_KEYS.
HIDDEN_KEYS = ("hidden_states", "verifier_last_hidden_states")
TOKEN_KEYS = ("input_ids", "loss_mask", "position_ids")  # int64 [1, max_tokens] each
# 4 packing threads measured on an H200 host (16 cores): 2.8-4.5 GB/s of hidden states from
# a cold disk (its plain sequential read: 1.8-2.1 GB/s), 22 GB/s from the page cache, against
# ~2 GB/s consumed at 65k tokens/s; more would only add pinned buffers.
MAX_DEFAULT_THREADS = 4
# Who copies a packed batch to the GPU: the packing thread (workers) or the thread that
# trains (consumer, the loader before issue 33).  The same on CPU, where nothing is copied.
STAGINGS = ("workers", "consumer")


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
    identical to ``dataset.make_loader``'s except that hidden states arrive in ``hidden_dtype``
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
