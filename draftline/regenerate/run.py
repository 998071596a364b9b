"""regenerate's stage: tokenize's samples kept (``data``) or every assistant reply replaced by the
target's greedy reply through vLLM (``target``), then the draft vocabulary from the replies.

With ``tokenize.reasoning=as_generated`` tokenize hands over its conversations too, and the
target's replies are generated turn by turn from them, each after the prompt the server renders
(draftline/regenerate/turns.py); otherwise token by token from tokenize's samples
(draftline/regenerate/greedy.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from draftline import engine
from draftline.formats import read_records, read_samples, read_tool_results, write_records, write_samples
from draftline.pipeline import artifacts, config
from draftline.pipeline.progress import Progress
from draftline.regenerate import greedy, turns
from draftline.tokenize import vocab
from draftline.tokenize.encode import load_tokenizer
from draftline.tokenize.generated import thinking_template

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


def chunks(out_dir: Path, fingerprint: str, count: int, size: int
           ) -> tuple[list[tuple[int, int]], list[Path], list[int]]:
    """The resume units of ``count`` items in chunks of ``size``: their bounds, their sample
    files under a folder named by ``fingerprint`` (other folders, made from other inputs or
    settings, are removed: never resumed), and the indices of those not yet written."""
    chunk_dir = out_dir / "chunks" / fingerprint[:16]
    for stale in (out_dir / "chunks").glob("*"):
        if stale != chunk_dir:
            shutil.rmtree(stale)
    chunk_dir.mkdir(parents=True, exist_ok=True)
    bounds = [(a, min(a + size, count)) for a in range(0, count, size)]
    paths = [chunk_dir / f"chunk-{i:05d}.safetensors" for i in range(len(bounds))]
    return bounds, paths, [i for i, path in enumerate(paths) if not path.exists()]


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

    seq_length = int(cfg.regenerate.seq_length)
    if seq_length >= int(cfg.regenerate.max_model_len):
        raise ValueError(f"regenerate.seq_length={seq_length} must stay below regenerate.max_model_len="
            f"{cfg.regenerate.max_model_len}")
    stop_ids = greedy.stop_token_ids(cfg.model.path)
    if "conversations" in tokenize:
        return run_turns(cfg, out_dir, tokenize_dir, tokenize, inputs, seq_length, stop_ids)
    samples, masks = read_samples(tokenize_dir / tokenize["samples"])
    tool_results = read_tool_results(tokenize_dir / tokenize["samples"])
    fingerprint = artifacts.config_hash({
        "tokenize": inputs, "regenerate": config.stage_config(cfg, "regenerate"), "stop_ids": stop_ids})
    bounds, paths, pending = chunks(out_dir, fingerprint, len(samples), int(cfg.regenerate.chunk_samples))
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
    made = Generation(new_ids, new_masks, stats, len(bounds), len(bounds) - len(pending), tokens_per_second)
    return {**finish(out_dir, tokenize, stop_ids, made, inputs), "form": "tokens"}


@dataclasses.dataclass(frozen=True)
class Generation:
    """What the chunks made, together: the samples and their loss masks, the counts
    (``greedy.ChunkStats`` or ``turns.TurnStats``), the chunks planned and those resumed from
    disk, and this run's tokens/s."""

    ids: list[list[int]]
    masks: list[list[int]]
    stats: greedy.ChunkStats | turns.TurnStats
    chunks: int
    resumed: int
    tokens_per_second: float


def finish(out_dir: Path, tokenize: dict, stop_ids: list[int], made: Generation, inputs: dict) -> dict:
    """The samples and the draft vocabulary of the regenerated replies, and the manifest."""
    new_ids, new_masks, stats = made.ids, made.masks, made.stats
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
        "generation": {**stats.__dict__, "resumed_chunks": made.resumed,
                       "chunks": made.chunks, "tokens_per_second": made.tokens_per_second},
        "skipped": [],
        "inputs": inputs,
    }

def splitter(cfg: DictConfig, tokenizer, stop_ids: list[int]) -> turns.ReplySplitter:
    """vLLM's reasoning parser for the family (``regenerate.reasoning_parser``); a thinking
    target without one would carry its reasoning into every later prompt as text."""
    parser = cfg.regenerate.reasoning_parser
    if parser is None and thinking_template(tokenizer):
        raise ValueError(
            "regenerate.replies=target with tokenize.reasoning=as_generated on a thinking target: set "
            "regenerate.reasoning_parser to the reasoning parser vLLM serves the family with (kimi_k2, "
            "qwen3, deepseek_r1, ...): each reply is split into reasoning_content and text as the server "
            "splits it, or the next prompt would carry the reasoning the server strips")
    template = OmegaConf.to_container(cfg.tokenize.chat_template_kwargs)
    return turns.ReplySplitter(tokenizer, None if parser is None else str(parser), stop_ids, template)


def run_turns(cfg: DictConfig, out_dir: Path, tokenize_dir: Path, tokenize: dict, inputs: dict,
              seq_length: int, stop_ids: list[int]) -> dict:
    """replies=target from tokenize's conversations, turn by turn (draftline/regenerate/turns.py),
    in chunks of ``regenerate.chunk_samples`` conversations, each written atomically: samples,
    regenerated records, counts (the samples file last: it marks the chunk done)."""
    records = read_records(tokenize_dir / tokenize["conversations"])
    tokenizer = load_tokenizer(str(cfg.model.path), bool(cfg.model.trust_remote_code))
    split = splitter(cfg, tokenizer, stop_ids)
    template = OmegaConf.to_container(cfg.tokenize.chat_template_kwargs)
    fingerprint = artifacts.config_hash({
        "tokenize": inputs, "regenerate": config.stage_config(cfg, "regenerate"), "stop_ids": stop_ids,
        "template": template, "form": "turns"})
    bounds, paths, pending = chunks(out_dir, fingerprint, len(records), int(cfg.regenerate.chunk_samples))
    log.info("%d conversations in %d chunks, %d to generate turn by turn (stop ids %s, reasoning "
             "parser %s)", len(records), len(bounds), len(pending), stop_ids, cfg.regenerate.reasoning_parser)
    tokens_per_second = 0.0
    if pending:
        engine = make_engine(cfg, stop_ids)
        progress = Progress("regenerate", len(records), len(records) - sum(
            bounds[i][1] - bounds[i][0] for i in pending), unit="conversations", logger=log)
        try:
            for i in pending:
                a, b = bounds[i]
                ids, masks, regenerated, chunk, examples = turns.regenerate(
                    records[a:b], tokenizer, engine, split, seq_length, cfg.regenerate.max_new_tokens, template)
                write_records(paths[i].with_suffix(".jsonl"), regenerated)
                artifacts.write_json(paths[i].with_suffix(".json"), {**chunk.__dict__, "examples": examples})
                write_samples(paths[i], ids, masks)
                progress.advance(b - a, tokens=chunk.generated_tokens)
        finally:
            engine.shutdown()
        progress.finish()
        tokens_per_second = progress.tokens_per_second()
    stats, examples = turns.TurnStats(), {}
    new_ids, new_masks, regenerated = [], [], []
    for path in paths:
        counts = artifacts.read_json(path.with_suffix(".json"))
        for kind, shown in counts.pop("examples").items():
            examples.setdefault(kind, []).extend(shown[: turns.EXAMPLES - len(examples.get(kind, []))])
        stats.add(turns.TurnStats(**counts))
        ids, masks = read_samples(path)
        new_ids += ids
        new_masks += masks
        regenerated += read_records(path.with_suffix(".jsonl"))
    if not new_ids:
        raise RuntimeError(f"regenerate made no sample from {len(records)} conversations: "
                           f"{stats.__dict__}, e.g. {examples}")
    write_records(out_dir / "conversations.jsonl", regenerated)
    made = Generation(new_ids, new_masks, stats, len(bounds), len(bounds) - len(pending), tokens_per_second)
    manifest = finish(out_dir, tokenize, stop_ids, made, inputs)
    if stats.rerender_differs:
        log.warning("%d of %d regenerated replies do not render back from their records as generated "
                    "(trained as generated all the same), e.g. %s", stats.rerender_differs,
                    stats.rerender_differs + stats.rerendered, examples["rerender_differs"][0])
    return {**manifest, "form": "turns", "conversations": "conversations.jsonl",
            "reasoning_parser": cfg.regenerate.reasoning_parser,
            "generation": {**manifest["generation"], "examples": examples}}
