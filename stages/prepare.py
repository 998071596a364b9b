"""prepare: validate the extracted shards, split by sample, write the trainer's index.

    make prepare EXP=tiny          # or: python -m stages.prepare experiment=tiny
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftline import prepare
from draftline.pipeline import artifacts, config
from draftline.pipeline.stage import refuse_mistakes, run_stage


def run(cfg: DictConfig) -> dict:
    extract_dir = config.stage_dir(cfg, "extract")
    extract = artifacts.read_manifest(extract_dir)
    rows = []
    for shard_index, shard in enumerate(extract["shards"]):
        for sample_id, row, length, masked in prepare.validate_shard(
                extract_dir / shard["file"], extract["num_slots"], extract["hidden_size"]):
            rows.append((shard_index, sample_id, row, length, masked))
    train, validation = prepare.split_rows(
        rows, float(cfg.prepare.validation_fraction), int(cfg.seed), int(cfg.prepare.min_validation))
    out_dir = config.stage_dir(cfg, "prepare")
    prepare.write_index(out_dir / "index.safetensors", train, validation)
    dropped = [r[1] for r in rows if r[4] == 0]
    return {
        "index": "index.safetensors",
        "shards": [str(extract_dir / s["file"]) for s in extract["shards"]],
        "num_train": len(train),
        "num_validation": len(validation),
        "train_tokens": sum(r[3] for r in train),
        "validation_tokens": sum(r[3] for r in validation),
        "skipped": [{"sample_id": s, "reason": "no assistant (loss-mask) tokens"} for s in dropped],
        "inputs": {"extract_manifest_sha256": artifacts.sha256_file(extract_dir / artifacts.MANIFEST)},
    }


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_stage("prepare", cfg, run)


if __name__ == "__main__":
    refuse_mistakes()
    main()
