"""What every stage entry point does around its own work: logging, stamp, failure."""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable

from omegaconf import DictConfig

from draftline import artifacts, config

log = logging.getLogger("draftline")


def run_stage(stage: str, cfg: DictConfig, work: Callable[[DictConfig], dict]) -> None:
    """Run ``work``; on any exception log the full traceback and exit non-zero.

    The stage writes its own config stamp too, so a stage run by hand (without Make) still
    leaves the record Make compares against. A manifest of an earlier run goes first: a run
    that fails must not leave one behind that reads as its success.
    """
    stage_dir = config.stage_dir(cfg, stage)
    resolved = config.stage_config(cfg, stage)
    artifacts.write_stamp(stage_dir / artifacts.STAMP, resolved)
    (stage_dir / artifacts.MANIFEST).unlink(missing_ok=True)
    start = time.monotonic()
    try:
        fields = work(cfg)
    except BaseException:
        log.exception("stage %s failed after %.1f s", stage, time.monotonic() - start)
        sys.exit(1)
    fields["wall_seconds"] = round(time.monotonic() - start, 3)
    path = artifacts.write_manifest(stage_dir, resolved, stage=stage, **fields)
    log.info("stage %s done in %.1f s: %s", stage, fields["wall_seconds"], path)
