"""Shared test helpers."""

import contextlib
import os
from collections.abc import Iterator


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
