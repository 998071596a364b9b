"""Serving speed-up of a run's draft, as benchmarks.serve measured it, kept beside the run.

``<run_dir>/benchmarks/serve.json`` maps a draft's hash (its config and weights) to the last
measurement of that draft, so a retrained draft never shows an older draft's speed-up; the
report reads the entry of the draft it reports on (and reruns when the file changes: it is one
of the report stage's files, config.stage_files).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from draftline.pipeline import artifacts, config


def draft_sha256(draft: str | Path) -> str:
    """sha256 over the draft's config.json and safetensors files (names and contents)."""
    draft = Path(draft)
    digest = hashlib.sha256()
    for path in [draft / "config.json", *sorted(draft.glob("*.safetensors"))]:
        digest.update(path.name.encode() + b"\0" + artifacts.sha256_file(path).encode() + b"\n")
    return digest.hexdigest()


def record(run_dir: str | Path, draft: str | Path, result: dict) -> Path:
    """Keep ``result`` as the draft's measurement (replacing its earlier one, keeping others')."""
    path = config.speedup_file(run_dir)
    measured = artifacts.read_json(path) if path.exists() else {}
    measured[draft_sha256(draft)] = {**result, "draft": str(draft)}
    artifacts.write_json(path, measured)
    return path


def read(run_dir: str | Path, draft: str | Path) -> dict | None:
    """The measurement of this draft, or None when benchmarks.serve has not run on it."""
    path = config.speedup_file(run_dir)
    if not path.exists():
        return None
    return artifacts.read_json(path).get(draft_sha256(draft))
