"""A no-op `make all` starts no Python, and each thing the stamps depend on still makes Make
start the steps that read it and list exactly the stages that would rerun.

In a copy of the repository with the test's venv, on a run finished by hand (manifests newer
than the stamps, as test_make_status writes them). Python runs through a wrapper that logs
each start. The steps themselves are tested in test_when_changed.py, what reruns on a real
run in test_pipeline.py.
"""

import hashlib
import os
import re
import sys
import time
from pathlib import Path

import pytest
from conftest import copy_repo
from helpers import run_make

from draftline.pipeline import artifacts, deps
from draftline.tiny import embedded

STAGES = ("tokenize", "regenerate", "extract", "prepare", "train")  # `make all`, EXP=tiny
CODE = "draftline/pipeline/artifacts.py"  # every hand-made record names it
DATA = "runs/_assets/conversations.jsonl"


class Make:
    def __init__(self, repo: Path, tmp_path: Path):
        self.repo, self.log = repo, tmp_path / "python-starts.log"
        self.py = tmp_path / "python"
        self.py.write_text(f'#!/bin/sh\necho "$*" >> {self.log}\nexec {sys.executable} "$@"\n')
        self.py.chmod(0o755)

    def __call__(self, *args: str, overrides: str = "") -> tuple[list[str], list[str], str]:
        """Run make; return the stages its output runs (or, under -n, lists), the Python
        steps it started, and its output."""
        self.log.write_text("")
        # UV=/bin/false: a setup started by mistake fails instead of re-syncing this venv.
        result = run_make(*args, f"VENV={sys.prefix}", f"PY={self.py}", "UV=/bin/false", "EXP=tiny",
                          f"OVERRIDES={overrides}", cwd=self.repo, expect=0)
        output = result.stdout + result.stderr
        started = [re.sub(r" .*", "", line.split("draftline.cli.status ")[1])
                   for line in self.log.read_text().splitlines()]
        return re.findall(r"-m stages\.(\w+)", output), started, output


def finish_by_hand(run: Path) -> None:
    now = time.time_ns()
    for i, stage in enumerate(STAGES):
        manifest = run / stage / artifacts.MANIFEST
        artifacts.write_json(manifest, {"provenance": {"config": artifacts.read_json(run / stage / artifacts.STAMP),
                                                       "deps": deps.current({"code": {CODE: None}})}})
        os.utime(manifest, ns=(now + i * 10**6, now + i * 10**6))  # 1 ms apart, in pipeline order
    time.sleep(0.05)  # all in the past: Make warns of mtimes in the future


@pytest.fixture()
def make(tmp_path):
    repo = copy_repo(tmp_path / "repo")
    make = Make(repo, tmp_path)
    _, started, _ = make("runs/tiny/.assets-inputs")  # the assets alone: the tiny target, the data
    assert started == ["waits", "assets"] and (repo / DATA).exists()
    ran, started, _ = make("-n", "all")
    assert ran == list(STAGES) and started == ["waits", "stamp"]  # the wait query read the built assets
    finish_by_hand(repo / "runs/tiny")
    return make


@pytest.mark.long  # a repo copy and a tiny run, about 14 s (7 s fixture, 6 s call)
def test_a_no_op_make_starts_no_python_and_each_input_still_counts(make):
    repo = make.repo
    for _ in range(2):
        start = time.monotonic()
        ran, started, output = make("all")
        print(f"\nno-op make all, hand-finished run: {time.monotonic() - start:.3f} s")
        assert (ran, started, output) == ([], [], "")
    (repo / "runs/tiny/prepare/config.json").unlink()  # a stamp gone: written again, newer
    assert make("-n", "all")[:2] == (["prepare", "train"], ["stamp"])
    finish_by_hand(repo / "runs/tiny")  # (rerun by hand)
    assert make("-n", "all", overrides="train.lr=0.5")[:2] == (["train"], ["waits", "stamp"])
    module = repo / CODE
    module.write_text(module.read_text() + "\n# an edit that changes no behaviour\n")
    assert make("-n", "all", overrides="train.lr=0.5")[:2] == (list(STAGES), ["waits", "stamp"])
    (repo / DATA).unlink()  # a missing asset: built again; tokenize reads a new file
    assert make("runs/tiny/.assets-inputs")[1] == ["waits", "assets"]
    assert hashlib.sha256((repo / DATA).read_bytes()).digest() == hashlib.sha256(
        (embedded.DATA_DIR / embedded.CONVERSATIONS).read_bytes()).digest()
    finish_by_hand(repo / "runs/tiny")
    ran, started, _ = make("-n", "all")
    assert ran == list(STAGES) and "stamp" in started
