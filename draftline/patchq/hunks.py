"""Hunk matching: each hunk exactly (no fuzz) nearest its stated line, every patch in memory first."""

from __future__ import annotations

from typing import Callable, Iterator, Optional

from draftline.patchq.diff import FilePatch, Hunk, Patch, split_lines
from draftline.patchq.errors import PatchFailed

Content = Optional[str]  # a file's text, or None when the file does not exist
Reader = Callable[[str], Content]


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
