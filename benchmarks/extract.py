"""Extraction throughput versus bare vLLM prefill, same engine settings, one run.

    .venv/bin/python -m benchmarks.extract                 # CPU defaults (about 3 minutes)
    .venv/bin/python -m benchmarks.extract --hidden 1024 --layers 16 --tokens 65536

Builds a random Llama larger than the embedded tiny target, then times
1. bare vLLM prefill: `LLM.generate(max_tokens=1)` on the same prompts, with the engine
   configured as the extractor configures it (eager, no prefix caching, same token budget
   and sequence slots), and no capture;
2. the extract path: the patched speculators generator (capture hooks, per-request buffers,
   worker-to-driver transfer) plus draftline's shard packing and atomic safetensors writes.
Prints tokens/s for both and their ratio.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768, help="hidden size")
    parser.add_argument("--layers", type=int, default=12, help="decoder layers")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    parser.add_argument("--tokens", type=int, default=24576, help="prompt tokens in total")
    parser.add_argument("--prompt-len", type=int, default=384, help="tokens per prompt")
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="scheduler slots")
    parser.add_argument("--dtype", default="bfloat16", help="engine dtype")
    parser.add_argument("--kv-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    return parser.parse_args()


def prompts(args: argparse.Namespace) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    count = args.tokens // args.prompt_len
    return [torch.randint(7, args.vocab, (args.prompt_len,), generator=generator).tolist()
            for _ in range(count)]


def bare_prefill(model_dir: Path, batch: list[list[int]], args) -> float:
    """Seconds for vLLM to prefill every prompt once (one sampled token each)."""
    from vllm import LLM, SamplingParams
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(model_dir), dtype=args.dtype, max_model_len=args.prompt_len + 16,
              max_num_batched_tokens=args.budget, max_num_seqs=args.max_num_seqs,
              enforce_eager=True, enable_prefix_caching=False,
              compilation_config=CompilationConfig(mode=CompilationMode.NONE))
    requests = [TokensPrompt(prompt_token_ids=ids) for ids in batch]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(requests[:2], params, use_tqdm=False)  # warm-up, not timed
    start = time.perf_counter()
    llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return seconds


def extract_path(model_dir: Path, batch: list[list[int]], args, out_dir: Path) -> float:
    """Seconds for the extract stage's path: generator + shard packing + writes."""
    from speculators.data_generation import VllmHiddenStatesGenerator

    from draftline import formats
    from draftline.extract import shards
    from draftline.pipeline.progress import TOKENS, Progress

    generator = VllmHiddenStatesGenerator(
        str(model_dir), layer_ids=[2, args.layers // 2, args.layers - 3],
        max_model_len=args.prompt_len + 16, dtype=args.dtype,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget)
    generator.generate(batch[:2])  # warm-up, not timed
    lengths = [len(ids) for ids in batch]
    plans = shards.plan_shards(lengths, shard_tokens=8192)
    masks = [[1] * n for n in lengths]
    progress = Progress("extract", sum(lengths), unit=TOKENS)
    start = time.perf_counter()
    shards.extract_shards(generator, plans, batch, masks, out_dir, token_budget=8192,
                              save_dtype="bfloat16", metadata={formats.FINGERPRINT: "benchmark"},
                              progress=progress)
    seconds = time.perf_counter() - start
    progress.finish()
    generator.shutdown()
    return seconds


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_gib)
    from draftline.tiny import targets

    batch = prompts(args)
    tokens = sum(len(ids) for ids in batch)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = targets.build_tiny_llama(
            Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers,
            num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 256),
            intermediate_size=args.hidden * 8 // 3 // 64 * 64, vocab_size=args.vocab)
        bare = bare_prefill(model_dir, batch, args)
        extract = extract_path(model_dir, batch, args, Path(tmp) / "shards")
    print(f"model: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.dtype}")
    print(f"work: {len(batch)} prompts x {args.prompt_len} tokens = {tokens} tokens, "
          f"budget {args.budget}, {args.max_num_seqs} seqs")
    print(f"bare vLLM prefill : {tokens / bare:10.1f} tokens/s ({bare:.2f} s)")
    print(f"extract path      : {tokens / extract:10.1f} tokens/s ({extract:.2f} s)")
    print(f"ratio extract/bare: {bare / extract:.3f}")


if __name__ == "__main__":
    main()
