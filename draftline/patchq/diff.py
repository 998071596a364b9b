"""The unified-diff parser: a queue's files, each parsed whole into its file sections and hunks."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Optional

from draftline.patchq.errors import PatchError, PatchFailed
from draftline.patchq.packages import PRISTINE_DIR, RECORD_NAME

PATCH_NAME_RE = re.compile(r"^\d{4}-[A-Za-z0-9][A-Za-z0-9._-]*\.diff$")
HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
# surrogateescape round-trips arbitrary bytes, so non-UTF-8 files survive intact.
ENCODING = ("utf-8", "surrogateescape")
UNSUPPORTED = ("rename from", "rename to", "copy from", "copy to", "deleted file mode",
               "Binary files ", "GIT binary patch")


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
