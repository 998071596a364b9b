"""extract: target hidden states for every sample (regenerate's output), through vLLM (prefill only).

    make extract EXP=tiny          # or: python -m stages.extract experiment=tiny

Validates everything it can (paths, layer ids, lengths, TP size, disk space) before the
model load; writes resumable safetensors shards under <run_dir>/extract/.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

from draftline import artifacts, config, extraction, remote_code
from draftline.samples import read_samples
from draftline.stage import run_stage

log = logging.getLogger("draftline.extract")
# The target's per-file sha256 by size and mtime, so a large target is read once, not per run
# (a dot file: never an output, never compared by `make reproduce`).
TARGET_DIGEST_CACHE = ".target-sha256.json"


def preflight(cfg: DictConfig, lengths: list[int]) -> extraction.TargetShape:
    """Every check that can fail before a (possibly 25-minute) model load."""
    remote_code.check(cfg.model.path, bool(cfg.model.trust_remote_code))
    shape = extraction.read_target_shape(cfg.model.path)
    extraction.check_layer_ids(list(cfg.model.aux_layer_ids), shape)
    if (shape.num_layers, shape.hidden_size) != (cfg.model.num_layers, cfg.model.hidden_size):
        raise ValueError(f"model config says {cfg.model.num_layers} layers x {cfg.model.hidden_size}, "
            f"{cfg.model.path}/config.json says {shape.num_layers} x {shape.hidden_size}")
    if max(lengths) >= cfg.extract.max_model_len:
        raise ValueError(f"longest sample has {max(lengths)} tokens; extract.max_model_len="
            f"{cfg.extract.max_model_len} must exceed it (vLLM needs one more for the sampled token)")
    check_devices(int(cfg.model.tensor_parallel_size))
    return shape


def check_devices(tensor_parallel_size: int) -> None:
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if tensor_parallel_size > count:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} > {count} GPUs")
    else:
        if tensor_parallel_size > os.cpu_count():
            raise ValueError(f"TP {tensor_parallel_size} > CPU cores")


def platform_environment(cfg: DictConfig) -> None:
    """Hardware choices made here, at the boundary, before vLLM is imported."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.extract.cpu_kvcache_gib))
    if cfg.model.mla_disable:
        os.environ["VLLM_MLA_DISABLE"] = "1"


def make_generator(cfg: DictConfig):
    from speculators.data_generation import VllmHiddenStatesGenerator

    return VllmHiddenStatesGenerator(
        str(cfg.model.path),
        layer_ids=list(cfg.model.aux_layer_ids),
        max_model_len=int(cfg.extract.max_model_len),
        gpu_memory_utilization=float(cfg.extract.gpu_memory_utilization),
        tensor_parallel_size=int(cfg.model.tensor_parallel_size),
        dtype=str(cfg.model.dtype),
        max_num_seqs=int(cfg.extract.max_num_seqs),
        max_num_batched_tokens=int(cfg.extract.max_num_batched_tokens),
        trust_remote_code=bool(cfg.model.trust_remote_code),
        limit_mm_per_prompt=config.mm_limits(cfg),
    )


# Keys that say where the target lives or how it was made (its files' content stands for them),
# or that only check the run: they change no byte of a shard.
NOT_IN_SHARD_BYTES = {"model": ("name", "path", "build", "train", "trust_remote_code"),
                      "extract": ("disk_headroom",)}


def shard_fingerprint(cfg: DictConfig, samples_path: Path) -> str:
    """What a shard on disk must have been made from to be reused, and what its header holds:
    the samples' bytes, the target's files (their content), and the model and extract keys that
    shape the tensors. No path, time or host enters it, so the same inputs give byte-identical
    shards in any run dir and on any machine."""
    resolved = config.stage_config(cfg, "extract")
    return artifacts.config_hash({
        "samples": artifacts.sha256_file(samples_path),
        "target": extraction.target_digest(cfg.model.path, config.stage_dir(cfg, "extract") / TARGET_DIGEST_CACHE),
        **{group: {key: value for key, value in resolved[group].items() if key not in skipped}
           for group, skipped in NOT_IN_SHARD_BYTES.items()},
    })


def remove_unplanned(out_dir: Path, plans: list[extraction.ShardPlan]) -> None:
    """Shards beyond the current plan (left by a run with other data) must not linger."""
    planned = {plan.name for plan in plans}
    for path in out_dir.glob("shard-*.safetensors"):
        if path.name not in planned:
            path.unlink()
            extraction.timing_path(path).unlink(missing_ok=True)


def run(cfg: DictConfig) -> dict:
    out_dir = config.stage_dir(cfg, "extract")
    regenerate_dir = config.stage_dir(cfg, "regenerate")
    regenerate_manifest = artifacts.read_manifest(regenerate_dir)
    samples_path = regenerate_dir / regenerate_manifest["samples"]
    samples, masks = read_samples(samples_path)
    lengths = [len(s) for s in samples]
    shape = preflight(cfg, lengths)

    plans = extraction.plan_shards(lengths, int(cfg.extract.shard_tokens))
    remove_unplanned(out_dir, plans)
    fingerprint = shard_fingerprint(cfg, samples_path)
    pending = [p for p in plans if not extraction.shard_is_complete(out_dir / p.name, p, fingerprint)]
    num_slots = len(cfg.model.aux_layer_ids) + 1
    per_token = extraction.bytes_per_token(num_slots, shape.hidden_size, cfg.extract.save_dtype)
    remaining = sum(p.num_tokens for p in pending)
    estimate = extraction.check_disk(out_dir, remaining, per_token, float(cfg.extract.disk_headroom))
    log.info("%d shards planned, %d to extract (%d tokens, about %.1f MiB)",
             len(plans), len(pending), remaining, estimate / 2**20)

    metadata = {
        "fingerprint": fingerprint,
        "aux_layer_ids": str(list(cfg.model.aux_layer_ids)),
        "slots": "aux layer inputs in aux_layer_ids order, then final post-norm state",
        "hidden_size": str(shape.hidden_size),
    }
    tokens_per_second = 0.0
    if pending:
        platform_environment(cfg)
        generator = make_generator(cfg)
        progress = extraction.Progress(sum(lengths), sum(lengths) - remaining)
        try:
            extraction.extract_shards(generator, plans, samples, masks, out_dir,
                                      int(cfg.extract.token_budget), cfg.extract.save_dtype,
                                      metadata, progress)
        finally:
            progress.close()
            generator.shutdown()
        tokens_per_second = progress.tokens_per_second()

    records = extraction.shard_records(plans, out_dir)
    total_bytes = sum(r["bytes"] for r in records)
    return {
        "shards": records,
        "num_samples": len(samples),
        "num_tokens": sum(lengths),
        "resumed_shards": len(plans) - len(pending),
        "aux_layer_ids": list(cfg.model.aux_layer_ids),
        "num_slots": num_slots,
        "hidden_size": shape.hidden_size,
        "target_architecture": shape.architecture,
        "target": str(cfg.model.path),
        "bytes_per_token": {"on_disk": total_bytes / max(sum(lengths), 1), "raw_minimum": per_token},
        "tokens_per_second": tokens_per_second,
        "inputs": {"regenerate_manifest_sha256": artifacts.sha256_file(regenerate_dir / artifacts.MANIFEST)},
        "skipped": [],
    }


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_stage("extract", cfg, run)


if __name__ == "__main__":
    main()
