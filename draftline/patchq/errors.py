"""The failures patchq reports: each a plain message and its exit code (the package's docstring
lists them)."""

from __future__ import annotations


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
