"""The whole pipeline through Make, in a copy of the repository, on a small embedded run.

Default tier: a full `make all`, a no-op rerun, a train-only change, edited modules (only the
stages that import them go stale; `make accept`), `make reproduce` refusing another lock or
patch queue. The `slow` tier adds the extract-key change, a touched tokenize input, a `kill -9`
of extract followed by a resume that must give byte-identical shards, and a full `make
reproduce` of the run.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, copy_repo
from helpers import run_make

pytestmark = pytest.mark.vllm

STAGES = ("tokenize", "regenerate", "extract", "prepare", "train")
# Small enough for a few minutes on 2 cores: ~25 conversations, a handful of train steps.
BASE = "data.max_bytes=20000 extract.shard_tokens=1024 extract.token_budget=1024 train.steps=4 train.checkpoint_every=2"


def make(repo: Path, *targets: str, extra: str = "") -> tuple[list[str], str]:
    """Run make; return the stages whose commands ran, and the output."""
    result = run_make(*targets, f"VENV={sys.prefix}", "EXP=tiny", f"OVERRIDES={BASE} {extra}".strip(),
                      cwd=repo, expect=0)
    output = result.stdout + result.stderr
    ran = [s for s in STAGES if f"-m stages.{s} " in output]
    return ran, output


def status_lines(output: str) -> dict[str, str]:
    """`make status` output -> {stage: what it said}."""
    lines = [line.strip().split(": ", 1) for line in output.splitlines() if ": " in line]
    return {stage: said for stage, said in lines if stage in (*STAGES, "evaluate")}


def shard_hashes(repo: Path) -> dict[str, str]:
    manifest = json.loads((repo / "runs/tiny/extract/manifest.json").read_text())
    return {s["file"]: s["sha256"] for s in manifest["shards"]}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = copy_repo(tmp_path_factory.mktemp("pipeline"))
    ran, _ = make(repo, "all")
    assert ran == list(STAGES)
    return repo


def test_every_stage_leaves_a_manifest_with_provenance(repo):
    for stage in STAGES:
        manifest = json.loads((repo / f"runs/tiny/{stage}/manifest.json").read_text())
        provenance = manifest["provenance"]
        assert provenance["config_sha256"] and provenance["versions"]["speculators"] == "0.3.0"
        assert [p["name"] for p in provenance["patches"]] == sorted(
            p.name for p in (REPO / "patches" / "speculators").glob("*.diff"))
        assert [p["name"] for p in provenance["vllm_patches"]] == sorted(
            p.name for p in (REPO / "patches" / "vllm").glob("*.diff"))
    # vLLM is installed here, so the saved draft's vLLM parse ran and nothing was skipped.
    train = json.loads((repo / "runs/tiny/train/manifest.json").read_text())
    assert train["skipped"] == [] and train["metrics"]["vllm"]["architectures"] == ["Eagle3LlamaForCausalLM"]
    extract = json.loads((repo / "runs/tiny/extract/manifest.json").read_text())
    assert extract["num_tokens"] == sum(s["tokens"] for s in extract["shards"])
    assert all(s["seconds"] > 0 and s["finished_unix"] > 0 for s in extract["shards"])


def test_the_rehearsal_cost_is_within_1pct_of_the_shards_extract_wrote(repo):
    """The cost line `make rehearse` prints, from tokenize's token count alone, against the
    bytes this run's real extraction of the same samples put on disk."""
    from draftline.pipeline import config
    from draftline.rehearse import cost

    cfg = config.compose(config.experiment_overrides("tiny", BASE.split()))
    cfg.model.path, cfg.run_dir = str(repo / cfg.model.path), str(repo / "runs/tiny")
    tokenized = json.loads((repo / "runs/tiny/tokenize/manifest.json").read_text())
    extracted = json.loads((repo / "runs/tiny/extract/manifest.json").read_text())
    estimate = cost.run_cost(cfg, tokenized)
    written = sum(s["bytes"] for s in extracted["shards"])
    assert extracted["num_tokens"] == tokenized["num_tokens"]  # replies=data: the same samples
    assert abs(estimate.total_bytes - written) <= 0.01 * written, (estimate.total_bytes, written)
    assert estimate.present_bytes == written and estimate.needed_bytes == 0  # a rerun resumes


def test_second_run_is_a_no_op(repo):
    start = time.monotonic()
    ran, _ = make(repo, "all")
    print(f"\nno-op make all: {time.monotonic() - start:.2f} s")
    assert ran == []


def test_train_key_reruns_only_train(repo):
    base_lr = json.loads((repo / "runs/tiny/train/config.json").read_text())["train"]["lr"]
    ran, _ = make(repo, "all", extra="train.lr=1e-3")
    assert ran == ["train"]
    _, output = make(repo, "status", extra="train.lr=1e-3")
    assert status_lines(output) == {**{s: "up to date" for s in STAGES},
                                    "evaluate": "STALE - never run (no manifest)"}
    _, output = make(repo, "status")  # the base config again: train is stale, and says why
    lines = status_lines(output)
    assert lines["train"] == f"STALE - config train.lr: 0.001 -> {json.dumps(base_lr)}"
    assert lines["prepare"] == "up to date"
    ran, _ = make(repo, "all")
    assert ran == ["train"]


@pytest.mark.slow
def test_extract_key_reruns_extract_prepare_train(repo):
    ran, _ = make(repo, "all", extra="extract.save_dtype=float32")
    assert ran == ["extract", "prepare", "train"]
    make(repo, "all")


@pytest.mark.slow
def test_touched_tokenize_input_reruns_everything(repo):
    (repo / "runs/_assets/conversations.jsonl").touch()
    ran, _ = make(repo, "all")
    assert ran == list(STAGES)


@pytest.mark.slow
def test_killed_extract_resumes_to_identical_shards(repo):
    make(repo, "extract")
    reference = shard_hashes(repo)
    assert len(reference) >= 3
    extract_dir = repo / "runs/tiny/extract"
    for path in extract_dir.glob("shard-*.safetensors"):
        path.unlink()
    (extract_dir / "manifest.json").unlink()

    command = [sys.executable, "-m", "stages.extract", "experiment=tiny", *BASE.split()]
    process = subprocess.Popen(command, cwd=repo, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while len(list(extract_dir.glob("shard-*.safetensors"))) < 2:
        assert process.poll() is None and time.monotonic() < deadline, "extract ended early"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)  # the stage and its vLLM workers
    process.wait()
    survivors = len(list(extract_dir.glob("shard-*.safetensors")))
    assert not (extract_dir / "manifest.json").exists()

    ran, output = make(repo, "extract")
    assert ran == ["extract"]
    resumed = json.loads((extract_dir / "manifest.json").read_text())["resumed_shards"]
    print(f"\nkilled with {survivors} shards on disk; resumed {resumed}")
    assert resumed >= 2
    assert shard_hashes(repo) == reference


# evaluate on the tiny run: the vLLM load check has its own test (test_evaluation), so it is off
# here; vLLM decodes two held-out replies.
# Four training steps: the draft is not expected to beat token counts, so the baseline gate is off
# here, with its reason (the floor file is what these tests hold the stage to).
EVALUATE = ("evaluate.vllm.max_replies=2 evaluate.vllm_check=false evaluate.bootstrap=200 "
            "evaluate.baseline_gate.enabled=false evaluate.baseline_gate.off_because=four_steps")


def evaluate_with_gate(repo: Path, gate: Path) -> subprocess.CompletedProcess:
    """The evaluate stage run directly (no vLLM decoding) against this gate file."""
    return subprocess.run([sys.executable, "-m", "stages.evaluate", "experiment=tiny", *BASE.split(),
                           *EVALUATE.split(), "evaluate.vllm.enabled=false", f"evaluate.gate={gate}"],
                          cwd=repo, capture_output=True, text=True)


def test_evaluate_runs_on_the_tiny_run_and_its_gate_fails_it(repo, tmp_path):
    _, output = make(repo, "evaluate", extra=EVALUATE)
    assert "-m stages.evaluate " in output
    manifest = json.loads((repo / "runs/tiny/evaluate/manifest.json").read_text())
    results = json.loads((repo / "runs/tiny/evaluate/results.json").read_text())
    prepared = json.loads((repo / "runs/tiny/prepare/manifest.json").read_text())
    k = manifest["k"]
    assert k == 3 and manifest["aux_layer_ids"] == [2, 3, 4]
    assert results["held_out_samples"] == prepared["num_validation"] > 0
    assert set(results["offline"]) == {"eagle3", "bigram", "most_frequent"}
    for name, result in results["offline"].items():
        assert 1.0 <= result["tau_ci"][0] <= result["tau"] <= result["tau_ci"][1] <= k + 1, name
        assert result["samples"] == prepared["num_validation"] and result["steps"] > 0, name
    assert 0.0 < results["draft_vocab_coverage_of_greedy"] <= 1.0
    measured = results["in_vllm"]
    assert 1 <= measured["replies"] <= 2 and not measured["on_target_text"]  # EXP=tiny keeps the data's replies
    assert measured["counters"]["drafts"] > 0
    assert not manifest["gate"]["checked"] and manifest["gate"]["passed"]
    assert manifest["gate"]["floor"] == {"checked": False, "file": "tests/assets/tau_gate.json"}
    assert manifest["gate"]["baseline"]["off_because"] == "four_steps"
    assert results["versus_best_baseline"]["baseline"] in {"bigram", "most_frequent"}
    assert {s["what"] for s in manifest["skipped"]} == {"vLLM load check"}
    assert set(manifest["inputs"]) == {"train", "extract", "prepare", "regenerate"}

    # A floor above anything reachable: the stage exits non-zero, keeps results.json, no manifest.
    gate = tmp_path / "gate.json"
    gate.write_text(json.dumps({"tiny": {"k": k, "tau_min": k + 1.5}}))
    result = evaluate_with_gate(repo, gate)
    output = result.stdout + result.stderr
    # The gate's verdict is the user's to act on: two lines on screen, the traceback in the log.
    assert result.returncode == 2 and "below the floor" in result.stderr and "Traceback" not in output
    assert result.stderr.splitlines()[-1] == ("hint: every number and the verdict are in "
                                              "runs/tiny/evaluate/results.json; the traceback is in "
                                              "runs/tiny/logs/evaluate.log")
    assert "GateFailed" in (repo / "runs/tiny/logs/evaluate.log").read_text()
    assert not (repo / "runs/tiny/evaluate/manifest.json").exists()
    assert (repo / "runs/tiny/evaluate/results.json").exists()
    gate.write_text(json.dumps({"tiny": {"k": k + 1, "tau_min": 1.0}}))
    result = evaluate_with_gate(repo, gate)
    assert result.returncode != 0 and f"floor was set for k={k + 1}" in result.stdout + result.stderr


# --------------------------------------------------------------------------- staleness


def _edit(path: Path, text: str) -> str:
    before = path.read_text()
    path.write_text(before + text)
    return before


def test_a_module_only_train_imports_reruns_only_train_and_accept_keeps_it(repo):
    module = repo / "draftline/train/checkpoint.py"
    before = _edit(module, "\n# an edit that changes no behaviour\n")
    _, output = make(repo, "status")
    assert "train: STALE - code draftline/train/checkpoint.py changed" in output
    lines = status_lines(output)
    assert [s for s in STAGES if lines[s] == "up to date"] == list(STAGES[:4]), output  # tokenize .. prepare
    assert "     setup: up to date" in output, output
    ran, _ = make(repo, "all")
    assert ran == ["train"]
    module.write_text(before)  # back to the recorded-before text: train differs again ...
    _, output = make(repo, "status")
    assert "train: STALE - code draftline/train/checkpoint.py changed" in output
    _, output = make(repo, "accept", "STAGE=train")  # ... and the user keeps its outputs
    assert "train: accepted code draftline/train/checkpoint.py changed" in output
    ran, output = make(repo, "all", "status")
    assert ran == [] and all(f"{stage}: up to date" in output for stage in STAGES), output
    accepted = json.loads((repo / "runs/tiny/train/manifest.json").read_text())["accepted"]
    assert accepted[-1]["differences"] == ["code draftline/train/checkpoint.py changed"]


def test_a_module_every_stage_imports_makes_every_stage_stale(repo):
    module = repo / "draftline/pipeline/artifacts.py"
    before = _edit(module, "\n# an edit that changes no behaviour\n")
    _, output = make(repo, "status")
    for stage in STAGES:
        assert f"{stage}: STALE - code draftline/pipeline/artifacts.py changed" in output
    module.write_text(before)  # same bytes as recorded: nothing is stale, whatever the mtime
    ran, output = make(repo, "all", "status")
    assert ran == [] and all(f"{stage}: up to date" in output for stage in STAGES), output


# --------------------------------------------------------------------------- make reproduce


def _reproduce(repo: Path, from_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftline.cli.reproduce", str(from_dir), *extra],
                          cwd=repo, capture_output=True, text=True)


def test_reproduce_refuses_another_lock_or_patch_queue(repo, tmp_path):
    copy = tmp_path / "elsewhere"
    shutil.copytree(repo / "runs/tiny", copy, ignore=shutil.ignore_patterns("*.safetensors"))
    for stage in STAGES:
        path = copy / stage / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["provenance"]["locks"]["cpu.lock"] = "0" * 64
        manifest["provenance"]["patches"][1]["sha256"] = "1" * 64
        path.write_text(json.dumps(manifest))
    result = _reproduce(repo, copy)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "refusing to reproduce: lock cpu.lock: 0000000000000000 ->" in result.stderr
    assert "speculators patches: 0001@" in result.stderr and "FORCE=1" in result.stderr
    assert "lock cpu.lock" in result.stdout and "DIFFERS" in result.stdout  # the table
    assert not (repo / "runs/tiny-reproduce").exists()


@pytest.mark.slow
def test_reproduce_replays_every_stage_to_identical_outputs(repo):
    start = time.monotonic()
    result = run_make("reproduce", f"VENV={sys.prefix}", "FROM=runs/tiny", cwd=repo)
    output = result.stdout + result.stderr
    print(output[-3000:], f"\nmake reproduce: {time.monotonic() - start:.0f} s")
    assert result.returncode == 0, output[-5000:]
    for stage in STAGES:
        assert f"\n  {stage} " in output and "differs" not in output.split("verdicts:")[1]
    assert (repo / "runs/tiny-reproduce/train/manifest.json").exists()
