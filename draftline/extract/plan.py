"""What every extract process reads and plans before any engine starts: the samples, the
shard plan, and the fingerprint a shard on disk must carry to be reused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from omegaconf import DictConfig

from draftline import formats, target
from draftline.extract import shards
from draftline.extract.preflight import preflight
from draftline.pipeline import artifacts, config

# The target's per-file sha256 by size and mtime, so a large target is read once, not per run
# (a dot file: never an output, never compared by `make reproduce`).
TARGET_DIGEST_CACHE = ".target-sha256.json"
# Keys that say where the target lives or how it was made (its files' content stands for them),
# or that only check the run: they change no byte of a shard.
NOT_IN_SHARD_BYTES = {"model": ("name", "path", "build", "train", "trust_remote_code",
                                 "enforce_eager"),  # extraction always runs eager
                      "extract": ("disk_headroom", "rank_timeout_s", "writer_timeout_s")}


def shard_fingerprint(cfg: DictConfig, samples_path: Path) -> str:
    """What a shard on disk must have been made from to be reused, and what its header holds:
    the samples' bytes, the target's files (their content), and the model and extract keys that
    shape the tensors. No path, time or host enters it, so the same inputs give byte-identical
    shards in any run dir and on any machine."""
    resolved = config.stage_config(cfg, "extract")
    return artifacts.config_hash({
        "samples": artifacts.sha256_file(samples_path),
        "target": target.target_digest(cfg.model.path, config.stage_dir(cfg, "extract") / TARGET_DIGEST_CACHE),
        **{group: {key: value for key, value in resolved[group].items() if key not in skipped}
           for group, skipped in NOT_IN_SHARD_BYTES.items()},
    })


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What every extract process reads and plans before any engine starts."""

    out_dir: Path
    regenerate_dir: Path
    samples: list[list[int]]
    masks: list[list[int]]
    shape: target.TargetShape
    plans: list[shards.ShardPlan]
    fingerprint: str


def read_inputs(cfg: DictConfig, replicas: int | None = 1) -> Inputs:
    """regenerate's samples, checked (``preflight``) and planned into shards."""
    regenerate_dir = config.stage_dir(cfg, "regenerate")
    regenerate_manifest = artifacts.read_manifest(regenerate_dir)
    samples_path = regenerate_dir / regenerate_manifest["samples"]
    samples, masks = formats.read_samples(samples_path)
    lengths = [len(s) for s in samples]
    shape = preflight(cfg, lengths, replicas)
    return Inputs(config.stage_dir(cfg, "extract"), regenerate_dir, samples, masks, shape,
                  shards.plan_shards(lengths, int(cfg.extract.shard_tokens)),
                  shard_fingerprint(cfg, samples_path))


def shard_metadata(cfg: DictConfig, inputs: Inputs) -> dict[str, str]:
    return formats.shard_metadata(inputs.fingerprint, list(cfg.model.aux_layer_ids),
                                  inputs.shape.hidden_size)


def remove_unplanned(out_dir: Path, plans: list[shards.ShardPlan]) -> None:
    """Shards beyond the current plan (left by a run with other data) must not linger."""
    planned = {plan.name for plan in plans}
    for path in out_dir.glob("shard-*.safetensors"):
        if path.name not in planned:
            path.unlink(missing_ok=True)  # slices on other hosts remove them too
            shards.timing_path(path).unlink(missing_ok=True)


def host_plans(cfg: DictConfig, plans: list[shards.ShardPlan]) -> list[shards.ShardPlan]:
    """This host's shards: all of them, or its slice under ``extract.shard=i/N``."""
    if cfg.extract.shard is None:
        return plans
    return shards.Part.parse(cfg.extract.shard, "extract.shard").take(plans)
