"""`make -n` writes nothing the user owns and builds nothing.

A dry run still refreshes the project's own stamps under runs/<EXP>/ (so it lists exactly the
stages that would rerun), but the user's data file, the checkout outside runs/ and the
project-built assets are left as they were. Run in a copy of the repository, from a fresh clone's
state: no runs/, so every stamp cache is stale.
"""

import hashlib
import re
import sys
from pathlib import Path

import pytest

from conftest import REPO, copy_repo
from helpers import run_make

USER_DATA = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'


def public_targets() -> list[str]:
    """Every target `make help` lists (the `## ` lines)."""
    text = (REPO / "Makefile").read_text()
    return sorted(set(re.findall(r"^([a-zA-Z_-]+):.*## ", text, flags=re.M)))


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` except runs/ (links are not followed)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.relative_to(root).parts[0] != "runs"}


@pytest.fixture()
def repo(tmp_path):
    return copy_repo(tmp_path / "repo")


def test_the_public_targets_are_the_ones_help_lists():
    assert {"tokenize", "extract", "train", "smoke", "status", "serve", "clean"} <= set(public_targets())


def test_make_n_of_every_public_target_writes_nothing_outside_runs(repo, tmp_path):
    user_data = tmp_path / "my_chats.jsonl"
    user_data.write_text(USER_DATA)
    before, data_before = tree_hashes(repo), user_data.read_bytes()
    for target in public_targets():
        run_make("-n", target, f"VENV={sys.prefix}", "EXP=tiny", f"OVERRIDES=data=file data.path={user_data}",
                 cwd=repo, expect=0)
        assert user_data.read_bytes() == data_before, target
        assert tree_hashes(repo) == before, target
        # No model is built, not even the project's own under runs/_assets/.
        assert not (repo / "runs/_assets").exists(), (target, sorted((repo / "runs/_assets").iterdir()))
    # ... and the stamps were refreshed, so the dry run could list the stale stages.
    assert (repo / "runs/tiny/tokenize/config.json").exists()
    print(f"make -n of {len(public_targets())} targets ({' '.join(public_targets())}): "
          f"{len(before)} files outside runs/ hashed, all unchanged; {user_data.name} sha256 "
          f"{hashlib.sha256(data_before).hexdigest()[:16]} unchanged; runs/_assets/ not created")


def test_the_embedded_set_at_a_users_path_is_refused_in_one_line(repo, tmp_path):
    # The user set data.path and forgot data=file: the project must neither write there nor
    # create a path that does not exist.
    user_data, absent = tmp_path / "my_chats.jsonl", tmp_path / "absent.jsonl"
    user_data.write_text(USER_DATA)
    for path in (user_data, absent):
        result = run_make("-n", "tokenize", f"VENV={sys.prefix}", "EXP=tiny", f"OVERRIDES=data.path={path}",
                          cwd=repo)
        assert result.returncode != 0
        # One line, at Make's parse (before any recipe, so no lines of Make's about deleted files)
        (line,) = result.stderr.splitlines()
        assert "draftline: data.path=" in line and "did you mean data=file?" in line, result.stderr
    assert user_data.read_text() == USER_DATA and not absent.exists()
    assert not (repo / "runs/_assets").exists()


def test_a_built_tiny_target_at_a_users_path_is_refused(repo, tmp_path):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    result = run_make("-n", "tokenize", f"VENV={sys.prefix}", "EXP=tiny", f"OVERRIDES=model.path={model_dir}",
                      cwd=repo)
    (line,) = result.stderr.splitlines()
    assert result.returncode == 2 and "conf/model/<name>.yaml with build: null" in line
    assert list(model_dir.iterdir()) == []


def test_a_big_target_makes_extract_wait_for_the_rehearsal_and_a_small_one_does_not(repo, tmp_path):
    """Decided when Make parses (draftline.cli.status waits): the rehearsal joins the dry
    run before extract only when the target's weight files exceed rehearse.min_target_gb."""
    shaped = REPO / "tests/assets/kimi-k2.5-shaped"
    big = tmp_path / "big"
    big.mkdir()
    for path in shaped.iterdir():
        (big / path.name).write_bytes(path.read_bytes())
    with open(big / "model-00001-of-00001.safetensors", "wb") as weights:
        weights.truncate(5 * 10**9)  # sparse: 5 GB of size, no disk
    data = tmp_path / "chats.jsonl"
    data.write_text(USER_DATA)
    before = tree_hashes(repo)
    ran = {}
    for name, model in (("big", big), ("small", shaped)):
        result = run_make("-n", "extract", f"VENV={sys.prefix}", "EXP=kimi-k2.5",
                          f"OVERRIDES=model.path={model} data.path={data}", cwd=repo, expect=0)
        ran[name] = re.findall(r"-m stages\.(\w+)", result.stdout)
    assert ran["big"] == ["tokenize", "regenerate", "rehearse", "extract"]
    assert ran["small"] == ["tokenize", "regenerate", "extract"]
    assert tree_hashes(repo) == before
