"""`make status` only reads: after a patch edit it says that setup is stale, why, and which
stages would then rerun, and it builds nothing (no venv sync, no patch applied, no target
trained, no asset built), in seconds.

In a copy of the repository, on a partly finished run made by hand (manifests as test_status
writes them), with the test's own venv. UV=false: were status to start setup, it would fail
at once instead of re-syncing that venv.
"""

import hashlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from conftest import copy_repo
from helpers import run_make

from draftline.patchq.packages import RECORD_NAME
from draftline.pipeline import artifacts, config, deps

EXP = "tiny-trained"  # the case: setup and the trained target come before every stage
PATCH = "patches/vllm/0002-cpu-spec-decode.diff"
CODE = "draftline/pipeline/artifacts.py"
STATUS = ("status", f"EXP={EXP}", f"VENV={sys.prefix}", "UV=/bin/false")  # `make status`'s arguments


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stamps_and_state(repo: Path, path: Path) -> bool:
    """What status may write: the stage stamps and Make's own records under runs/<exp>/."""
    rel = path.relative_to(repo / "runs" / EXP).parts if path.is_relative_to(repo / "runs" / EXP) else ()
    return (len(rel) == 2 and rel[1] in (artifacts.STAMP, "deps.json")) or (len(rel) == 1 and rel[0].startswith("."))


def snapshot(repo: Path) -> dict[str, tuple[int, str]]:
    """mtime and sha256 of every file of the copy but those, and of the venv's setup stamp,
    patch records and patched files."""
    files = [p for p in repo.rglob("*") if p.is_file() and not stamps_and_state(repo, p)]
    site = Path(importlib.util.find_spec("vllm").origin).parents[1]
    for package in ("speculators", "vllm"):
        record = site / package / RECORD_NAME
        files += [record, *(site / f["path"] for f in json.loads(record.read_text())["files"])]
    files += [Path(sys.prefix) / ".setup-cpu"]
    return {str(p): (p.stat().st_mtime_ns, _sha(p)) for p in files}


def finish_by_hand(repo: Path, stages: tuple[str, ...]) -> None:
    """Manifests for ``stages`` as if they had run after the stamps: their config is the stamp,
    their record names CODE (and extract's vLLM and its queue), newer in pipeline order."""
    run, now = repo / "runs" / EXP, time.time_ns()
    for i, stage in enumerate(stages):
        record = {"code": {CODE: None}, "patches": {"vllm": None} if stage == "extract" else {}}
        manifest = run / stage / artifacts.MANIFEST
        artifacts.write_json(manifest, {"provenance": {"config": artifacts.read_json(run / stage / artifacts.STAMP),
                                                       "deps": deps.current(record)}})
        os.utime(manifest, ns=(now + i * 10**9, now + i * 10**9))


def test_status_after_a_patch_edit_says_setup_is_stale_and_builds_nothing(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    first = run_make(*STATUS, cwd=repo, expect=0)  # writes the stamps, and says the target and the data are missing
    assert "    target: STALE - runs/_assets/tiny-trained/build.json is missing" in first.stdout
    assert "    assets: runs/_assets/conversations.jsonl is missing" in first.stdout
    finish_by_hand(repo, ("tokenize", "regenerate", "extract", "prepare"))
    patch = repo / PATCH
    patch.write_text("# a comment added to the header\n" + patch.read_text())
    before = snapshot(repo)

    start = time.monotonic()
    result = run_make(*STATUS, cwd=repo, expect=0)
    seconds = time.monotonic() - start
    said = result.stdout.splitlines()
    print("\n".join(["", f"make status EXP={EXP} after a patch edit: {seconds:.1f} s", *said]))
    assert seconds < 30  # a venv sync alone takes a minute here, the target's training minutes
    assert said[0] == (f"     setup: STALE - {PATCH} changed: `make setup`, which every stage target runs "
                       f"first, would re-sync the venv from requirements/cpu.lock and re-apply both patch queues")
    # Every stage target trains the target again after setup, whose stamp it depends on, and
    # builds the data: the stages that read them rerun too.
    assert said[1].startswith("    target: STALE - runs/_assets/tiny-trained/build.json is missing")
    assert said[2].startswith("    assets: runs/_assets/conversations.jsonl is missing")
    stages = {line.split(":")[0].strip(): line.split(": ", 1)[1] for line in said if ": " in line}
    target, data = ("after `make target`: runs/_assets/tiny-trained is rebuilt",
                    "after `make`: runs/_assets/conversations.jsonl is built")
    assert stages["tokenize"] == f"STALE - {target}; {data}"
    assert stages["regenerate"] == f"STALE - {target}"
    assert stages["extract"] == f"STALE - after `make setup`: vllm patch 0002-cpu-spec-decode.diff changed; {target}"
    assert stages["prepare"] == "STALE - an upstream stage is stale"
    assert stages["train"] == "STALE - never run (no manifest)"
    assert stages["next"] == f"make tokenize EXP={EXP}"
    # Nothing written but the stamps and Make's records: no venv sync, no patch applied, no
    # target trained, no asset built.
    assert snapshot(repo) == before
    assert not (repo / "runs/_assets").exists()
    assert {p.name for p in (repo / "runs" / EXP / "tokenize").iterdir()} == {
        artifacts.STAMP, "deps.json", artifacts.MANIFEST}
    assert set(config.STAGES) <= {p.name for p in (repo / "runs" / EXP).iterdir()}
