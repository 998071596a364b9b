"""What every stage entry point does around its own work: logging, stamp, failure."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig

from draftline import errors
from draftline.pipeline import artifacts, config, deps, numerics

log = logging.getLogger("draftline")


def _resumed_deps(stage_dir, resolved: dict) -> dict | None:
    """The dependency record of the previous run when it had this config: a rerun may keep
    its outputs (shards, chunks, checkpoints), so what made them stays recorded."""
    path = stage_dir / artifacts.MANIFEST
    if not path.exists():
        return None
    provenance = artifacts.read_json(path).get("provenance", {})
    return provenance.get("deps") if provenance.get("config") == resolved else None


def refuse_mistakes(argv: list[str] | None = None) -> None:
    """Before a stage's @hydra.main composes: the refusals `make` gives when it stamps
    (config.compose, config.check), for a stage run by hand, as two lines and exit 2 instead
    of Hydra's message or a library's traceback. Costs one more compose (under a second)."""
    args = sys.argv[1:] if argv is None else argv
    if any(arg.startswith("-") for arg in args):
        return  # Hydra's own flags (--cfg, --config-path as `make reproduce` passes): Hydra's to read
    try:
        config.check(config.compose(args))
    except errors.UserError as error:
        errors.refuse(error)


def run_stage(stage: str, cfg: DictConfig, work: Callable[[DictConfig], dict],
              parts: Callable[[], list[dict]] = list) -> None:
    """Run ``work`` under the configured numerics; on any exception log the full traceback
    and exit non-zero. The manifest records the numerics and what the run imported, with
    what ``parts()`` returns after the work: the dependency records of the processes that did
    part of it (``run_part``).

    The stage writes its own config stamp too, so a stage run by hand (without Make) still
    leaves the record Make compares against. A manifest of an earlier run goes first: a run
    that fails must not leave one behind that reads as its success.
    """
    config.fill_from_local(cfg)  # as `make` stamping composed it
    stage_dir = config.stage_dir(cfg, stage)
    resolved = config.stage_config(cfg, stage)
    artifacts.write_stamp(stage_dir / artifacts.STAMP, resolved)
    previous = _resumed_deps(stage_dir, resolved)
    (stage_dir / artifacts.MANIFEST).unlink(missing_ok=True)
    start = time.monotonic()
    try:
        applied = numerics.apply(cfg.numerics.torch_threads, bool(cfg.numerics.deterministic))
        fields = work(cfg)
        # What the run imported, read from this process once the work is done (draftline.pipeline.deps).
        recorded = deps.loaded(config.stage_files(cfg, stage), deps.union(previous, *parts()))
    except errors.UserError as error:
        stop_for_user(f"stage {stage} stopped after {time.monotonic() - start:.1f} s", error)
    except BaseException:
        log.exception("stage %s failed after %.1f s", stage, time.monotonic() - start)
        sys.exit(1)
    fields["wall_seconds"] = round(time.monotonic() - start, 3)
    path = artifacts.write_manifest(stage_dir, resolved, stage=stage, **fields,
                                    extra_provenance={"exp": str(cfg.exp), "numerics": numerics.describe(applied),
                                                      "deps": recorded,
                                                      "launch": config.launch_config(cfg, stage)})
    log.info("stage %s done in %.1f s: %s", stage, fields["wall_seconds"], path)


def stop_for_user(what: str, error: errors.UserError) -> None:
    """Exit 2 with the error's message and hint on stderr, its traceback in the stage's log
    file (Hydra's, runs/<exp>/logs/<stage>.log), which the second line names. Without a log
    file (a stage run outside Hydra) the traceback goes to the screen as any failure's does."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if not files:
        log.exception("%s", what)
        sys.exit(2)
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s: %s", (what, error), sys.exc_info())
    for handler in files:
        handler.handle(record)
    where = ", ".join(_shown(h.baseFilename) for h in files)
    hint = f"hint: {error.hint}; " if error.hint else ""
    print(f"draftline: {what}: {error}\n{hint}the traceback is in {where}", file=sys.stderr)
    sys.exit(2)


def _shown(path: str) -> str:
    """A path relative to the working directory when it lies under it."""
    resolved, here = Path(path).resolve(), Path.cwd().resolve()
    return str(resolved.relative_to(here)) if resolved.is_relative_to(here) else str(resolved)


def run_part(what: str, cfg: DictConfig, work: Callable[[DictConfig], None], record: Path) -> None:
    """Part of a stage's work in its own process (an extract slice or replica): the same
    numerics and failure handling as ``run_stage``, but no stamp and no manifest: the
    process that writes the manifest checks what the parts left on disk, and adds the
    dependency record each part leaves at ``record`` once its work is done."""
    config.fill_from_local(cfg)
    start = time.monotonic()
    try:
        numerics.apply(cfg.numerics.torch_threads, bool(cfg.numerics.deterministic))
        work(cfg)
        artifacts.write_json(record, deps.loaded())
    except BaseException:
        log.exception("%s failed after %.1f s", what, time.monotonic() - start)
        sys.exit(1)
    log.info("%s done in %.1f s", what, time.monotonic() - start)
