"""draftline/cli/when_changed.sh: Make's every-call steps run only when what they read
changed, so a no-op `make` starts no Python.

The script runs in a throwaway checkout (conf/, draftline/, stages/) with a shell command in
place of the Python step: it logs each run and names its inputs as the real steps do.
"""

import subprocess
from pathlib import Path

import pytest

from conftest import REPO

SCRIPT = REPO / "draftline/cli/when_changed.sh"


@pytest.fixture()
def checkout(tmp_path):
    for rel in ("conf/config.yaml", "conf/model/m.yaml", "conf/README.md", "draftline/x.py",
                "draftline/sub/y.py", "stages/s.py", "tests/test_x.py", "data.jsonl"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("a\n")
    return tmp_path


def step(checkout: Path, *args: str, answer: bool = False, code: int = 0) -> subprocess.CompletedProcess:
    """The script around a step that logs its run, names data.jsonl as its input, prints an
    answer and exits with ``code``."""
    command = ("echo ran \"$*\" >> log; mkdir -p runs/e; printf 'data.jsonl\\n' > runs/e/.s-inputs; "
               f"echo answer-of \"$*\"; exit {code}")
    return subprocess.run(["bash", str(SCRIPT), *(["--answer"] if answer else []), "runs/e/.s",
                           "bash", "-c", command, "step", *args],
                          cwd=checkout, capture_output=True, text=True)


def runs(checkout: Path) -> int:
    log = checkout / "log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_step_runs_once_then_only_when_what_it_read_changed(checkout):
    first = step(checkout, "a=1")
    assert first.returncode == 0 and runs(checkout) == 1
    assert first.stdout.splitlines()[0].startswith("bash -c ")  # echoed, as Make echoes a recipe
    assert step(checkout, "a=1").stdout == "" and runs(checkout) == 1  # nothing changed: not started
    # Its record, written whole and readable by all; no temporary file left.
    assert sorted(p.name for p in (checkout / "runs/e").iterdir()) == [".s-inputs", ".s-stats"]
    assert (checkout / "runs/e/.s-stats").stat().st_mode & 0o777 == 0o644
    step(checkout, "a=2")  # other arguments (overrides)
    assert runs(checkout) == 2
    expected = 2
    for rel in ("conf/config.yaml", "conf/model/m.yaml", "draftline/x.py", "draftline/sub/y.py", "stages/s.py",
                "data.jsonl"):
        (checkout / rel).write_text("b\n")  # same size, same second: the mtime's nanoseconds tell
        step(checkout, "a=2")
        expected += 1
        assert runs(checkout) == expected, rel
        step(checkout, "a=2")
        assert runs(checkout) == expected, rel
    for rel in ("conf/README.md", "tests/test_x.py"):
        (checkout / rel).write_text("c\n")
        step(checkout, "a=2")
        assert runs(checkout) == expected, rel


def test_files_coming_and_going_count(checkout):
    step(checkout)
    for change in (lambda: (checkout / "draftline/new.py").write_text(""),
                   lambda: (checkout / "draftline/new.py").unlink(),
                   lambda: (checkout / "data.jsonl").unlink(),  # an input gone ...
                   lambda: (checkout / "data.jsonl").write_text("a\n")):  # ... and back
        before = runs(checkout)
        change()
        step(checkout)
        assert runs(checkout) == before + 1
    step(checkout)
    assert runs(checkout) == 5


def test_a_failed_step_fails_and_runs_again(checkout):
    step(checkout)
    failed = step(checkout, "a=3", code=1)
    assert failed.returncode == 1 and runs(checkout) == 2
    assert step(checkout, "a=3", code=1).returncode == 1 and runs(checkout) == 3
    assert step(checkout, "a=3").returncode == 0 and runs(checkout) == 4
    assert step(checkout, "a=3").returncode == 0 and runs(checkout) == 4


def test_an_answer_is_kept_and_given_again_and_a_refusal_passed_on(checkout):
    assert step(checkout, "x", answer=True).stdout == "answer-of x\n"  # not echoed: stdout is the answer
    again = step(checkout, "x", answer=True)
    assert again.stdout == "answer-of x\n" and runs(checkout) == 1
    refused = step(checkout, "y", answer=True, code=2)
    assert refused.returncode == 2 and refused.stdout == "answer-of y\n"  # Make's $(error) prints it
    assert step(checkout, "y", answer=True, code=2).returncode == 2 and runs(checkout) == 3


def test_a_refused_step_leaves_no_run_dir(checkout):
    result = subprocess.run(["bash", str(SCRIPT), "--answer", "runs/typo/.waits", "bash", "-c", "echo no; exit 2"],
                            cwd=checkout, capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == "no\n"
    assert not (checkout / "runs").exists()
