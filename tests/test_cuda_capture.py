"""Rank 0's shard writer on CUDA tensors (patches/speculators/0008): what `make selftest` runs
on a GPU host before the flagship's extraction, and what a CPU cannot show (pinned buffers,
the copy stream, events, a writer thread waiting on them).

The worker's own functions run on CUDA rows as vLLM's executor would call them (hooks, then
_distribute_step, _take_captured, _finish_shard; benchmarks/capture.py's harness, which needs
no vLLM). Steps mix requests out of shard order and split one request across steps, as
chunked prefill does. The shard must be byte for byte the one the driver's path writes from
the same rows (draftline.formats.pack_shard + write_shard), in bf16 and fp8; a NaN must stop
the shard unwritten, naming the same (token, slot, value) as formats' own check.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from conftest import require_cuda

pytestmark = pytest.mark.gpu
HIDDEN, SLOTS = 7168, 4  # Kimi-K2.5's width: 3 aux slots + the final one
# (request, tokens) per step; r1 is prefilled in two chunks, r2 comes before r0 in a step.
STEPS = [{"r1": 300, "r2": 200}, {"r1": 212, "r0": 100, "r3": 50}]
LENGTHS = {"r0": 100, "r1": 512, "r2": 200, "r3": 50}  # shard order: r0, r1, r2, r3


def _rows(seed: int) -> dict[str, torch.Tensor]:
    """Each request's forward rows per slot, bf16 on the GPU: [length, slots, hidden]."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return {r: torch.randn(n, SLOTS, HIDDEN, generator=generator, device="cuda").bfloat16() * 8
            for r, n in LENGTHS.items()}


def _rank0_shard(storage: str, rows: dict, path: Path) -> dict:
    """The worker's functions on CUDA: open, place, two steps, finish, flush."""
    from benchmarks import capture
    from draftline import formats
    from draftline.extract import writer

    worker = capture.Worker(capture.worker_module(), SLOTS, HIDDEN, torch.device("cuda"), storage)
    worker.ext._open_shard_writer(2048, writer.WRITER, 2)
    order = list(LENGTHS)
    tensors = formats.shard_rows(range(4), {i: list(range(LENGTHS[r])) for i, r in enumerate(order)},
                                 {i: [1] * LENGTHS[r] for i, r in enumerate(order)})
    offsets = tensors[formats.SAMPLE_OFFSETS].tolist()
    worker.ext._begin_shard({"path": str(path), "num_tokens": offsets[-1], "tensors": tensors,
                             "metadata": {"fingerprint": "gpu test"},
                             "values_key": formats.HIDDEN_STATES, "scales_key": formats.HIDDEN_SCALES})
    worker.ext._place_requests({r: (offsets[i], LENGTHS[r]) for i, r in enumerate(order)})
    done = {r: 0 for r in order}
    for step in STEPS:
        parts = [torch.cat([rows[r][done[r]:done[r] + n, slot] for r, n in step.items()])
                 for slot in range(SLOTS)]
        positions = torch.cat([torch.arange(done[r], done[r] + n, device="cuda")
                               for r, n in step.items()])
        worker.step(parts, positions, step)
        for r, n in step.items():
            done[r] += n
    assert worker.ext._take_captured(order) == LENGTHS
    status = worker.ext._finish_shard()
    if status["non_finite"] is None:
        status["written"] += worker.ext._flush_shards()["written"]
    return status


def _driver_shard(storage: str, rows: dict, path: Path) -> None:
    """The same rows through the driver's path: cast in the worker, packed and written here."""
    from draftline import formats

    order = list(LENGTHS)
    results = {}
    for i, r in enumerate(order):
        host = rows[r].float().cpu()  # [T, slots, H]
        if storage == "float8_e4m3fn":
            values, scales = formats.quantize_fp8(rows[r])  # the worker quantizes on its device
            result = {"hidden_states": list(values.cpu().unbind(1)),
                      "hidden_states_scales": list(scales.cpu().unbind(1))}
        else:
            result = {"hidden_states": list(host.bfloat16().unbind(1))}
        results[i] = {**result, "input_ids": torch.arange(LENGTHS[r])}
    tensors = formats.pack_shard(range(4), results, {i: [1] * LENGTHS[r] for i, r in enumerate(order)},
                                 storage, name=str(path))
    formats.write_shard(path, tensors, {"fingerprint": "gpu test"})


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_shard_writer_on_cuda(storage, tmp_path):
    require_cuda()
    rows = _rows(0)
    status = _rank0_shard(storage, rows, tmp_path / "rank0.safetensors")
    assert status["non_finite"] is None and [w["path"] for w in status["written"]] == [
        str(tmp_path / "rank0.safetensors")]
    _driver_shard(storage, rows, tmp_path / "driver.safetensors")
    digest = {name: hashlib.sha256((tmp_path / f"{name}.safetensors").read_bytes()).hexdigest()
              for name in ("rank0", "driver")}
    assert digest["rank0"] == digest["driver"], digest


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_shard_writer_on_cuda_never_writes_nan(storage, tmp_path):
    from draftline import formats

    require_cuda()
    rows = _rows(1)
    rows["r2"][150, 2, 9] = float("nan")  # shard row 612 + 150, slot 2
    status = _rank0_shard(storage, rows, tmp_path / "rank0.safetensors")
    assert not (tmp_path / "rank0.safetensors").exists() and status["written"] == []
    with pytest.raises(formats.NonFiniteHiddenStates) as driver:
        _driver_shard(storage, rows, tmp_path / "driver.safetensors")
    token, slot, value = status["non_finite"]
    assert (token, slot) == (612 + 150, 2)
    found = formats.non_finite_error(str(tmp_path / "driver.safetensors"), range(4),
                                     [0, 100, 612, 812, 862], token, slot, value)
    assert str(found) == str(driver.value)


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_buffers_rotate_on_cuda_with_more_shards_than_buffers(storage, tmp_path):
    """draftline issue 44: five shards through two pinned buffers (each begin waits for that
    buffer's last write), each shard filled in two steps on the copy stream; every file holds
    exactly the rows its steps handed over (the same tensors written directly), and a request
    restarted after a NaN leaves its recomputed shard written."""
    from draftline import formats
    from draftline.extract import capture

    require_cuda()
    writer = capture.ShardWriter(512, SLOTS, HIDDEN, storage, torch.device("cuda"), formats.write_shard, 2)
    generator = torch.Generator(device="cuda").manual_seed(5)
    expected = {}
    for index in range(5):
        rows = torch.randn(300, SLOTS, HIDDEN, generator=generator, device="cuda").bfloat16() * 8
        parts = formats.quantize_fp8(rows) if formats.is_quantized(storage) else (rows,)
        tensors = formats.shard_rows([0], {0: list(range(300))}, {0: [1] * 300})
        path = tmp_path / f"shard-{index:05d}.safetensors"
        writer.begin({"path": str(path), "num_tokens": 300, "tensors": tensors, "metadata": {},
                      "values_key": formats.HIDDEN_STATES, "scales_key": formats.HIDDEN_SCALES})
        writer.place({"r": (0, 300)})
        if index == 3:  # a first attempt with a NaN, then vLLM's restart from position 0
            poisoned = tuple(p[:100].clone() for p in parts)
            poisoned[-1][7].fill_(float("nan"))
            writer.copy_step(["r"], [100], torch.arange(100), poisoned)
        writer.copy_step(["r"], [200], torch.arange(200), tuple(p[:200] for p in parts))
        writer.copy_step(["r"], [100], torch.arange(200, 300), tuple(p[200:] for p in parts))
        assert writer.finish()["non_finite"] is None
        reference = tmp_path / f"reference-{index}.safetensors"
        formats.write_shard(reference, {**tensors, formats.HIDDEN_STATES: parts[0].cpu(),
                                        **({formats.HIDDEN_SCALES: parts[1].cpu()} if len(parts) > 1 else {})}, {})
        expected[path] = hashlib.sha256(reference.read_bytes()).hexdigest()
    writer.flush()
    got = {path: hashlib.sha256(path.read_bytes()).hexdigest() for path in expected}
    assert got == expected
