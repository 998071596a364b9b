"""A failing TP rank ends the run (patches/vllm/0004): TP=2 on the CPU engine, with a fault
injected into rank 1 through tests/faults/sitecustomize.py (installed files are never edited).

Without the patch, rank 1 logs its traceback and loops on while rank 0 waits for it in the
forward pass's all-reduce and the driver waits for rank 0: the stage hangs (these tests then
fail at their subprocess timeout)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftline import engine, formats
from draftline.pipeline import artifacts

from conftest import REPO

pytestmark = pytest.mark.vllm

FAULTS = Path(__file__).resolve().parent / "faults"
CAPTURE = "speculators.data_generation.custom_worker:HiddenStatesWorkerExtension._capture_step"
EXECUTE = "vllm.v1.worker.cpu_worker:CPUWorker.execute_model"
BOUND_S = 60  # from the fault to the process's exit: worker monitor + executor shutdown


def fault_env(method: str, stamp: Path, after: int = 0) -> dict:
    env = {key: value for key, value in os.environ.items() if key != engine.THREADS_BIND}
    return {**env, "PYTHONPATH": os.pathsep.join([str(FAULTS), str(REPO)]),
            "DRAFTLINE_FAULT": method, "DRAFTLINE_FAULT_RANK": "1",
            "DRAFTLINE_FAULT_AFTER": str(after), "DRAFTLINE_FAULT_STAMP": str(stamp),
            "HYDRA_FULL_ERROR": "1", "PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def run_until_exit(command: list[str], env: dict, stamp: Path) -> tuple[subprocess.CompletedProcess, float]:
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    ended = time.time()
    if not stamp.exists():
        raise AssertionError(f"the fault never fired (exit {result.returncode}):\n{result.stderr[-5000:]}")
    return result, ended - float(stamp.read_text())


def _regenerated(run_dir: Path) -> Path:
    """A run dir whose regenerate stage is done: eight samples of 48 tokens."""
    regenerate_dir = run_dir / "regenerate"
    lengths = [48] * 8
    ids = [[7 + (i * 5 + j) % 400 for j in range(n)] for i, n in enumerate(lengths)]
    formats.write_samples(regenerate_dir / "samples.safetensors", ids, [[1] * n for n in lengths])
    artifacts.write_manifest(regenerate_dir, {"replies": "data"}, samples="samples.safetensors")
    return run_dir


@pytest.mark.long  # a TP=2 engine, 40-80 s; the default tier keeps its 15 minutes
def test_a_failing_tp_rank_ends_extraction(tmp_path, model_dir):
    run_dir = _regenerated(tmp_path / "run")
    stamp = tmp_path / "fault-time"
    result, seconds = run_until_exit(
        [sys.executable, "-m", "stages.extract", "experiment=tiny", f"run_dir={run_dir}",
         f"model.path={model_dir}", "model.tensor_parallel_size=2"],
        fault_env(CAPTURE, stamp), stamp)
    output = result.stdout + result.stderr
    print(f"extract: exit {result.returncode} {seconds:.1f} s after the fault; its error:\n"
          + "\n".join(line for line in output.splitlines() if line.startswith("RuntimeError")))
    assert result.returncode != 0
    assert seconds < BOUND_S
    assert "InjectedFault: injected fault in " + CAPTURE + " on TP rank 1" in output
    assert "died unexpectedly" in output
    assert "Worker proc VllmWorker-1 died unexpectedly" in output
    # The stage's last error names the cause (workers' buffered lines may follow it).
    errors = [line for line in output.splitlines() if line.startswith("RuntimeError: ")]
    assert errors[-1] == (
        "RuntimeError: vLLM's engine was shut down because one of its worker processes died: the "
        "log above names it (\"Worker proc ... died unexpectedly\") and holds its traceback "
        "(\"WorkerProc hit an exception\")")
    assert not (run_dir / "extract" / artifacts.MANIFEST).exists()


@pytest.mark.long  # the default tier keeps the extraction case; CI runs this
def test_a_hanging_tp_rank_ends_extraction_within_the_rank_timeout(tmp_path, model_dir):
    """Rank 1 sleeps in its first capture step without raising: rank 0 waits for it in the
    all-reduce, and only the driver's timeout on the capture call (patches/speculators/0007,
    extract.rank_timeout_s) ends the stage, naming the key."""
    run_dir = _regenerated(tmp_path / "run")
    stamp = tmp_path / "fault-time"
    timeout = 20
    result, seconds = run_until_exit(
        [sys.executable, "-m", "stages.extract", "experiment=tiny", f"run_dir={run_dir}",
         f"model.path={model_dir}", "model.tensor_parallel_size=2",
         f"extract.rank_timeout_s={timeout}"],
        {**fault_env(CAPTURE, stamp), "DRAFTLINE_FAULT_MODE": "hang"}, stamp)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("RuntimeError: ")]
    print(f"extract: exit {result.returncode} {seconds:.1f} s after the hang began; last error:\n"
          + (errors[-1] if errors else output[-3000:]))
    assert result.returncode != 0
    assert "injected hang in " + CAPTURE + " on TP rank 1" in output
    assert "TimeoutError: RPC call to _capture_step timed out." in output
    assert errors and errors[-1].startswith(
        f"RuntimeError: the TP ranks did not answer one capture step within "
        f"extract.rank_timeout_s={timeout} s")
    assert timeout <= seconds < timeout + BOUND_S
    assert not (run_dir / "extract" / artifacts.MANIFEST).exists()


@pytest.mark.long  # the default tier keeps the extraction case; CI runs this
def test_a_failing_tp_rank_ends_speculative_decoding(tmp_path, model_dir):
    from test_serving import _save_draft

    draft = _save_draft(model_dir, [1, 2, 3], tmp_path / "draft")
    options = engine.EngineOptions(target=str(model_dir), dtype="float32", max_model_len=256,
                                   tensor_parallel_size=2, max_num_seqs=2, cpu_threads_bind="0|1"
                                   if len(os.sched_getaffinity(0)) >= 2 else None)
    stamp = tmp_path / "fault-time"
    request = tmp_path / "request.json"
    import dataclasses
    import json

    request.write_text(json.dumps({
        "draft": str(draft), "k": 3, "prompts": [[0, 4, 60, 70, 80, 6, 5]], "max_tokens": [32],
        "stop_ids": [1], "options": dataclasses.asdict(options)}))
    env = {**fault_env(EXECUTE, stamp, after=20), **options.environment()}
    result, seconds = run_until_exit(
        [sys.executable, "-m", "draftline.speculative.jobs", "measure-replies", str(request),
         str(tmp_path / "out.json")], env, stamp)
    output = result.stdout + result.stderr
    print(f"speculative decoding: exit {result.returncode} {seconds:.1f} s after the fault; "
          "last lines:\n" + "\n".join(result.stderr.splitlines()[-12:]))
    assert result.returncode != 0
    assert seconds < BOUND_S
    assert "InjectedFault: injected fault in " + EXECUTE + " on TP rank 1" in output
    # The engine core's executor call is cancelled when the worker dies: the engine core
    # stops with a fatal error and the caller gets vLLM's EngineDeadError.
    assert "EngineCore encountered a fatal error" in output
    assert "vllm.v1.engine.exceptions.EngineDeadError" in result.stderr
    assert not (tmp_path / "out.json").exists()
