"""Scaling out on CPU: the train stage under torchrun (gloo, two processes), a rank killed
mid-run, resume on another world size; extraction replicas and slices (SHARD=i/N) against
one replica's shards; the deploy manifests against the Makefile.

The torchrun runs go through the stage entry point exactly as `make train GPUS=2` does
(``train.gpus=2``: the stage re-launches itself under torchrun), on a run directory whose
upstream manifests point at shards of real hidden states of a tiny random Llama.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from draftline import launch, tiny
from test_training import AUX_IDS, FULL_TRAIN, NUM_LAYERS, SHARD_LENGTHS, VALIDATION
from test_training import write_shards, write_split_index, write_vocab_mapping

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT = 240  # seconds for one stage run (imports dominate on a busy 2-core box)


# --------------------------------------------------------------------------- train


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict:
    """A run directory as prepare leaves it: shards, split index, vocab, manifests."""
    root = tmp_path_factory.mktemp("scale")
    verifier = tiny.build_tiny_llama(root / "verifier", num_layers=NUM_LAYERS)
    (root / "run" / "extract").mkdir(parents=True)
    shards = write_shards(root / "run" / "extract", verifier, SHARD_LENGTHS)
    prepare_dir = root / "run" / "prepare"
    prepare_dir.mkdir(parents=True)
    write_split_index(prepare_dir / "index.safetensors", FULL_TRAIN, VALIDATION)
    regenerate_dir = root / "run" / "regenerate"
    regenerate_dir.mkdir(parents=True)
    write_vocab_mapping(regenerate_dir / "vocab.safetensors")
    manifests = {
        "regenerate": {"vocab": "vocab.safetensors"},
        "extract": {"aux_layer_ids": AUX_IDS},
        "prepare": {"shards": [str(p) for p in shards], "index": "index.safetensors"},
    }
    for stage, manifest in manifests.items():
        (root / "run" / stage / "manifest.json").write_text(json.dumps(manifest))
    return {"run_dir": root / "run", "verifier": verifier}


def train_command(prepared: dict, *overrides: str, run_dir: Path | None = None) -> list[str]:
    return [sys.executable, "-m", "stages.train", "experiment=tiny",
            f"run_dir={run_dir or prepared['run_dir']}", f"model.path={prepared['verifier']}",
            "train.device=cpu", "train.max_tokens_per_step=512", "train.lr=1e-3",
            "train.collective_timeout_s=60", *overrides]


def stage_env() -> dict:
    return {**os.environ, "HYDRA_FULL_ERROR": "1", "PYTHONUNBUFFERED": "1"}


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def rank_pid(root_pid: int, rank: int) -> int:
    """The worker process with RANK=rank below ``root_pid`` (stage -> torchrun -> workers)."""
    pending = children(root_pid)
    while pending:
        pid = pending.pop()
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if f"RANK={rank}".encode() in environ and f"LOCAL_RANK={rank}".encode() in environ:
            return pid
        pending += children(pid)
    raise LookupError(f"no rank {rank} below {root_pid}")


def run_until_step(command: list[str], step: int) -> tuple[subprocess.Popen, list[str]]:
    """Start the stage; return once rank 0 logged ``step``."""
    process = subprocess.Popen(command, cwd=REPO, env=stage_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines, deadline = [], time.monotonic() + LAUNCH_TIMEOUT
    for line in process.stdout:
        lines.append(line)
        if re.search(rf"\] - step {step}/", line):
            return process, lines
        if time.monotonic() > deadline:
            break
    process.kill()
    raise AssertionError("the run never reached step %d:\n%s" % (step, "".join(lines)))


def finish(process: subprocess.Popen, lines: list[str]) -> str:
    """The rest of the output; fails if the run is still going after LAUNCH_TIMEOUT."""
    try:
        rest, _ = process.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError("the run hung after a rank was killed")
    return "".join(lines) + rest


def test_torchrun_command_turns_nvlink_multicast_off_and_names_the_rendezvous():
    command = launch.torchrun_command("stages.train", ["experiment=x"], 8, nodes=2,
                                      rendezvous="head:29500", run_id="job")
    assert command[command.index("--rdzv-endpoint") + 1] == "head:29500"
    assert command[command.index("--nnodes") + 1] == "2"
    assert command[-3:] == ["-m", "stages.train", "experiment=x"]
    assert "--standalone" in launch.torchrun_command("stages.train", [], 2)
    with pytest.raises(ValueError, match="rendezvous"):
        launch.torchrun_command("stages.train", [], 8, nodes=2)
    assert launch.NO_MULTICAST["NCCL_NVLS_ENABLE"] == "0"


def test_killed_rank_ends_the_run_with_its_traceback_and_resumes_on_one_process(prepared):
    """torchrun (gloo, 2 processes): SIGINT to rank 1 mid-run -> its KeyboardInterrupt
    traceback, non-zero exit, no manifest; then one process resumes the checkpoint rank 0
    wrote and finishes with a manifest."""
    manifest = prepared["run_dir"] / "train" / "manifest.json"
    command = train_command(prepared, "train.gpus=2", "train.steps=30",
                            "train.checkpoint_every=2")
    process, lines = run_until_step(command, 3)
    os.kill(rank_pid(process.pid, 1), signal.SIGINT)
    output = finish(process, lines)
    assert process.returncode != 0, output
    rank1 = "\n".join(line for line in output.splitlines() if line.startswith("[default1]:"))
    assert "Traceback" in rank1 and "KeyboardInterrupt" in rank1, output
    assert "train rank 1 of 2 failed" in rank1, output
    assert not manifest.exists()

    resumed = subprocess.run(train_command(prepared, "train.gpus=1", "train.steps=30",
                                           "train.checkpoint_every=2"),
                             cwd=REPO, env=stage_env(), capture_output=True, text=True,
                             timeout=LAUNCH_TIMEOUT)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    metrics = json.loads(manifest.read_text())["metrics"]
    assert metrics["world_size"] == 1 and metrics["completed"]
    assert metrics["resumed_from"] >= 2


def bench_record(world_size: int, ddp: bool, tokens_per_second: float) -> dict:
    """A --results record of one run, as far as print_ratios reads it."""
    return {"world_size": world_size, "ddp": ddp, "dims": {"hidden": 64},
            "runs": {"fp32 resident": {"tokens_per_second": tokens_per_second}}}


def test_benchmark_total_is_every_rank_over_the_slowest_and_ratio_is_against_the_baseline(
        capsys):
    from benchmarks.train import RunResult, combine, print_ratios

    fast = RunResult("bf16 disk", tokens=900, positions=1000, flops=5.0, seconds=1.0,
                     step_ms=[400.0, 600.0], peak_gib=10.0, loss=2.0, rank=0)
    slow = RunResult("bf16 disk", tokens=800, positions=1000, flops=5.0, seconds=2.0,
                     step_ms=[700.0, 500.0], peak_gib=12.0, loss=2.0, rank=1)
    total = combine([fast, slow])
    assert total.tokens_per_second == 850.0  # 1700 tokens over the slower rank's 2 s
    assert total.step_ms == [700.0, 600.0] and total.peak_gib == 12.0 and total.rank is None
    print_ratios(bench_record(2, True, 190.0), bench_record(1, False, 100.0))
    assert "2 / 1 process(es) (DDP / plain) tokens/s: 1.900x, scaling efficiency 95.0%" \
        in capsys.readouterr().out
    with pytest.raises(ValueError, match="other dimensions"):
        print_ratios(bench_record(2, True, 190.0), {**bench_record(1, False, 100.0),
                                                     "dims": {"hidden": 128}})


@pytest.mark.slow
def test_benchmark_runs_ddp_under_torchrun_with_gloo_each_rank_on_its_share(tmp_path):
    """python -m benchmarks.train --gpus 2 on CPU: the launcher's torchrun (gloo, NVLink
    multicast off), one DDP rank per process, each reading its own rows of the shards, a
    total and a ratio against a baseline record."""
    baseline = tmp_path / "one.json"
    baseline.write_text(json.dumps({
        "world_size": 1, "ddp": False,
        "dims": {"hidden": 64, "intermediate": 224, "heads": 1, "kv_heads": 1, "head_dim": 64,
                 "vocab": 512, "draft_vocab": 128, "layers": 1, "ttt": 3},
        "runs": {"fp32 resident": {"tokens_per_second": 1.0},
                 "fp32 disk": {"tokens_per_second": 1.0}}}))
    results = tmp_path / "two.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.train", "--device", "cpu", "--gpus", "2",
         "--hidden", "64", "--vocab", "512", "--draft-vocab", "128", "--tokens-per-step", "256",
         "--steps", "2", "--warmup", "1", "--disk-tokens", "2048", "--collective-timeout-s",
         "120", "--results", str(results), "--baseline", str(baseline)],
        cwd=REPO, env=stage_env(), capture_output=True, text=True, timeout=2 * LAUNCH_TIMEOUT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    record = json.loads(results.read_text())
    assert record["world_size"] == 2 and record["ddp"], record
    assert record["env"] == launch.NO_MULTICAST
    for name, run in record["runs"].items():
        ranks = run["ranks"]
        assert len(ranks) == 2, name
        assert run["tokens"] == sum(r["tokens"] for r in ranks) > 0
        assert f"{name} r1" in output
        # Baseline of 1 tok/s: the printed ratio is the total itself.
        assert f"{name}: 2 / 1 process(es) (DDP / plain) tokens/s: " \
               f"{run['tokens_per_second']:.3f}x" in output, output
    rows = [set(r["samples"]) for r in record["runs"]["fp32 disk"]["ranks"]]
    assert all(rows) and not rows[0] & rows[1], rows  # each rank its own share


@pytest.mark.slow
def test_sigkilled_rank_ends_the_run_without_a_manifest(prepared, tmp_path):
    """A rank that cannot print anything (SIGKILL): torchrun names it and ends the others."""
    command = train_command(prepared, "train.gpus=2", "train.steps=30",
                            run_dir=tmp_path / "run")
    for stage in ("regenerate", "extract", "prepare"):
        target = tmp_path / "run" / stage
        target.mkdir(parents=True)
        for path in (prepared["run_dir"] / stage).iterdir():
            (target / path.name).symlink_to(path)
    process, lines = run_until_step(command, 2)
    os.kill(rank_pid(process.pid, 1), signal.SIGKILL)
    output = finish(process, lines)
    assert process.returncode != 0, output
    assert "Signal 9 (SIGKILL)" in output and "local_rank: 1" in output, output
    assert not (tmp_path / "run" / "train" / "manifest.json").exists()
