"""prepare's stage: every extracted shard checked, its rows split by sample into train and
validation, and the trainer's index written.
"""

from __future__ import annotations

from omegaconf import DictConfig

from draftline.pipeline import artifacts, config
from draftline.prepare import split


def run(cfg: DictConfig) -> dict:
    extract_dir = config.stage_dir(cfg, "extract")
    extract = artifacts.read_manifest(extract_dir)
    rows = []
    for shard_index, shard in enumerate(extract["shards"]):
        for sample_id, row, length, masked in split.validate_shard(
                extract_dir / shard["file"], extract["num_slots"], extract["hidden_size"]):
            rows.append((shard_index, sample_id, row, length, masked))
    train, validation = split.split_rows(
        rows, float(cfg.prepare.validation_fraction), int(cfg.seed), int(cfg.prepare.min_validation))
    out_dir = config.stage_dir(cfg, "prepare")
    split.write_index(out_dir / "index.safetensors", train, validation)
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
