"""Shared test plumbing: the repository's path, a copy of it, the project's config as a stage
sees it, and one tiny Llama target for the whole session (read-only: a test that changes a
target copies it first)."""

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def copy_repo(dst: Path) -> Path:
    """The files git would commit (tracked, and untracked but not ignored) copied to ``dst``
    with their mtimes, so the copy's `make setup` stays up to date."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    for name in listed:
        source = REPO / name
        if source.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dst / name)
    return dst


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny random Llama target (draftline.tiny.builders), built once per session."""
    from draftline.tiny import builders

    return builders.build_tiny_llama(tmp_path_factory.mktemp("target") / "model")


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the block, then put back what was there."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def compose(exp: str = "tiny", *overrides: str):
    """The project's real config for ``exp`` plus free overrides: the tree a stage's
    @hydra.main gets for `make <stage> EXP=exp OVERRIDES="..."`."""
    from draftline.pipeline import config

    return config.compose(config.experiment_overrides(exp, list(overrides)))


def require_cuda() -> None:
    """A gpu test fails, never skips, where torch sees no GPU: `make selftest` on a host whose
    GPU the container cannot see must not pass by skipping (asked without a CUDA context)."""
    from draftline import engine

    if not engine.cuda_available():
        raise RuntimeError("no CUDA GPU visible to torch: the gpu-marked tests need one "
                           "(make selftest, in the gpu image on the GPU host)")
