"""Serving speed-up of a run's draft, as benchmarks.serve measured it, kept beside the run.

``<run_dir>/benchmarks/serve.json`` maps a draft's hash (artifacts.sha256_tree of its
directory: config, weights, everything vLLM loads) to the last
measurement of that draft, so a retrained draft never shows an older draft's speed-up; the
report reads the entry of the draft it reports on (and reruns when the file changes: it is one
of the report stage's files, config.stage_files).
"""

from __future__ import annotations

from pathlib import Path

from draftline.pipeline import artifacts, config


def record(run_dir: str | Path, draft: str | Path, result: dict) -> Path:
    """Keep ``result`` as the draft's measurement (replacing its earlier one, keeping others')."""
    path = config.speedup_file(run_dir)
    measured = artifacts.read_json(path) if path.exists() else {}
    measured[artifacts.sha256_tree(draft)] = {**result, "draft": str(draft)}
    artifacts.write_json(path, measured)
    return path


def read(run_dir: str | Path, draft: str | Path) -> dict | None:
    """The measurement of this draft, or None when benchmarks.serve has not run on it."""
    path = config.speedup_file(run_dir)
    if not path.exists():
        return None
    return artifacts.read_json(path).get(artifacts.sha256_tree(draft))
