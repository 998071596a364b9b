"""train's stage: the run key that names the resume directory, the loop on rank 0 and the other
ranks, and the ``<run_dir>/draft`` link to the latest draft.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from omegaconf import DictConfig

from draftline.pipeline import artifacts, config, launch

log = logging.getLogger("draftline.train")


def vocab_path(cfg: DictConfig) -> Path:
    """d2t/t2d of the data that was extracted (regenerate's manifest names the file)."""
    regenerate_dir = config.stage_dir(cfg, "regenerate")
    return regenerate_dir / artifacts.read_manifest(regenerate_dir)["vocab"]


def train_data(cfg: DictConfig):
    """The run's :class:`draftline.train.settings.TrainData`: prepare's shards and split,
    tokenize's vocabulary mapping as regenerate names it, the target, extract's aux layers."""
    from draftline.train.settings import TrainData

    prepare_dir = config.stage_dir(cfg, "prepare")
    prepared = artifacts.read_manifest(prepare_dir)
    extract = artifacts.read_manifest(config.stage_dir(cfg, "extract"))
    return TrainData(prepared["shards"], prepare_dir / prepared["index"], vocab_path(cfg),
                     str(cfg.model.path), list(extract["aux_layer_ids"]))


def run_key(cfg: DictConfig, prepare_dir: Path) -> str:
    """One folder per (config, data): checkpoints resume only into the run that made them,
    and switching a key back resumes the earlier run instead of discarding it. The data is
    named by content (the split index, the shards' recorded sha256, the vocab mapping), never
    by the run dir or a manifest (its hosts and wall times): the same run in another run dir,
    on another machine or in a `make reproduce` replay gets the same key. The step planner's
    name is in it too: another planner means other batches, so a fresh run, not a resume."""
    from draftline.train.packing import PACKING  # numpy only: cheap where status calls this

    train_cfg = config.stage_config(cfg, "train")  # without the launch keys (config.LAUNCH_KEYS)
    del train_cfg["run_dir"]
    prepared = artifacts.read_manifest(prepare_dir)
    extract = artifacts.read_manifest(config.stage_dir(cfg, "extract"))
    return artifacts.config_hash({
        "train": train_cfg,
        "index": artifacts.sha256_file(prepare_dir / prepared["index"]),
        "shards": [shard["sha256"] for shard in extract["shards"]],
        "vocab": artifacts.sha256_file(vocab_path(cfg)),
        "packing": PACKING,
    })[:12]


def run(cfg: DictConfig, world: launch.World = launch.World()) -> dict:
    from draftline.train import loop
    from draftline.train.settings import TrainSettings

    prepare_dir = config.stage_dir(cfg, "prepare")
    extract = artifacts.read_manifest(config.stage_dir(cfg, "extract"))
    out_dir = config.stage_dir(cfg, "train") / run_key(cfg, prepare_dir)
    device = launch.rank_device(str(cfg.train.device), world)
    if world.distributed:
        launch.init_process_group(device, float(cfg.train.collective_timeout_s))
    try:
        result = loop.train(train_data(cfg), TrainSettings.from_config(cfg.train, device=device),
                            out_dir, world=world)
    finally:
        launch.destroy_process_group()
    if not result["completed"]:
        raise RuntimeError(f"training stopped at step {result['steps']} of {result['total_steps']}")
    return {
        "draft": str(result["draft_dir"]),
        "aux_layer_ids": list(extract["aux_layer_ids"]),
        "metrics": {k: v for k, v in result.items() if k not in ("draft_dir", "skipped")},
        "inputs": {"prepare_manifest_sha256": artifacts.sha256_file(prepare_dir / artifacts.MANIFEST)},
        # e.g. the draft's vLLM parse where vLLM is not installed (training hosts need not
        # have it): said where a reader of the manifest looks.
        "skipped": result["skipped"],
    }


def link_draft(cfg: DictConfig) -> Path:
    """``<run_dir>/draft``: a relative link to the draft the train manifest names, swapped in
    atomically (written after the manifest, so it never points at a draft of a failed run)."""
    draft = artifacts.read_manifest(config.stage_dir(cfg, "train"))["draft"]
    return artifacts.point_link(Path(cfg.run_dir) / "draft", draft)


def run_other_rank(cfg: DictConfig, world: launch.World) -> None:
    """A rank other than 0: the same work, no stamp or manifest; a failure exits non-zero
    with its traceback (torchrun then ends the other ranks)."""
    try:
        run(cfg, world)
    except BaseException:
        log.exception("train rank %d of %d failed", world.rank, world.world_size)
        sys.exit(1)
