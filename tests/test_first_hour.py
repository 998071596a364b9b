"""A new user's config mistakes: refused in at most two lines (message, hint), exit 2, no traceback.

Through the commands users run: `make tokenize ...` (Make stops at its parse, in the one line
`$(error)` prints) and a stage run by hand (`python -m stages.tokenize ...`, the two lines
errors.refuse prints before @hydra.main composes). In a copy of the repository: no conf/local.yaml
(it is untracked), so no value of this machine's fills what the test leaves unset.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, copy_repo
from helpers import run_make

SHAPED = REPO / "tests/assets/kimi-k2.5-shaped"  # a model directory that exists


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return copy_repo(tmp_path_factory.mktemp("first-hour") / "repo")


@pytest.fixture()
def data(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    return path


def make(repo: Path, exp: str, overrides: str = "") -> str:
    """`make tokenize`'s refusal: the one line Make's parse stops with."""
    result = run_make("tokenize", f"VENV={sys.prefix}", f"EXP={exp}", f"OVERRIDES={overrides}", cwd=repo)
    [line] = refused(result)
    assert line.startswith("Makefile:") and "*** draftline: " in line and line.endswith(".  Stop."), line
    return line


def stage(repo: Path, *overrides: str) -> list[str]:
    """A stage run by hand: message and hint."""
    result = subprocess.run([sys.executable, "-m", "stages.tokenize", *overrides], cwd=repo,
                            capture_output=True, text=True)
    lines = refused(result)
    assert len(lines) == 2 and lines[0].startswith("draftline: ") and lines[1].startswith("hint: "), lines
    return lines


def refused(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert 1 <= len(lines) <= 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines


def test_a_misspelled_key_is_refused_with_the_nearest_one_with_or_without_a_plus(repo):
    for override in ("train.lrr=1e-3", "+train.lrr=1e-3"):
        line = make(repo, "tiny", override)
        assert f"draftline: {override}: train.lrr is no config key; hint: did you mean train.lr?" in line
        assert stage(repo, "experiment=tiny", override) == [
            f"draftline: {override}: train.lrr is no config key", "hint: did you mean train.lr?"]
    # `+` still adds to a map whose keys are the user's: no refusal, the stage gets past its config.
    result = subprocess.run([sys.executable, "-m", "draftline.cli.status", "stamp", "tiny", "--",
                             "+data.roles.narrator=assistant"], cwd=repo, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_model_or_data_path_that_does_not_exist_is_named_before_any_library_call(repo, data, tmp_path):
    absent = tmp_path / "nonexistent"
    line = make(repo, "kimi-k2.5", f"model.path={absent} data.path={data}")
    assert f"draftline: model.path={absent}: no such directory; hint: model.path is the target's directory" in line
    assert stage(repo, "experiment=kimi-k2.5", f"model.path={absent}", f"data.path={data}")[0] == \
        f"draftline: model.path={absent}: no such directory"
    line = make(repo, "kimi-k2.5", f"model.path={SHAPED} data.path={absent}.jsonl")
    assert f"draftline: data.path={absent}.jsonl: no such file or directory; hint: data.path is a JSON" in line


def test_a_required_value_left_unset_names_the_key_and_where_to_set_it(repo):
    line = make(repo, "kimi-k2.5", f"data.path={SHAPED}")
    assert ('draftline: model.path is required and not set; hint: add model.path=... to the overrides '
            '(make: OVERRIDES="model.path=..."), or set it in the untracked conf/local.yaml') in line
    assert stage(repo, "experiment=kimi-k2.5")[0] == "draftline: data.path and model.path are required and not set"
    assert not (repo / "conf/local.yaml").exists()


def test_a_misspelled_experiment_is_one_line_with_the_nearest_one(repo):
    known = ", ".join(sorted(p.stem for p in (repo / "conf/experiment").glob("*.yaml")))
    line = make(repo, "tinyy")
    assert ("draftline: EXP=tinyy: there is no conf/experiment/tinyy.yaml; hint: did you mean EXP=tiny? "
            f"known: {known}") in line
    # Hydra alone would take it silently (the experiment group is optional) and run the defaults.
    assert stage(repo, "experiment=tinyy") == [
        "draftline: experiment=tinyy: there is no conf/experiment/tinyy.yaml",
        f"hint: did you mean experiment=tiny? known: {known}"]


def test_a_model_without_a_chat_template_stops_tokenize_in_two_lines_and_logs_the_traceback(repo, data, tmp_path):
    """A mistake found inside a stage: its message and hint on screen, the traceback in the
    stage's log file, which the hint line names; Make adds only its own `Error 2` line."""
    model, run = tmp_path / "no-template", tmp_path / "run"
    shutil.copytree(SHAPED, model, ignore=shutil.ignore_patterns("chat_template.jinja"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    result = run_make("tokenize", f"VENV={sys.prefix}", "EXP=kimi-k2.5",
                      f"OVERRIDES=model.path={model} data.path={data} run_dir={run}", cwd=repo, expect=2)
    assert "Traceback" not in result.stdout + result.stderr
    # (a fresh copy first builds .tools/: pip may warn there, before the stage starts)
    message, hint, by_make = result.stderr.splitlines()[-3:]
    assert message.startswith("draftline: stage tokenize stopped after ") and \
        message.endswith(f"{model}: tokenizer has no chat_template"), message
    assert hint.startswith("hint: tokenize renders every conversation with the target's chat template") and \
        hint.endswith(f"the traceback is in {run}/logs/tokenize.log"), hint
    assert re.match(r"make(\[\d+\])?: \*\*\* ", by_make) and by_make.endswith("Error 2"), by_make  # make[1] under make test
    logged = (run / "logs/tokenize.log").read_text()
    assert "Traceback (most recent call last)" in logged and "NoChatTemplate" in logged
