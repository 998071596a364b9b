"""Rank 0's shard writer (draftline/extract/capture.py, draftline issue 44), driven directly on
the CPU: no engine. Each test is one way a shard could be lost or misexplained."""

from __future__ import annotations

import errno
import json
import os
import re
import threading
from pathlib import Path

import pytest
import torch

from draftline import formats
from draftline.extract import capture, preflight
from draftline.extract import writer as extract_writer
from draftline.extract.settings import ShardJob
from draftline.pipeline import artifacts, config

SLOTS, HIDDEN = 3, 8


def layout(path: Path, num_tokens: int) -> dict:
    ids = list(range(num_tokens))
    rows = formats.shard_rows([0], {0: ids}, {0: [1] * num_tokens})
    return {"path": str(path), "num_tokens": num_tokens, "tensors": rows,
            "metadata": formats.shard_metadata("test", [1, 2], HIDDEN),
            "values_key": formats.HIDDEN_STATES, "scales_key": formats.HIDDEN_SCALES}


def step(writer: capture.ShardWriter, requests: list[tuple[str, int, int]], storage: str,
         nan_at: tuple[int, int] | None = None, seed: int = 0) -> torch.Tensor:
    """One forward's rows for ``requests`` = [(req_id, first position, rows)], as the worker
    hands them over (cast or quantized); ``nan_at``: (row of the step, slot) made NaN."""
    total = sum(n for _, _, n in requests)
    rows = torch.randn(total, SLOTS, HIDDEN, generator=torch.Generator().manual_seed(seed))
    if nan_at is not None:
        rows[nan_at[0], nan_at[1], 3] = float("nan")
    positions = torch.cat([torch.arange(p, p + n) for _, p, n in requests])
    parts = formats.quantize_fp8(rows) if formats.is_quantized(storage) else (rows.to(formats.SAVE_DTYPES[storage]),)
    writer.copy_step([r for r, _, _ in requests], [n for _, _, n in requests], positions, parts)
    return rows


def new_writer(write=formats.write_shard, storage="bfloat16", timeout=None, buffers=2) -> capture.ShardWriter:
    return capture.ShardWriter(64, SLOTS, HIDDEN, storage, torch.device("cpu"), write, buffers, timeout)


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_a_request_restarted_after_a_nan_writes_its_recomputed_shard(tmp_path, storage):
    """Defect 1: vLLM preempts a request after a NaN row; its recompute from position 0 is
    finite. The shard is written with the recomputed rows (it used to be dropped without a
    word while the driver counted it written)."""
    writer = new_writer(storage=storage)
    path = tmp_path / "shard-00000.safetensors"
    writer.begin(layout(path, 12))
    writer.place({"a": (0, 8), "b": (8, 4)})
    step(writer, [("a", 0, 4)], storage, nan_at=(2, 1), seed=1)  # first attempt: NaN at a[2]
    recomputed = step(writer, [("a", 0, 8)], storage, seed=2)  # preempted: starts over
    step(writer, [("b", 0, 4)], storage, seed=3)
    assert writer.take(["a", "b"]) == {"a": 8, "b": 4}
    status = writer.finish()
    assert status["non_finite"] is None
    writer.flush()
    shard = formats.read_shard(path)
    stored = formats.dequantize(shard[formats.HIDDEN_STATES], shard.get(formats.HIDDEN_SCALES))
    want = formats.dequantize(*formats.quantize_fp8(recomputed)) if formats.is_quantized(storage) \
        else recomputed.to(torch.bfloat16).float()
    assert torch.equal(stored[:8], want)


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_a_nan_that_stays_is_named_and_never_written(tmp_path, storage):
    writer = new_writer(storage=storage)
    path = tmp_path / "shard-00000.safetensors"
    writer.begin(layout(path, 12))
    writer.place({"a": (0, 8), "b": (8, 4)})
    step(writer, [("a", 0, 8)], storage)
    step(writer, [("b", 0, 4)], storage, nan_at=(2, 1))  # b's row 2: shard row 10, slot 1
    status = writer.finish()
    token, slot, value = status["non_finite"]
    assert (token, slot) == (10, 1) and value != value  # NaN (fp8: its scale)
    writer.flush()
    assert not path.exists() and not list(tmp_path.glob("*.tmp"))


def test_a_full_disk_names_the_shard_keeps_the_finished_ones_and_leaves_no_tmp(tmp_path):
    """Risk 3: the second shard's write fails with ENOSPC. The error names that shard and its
    storage; the first shard's record is still reported; no temporary file is left."""
    def write(path, tensors, metadata):
        if path.endswith("00001.safetensors"):
            with artifacts.atomic_path(path, fsync=True) as tmp:
                tmp.write_bytes(b"half a shard")
                raise OSError(errno.ENOSPC, "No space left on device")
        formats.write_shard(Path(path), tensors, metadata)

    writer = new_writer(write)
    reported = []  # shard 0's record comes back from whichever call finds its write done
    for index in (0, 1):
        reported += writer.begin(layout(tmp_path / f"shard-0000{index}.safetensors", 4))["written"]
        writer.place({f"r{index}": (0, 4)})
        step(writer, [(f"r{index}", 0, 4)], "bfloat16")
        status = writer.finish()
        assert status["non_finite"] is None
        reported += status["written"]
    with pytest.raises(capture.ShardWriteError, match=re.escape(
            f"{tmp_path}/shard-00001.safetensors: writing it failed: OSError: [Errno 28] No space left "
            f"on device (storage: {tmp_path})")):
        writer.flush()
    reported += writer.flush()["written"]
    assert [Path(r["path"]).name for r in reported] == ["shard-00000.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000.safetensors"]


def test_a_writer_slower_than_the_forwards_is_waited_for_and_its_timeout_names_the_writer(tmp_path):
    """Risk 2: a slow disk. Without a bound the forwards wait for a free buffer (backpressure)
    and every shard is written; with one, the error says the writer, the shard and the storage,
    not a rank that hangs."""
    done = [threading.Event() for _ in range(3)]  # shard i's write ends when done[i] is set

    def slow(path, tensors, metadata):
        done[int(Path(path).stem[-5:])].wait(10)
        formats.write_shard(Path(path), tensors, metadata)

    writer = new_writer(slow, buffers=1)
    for index in range(3):  # one buffer: each begin waits for the last write
        if index:  # the last write ends 0.3 s from now, however long the steps above took
            threading.Timer(0.3, done[index - 1].set).start()
        status = writer.begin(layout(tmp_path / f"shard-{index:05d}.safetensors", 4))
        assert index == 0 or status["waited_s"] > 0.1
        writer.place({f"r{index}": (0, 4)})
        step(writer, [(f"r{index}", 0, 4)], "bfloat16")
        writer.finish()
    done[2].set()
    writer.flush()
    assert len(list(tmp_path.glob("shard-*.safetensors"))) == 3

    stuck = threading.Event()
    writer = new_writer(lambda *_: stuck.wait(5), buffers=1, timeout=0.2)
    writer.begin(layout(tmp_path / "slow-00000.safetensors", 4))
    writer.place({"r": (0, 4)})
    step(writer, [("r", 0, 4)], "bfloat16")
    writer.finish()
    with pytest.raises(capture.WriterTimeout, match=re.escape(
            f"{tmp_path}/slow-00000.safetensors: still being written after "
            "extract.writer_timeout_s=0.2 s: the storage is slower")) as raised:
        writer.begin(layout(tmp_path / "slow-00001.safetensors", 4))
    assert "rank" not in str(raised.value).replace("rank 0's shard writer", "")
    stuck.set()


def test_placement_must_lie_inside_the_shard(tmp_path):
    writer = new_writer()
    writer.begin(layout(tmp_path / "shard-00000.safetensors", 12))
    with pytest.raises(ValueError, match=r"b: rows \[8, 16\) do not lie in shard .* of 12 rows"):
        writer.place({"a": (0, 8), "b": (8, 8)})
    with pytest.raises(ValueError, match=r"c: rows \[-1, 3\)"):
        writer.place({"c": (-1, 4)})


def test_the_nan_search_reduces_per_token_first():
    """Risk 5: the first (token, slot, value) of an all-NaN stretch, as the element-wise
    search found it, with temporaries of a few values per token."""
    values = torch.randn(4096, 4, 64, dtype=torch.bfloat16)
    values[1000:] = float("nan")
    values[999, 3, 7] = float("-inf")
    assert formats.first_non_finite(values) == (999, 3, float("-inf"))
    scales = torch.rand(300, 4)
    scales[200, 2] = float("inf")
    assert formats.first_non_finite(scales) == (200, 2, float("inf"))
    assert formats.first_non_finite(torch.zeros(5, 2, 3)) is None


def test_a_shard_is_on_the_disk_before_its_name_is(tmp_path, monkeypatch):
    """Risk 6: the file is fsynced before the rename and its folder after, so a power loss
    never leaves a truncated shard under its final name."""
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    path = tmp_path / "shard-00000.safetensors"
    formats.write_shard(path, layout(path, 2)["tensors"], {})
    assert len(synced) == 2 and ".tmp" in Path(synced[0]).name and Path(synced[1]) == tmp_path
    synced.clear()
    artifacts.write_json(tmp_path / "small.json", {})  # other files keep their cheap write
    assert synced == []


def test_the_preflight_counts_pinned_buffers_as_the_allocator_rounds_them(tmp_path):
    """Risk 4: torch's pinned host allocator rounds each block up to a power of two; for
    llama-3.1-8b in fp8 a 1.21 GB buffer takes 2.15 GB."""
    cfg = config.compose(["experiment=llama-3.1-8b", "extract.save_dtype=float8_e4m3fn"])
    rows = preflight.buffer_tokens(cfg) * (len(cfg.model.aux_layer_ids) + 1)
    values = rows * 4096
    assert round(values / 1e9, 2) == 1.21 and preflight.pinned_size(values) == 2**31
    assert preflight.buffer_bytes(cfg, 4096) == 2 * (values + rows * 4)
    assert preflight.buffer_bytes(cfg, 4096, pinned=True) == 2 * (2**31 + preflight.pinned_size(rows * 4))
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:    4000000 kB\n")  # 4.1 GB: the pageable sum fits, pinned not
    assert preflight.check_host_memory(cfg, 4096, 1, meminfo, pinned=False) < 4000000 * 1024
    with pytest.raises(ValueError, match="pinned: each rounded up to a power of two"):
        preflight.check_host_memory(cfg, 4096, 1, meminfo, pinned=True)


def test_a_writer_error_keeps_the_timing_files_of_the_shards_written_before_it(tmp_path):
    """Risk 3 from the driver's side (draftline.extract.writer.on_rank0): the shards written
    before the failing one keep their timing files, and the error names the failing shard."""
    from draftline.extract import shards
    from draftline.pipeline.progress import Progress

    def write(path, tensors, metadata):
        if path.endswith("00002.safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device")
        formats.write_shard(Path(path), tensors, metadata)

    samples = [[5 + i] * 6 for i in range(6)]
    plans = shards.plan_shards([6] * 6, 12)
    rank0 = InProcess(capture.ShardWriter(24, SLOTS, HIDDEN, "bfloat16", torch.device("cpu"), write, 2))
    metadata = formats.shard_metadata("fp", [1, 2], HIDDEN)
    with pytest.raises(capture.ShardWriteError, match="shard-00002.safetensors: writing it failed"):
        extract_writer.on_rank0(rank0, plans, ShardJob(samples, [[1] * 6] * 6, tmp_path, metadata, 12, "bfloat16"),
                                Progress("extract", 36, unit="tok"), extract_writer.TimeSplit())
    written = sorted(p.name for p in tmp_path.glob("shard-*.safetensors"))
    assert written == ["shard-00000.safetensors", "shard-00001.safetensors"]
    for name in written:
        timing = json.loads(shards.timing_path(tmp_path / name).read_text())
        assert timing["write_seconds"] >= 0
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


class InProcess:
    """The generator's rank-0 calls answered by a ShardWriter in this process: the engine's
    forwards stand replaced by random rows (the real engine: tests/test_extraction.py)."""

    executor = None

    def __init__(self, writer: capture.ShardWriter):
        self.writer, self.count = writer, 0

    def begin_shard(self, layout):
        return self.writer.begin(layout)

    def generate(self, prompts, offsets):
        ids = [f"r{self.count + i}" for i in range(len(prompts))]
        self.count += len(prompts)
        self.writer.place({r: (o, len(p)) for r, o, p in zip(ids, offsets, prompts)})
        step(self.writer, [(r, 0, len(p)) for r, p in zip(ids, prompts)], "bfloat16")
        return [{"num_rows": n} for n in self.writer.take(ids).values()]

    def finish_shard(self):
        return self.writer.finish()

    def flush_shards(self):
        return self.writer.flush()
