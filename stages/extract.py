"""extract: target hidden states for every sample (regenerate's output), through vLLM (prefill only).

    make extract EXP=tiny          # or: python -m stages.extract experiment=tiny
    make extract EXP=tiny OVERRIDES=extract.replicas=2   # two engines on this host
    make extract EXP=tiny SHARD=1/3   # one host's slice; then a plain `make extract` finalizes

Validates everything it can (paths, layer ids, lengths, TP size, disk space, host memory for
the shard buffers) before the model load; the engine's rank 0 writes resumable safetensors
shards under <run_dir>/extract/ (draftline/extract/: the plan, the preflight, the generator's
setup, the writer, and replicas and slices). Replicas and slices leave what they imported in
extract/.deps-<part>.json; the manifest's dependency record includes it (vLLM and its patches),
though its writer loaded no engine.
"""

from __future__ import annotations

import os

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from draftline.extract import shards
from draftline.extract.run import REPLICA_ENV, run, run_replica, run_slice
from draftline.pipeline import config
from draftline.pipeline.stage import refuse_mistakes, run_part, run_stage


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    overrides = list(HydraConfig.get().overrides.task)
    out_dir = config.stage_dir(cfg, "extract")
    shard, replica = cfg.extract.shard, os.environ.get(REPLICA_ENV)
    # Each part's dependency record, named by the part (a replica of a slice by both).
    part_name = "-".join(f"{kind}-{str(value).replace('/', '-of-')}"
                         for kind, value in (("slice", shard), ("replica", replica)) if value)
    record = shards.part_deps_path(out_dir, part_name)
    if replica:
        part = shards.Part.parse(replica, REPLICA_ENV)
        run_part(f"extract replica {part}", cfg, lambda c: run_replica(c, part), record)
    elif shard is not None:
        run_part(f"extract slice {shard}", cfg, lambda c: run_slice(c, overrides), record)
    else:
        run_stage("extract", cfg, lambda c: run(c, overrides), lambda: shards.read_part_deps(out_dir))


if __name__ == "__main__":
    refuse_mistakes()
    main()
