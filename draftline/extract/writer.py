"""The shards out of the engine, and where the seconds went.

Two writers make the same bytes (tests/test_extraction.py holds them to it):

* ``on_rank0`` (the default, ``extract.writer=rank0``): the engine's rank 0 copies each
  step's rows, cast or quantized and checked on its device, into a pinned shard buffer and
  a writer thread writes the shard while the next forwards run (patches/speculators/0008).
  This process plans the shards, places each sample in one and gets counts back.
* ``in_driver`` (``extract.writer=driver``): every row crosses vLLM's RPC to this process,
  which packs, checks and writes the shard between forwards: the path before draftline
  issue 30, kept to compare bytes and speed.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from draftline import engine, formats
from draftline.extract import shards
from draftline.extract.settings import ShardJob
from draftline.pipeline.artifacts import write_json
from draftline.pipeline.progress import Progress

WRITER = "draftline.formats:write_shard"  # what rank 0 writes a shard with: the same bytes
CAPTURE_BOUND = 0.10  # a run whose forwards wait this share of its time says so


@dataclasses.dataclass
class TimeSplit:
    """Where an extraction's seconds went, as the driver sees them."""

    forward: float = 0.0  # in generate() calls: the forwards (on CPU also the shard copies)
    waiting: float = 0.0  # on rank 0's copies or its writer (a free buffer, the last writes)
    writing: float = 0.0  # writing shards: on rank 0's writer thread, beside the forwards
    serial: bool = False  # whether writing held up the forwards (the driver's writer)

    def capture_share(self) -> float:
        """The share of the run the forwards were held up by the capture path."""
        held = self.waiting + (self.writing if self.serial else 0.0)
        return held / max(self.forward + held, 1e-9)

    def line(self) -> str:
        """For the progress line: ``forward 61 s, waiting 2 s, writing 18 s (beside)``."""
        where = "in between" if self.serial else "beside"
        bound = "; capture-bound" if self.capture_share() > CAPTURE_BOUND else ""
        return (f"forward {self.forward:.0f} s, waiting {self.waiting:.0f} s, writing "
                f"{self.writing:.0f} s ({where}){bound}")

    def record(self, writer: str) -> dict:
        return {"writer": writer, "forward_s": round(self.forward, 3),
                "waiting_s": round(self.waiting, 3), "writing_s": round(self.writing, 3),
                "writing_overlaps_forward": not self.serial,
                "capture_share": round(self.capture_share(), 4),
                "capture_bound": self.capture_share() > CAPTURE_BOUND}


def on_rank0(generator, plans: list[shards.ShardPlan], job: ShardJob, progress: Progress,
             split: TimeSplit) -> list[int]:
    """Every pending shard of ``plans`` written by the engine's rank 0; their indices."""
    seconds, written = {}, []  # this process's seconds per shard: begin to finish

    def note(done: list[dict]) -> None:  # writes rank 0 finished since the last call
        for record in done:
            path = Path(record["path"])
            split.writing += record["write_s"]
            write_json(shards.timing_path(path), {
                "seconds": seconds[path], "write_seconds": record["write_s"],
                "finished_unix": record["finished_unix"]})

    def waited(call, *args) -> dict:
        start = time.monotonic()
        status = call(*args)
        split.waiting += time.monotonic() - start
        note(status["written"])
        return status

    try:
        for plan in plans:
            path = job.out_dir / plan.name
            if shards.shard_is_complete(path, plan, job.metadata[formats.FINGERPRINT]):
                continue
            seconds[path] = _on_rank0_shard(generator, plan, job, progress, split, waited)
            written.append(plan.index)
        waited(generator.flush_shards)
    except BaseException as error:
        # Shards already handed to rank 0's writer are whole: keep them (a rerun resumes
        # after them) and their timing files, unless the ranks stopped answering or the
        # engine is gone. A writer error names its shard; rank 0 keeps the records of the
        # writes that finished beside it, and this flush reports them.
        if not engine.timed_out(error) and engine.worker_failure(generator.executor) is None:
            try:
                waited(generator.flush_shards)
            except Exception as flush_error:
                error.add_note(f"and the shards handed to rank 0's writer could not all be "
                               f"written: {flush_error!r}")
        raise
    return written


def _on_rank0_shard(generator, plan: shards.ShardPlan, job: ShardJob, progress: Progress,
                    split: TimeSplit, waited) -> float:
    """One shard: its layout to rank 0, its samples placed and prefilled, handed to the
    writer; this process's seconds on it."""
    started = time.monotonic()
    samples, lengths, path = job.samples, job.lengths, job.out_dir / plan.name
    rows = formats.shard_rows(plan.sample_ids, {i: samples[i] for i in plan.sample_ids},
                              {i: job.loss_masks[i] for i in plan.sample_ids})
    offsets = rows[formats.SAMPLE_OFFSETS].tolist()
    at = dict(zip(plan.sample_ids, offsets))
    waited(generator.begin_shard, {
        "path": str(path), "num_tokens": plan.num_tokens, "tensors": rows,
        "metadata": job.metadata, "values_key": formats.HIDDEN_STATES,
        "scales_key": formats.HIDDEN_SCALES})
    for batch in shards.plan_batches(plan.sample_ids, lengths, job.token_budget):
        start = time.monotonic()
        generator.generate([samples[i] for i in batch], offsets=[at[i] for i in batch])
        split.forward += time.monotonic() - start
        progress.advance(sum(lengths[i] for i in batch), detail=split.line())
    status = waited(generator.finish_shard)  # its write is noted at a later call
    if status["non_finite"] is not None:
        raise formats.non_finite_error(str(path), plan.sample_ids, offsets, *status["non_finite"])
    return time.monotonic() - started


def in_driver(generator, plans: list[shards.ShardPlan], job: ShardJob, progress: Progress,
              split: TimeSplit) -> list[int]:
    """Every pending shard of ``plans`` from rows returned by ``generator``, packed and
    written here; their indices."""
    split.serial = True
    samples, lengths, metadata = job.samples, job.lengths, job.metadata
    written = []
    for plan in plans:
        path = job.out_dir / plan.name
        if shards.shard_is_complete(path, plan, metadata[formats.FINGERPRINT]):
            continue
        results = {}
        start = time.monotonic()
        for batch in shards.plan_batches(plan.sample_ids, lengths, job.token_budget):
            began = time.monotonic()
            outputs = generator.generate([samples[i] for i in batch])
            split.forward += time.monotonic() - began
            results.update(zip(batch, outputs))
            progress.advance(sum(lengths[i] for i in batch), detail=split.line())
        began = time.monotonic()
        masks = {i: job.loss_masks[i] for i in plan.sample_ids}
        formats.write_shard(path, formats.pack_shard(plan.sample_ids, results, masks, job.save_dtype,
                                                     name=str(path)), metadata)
        split.writing += time.monotonic() - began
        # Beside the shard, not in its metadata: a resumed run must rewrite identical bytes.
        write_json(shards.timing_path(path), {"seconds": time.monotonic() - start,
                                              "finished_unix": time.time()})
        written.append(plan.index)
    return written
