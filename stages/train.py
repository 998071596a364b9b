"""train: an EAGLE-3 draft with speculators' Eagle3DraftModel on the prepared shards.

    make train EXP=tiny          # or: python -m stages.train experiment=tiny

Aux layer ids come from the extract manifest (what the data was made with), never from
config, so a draft cannot be trained on features from other layers than its config.json
names. Resumes from the latest complete checkpoint under <run_dir>/train/runs/<key>/, where
the key hashes the train config and the prepared data.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from draftline import artifacts, config
from draftline.stage import run_stage


def pick_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not (requested == "cpu" or torch.cuda.is_available()):
        raise ValueError(f"train.device={requested} but no CUDA GPU")
    return requested


def auto_or(value, kind: type):
    """``auto`` (or null) -> None, which lets training size it; else the value as ``kind``."""
    return None if value is None or str(value) == "auto" else kind(value)


def vocab_path(cfg: DictConfig) -> Path:
    """d2t/t2d of the data that was extracted (regenerate's manifest names the file)."""
    regenerate_dir = config.stage_dir(cfg, "regenerate")
    return regenerate_dir / artifacts.read_manifest(regenerate_dir)["vocab"]


def run(cfg: DictConfig) -> dict:
    from draftline import training

    prepare_dir = config.stage_dir(cfg, "prepare")
    prepared = artifacts.read_manifest(prepare_dir)
    extract = artifacts.read_manifest(config.stage_dir(cfg, "extract"))
    # One folder per (config, data): checkpoints resume only into the run that made them,
    # and switching a key back resumes the earlier run instead of discarding it.
    run_key = artifacts.config_hash({
        "train": config.stage_config(cfg, "train"),
        "prepare": artifacts.sha256_file(prepare_dir / artifacts.MANIFEST),
    })[:12]
    out_dir = config.stage_dir(cfg, "train") / "runs" / run_key
    result = training.train(
        prepared["shards"], prepare_dir / prepared["index"],
        vocab_path(cfg),
        str(cfg.model.path), out_dir, list(extract["aux_layer_ids"]),
        steps=int(cfg.train.steps), lr=float(cfg.train.lr), ttt_steps=int(cfg.train.ttt_steps),
        max_tokens_per_step=int(cfg.train.max_tokens_per_step), seed=int(cfg.train.seed),
        device=pick_device(str(cfg.train.device)), num_layers=int(cfg.train.num_layers),
        checkpoint_every=int(cfg.train.checkpoint_every),
        precision=str(cfg.train.get("precision", "auto")),
        compile=auto_or(cfg.train.get("compile", "auto"), bool),
        loader_threads=auto_or(cfg.train.get("loader_threads", "auto"), int),
        prefetch_batches=auto_or(cfg.train.get("prefetch_batches", "auto"), int),
    )
    if not result["completed"]:
        raise RuntimeError(f"training stopped at step {result['steps']} of {result['total_steps']}")
    return {
        "draft": str(result["draft_dir"]),
        "aux_layer_ids": list(extract["aux_layer_ids"]),
        "metrics": {k: v for k, v in result.items() if k not in ("draft_dir",)},
        "inputs": {"prepare_manifest_sha256": artifacts.sha256_file(prepare_dir / artifacts.MANIFEST)},
        # The draft's vLLM parse is skipped where vLLM is not installed (training hosts need
        # not have it): say so where a reader of the manifest looks.
        "skipped": [] if result.get("vllm") is not None else [
            {"what": "vLLM parse of the saved draft", "reason": "vLLM is not installed here"}],
    }


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_stage("train", cfg, run)


if __name__ == "__main__":
    main()
