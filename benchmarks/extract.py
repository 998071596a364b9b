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

    .venv/bin/python -m benchmarks.extract --capture-path   # Kimi widths (about 10 minutes)

``--capture-path`` measures the path every captured byte takes after the forward, per
storage dtype (bfloat16, float8_e4m3fn), on a target as wide as Kimi-K2.5 (hidden 7168, 3
aux ids + the final slot) but nearly free to run (4 layers, one 128-wide attention head, MLP
128, vocab 512): the worker's copies (hook clones, stack, cast or fp8 quantization; on CPU
the "device" is the host), the executor's RPC that returns finished requests (pickled by the
worker, through shared memory or a socket, unpickled by the driver), the generator's
per-slot split, draftline's shard packing (stack, cast, finite check) and the atomic
safetensors write (to the page cache: no fsync). The worker's share is timed on a step-sized
tensor in this process (the same ops); the rest is timed around the real engine's calls in
the driver. Prints GB/s of shard bytes per part and the tokens/s ceiling they imply, which is
the rate extraction could not exceed with an infinitely fast forward, since the driver runs
capture, RPC, packing and writing serially with the forward.
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
    parser.add_argument("--capture-path", action="store_true",
                        help="time the capture path alone at Kimi widths (see above)")
    parser.add_argument("--shard-tokens", type=int, default=8192, help="tokens per shard")
    parser.add_argument("--repeats", type=int, default=3,
                        help="--capture-path: interleaved repeats per dtype (median kept)")
    args = parser.parse_args()
    if args.capture_path:  # Kimi-K2.5's width unless given
        for key, value in CAPTURE_DEFAULTS.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    return args


# --capture-path: Kimi-K2.5's width and slots, everything else as cheap as vLLM allows.
CAPTURE_DEFAULTS = {"hidden": 7168, "layers": 4, "tokens": 16384, "prompt_len": 512, "vocab": 512,
                    "dtype": "float32"}
CAPTURE_AUX_IDS = [1, 2, 3]  # 3 aux slots + the final one, as Kimi-K2.5's 2, 30, 58 (+ final)
STORAGE = ("bfloat16", "float8_e4m3fn")


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

    if args.capture_path:
        capture_path(args)
        return

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



# --------------------------------------------------------------------------- capture path


class Timer:
    """Seconds per named part, accumulated across calls."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, name: str, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return timed


def worker_seconds(rows: int, hidden: int, storage: str, engine_dtype: str) -> float:
    """What the worker does to one step's rows after the forward (custom_worker's hooks and
    _distribute_step, on this CPU): clone each slot, stack, cast or quantize, slice per
    request. Median of 5."""
    from speculators.data_generation import custom_worker

    dtype = getattr(torch, engine_dtype)
    slots = [torch.randn(rows, hidden).to(dtype) for _ in range(len(CAPTURE_AUX_IDS) + 1)]
    times = []
    for _ in range(5):
        start = time.perf_counter()
        clones = [s.detach().clone() for s in slots]
        stacked = torch.stack(clones, dim=1)  # [rows, slots, hidden]
        if storage == "float8_e4m3fn":
            parts = custom_worker._quantize_fp8(stacked)
        else:
            parts = (stacked.to(getattr(torch, storage)),)
        [p[: rows // 2] for p in parts]
        times.append(time.perf_counter() - start)
    return sorted(times)[2]


def capture_run(model_dir: Path, batch: list[list[int]], args, storage: str,
                out_dir: Path) -> dict:
    """The generator with ``storage`` in its worker, then pack + write per shard, timed."""
    from speculators.data_generation import VllmHiddenStatesGenerator

    from draftline import formats
    from draftline.extract import shards

    generator = VllmHiddenStatesGenerator(
        str(model_dir), layer_ids=CAPTURE_AUX_IDS, max_model_len=args.prompt_len + 16,
        dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget,
        hidden_states_dtype=storage)
    try:
        generator.generate(batch[:2])  # warm-up, not timed
        timer = Timer()
        rpc = generator.executor.collective_rpc

        def timed_rpc(method, *a, **k):
            return timer.wrap(f"rpc {method}", rpc)(method, *a, **k)

        generator.executor.collective_rpc = timed_rpc
        generator._collect_results = timer.wrap("split per slot", generator._collect_results)
        lengths = [len(ids) for ids in batch]
        plans = shards.plan_shards(lengths, args.shard_tokens)
        written, start = 0, time.perf_counter()
        for plan in plans:
            outputs = timer.wrap("generate", generator.generate)([batch[i] for i in plan.sample_ids])
            results = dict(zip(plan.sample_ids, outputs))
            masks = {i: [1] * lengths[i] for i in plan.sample_ids}
            tensors = timer.wrap("pack", formats.pack_shard)(plan.sample_ids, results, masks, storage)
            path = out_dir / f"{storage}-{plan.name}"
            timer.wrap("write", formats.write_shard)(path, tensors, {formats.FINGERPRINT: "benchmark"})
            written += path.stat().st_size
            path.unlink()
        total = time.perf_counter() - start
    finally:
        generator.shutdown()
    return {"seconds": timer.seconds, "total": total, "bytes": written}


def capture_path(args) -> None:
    from draftline.extract import shards
    from draftline.tiny import targets

    batch = prompts(args)
    tokens = sum(len(ids) for ids in batch)
    runs: dict[str, list[dict]] = {s: [] for s in STORAGE}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = targets.build_tiny_llama(
            Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=1,
            num_kv_heads=1, head_dim=128, intermediate_size=128, vocab_size=args.vocab)
        for _ in range(args.repeats):  # interleaved: the box's load moves between runs
            for storage in STORAGE:
                runs[storage].append(capture_run(model_dir, batch, args, storage, Path(tmp)))
                gc.collect()
    print(f"model: Llama hidden {args.hidden}, {args.layers} layers, 1 head x 128, MLP 128, "
          f"engine {args.dtype}; {len(CAPTURE_AUX_IDS) + 1} slots; {tokens} tokens in shards of "
          f"{args.shard_tokens}, prompts of {args.prompt_len}, step budget {args.budget}; "
          f"median of {args.repeats} interleaved runs")
    for storage in STORAGE:
        report_capture(storage, runs[storage], tokens, args,
                       shards.bytes_per_token(len(CAPTURE_AUX_IDS) + 1, args.hidden, storage))


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def report_capture(storage: str, runs: list[dict], tokens: int, args, per_token: int) -> None:
    """Seconds per part (median over runs), as GB/s of shard bytes and as a tokens/s ceiling."""
    parts = {"worker copy + cast/quantize (step-sized, this CPU)":
             worker_seconds(args.budget, args.hidden, storage, args.dtype) * tokens / args.budget,
             "RPC: finished requests to the driver": median(
                 [r["seconds"].get("rpc _take_captured", 0.0) for r in runs]),
             "split per slot (generator)": median([r["seconds"]["split per slot"] for r in runs]),
             "pack (stack, cast, finite check)": median([r["seconds"]["pack"] for r in runs]),
             "write (safetensors, atomic)": median([r["seconds"]["write"] for r in runs])}
    steps = median([r["seconds"]["rpc _capture_step"] for r in runs])
    total = median([r["total"] for r in runs])
    nbytes = median([r["bytes"] for r in runs])
    path = sum(parts.values())
    host = path - next(iter(parts.values()))  # on a GPU machine the worker's part is on the device
    print(f"\n{storage}: {nbytes / tokens:.1f} bytes/token on disk (formula {per_token}); "
          f"whole run {tokens / total:,.0f} tokens/s ({total:.2f} s, of it capture steps "
          f"{steps:.2f} s: forward + worker copies)")
    for name, seconds in parts.items():
        print(f"  {name:<52} {seconds:7.3f} s  {nbytes / seconds / 1e9:7.2f} GB/s  "
              f"{tokens / seconds:>12,.0f} tokens/s")
    print(f"  {'host parts (RPC, split, pack, write)':<52} {host:7.3f} s  "
          f"{nbytes / host / 1e9:7.2f} GB/s  {tokens / host:>12,.0f} tokens/s ceiling")
    print(f"  {'capture path, all parts (serial with the forward)':<52} {path:7.3f} s  "
          f"{nbytes / path / 1e9:7.2f} GB/s  {tokens / path:>12,.0f} tokens/s ceiling")


if __name__ == "__main__":
    main()
