"""regenerate's stage: tokenize's samples kept (``data``) or every assistant reply replaced by the
target's greedy reply through vLLM (``target``), then the draft vocabulary from the replies.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from omegaconf import DictConfig

from draftline import engine
from draftline.formats import read_samples, read_tool_results, write_samples
from draftline.pipeline import artifacts, config
from draftline.pipeline.progress import Progress
from draftline.regenerate import greedy
from draftline.tokenize import vocab

log = logging.getLogger("draftline.regenerate")


MODES = ("data", "target")


def keep(tokenize_dir: Path, tokenize: dict) -> dict:
    """replies=data: point at tokenize's files (relative to this stage's folder)."""
    return {
        "replies": "data",
        "samples": os.path.relpath(tokenize_dir / tokenize["samples"], tokenize_dir.parent / "regenerate"),
        "vocab": os.path.relpath(tokenize_dir / tokenize["vocab"], tokenize_dir.parent / "regenerate"),
        **{key: tokenize[key] for key in ("num_samples", "num_tokens", "num_masked_tokens",
                                          "target_vocab_size", "draft_vocab_size",
                                          "draft_vocab_coverage")},
        "skipped": [],
    }


def make_engine(cfg: DictConfig, stop_ids: list[int]) -> greedy.VllmReplies:
    options = engine.engine_options(cfg, cfg.regenerate)
    os.environ.update(options.environment())  # before vLLM is imported
    # Replies need no per-step statistics: vLLM may overlap steps (async scheduling on GPUs).
    return greedy.VllmReplies(options, stop_ids, async_scheduling=None,
                                  max_num_batched_tokens=int(cfg.regenerate.max_num_batched_tokens))


def run(cfg: DictConfig) -> dict:
    mode = str(cfg.regenerate.replies)
    if mode not in MODES:
        raise ValueError(f"regenerate.replies={mode!r}; choose one of {MODES}")
    out_dir = config.stage_dir(cfg, "regenerate")
    tokenize_dir = config.stage_dir(cfg, "tokenize")
    tokenize = artifacts.read_manifest(tokenize_dir)
    inputs = {"tokenize_manifest_sha256": artifacts.sha256_file(tokenize_dir / artifacts.MANIFEST)}
    if mode == "data":
        shutil.rmtree(out_dir / "chunks", ignore_errors=True)
        return {**keep(tokenize_dir, tokenize), "inputs": inputs}

    samples, masks = read_samples(tokenize_dir / tokenize["samples"])
    tool_results = read_tool_results(tokenize_dir / tokenize["samples"])
    seq_length = int(cfg.regenerate.seq_length)
    if seq_length >= int(cfg.regenerate.max_model_len):
        raise ValueError(f"regenerate.seq_length={seq_length} must stay below regenerate.max_model_len="
            f"{cfg.regenerate.max_model_len}")
    stop_ids = greedy.stop_token_ids(cfg.model.path)
    fingerprint = artifacts.config_hash({
        "tokenize": inputs, "regenerate": config.stage_config(cfg, "regenerate"), "stop_ids": stop_ids})
    chunk_dir = out_dir / "chunks" / fingerprint[:16]
    for stale in (out_dir / "chunks").glob("*"):
        if stale != chunk_dir:  # chunks of other inputs or settings must not be resumed
            shutil.rmtree(stale)
    chunk_dir.mkdir(parents=True, exist_ok=True)
    size = int(cfg.regenerate.chunk_samples)
    bounds = [(a, min(a + size, len(samples))) for a in range(0, len(samples), size)]
    paths = [chunk_dir / f"chunk-{i:05d}.safetensors" for i in range(len(bounds))]
    pending = [i for i, path in enumerate(paths) if not path.exists()]
    log.info("%d samples in %d chunks, %d to generate (stop ids %s)", len(samples), len(bounds),
             len(pending), stop_ids)

    stats = greedy.ChunkStats()
    tokens_per_second = 0.0
    if pending:
        engine = make_engine(cfg, stop_ids)
        progress = Progress("regenerate", len(samples), len(samples) - sum(
            bounds[i][1] - bounds[i][0] for i in pending), unit="samples", logger=log)
        try:
            for i in pending:
                a, b = bounds[i]
                ids, new_masks, chunk = greedy.regenerate(
                    samples[a:b], masks[a:b], engine, seq_length, cfg.regenerate.max_new_tokens,
                    None if tool_results is None else tool_results[a:b])
                # The samples file marks the chunk done, so it is written after its stats.
                artifacts.write_json(paths[i].with_suffix(".json"), chunk.__dict__)
                write_samples(paths[i], ids, new_masks)
                stats.add(chunk)
                progress.advance(b - a, tokens=chunk.generated_tokens)
        finally:
            engine.shutdown()
        progress.finish()
        tokens_per_second = progress.tokens_per_second()
    resumed = greedy.ChunkStats()
    for i in set(range(len(bounds))) - set(pending):
        resumed.add(greedy.ChunkStats(**artifacts.read_json(paths[i].with_suffix(".json"))))
    stats.add(resumed)

    new_ids, new_masks = [], []
    for path in paths:
        ids, chunk_masks = read_samples(path)
        new_ids += ids
        new_masks += chunk_masks
    target_vocab, draft_vocab = int(tokenize["target_vocab_size"]), int(tokenize["draft_vocab_size"])
    write_samples(out_dir / "samples.safetensors", new_ids, new_masks)
    freq, t2d = vocab.write_vocab(out_dir / "vocab.safetensors", new_ids, new_masks,
                                  target_vocab, draft_vocab)
    masked = sum(sum(m) for m in new_masks)
    log.info("%d replies regenerated (%d ended by a stop token, %d capped), %d tokens (%d masked), "
             "draft vocab covers %.1f%% of masked tokens", stats.replies, stats.stopped,
             stats.capped, sum(map(len, new_ids)), masked, 100 * vocab.coverage(freq, t2d))
    return {
        "replies": "target",
        "samples": "samples.safetensors",
        "vocab": "vocab.safetensors",
        "num_samples": len(new_ids),
        "num_tokens": sum(map(len, new_ids)),
        "num_masked_tokens": masked,
        "target_vocab_size": target_vocab,
        "draft_vocab_size": draft_vocab,
        "draft_vocab_coverage": vocab.coverage(freq, t2d),
        "source_masked_tokens": int(tokenize["num_masked_tokens"]),
        "stop_token_ids": stop_ids,
        "generation": {**stats.__dict__, "resumed_chunks": len(bounds) - len(pending),
                       "chunks": len(bounds), "tokens_per_second": tokens_per_second},
        "skipped": [],
        "inputs": inputs,
    }
