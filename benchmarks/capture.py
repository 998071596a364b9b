"""The capture path alone, driven through the patched worker's own functions (no vLLM needed).

    python -m benchmarks.extract --torch-only                 # CUDA if present, else CPU
    python -m benchmarks.extract --torch-only --device cpu --threads 1

What a forward leaves behind is simulated: each step, one [step_tokens, hidden] tensor per slot
in the engine's dtype, handed to the worker's hooks (``_record``, ``_record_final``), then the
worker's ``_distribute_step`` and ``_take_captured`` run as vLLM's executor would call them.
The forward itself takes no time, so the rate printed is the ceiling the capture path puts on
extraction. Two writers, the same shards:

* driver (the path before draftline issue 30): rows to host memory per step, concatenated
  per request, pickled (the executor's RPC; its socket transfer is left out, so this path is
  shown faster than it is), unpickled, split per slot, packed (stack, cast, finite check) and
  written by draftline.formats;
* rank0 (patches/speculators/0008): the worker copies each step into a pinned shard buffer on
  a copy stream, and its writer thread writes the shard with draftline.formats.write_shard
  while the next steps run.

Without vLLM the worker module is loaded from the installed, patched speculators file with
``vllm.distributed`` stubbed: the capture functions never call it (only the model setup does).
"""

from __future__ import annotations

import functools
import importlib.util
import pickle
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from draftline import formats
from draftline.extract import shards, writer


@functools.cache  # the stub below must be made once: a second find_spec("vllm") would fail on it
def worker_module():
    """speculators' patched custom_worker, with or without vLLM installed."""
    if importlib.util.find_spec("vllm") is not None:
        from speculators.data_generation import custom_worker

        return custom_worker
    spec = importlib.util.find_spec("speculators")
    if spec is None:
        raise SystemExit("speculators is not installed: install it (--no-deps) and apply "
                         "patches/speculators with python -m draftline.patchq apply")
    path = Path(spec.submodule_search_locations[0]) / "data_generation" / "custom_worker.py"
    if "ShardWriter" not in path.read_text():
        raise SystemExit(f"{path} lacks patches/speculators/0008: apply the queue first")

    def unused(*_):
        raise RuntimeError("the benchmark drives no model setup")

    vllm = types.ModuleType("vllm")
    vllm.distributed = types.ModuleType("vllm.distributed")
    vllm.distributed.get_pp_group = vllm.distributed.get_tp_group = unused
    sys.modules.setdefault("vllm", vllm)
    sys.modules.setdefault("vllm.distributed", vllm.distributed)
    module_spec = importlib.util.spec_from_file_location("draftline_bench_custom_worker", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


class Worker:
    """One TP rank 0 worker extension with its capture state and nothing of vLLM's."""

    def __init__(self, module, num_slots: int, hidden: int, device: torch.device, storage: str):
        self.ext = module.HiddenStatesWorkerExtension.__new__(module.HiddenStatesWorkerExtension)
        self.ext._init_capture(num_slots, hidden, device, True, storage)
        self.ext.model_runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(req_ids=[]))
        self.num_slots = num_slots

    def step(self, rows: list[torch.Tensor], positions: torch.Tensor, requests: dict[str, int]):
        """What the hooks and _capture_step do after one forward of ``requests``."""
        ext = self.ext
        ext._capturing = True
        for slot in range(self.num_slots - 1):
            ext._record(slot, rows[slot], positions)
        ext._record_final(self.num_slots - 1, rows[-1])
        ext._capturing = False
        ext.model_runner.input_batch.req_ids = list(requests)
        ext._distribute_step(requests)


def sync(device: torch.device) -> None:
    """Wait for the compute stream only: copies on the worker's copy stream run on."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def run_path(path: str, args, storage: str, device: torch.device, out_dir: Path, module) -> dict:
    """One pass over ``args.shards`` shards; seconds per part and the whole wall time."""
    dtype = getattr(torch, args.engine_dtype)
    slots, hidden, prompt = args.slots, args.hidden, args.prompt_len
    per_step = args.step_tokens // prompt  # whole requests per step
    per_shard = args.shard_tokens // prompt
    generator = torch.Generator(device=device).manual_seed(0)
    rows = [torch.randn(per_step * prompt, hidden, generator=generator, device=device).to(dtype)
            for _ in range(slots)]  # one step's forward output per slot, reused every step
    positions = torch.arange(prompt, device=device).repeat(per_step)
    worker = Worker(module, slots, hidden, device, storage)
    metadata = formats.shard_metadata("benchmark", list(range(1, slots)), hidden)
    ids = torch.randint(7, 500, (prompt,)).tolist()
    seconds: dict[str, float] = {}
    files: list[Path] = []  # removed after the timing: freeing their pages is no part of the path

    def timed(name, function, *a):
        start = time.perf_counter()
        result = function(*a)
        sync(device)
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
        return result

    if path == "rank0":
        timed("worker: allocate buffers (once)", worker.ext._open_shard_writer,
              per_shard * prompt, writer.WRITER, 2)
    start = time.perf_counter()
    for index in range(args.shards):
        names = [f"s{index}r{i}" for i in range(per_shard)]
        name = str(out_dir / f"{path}-{storage}-shard-{index:05d}.safetensors")
        sample_ids = tuple(range(per_shard))
        masks = {i: [1] * prompt for i in sample_ids}
        if path == "rank0":
            rows_meta = formats.shard_rows(sample_ids, {i: ids for i in sample_ids}, masks)
            status = timed("driver waits: a free buffer", worker.ext._begin_shard, {
                "path": name, "num_tokens": per_shard * prompt, "tensors": rows_meta,
                "metadata": metadata, "values_key": formats.HIDDEN_STATES,
                "scales_key": formats.HIDDEN_SCALES})
            note_writes(status["written"], seconds, files)
            worker.ext._place_requests({r: (i * prompt, prompt) for i, r in enumerate(names)})
        taken = {}
        for first in range(0, per_shard, per_step):
            step = {r: prompt for r in names[first:first + per_step]}
            timed("worker: record, stack, cast, copy" if path == "rank0" else
                  "worker: record, stack, cast, D2H", worker.step, rows, positions, step)
            got = timed("worker: take", worker.ext._take_captured, list(step))
            if path == "driver":
                message = timed("pickle (worker)", pickle.dumps, got, pickle.HIGHEST_PROTOCOL)
                taken.update(timed("unpickle (driver)", pickle.loads, message))
        if path == "rank0":
            status = timed("driver waits: finish", worker.ext._finish_shard)
            if status["non_finite"] is not None:
                raise RuntimeError(f"non-finite rows: {status['non_finite']}")
        else:
            results = timed("split per slot (driver)", split_results, taken, names, ids)
            tensors = timed("pack (driver)", formats.pack_shard, sample_ids, results, masks,
                            storage)
            timed("write (driver)", formats.write_shard, Path(name), tensors, metadata)
            files.append(Path(name))
        if path == "rank0":
            note_writes(status["written"], seconds, files)
    if path == "rank0":
        status = timed("driver waits: last writes", worker.ext._flush_shards)
        note_writes(status["written"], seconds, files)
    total = time.perf_counter() - start
    written = sum(f.stat().st_size for f in files)
    for f in files:
        f.unlink()
        shards.timing_path(f).unlink(missing_ok=True)
    return {"seconds": seconds, "total": total, "bytes": written,
            "tokens": args.shards * per_shard * prompt}


def split_results(taken: dict, names: list[str], ids: list[int]) -> dict[int, dict]:
    """The generator's per-slot split of what the RPC brought (_collect_results)."""
    results = {}
    for i, name in enumerate(names):
        rows = taken[name]
        rows, scales = rows if isinstance(rows, tuple) else (rows, None)
        if scales is not None:
            rows = rows.view(torch.float8_e4m3fn)
        result = {"input_ids": torch.as_tensor(ids), "hidden_states": [
            rows[:, s].contiguous() for s in range(rows.shape[1])]}
        if scales is not None:
            result["hidden_states_scales"] = [scales[:, s].contiguous() for s in range(scales.shape[1])]
        results[i] = result
    return results


def note_writes(records: list[dict], seconds: dict[str, float], files: list[Path]) -> None:
    """Rank 0's finished writes: their seconds (on the writer thread) and files."""
    for record in records:
        for key, name in (("copy_wait_s", "writer thread: wait for copies (beside)"),
                          ("write_s", "writer thread: write (beside)")):
            seconds[name] = seconds.get(name, 0.0) + record[key]
        files.append(Path(record["path"]))


def main(args) -> None:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(args.threads)
    module = worker_module()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    per_token = shards.bytes_per_token(args.slots, args.hidden, "bfloat16")
    print(f"capture path, torch only, on {name} ({device}); {args.threads} torch thread(s); hidden "
          f"{args.hidden}, {args.slots} slots, engine {args.engine_dtype}; {args.shards} shards of "
          f"{args.shard_tokens} tokens, steps of {args.step_tokens}, prompts of {args.prompt_len}; "
          f"forward: none (the ceiling); median of {args.repeats} interleaved runs; "
          f"bf16 {per_token} B/token")
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        for storage in args.storage:
            runs = {path: [] for path in args.writers}
            for _ in range(args.repeats):
                for path in runs:
                    runs[path].append(run_path(path, args, storage, device, Path(tmp), module))
            for path, done in runs.items():
                report(path, storage, done)
            if len(runs) == 2:
                driver, rank0 = (sorted(r["total"] for r in runs[p])[len(runs[p]) // 2]
                                 for p in ("driver", "rank0"))
                print(f"  {storage}: rank0 / driver: {driver / rank0:.2f}x")


def report(path: str, storage: str, runs: list[dict]) -> None:
    tokens = runs[0]["tokens"]
    total = sorted(r["total"] for r in runs)[len(runs) // 2]
    print(f"\n{storage}, {path}: whole path {tokens / total:>10,.0f} tokens/s "
          f"({total:.2f} s for {tokens} tokens, {runs[0]['bytes'] / tokens:.0f} B/token on disk)")
    for name in runs[0]["seconds"]:
        value = sorted(r["seconds"].get(name, 0.0) for r in runs)[len(runs) // 2]
        alone = f"{tokens / value:>12,.0f}" if value > 0 else f"{'-':>12}"
        print(f"  {name:<46} {value:7.3f} s {alone} tokens/s alone")
