"""The commands: apply, check, status and restore one package's queue."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Optional

from draftline.patchq.diff import list_patch_files, load_patches, parse_patch
from draftline.patchq.errors import PatchFailed
from draftline.patchq.hunks import Content, apply_patch, dry_run, overlay
from draftline.patchq.packages import get_package
from draftline.patchq.state import (changed_error, check_version, commit, locate_install, patch_set,
                                    pristine_reader, read_manifest, read_record, read_text, sha256_text,
                                    verify_record, write_files)


def _queue(package: str, patch_dir: str | Path | None, expect_version: Optional[str]) -> tuple[Path, str]:
    """The queue folder and pinned version: the package's own unless given."""
    pkg = get_package(package)
    return (pkg.patch_dir if patch_dir is None else Path(patch_dir),
            pkg.version if expect_version is None else expect_version)


def apply_queue(patch_dir: str | Path | None = None, site_packages: str | Path | None = None,
                expect_version: Optional[str] = None, replace: bool = False,
                package: str = "speculators") -> str:
    """Apply the whole queue or nothing; returns a one-line summary for the user."""
    patch_dir, expect_version = _queue(package, patch_dir, expect_version)
    install = locate_install(site_packages, package)
    check_version(install, expect_version)
    patches = load_patches(patch_dir, package)
    record, manifest = read_record(install), read_manifest(install)
    if record is not None:
        verify_record(install, record)
        if patch_set(record["patches"]) == patch_set(patches):
            return f"already applied: {len(patches)} patches, nothing to do"
    if (record is not None or manifest) and not replace:
        raise changed_error(record, patches)
    results = dry_run(patches, pristine_reader(install, manifest))
    commit(install, patches, manifest, results)
    return f"applied {len(patches)} patches to {install.package_dir} ({len(results)} files changed)"


def check_queue(patch_dir: str | Path | None = None, site_packages: str | Path | None = None,
                expect_version: Optional[str] = None,
                package: str = "speculators") -> list[tuple[str, Optional[str]]]:
    """Dry run against pristine content: (patch name, None if ok else why it fails)."""
    patch_dir, expect_version = _queue(package, patch_dir, expect_version)
    install = locate_install(site_packages, package)
    check_version(install, expect_version)
    changes: dict[str, Content] = {}
    view = overlay(changes, pristine_reader(install, read_manifest(install)))
    report: list[tuple[str, Optional[str]]] = []
    for path in list_patch_files(patch_dir):
        try:
            changes.update(apply_patch(parse_patch(path.name, path.read_bytes(), package), view))
            report.append((path.name, None))
        except PatchFailed as err:  # reported per patch; later patches are still checked
            report.append((path.name, err.detail))
    return report


def status_text(site_packages: str | Path | None = None, package: str = "speculators") -> str:
    """Human-readable record, flagging files that no longer match it."""
    install = locate_install(site_packages, package)
    record = read_record(install)
    if record is None:
        interrupted = install.manifest_path.exists()
        return "unpatched" + (" (an earlier apply was interrupted; apply --replace)" if interrupted else "")
    lines = [f"{install.dist} {record['package_version']} at {install.package_dir}: patched by "
             f"{record['applier']} {record['applier_version']}", "patches:"]
    lines += [f"  {p['name']}  sha256:{p['sha256']}" for p in record["patches"]]
    lines.append("files:")
    for f in record["files"]:
        ok = sha256_text(read_text(install.disk_path(f["path"]))) == f["sha256"]
        lines.append(f"  {f['path']}  sha256:{f['sha256']}" + ("" if ok else "  MODIFIED"))
    return "\n".join(lines)


def restore_queue(site_packages: str | Path | None = None, force: bool = False,
                  package: str = "speculators") -> str:
    """Undo all patches from the pristine copies; ``force`` discards out-of-band edits."""
    install = locate_install(site_packages, package)
    record, manifest = read_record(install), read_manifest(install)
    if record is None and not manifest:
        return "unpatched, nothing to restore"
    if record is not None and not force:
        verify_record(install, record)
    read = pristine_reader(install, manifest)
    contents = {path: read(path) for path in manifest}  # read everything before writing
    with contextlib.suppress(FileNotFoundError):
        install.record_path.unlink()
    write_files(install, contents)
    if install.pristine_dir.exists():
        shutil.rmtree(install.pristine_dir)
    return f"restored {len(contents)} files to pristine"
