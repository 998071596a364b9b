"""Extraction throughput versus bare vLLM prefill, and the capture path alone, with both
shard writers (draftline.extract.writer: the engine's rank 0, and the driver as before
draftline issue 30), in one run, interleaved.

    .venv/bin/python -m benchmarks.extract --repeats 1     # CPU defaults (about 4 minutes)
    .venv/bin/python -m benchmarks.extract --hidden 1024 --layers 16 --tokens 65536

Builds a random Llama larger than the embedded tiny target, then times
1. bare vLLM prefill: `LLM.generate(max_tokens=1)` on the same prompts, with the engine
   configured as the extractor configures it (eager, no prefix caching, same token budget
   and sequence slots), and no capture;
2. the extract path with each writer: the patched speculators generator (capture hooks, bf16
   in the worker) and the shards written (rank 0's writer thread, or the driver's packing and
   atomic safetensors writes after the rows crossed the RPC).
Prints tokens/s for each and extract / bare, and each run's time split.

    .venv/bin/python -m benchmarks.extract --capture-path   # Kimi widths (about 15 minutes)

``--capture-path`` measures the path every captured byte takes after the forward, per
storage dtype (bfloat16, float8_e4m3fn) and writer, on a target as wide as Kimi-K2.5 (hidden
7168, 3 aux ids + the final slot) but nearly free to run (4 layers, one 128-wide attention
head, MLP 128, vocab 512). Driver: the worker's copies (hook clones, stack, cast or fp8
quantization; on CPU the "device" is the host), the executor's RPC that returns finished
requests (pickled by the worker, through shared memory or a socket, unpickled by the
driver), the generator's per-slot split, draftline's shard packing (stack, cast, finite
check) and the atomic safetensors write (to the page cache: no fsync). Rank 0: the worker's
copies plus its finite flag and the copy into the shard buffer, the RPCs of placements and
counts, the driver's waits on rank 0, and the writer thread's writes. The worker's share is
timed on a step-sized tensor in this process through the worker's own functions; the rest
around the real engine's calls. Prints GB/s of shard bytes per part and the tokens/s ceiling
their sum implies: the rate extraction could not exceed with an infinitely fast forward if
every part ran serially with it (rank 0's writes in fact run beside it).

    python -m benchmarks.extract --torch-only               # a GPU host without vLLM

``--torch-only`` drives the patched worker's own capture, copy and writer functions on CUDA
tensors (or CPU ones), and draftline's shard code, at Kimi-K2.5's width, with no vLLM and no
forward: benchmarks/capture.py.
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
                        help="--capture-path, --torch-only: interleaved repeats (median kept)")
    parser.add_argument("--torch-only", action="store_true",
                        help="the capture path through the patched worker's own functions, no "
                             "vLLM (a GPU host without it; benchmarks/capture.py)")
    parser.add_argument("--device", default=None, help="--torch-only: cuda or cpu (default: cuda if any)")
    parser.add_argument("--threads", type=int, default=1,
                        help="--torch-only: torch threads (vLLM's executor sets 1)")
    parser.add_argument("--shards", type=int, default=4, help="--torch-only: shards per run")
    parser.add_argument("--step-tokens", type=int, default=16384, help="--torch-only: tokens per step")
    parser.add_argument("--slots", type=int, default=4, help="--torch-only: aux slots + the final one")
    parser.add_argument("--engine-dtype", default="bfloat16", help="--torch-only: the forward's dtype")
    parser.add_argument("--storage", nargs="+", default=list(STORAGE), help="--torch-only: shard dtypes")
    parser.add_argument("--writers", nargs="+", default=list(WRITERS), choices=WRITERS,
                        help="--torch-only: which writers to run")
    parser.add_argument("--out", default=None, help="--torch-only: where shards are written (then removed)")
    args = parser.parse_args()
    defaults = TORCH_ONLY_DEFAULTS if args.torch_only else CAPTURE_DEFAULTS if args.capture_path else {}
    for key, value in defaults.items():  # Kimi-K2.5's width unless given
        if getattr(args, key) == parser.get_default(key):
            setattr(args, key, value)
    return args


# --capture-path: Kimi-K2.5's width and slots, everything else as cheap as vLLM allows.
CAPTURE_DEFAULTS = {"hidden": 7168, "layers": 4, "tokens": 16384, "prompt_len": 512, "vocab": 512,
                    "dtype": "float32"}
# --torch-only: the shapes of the issue-30 measurement (65,536-token shards, 16,384-token steps).
TORCH_ONLY_DEFAULTS = {"hidden": 7168, "shard_tokens": 65536, "prompt_len": 2048}
CAPTURE_AUX_IDS = [1, 2, 3]  # 3 aux slots + the final one, as Kimi-K2.5's 2, 30, 58 (+ final)
STORAGE = ("bfloat16", "float8_e4m3fn")
WRITERS = ("driver", "rank0")  # draftline.extract.writer: in_driver, on_rank0


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


def extract_path(model_dir: Path, batch: list[list[int]], args, out_dir: Path, path: str) -> float:
    """Seconds for the extract stage's path with ``path``'s writer (draftline.extract.writer):
    generator, capture, and the shards written (bf16)."""
    from speculators.data_generation import VllmHiddenStatesGenerator

    from draftline import formats
    from draftline.extract import shards, writer
    from draftline.extract.settings import ShardJob
    from draftline.pipeline.progress import TOKENS, Progress

    generator = VllmHiddenStatesGenerator(
        str(model_dir), layer_ids=[2, args.layers // 2, args.layers - 3],
        max_model_len=args.prompt_len + 16, dtype=args.dtype, hidden_states_dtype="bfloat16",
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget)
    try:
        generator.generate(batch[:2])  # warm-up, not timed
        lengths = [len(ids) for ids in batch]
        plans = shards.plan_shards(lengths, shard_tokens=args.shard_tokens)
        masks = [[1] * n for n in lengths]
        progress, split = Progress("extract", sum(lengths), unit=TOKENS), writer.TimeSplit()
        metadata = {formats.FINGERPRINT: "benchmark"}
        if path == "rank0":
            generator.open_shard_writer(args.shard_tokens + args.prompt_len + 16, writer.WRITER)
        start = time.perf_counter()
        job = ShardJob(batch, masks, Path(out_dir), metadata, 8192, "bfloat16")
        if path == "rank0":
            writer.on_rank0(generator, plans, job, progress, split)
        else:
            writer.in_driver(generator, plans, job, progress, split)
        seconds = time.perf_counter() - start
        progress.finish()
        print(f"  {path}: {split.line()}")
    finally:
        generator.shutdown()
    return seconds


def main() -> None:
    args = parse_args()
    if args.torch_only:
        from benchmarks import capture

        capture.main(args)
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_gib)
    from draftline.tiny import builders

    if args.capture_path:
        capture_path(args)
        return

    batch = prompts(args)
    tokens = sum(len(ids) for ids in batch)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = builders.build_tiny_llama(
            Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers,
            num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 256),
            intermediate_size=args.hidden * 8 // 3 // 64 * 64, vocab_size=args.vocab)
        times = {"bare": [], **{path: [] for path in WRITERS}}
        for _ in range(args.repeats):  # interleaved: the box's load moves between runs
            times["bare"].append(bare_prefill(model_dir, batch, args))
            for path in WRITERS:
                times[path].append(extract_path(model_dir, batch, args, Path(tmp) / path, path))
    print(f"model: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.dtype}")
    print(f"work: {len(batch)} prompts x {args.prompt_len} tokens = {tokens} tokens, "
          f"budget {args.budget}, {args.max_num_seqs} seqs; shards of {args.shard_tokens} "
          f"tokens, bf16; median of {args.repeats} interleaved runs")
    bare = median(times["bare"])
    print(f"bare vLLM prefill      : {tokens / bare:10.1f} tokens/s ({bare:.2f} s)")
    for path in WRITERS:
        seconds = median(times[path])
        print(f"extract, writer {path:<6} : {tokens / seconds:10.1f} tokens/s ({seconds:.2f} s); "
              f"extract / bare {bare / seconds:.3f}")


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


def worker_seconds(rows: int, hidden: int, storage: str, engine_dtype: str, path: str) -> float:
    """What the worker does to one step's rows after the forward, on this CPU, through its
    own functions (benchmarks/capture.py): the hooks' clones, stack, cast or quantize, then
    per request either slices for the RPC (driver) or the finite flag and the copy into the
    shard buffer (rank0). Median of 5."""
    from benchmarks import capture

    dtype = getattr(torch, engine_dtype)
    device = torch.device("cpu")
    slots = [torch.randn(rows, hidden).to(dtype) for _ in range(len(CAPTURE_AUX_IDS) + 1)]
    positions = torch.arange(rows)
    worker = capture.Worker(capture.worker_module(), len(slots), hidden, device, storage)
    if path == "rank0":
        worker.ext._open_shard_writer(rows, "draftline.formats:write_shard", 1)
    times = []
    for repeat in range(5):
        if path == "rank0":
            worker.ext._begin_shard({"path": "unused", "num_tokens": rows, "tensors": {},
                                     "metadata": {}, "values_key": "v", "scales_key": "s"})
            worker.ext._place_requests({f"r{repeat}": (0, rows)})
        start = time.perf_counter()
        worker.step(slots, positions, {f"r{repeat}": rows})
        times.append(time.perf_counter() - start)
        if path == "rank0":
            worker.ext._shards.drop()
        else:
            worker.ext._take_captured([f"r{repeat}"])
    return sorted(times)[2]


def capture_run(model_dir: Path, batch: list[list[int]], args, storage: str, path: str,
                out_dir: Path) -> dict:
    """The generator with ``storage`` in its worker and ``path``'s writer, timed per part."""
    from speculators.data_generation import VllmHiddenStatesGenerator

    from draftline import formats
    from draftline.extract import shards, writer
    from draftline.extract.settings import ShardJob
    from draftline.pipeline.progress import TOKENS, Progress

    generator = VllmHiddenStatesGenerator(
        str(model_dir), layer_ids=CAPTURE_AUX_IDS, max_model_len=args.prompt_len + 16,
        dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget,
        hidden_states_dtype=storage)
    try:
        generator.generate(batch[:2])  # warm-up, not timed
        if path == "rank0":
            generator.open_shard_writer(args.shard_tokens + args.prompt_len + 16, writer.WRITER)
        timer = Timer()
        rpc = generator.executor.collective_rpc

        def timed_rpc(method, *a, **k):
            return timer.wrap(f"rpc {method}", rpc)(method, *a, **k)

        generator.executor.collective_rpc = timed_rpc
        generator._collect_results = timer.wrap("split per slot", generator._collect_results)
        pack, write = formats.pack_shard, formats.write_shard
        formats.pack_shard = timer.wrap("pack", pack)
        formats.write_shard = timer.wrap("write", write)
        lengths = [len(ids) for ids in batch]
        plans = shards.plan_shards(lengths, args.shard_tokens)
        masks = [[1] * n for n in lengths]
        split, progress = writer.TimeSplit(), Progress("bench", sum(lengths), unit=TOKENS, quiet=True)
        metadata = {formats.FINGERPRINT: "benchmark"}
        start = time.perf_counter()
        try:
            job = ShardJob(batch, masks, Path(out_dir), metadata, args.shard_tokens, storage)
            if path == "rank0":
                writer.on_rank0(generator, plans, job, progress, split)
            else:
                writer.in_driver(generator, plans, job, progress, split)
        finally:
            formats.pack_shard, formats.write_shard = pack, write
        total = time.perf_counter() - start
        written = sum((out_dir / p.name).stat().st_size for p in plans)
        for plan in plans:
            (out_dir / plan.name).unlink()
            shards.timing_path(out_dir / plan.name).unlink()
    finally:
        generator.shutdown()
    return {"seconds": timer.seconds, "split": split, "total": total, "bytes": written}


def capture_path(args) -> None:
    from draftline.extract import shards
    from draftline.tiny import builders

    batch = prompts(args)
    tokens = sum(len(ids) for ids in batch)
    runs: dict[tuple[str, str], list[dict]] = {(s, p): [] for s in STORAGE for p in WRITERS}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = builders.build_tiny_llama(
            Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=1,
            num_kv_heads=1, head_dim=128, intermediate_size=128, vocab_size=args.vocab)
        for _ in range(args.repeats):  # interleaved: the box's load moves between runs
            for storage, path in runs:
                runs[storage, path].append(capture_run(model_dir, batch, args, storage, path, Path(tmp)))
                gc.collect()
    print(f"model: Llama hidden {args.hidden}, {args.layers} layers, 1 head x 128, MLP 128, "
          f"engine {args.dtype}; {len(CAPTURE_AUX_IDS) + 1} slots; {tokens} tokens in shards of "
          f"{args.shard_tokens}, prompts of {args.prompt_len}, step budget {args.budget}; "
          f"median of {args.repeats} interleaved runs")
    ceilings = {}
    for storage, path in runs:
        ceilings[storage, path] = report_capture(
            storage, path, runs[storage, path], tokens, args,
            shards.bytes_per_token(len(CAPTURE_AUX_IDS) + 1, args.hidden, storage))
    for storage in STORAGE:
        print(f"{storage}: capture ceiling rank0 / driver "
              f"{ceilings[storage, 'rank0'] / ceilings[storage, 'driver']:.2f}x")


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def capture_parts(storage: str, path: str, runs: list[dict], tokens: int, args) -> dict[str, float]:
    """Seconds per part of the capture path (median over runs)."""
    worker = worker_seconds(args.budget, args.hidden, storage, args.dtype, path) * tokens / args.budget
    if path == "driver":
        return {"worker: clone, stack, cast/quantize (step-sized, this CPU)": worker,
                "RPC: finished requests' rows to the driver": median(
                    [r["seconds"].get("rpc _take_captured", 0.0) for r in runs]),
                "split per slot (generator)": median([r["seconds"]["split per slot"] for r in runs]),
                "pack (stack, cast, finite check)": median([r["seconds"]["pack"] for r in runs]),
                "write (safetensors, atomic)": median([r["seconds"]["write"] for r in runs])}
    return {"worker: + finite flag, copy to shard buffer (step-sized)": worker,
            "RPC: placements and counts": median(
                [sum(r["seconds"].get(f"rpc {m}", 0.0) for m in ("_take_captured", "_place_requests"))
                 for r in runs]),
            "driver waits on rank 0 (buffer, finish, last writes)": median(
                [r["split"].waiting for r in runs]),
            "writer thread: write (safetensors, atomic)": median([r["split"].writing for r in runs])}


def report_capture(storage: str, path: str, runs: list[dict], tokens: int, args,
                   per_token: int) -> float:
    """Seconds per part, as GB/s of shard bytes and as a tokens/s ceiling; the ceiling."""
    parts = capture_parts(storage, path, runs, tokens, args)
    steps = median([r["seconds"]["rpc _capture_step"] for r in runs])
    total = median([r["total"] for r in runs])
    nbytes = median([r["bytes"] for r in runs])
    ceiling = sum(parts.values())
    host = ceiling - next(iter(parts.values()))  # on a GPU machine the worker's part is on the device
    print(f"\n{storage}, writer {path}: {nbytes / tokens:.1f} bytes/token on disk (formula "
          f"{per_token}); whole run {tokens / total:,.0f} tokens/s ({total:.2f} s, of it capture "
          f"steps {steps:.2f} s: forward + worker copies)")
    for name, seconds in parts.items():
        print(f"  {name:<56} {seconds:7.3f} s  {nbytes / max(seconds, 1e-9) / 1e9:7.2f} GB/s  "
              f"{tokens / max(seconds, 1e-9):>12,.0f} tokens/s")
    print(f"  {'host parts (all but the worker)':<56} {host:7.3f} s  "
          f"{nbytes / host / 1e9:7.2f} GB/s  {tokens / host:>12,.0f} tokens/s ceiling")
    print(f"  {'capture path, all parts (as if serial with the forward)':<56} {ceiling:7.3f} s  "
          f"{nbytes / ceiling / 1e9:7.2f} GB/s  {tokens / ceiling:>12,.0f} tokens/s ceiling")
    return tokens / ceiling


if __name__ == "__main__":
    main()
