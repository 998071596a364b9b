"""Draft training throughput: bf16 vs fp32, batches on the device vs read from shards on disk.

    python -m benchmarks.train                          # CUDA, Llama-3.1-8B dims, auto precision
    python -m benchmarks.train --compare-precision      # bf16 and fp32, with their ratio
    python -m benchmarks.train --device cpu --hidden 256 --vocab 2048 --draft-vocab 512 \\
        --tokens-per-step 512 --steps 3 --warmup 1 --compare-precision     # CPU smoke run
    python -m benchmarks.train --results one.json                 # plain, one GPU: the baseline
    python -m benchmarks.train --gpus 2 --baseline one.json       # DDP on 2 GPUs, with the ratio
    python -m benchmarks.train --save-dtype float8_e4m3fn         # fp8 shards (issue 24)
    python -m benchmarks.train --reference --loader-staging consumer,workers   # issue 33's table

For each precision, the same training step (``draftline.train.loop.Session.step``: speculators'
forward with TTT rollout and KL loss, backward, clip, AdamW, schedule) runs twice, each for
``--warmup`` untimed then ``--steps`` timed steps:

1. ``resident``: synthetic batches made once on the device (bf16 hidden states, as shards
   store them) and reused -- the step alone;
2. ``disk``: batches read from synthetic shards through the training data path
   (``draftline.train.loader.PackedLoader``: memory-mapped shards, packing by token budget with
   ``draftline.train.packing``'s planner, pinned buffers, packing threads, device copy one step
   ahead).  ``python -m benchmarks.packing`` prints the fill of these plans without training.

Shards (``--disk-tokens`` tokens, default enough for every step of one run) are written to
``--workdir`` first.  Before each read the page cache for them is dropped (fsync +
``posix_fadvise(DONTNEED)``; best effort, some kernels and sandboxes ignore it), and three
reads are timed: a plain sequential read of the files (the disk's bandwidth), the loader
alone (no model), and training from disk.  The verifier is a minimal directory
(config.json + ``model.embed_tokens.weight``, tied head) of random weights; no vLLM, no
network.

``--optimizer`` picks AdamW's kernel (``auto``: fused where torch has it, as training does;
``unfused``: torch's default, ``foreach`` on CUDA, as speculators' Trainer runs it); the header
line and ``--results`` name the one that ran.

``--save-dtype float8_e4m3fn`` writes the shards as extract does with that dtype (fp8 values,
a float32 scale per token and slot); the loader moves those bytes and dequantizes on the
device, and the resident batches are held the same way and dequantized every step.  The
loader's GB/s counts the bytes the shards store per position, whatever the dtype.

``--loader-staging consumer,workers`` reads from disk once per staging (``PackedLoader``'s
``staging``: the training thread copies each batch to the GPU, as before issue 33, or the
packing threads do), page cache dropped before each, with the same session: before and after
in one process.  ``--reference`` adds the anchor: speculators 0.3.0's own step
(``reference_run``) on resident batches in the same process.

Printed per run: tokens/s (real tokens, padding excluded) over the timed steps and over
the steady ones (timed steps whose batch was asked for after the loader first held its
whole prefetch), median step time (ms), the wait for data per timed step (host ms between
asking for the batch and holding it: p50/p90/max), the device's idle time before each
step's first kernel (CUDA events: p50/p90/max), start-up (s from the warm-up's first request
to the first full prefetch), peak memory (GiB: ``torch.cuda.max_memory_allocated`` on CUDA,
the process's peak RSS on CPU), achieved TFLOP/s, and the fill (real tokens / token budget);
then each disk run over its resident run and every run over the anchor.

FLOPs per step (``step_flops``), matmuls only, 2 FLOPs per multiply-add; P positions per step
(the token budget: the draft computes on padding too), H hidden, I intermediate, nh/nkv
heads, d head dim, Vd draft vocab, K TTT steps, L draft layers, lengths l_j of the packed
samples:

    trainable forward = P * (2*3H*H                                   fc, once
                          + K * ( 2*2H*(nh + 2*nkv)*d + 2*nh*d*H     first layer q,k,v | o
                                  + (L-1) * (2*H*(nh + 2*nkv)*d + 2*nh*d*H)
                                  + L * 3 * 2*H*I                    gate, up, down
                                  + 2*H*Vd ))                        lm_head
                      + K * L * 4*nh*d * sum_k (sum_j l_j*(l_j+1)/2 + k*P)   QK^T and PV
    step FLOPs = 3 * trainable forward (forward + backward) + P * 2*H*Vd
                                                     (verifier lm_head targets, forward only)

Attention counts only unmasked scores (causal within a sample, plus the k earlier TTT
positions of each token at TTT step k); kernels that compute masked blocks do more work.
Llama-3.1-8B defaults: ~7.3 GFLOP per position.

Several GPUs (``--gpus N``): the command re-launches itself under torchrun with N processes
(``draftline.pipeline.launch``: one per GPU, NCCL -- gloo with ``--device cpu`` -- and NVLink multicast
off, as ``make train GPUS=N`` runs), each rank on ``cuda:<local rank>`` with the draft wrapped in
``DistributedDataParallel`` (also at N = 1, so ``--gpus 1`` against the plain run is DDP's own
cost), exactly as the train stage trains.  ``--tokens-per-step`` is each rank's budget (weak
scaling: N GPUs do N times the work per step); ``--split-budget`` divides it among the ranks
instead, as ``train.max_tokens_per_step`` is divided.  Each rank makes its own resident batches
and reads its own share of the shards (the step planner's share for rank r of N);
rank 0 writes the shards before the others start.  Printed: each rank's line, then the total
(tokens of all ranks over the slowest rank's time, peak memory of the fullest GPU, TFLOP/s of
all GPUs together).  ``--results FILE`` writes the numbers as JSON; ``--baseline FILE`` (an
earlier ``--results``, e.g. the plain one-GPU run) prints this run's tokens/s over that one's
and the scaling efficiency (ratio / GPU ratio).

Measured on one H200 (torch 2.11, defaults, --steps 10 --warmup 3): bf16 ~64-66k tokens/s
(124-128 ms/step, 16.2 GiB, ~470-480 TFLOP/s) resident and ~59-61k from disk at the same
step rate; fp32 ~4.8k (1.72 s/step, 22.5 GiB, 35 TFLOP/s); bf16/fp32 13.8x.  With
``--compile 0`` (dense-mask SDPA) bf16 runs ~31k tokens/s.  Loader alone: 2.8-4.5 GB/s
from a cold disk whose plain sequential read gave 1.8-2.1 GB/s, 22 GB/s from page cache.
Again later (same machine kind, torch 2.11.0+cu130, --steps 10 --warmup 3), plain vs
``--gpus 1`` (DDP, one rank): Llama-3.1-8B dims 66.1k vs 63.3k resident (122.9 vs 129.0 ms,
16.2 vs 19.4 GiB), 60.7k vs 57.6k from disk; Kimi-K2.5 draft dims (``--hidden 7168
--intermediate 18432 --heads 56 --kv-heads 8 --vocab 163840``) 33.0k vs 31.6k resident
(248.9 vs 258.0 ms, 30.5 vs 36.6 GiB), 30.0k vs 29.1k from disk.
On nvidia-h200-x2 (2 H200s, torch 2.11.0+cu130, --steps 10 --warmup 3, 8192 tokens/step per
rank), plain one GPU vs ``--gpus 2``: Llama-3.1-8B dims resident 65.5k vs 120.2k tokens/s
(1.834x, 91.7%; 123.7 vs 133.9 ms/step; 16.2 vs 19.4 GiB per GPU), from disk 60.6k vs 93.5k
(1.54x); Kimi-K2.5 draft dims resident 32.3k vs 60.0k (1.859x, 93.0%; 251.5 vs 272.2 ms;
30.5 vs 36.6 GiB), from disk 29.8k vs 39.3k (1.32x).  From disk, two ranks share one disk with
the page cache dropped before each read: 39.3k Kimi tokens/s is ~2.2 GB/s of hidden states,
what the loader alone read cold (2.76 GB/s) on that disk, so the disk, not DDP, bounds it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import get_linear_schedule_with_warmup

from draftline import formats
from draftline.pipeline import launch
from draftline.train.dataset import ShardSampleDataset
from draftline.train.fp8 import SCALE_KEYS, dequantize_batch
from draftline.train.loader import HIDDEN_KEYS, STAGINGS, PackedLoader
from draftline.train.packing import make_sampler, plan_steps
from draftline.train.draft import build_draft, set_attention
from draftline.train.loop import GRAD_CLIP, Session, make_session
from draftline.train.settings import TrainSettings
from draftline.train.optimizer import optimizer_implementation
from draftline.train.timing import StepClock, distribution

NUM_AUX = 3
SLOTS = NUM_AUX + 1
READ_CHUNK = 64 << 20  # bytes per read() in the sequential-read baseline
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Dims:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    draft_vocab: int
    layers: int
    ttt: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    add("--hidden", type=int, default=4096, help="hidden size")
    add("--intermediate", type=int, default=None, help="MLP size (default 3.5 x hidden)")
    add("--heads", type=int, default=None, help="attention heads (default hidden / 128)")
    add("--kv-heads", type=int, default=None, help="KV heads (default heads / 4)")
    add("--vocab", type=int, default=128256, help="verifier vocabulary size")
    add("--draft-vocab", type=int, default=32000, help="draft vocabulary size")
    add("--layers", type=int, default=1, help="draft decoder layers")
    add("--ttt", type=int, default=3, help="TTT steps")
    add("--tokens-per-step", type=int, default=8192, help="token budget per step")
    add("--sample-len", type=int, default=None,
        help="mean sample length, tokens (default tokens-per-step / 8); lengths uniform in "
             "[mean/2, 3*mean/2]")
    add("--steps", type=int, default=20, help="timed steps per run")
    add("--warmup", type=int, default=5, help="untimed steps before each run (compiles)")
    add("--precision", default="auto", choices=["auto", "bf16", "fp32"],
        help="auto: bf16 on CUDA, fp32 on CPU")
    add("--compare-precision", action="store_true", help="run bf16 and fp32, print ratios")
    add("--compile", default="auto", choices=["auto", "0", "1"],
        help="torch.compile the forward (auto: on CUDA)")
    add("--optimizer", default="auto", choices=["auto", "fused", "unfused"],
        help="AdamW kernel (auto: fused where torch has one)")
    add("--disk-tokens", type=int, default=None,
        help="tokens in the synthetic shards (default (warmup + steps) x tokens-per-step)")
    add("--shard-tokens", type=int, default=65536, help="tokens per shard file")
    add("--save-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"],
        help="hidden states in the shards (extract.save_dtype); fp8 is dequantized on the "
             "device, in the resident batches too")
    add("--loader-threads", type=int, default=None, help="packing threads (default: auto)")
    add("--prefetch", type=int, default=None, help="batches packed ahead (default: auto)")
    add("--loader-staging", default="workers", type=stagings,
        help=f"comma-separated, of {','.join(STAGINGS)}: who copies a packed batch to the "
             "GPU (workers: the packing threads; consumer: the training thread, the loader "
             "before issue 33); one disk run each, in this order, in this process")
    add("--reference", action="store_true",
        help="also time speculators 0.3.0's own step (its Trainer's calls, its default "
             "AdamW, bf16 autocast over float32 weights) on the resident batches: the anchor")
    add("--workdir", default=None, help="where shards and the verifier go (default: a temp "
                                        "dir, removed afterwards)")
    add("--seed", type=int, default=0, help="RNG seed")
    add("--gpus", type=int, default=None,
        help="run under torchrun with this many processes (DDP, one per GPU; gloo on CPU); "
             "default: the plain single-process path")
    add("--split-budget", action="store_true",
        help="--tokens-per-step is the global budget, divided among the ranks")
    add("--collective-timeout-s", type=float, default=1800.0,
        help="seconds a collective (the wait for rank 0's shards too) may take")
    add("--results", default=None, help="write the numbers to this JSON file (rank 0)")
    add("--baseline", default=None,
        help="a --results file (e.g. one GPU) to print this run's tokens/s ratio against")
    return parser.parse_args(argv)


def stagings(value: str) -> list[str]:
    """``--loader-staging``'s comma-separated list, each one of STAGINGS, none twice."""
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    if not chosen or len(set(chosen)) != len(chosen) or set(chosen) - set(STAGINGS):
        raise argparse.ArgumentTypeError(f"expected distinct names of {STAGINGS}, got {value!r}")
    return chosen


def dims_from(args: argparse.Namespace) -> Dims:
    heads = args.heads or max(1, args.hidden // 128)
    return Dims(hidden=args.hidden, intermediate=args.intermediate or args.hidden * 7 // 2,
                heads=heads, kv_heads=args.kv_heads or max(1, heads // 4),
                head_dim=args.hidden // heads, vocab=args.vocab,
                draft_vocab=args.draft_vocab, layers=args.layers, ttt=args.ttt)


def rank_tokens(args: argparse.Namespace, world: launch.World) -> int:
    """One rank's token budget per step: all of it, or with --split-budget its share."""
    if not args.split_budget:
        return args.tokens_per_step
    return launch.rank_tokens(args.tokens_per_step, world, "--split-budget --tokens-per-step")


# --------------------------------------------------------------------------- FLOPs


def step_flops(dims: Dims, positions: int, lengths: Iterable[int]) -> float:
    """Matmul FLOPs of one training step (formula in the module docstring)."""
    h, d = dims.hidden, dims.head_dim
    qkv_out = (dims.heads + 2 * dims.kv_heads) * d
    first = 2 * 2 * h * qkv_out + 2 * dims.heads * d * h
    later = (dims.layers - 1) * (2 * h * qkv_out + 2 * dims.heads * d * h)
    mlp = dims.layers * 3 * 2 * h * dims.intermediate
    lm_head = 2 * h * dims.draft_vocab
    per_position = 2 * 3 * h * h + dims.ttt * (first + later + mlp + lm_head)
    causal = sum(n * (n + 1) / 2 for n in lengths)
    scores = sum(causal + k * positions for k in range(dims.ttt))
    attention = dims.layers * 4 * dims.heads * d * scores
    return 3 * (positions * per_position + attention) + positions * lm_head


# --------------------------------------------------------------------------- inputs


def write_verifier(root: Path, dims: Dims, generator: torch.Generator) -> Path:
    """config.json + the (tied) embedding: all the draft reads of its verifier."""
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": dims.hidden, "intermediate_size": dims.intermediate,
        "num_attention_heads": dims.heads, "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim, "num_hidden_layers": 32, "vocab_size": dims.vocab,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    }
    (root / "config.json").write_text(json.dumps(config, indent=2))
    embed = random_bf16((dims.vocab, dims.hidden), generator) * 0.02
    save_file({"model.embed_tokens.weight": embed}, str(root / "model.safetensors"))
    return root


def random_bf16(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Standard-normal bf16 on the CPU, drawn on the GPU when there is one (GBs: ~50x faster)."""
    if not torch.cuda.is_available():
        return torch.randn(shape, generator=generator).to(torch.bfloat16)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    cuda = torch.Generator("cuda").manual_seed(seed)
    return torch.randn(shape, generator=cuda, device="cuda", dtype=torch.bfloat16).cpu()


def vocab_mapping(dims: Dims, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t int64 [draft_vocab], t2d bool [vocab]: a random draft vocabulary."""
    selected = torch.randperm(dims.vocab, generator=generator)[: dims.draft_vocab].sort().values
    t2d = torch.zeros(dims.vocab, dtype=torch.bool)
    t2d[selected] = True
    return selected - torch.arange(dims.draft_vocab), t2d


def sample_lengths(total: int, mean: int, generator: torch.Generator) -> list[int]:
    """Sample lengths uniform in [mean/2, 3*mean/2] (at least 2) summing to ``total``."""
    lengths, used = [], 0
    low, high = max(2, mean // 2), max(3, mean * 3 // 2)
    while used < total:
        length = min(int(torch.randint(low, high + 1, (1,), generator=generator)), total - used)
        if length < 2:
            break
        lengths.append(length)
        used += length
    return lengths


def resident_batches(dims: Dims, tokens: int, mean: int, device: str, count: int,
                     generator: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """``count`` packed batches made on the device, as the loader delivers them (bf16)."""
    batches = []
    for _ in range(count):
        lengths = sample_lengths(tokens, mean, generator)
        positions = torch.cat([torch.arange(1, n + 1) for n in lengths])  # [tokens]
        batch = {
            "hidden_states": torch.randn(1, tokens, NUM_AUX * dims.hidden, generator=generator),
            "verifier_last_hidden_states": torch.randn(1, tokens, dims.hidden,
                                                       generator=generator),
            "input_ids": torch.randint(0, dims.vocab, (1, tokens), generator=generator),
            "loss_mask": torch.ones(1, tokens, dtype=torch.long),
            "position_ids": positions[None],
            "lengths": torch.tensor(lengths, dtype=torch.long),
        }
        batches.append({k: v.to(torch.bfloat16) if v.is_floating_point() else v
                        for k, v in batch.items()})
    return [{k: v.to(device) for k, v in b.items()} for b in batches]


def as_stored(batch: dict[str, torch.Tensor], save_dtype: str) -> dict[str, torch.Tensor]:
    """A resident batch as the loader hands fp8 shards to the device: values and scales
    (SCALE_KEYS), for ``dequantized`` to undo each step. bf16: the batch itself."""
    if not formats.is_quantized(save_dtype):
        return batch
    out = dict(batch)
    aux, hidden = NUM_AUX, batch["verifier_last_hidden_states"].shape[-1]
    states = batch["hidden_states"].view(*batch["hidden_states"].shape[:2], aux, hidden)
    values, scales = formats.quantize_fp8(states)
    out["hidden_states"], out[SCALE_KEYS[0]] = values.view(batch["hidden_states"].shape), scales
    out["verifier_last_hidden_states"], out[SCALE_KEYS[1]] = formats.quantize_fp8(
        batch["verifier_last_hidden_states"])
    return out


def dequantized(batches: Iterable[dict], dtype: torch.dtype) -> Iterable[dict]:
    """Resident fp8 batches dequantized on the device each step, as PackedLoader does."""
    for batch in batches:
        yield dequantize_batch(batch, dtype) if SCALE_KEYS[0] in batch else batch


def write_shards(root: Path, dims: Dims, total_tokens: int, shard_tokens: int, mean: int,
                 generator: torch.Generator, save_dtype: str = "bfloat16"
                 ) -> tuple[list[Path], Path]:
    """Shards in the extract stage's format plus a split index with every sample in train."""
    root.mkdir(parents=True, exist_ok=True)
    lengths = sample_lengths(total_tokens, mean, generator)
    paths, rows, first = [], [], 0
    while first < len(lengths):
        count, tokens = 0, 0
        while first + count < len(lengths) and (tokens < shard_tokens or count == 0):
            tokens += lengths[first + count]
            count += 1
        shard_lengths = lengths[first:first + count]
        path = root / f"shard-{len(paths):05d}.safetensors"
        save_file(_shard_tensors(dims, shard_lengths, first, generator, save_dtype), str(path))
        rows += [(len(paths), row, n) for row, n in enumerate(shard_lengths)]
        paths.append(path)
        first += count
    index = root / "split.safetensors"
    formats.write_split_index(index, torch.tensor(rows, dtype=torch.int64),
                              torch.zeros(0, 3, dtype=torch.int64))
    return paths, index


def _shard_tensors(dims: Dims, lengths: list[int], first_id: int, generator: torch.Generator,
                   save_dtype: str = "bfloat16") -> dict[str, torch.Tensor]:
    """Random samples packed as the extract stage packs them (every token in the loss)."""
    tokens = sum(lengths)
    hidden = random_bf16((tokens, SLOTS, dims.hidden), generator)  # [tokens, slots, H]
    ids = torch.randint(0, dims.vocab, (tokens,), generator=generator)  # [tokens]
    mask = torch.ones(tokens, dtype=torch.uint8)  # [tokens]
    sample_ids = range(first_id, first_id + len(lengths))
    results, masks, start = {}, {}, 0  # fp8 (--save-dtype): quantized by pack_shard
    for sample_id, length in zip(sample_ids, lengths):
        span = slice(start, start + length)
        # What the hidden-state generator returns per sample: one [T, H] tensor per slot.
        results[sample_id] = {"hidden_states": list(hidden[span].unbind(1)), "input_ids": ids[span]}
        masks[sample_id] = mask[span]
        start += length
    return formats.pack_shard(tuple(sample_ids), results, masks, save_dtype)


def drop_page_cache(paths: Iterable[Path]) -> None:
    """Best effort: make the next read come from the disk, not from memory."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read(paths: list[Path]) -> float:
    """GB/s of a plain sequential read of the files."""
    buffer = bytearray(READ_CHUNK)
    total, start = 0, time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while read := handle.readinto(buffer):
                total += read
    return total / (time.perf_counter() - start) / 1e9


# --------------------------------------------------------------------------- timing


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # KiB on Linux


@dataclasses.dataclass
class RunResult:
    name: str
    tokens: int = 0
    positions: int = 0
    flops: float = 0.0
    seconds: float = 0.0
    step_ms: list[float] = dataclasses.field(default_factory=list)
    peak_gib: float = 0.0
    loss: float = float("nan")
    rank: int | None = None  # None: one process, or the total over ranks
    samples: list[int] = dataclasses.field(default_factory=list)  # disk runs: dataset rows read
    steady_tokens: int = 0  # timed steps after the loader's first full prefetch
    steady_seconds: float = 0.0
    startup_s: float | None = None  # loader: first request -> first full prefetch
    wait_ms: list[float] = dataclasses.field(default_factory=list)  # per timed step, host
    idle_ms: list[float] = dataclasses.field(default_factory=list)  # per timed step, CUDA only

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def positions_per_second(self) -> float:
        return self.positions / self.seconds

    @property
    def steady_tokens_per_second(self) -> float | None:
        return self.steady_tokens / self.steady_seconds if self.steady_seconds else None

    def line(self) -> str:
        name = self.name if self.rank is None else f"{self.name} r{self.rank}"
        steady = self.steady_tokens_per_second
        startup = "-" if self.startup_s is None else f"{self.startup_s:.2f}"
        return (f"{name:<26} {self.tokens_per_second:>9,.0f} "
                f"{'-' if steady is None else f'{steady:,.0f}':>9} "
                f"{statistics.median(self.step_ms):>7.1f} {_triple(self.wait_ms):>17} "
                f"{_triple(self.idle_ms):>17} {startup:>6} {self.peak_gib:>6.2f} "
                f"{self.flops / self.seconds / 1e12:>7.1f} {self.tokens / self.positions:.3f} "
                f"{self.loss:.3f}")

    def summary(self) -> dict:
        return {"tokens_per_second": self.tokens_per_second,
                "steady_tokens_per_second": self.steady_tokens_per_second,
                "startup_s": self.startup_s,
                "step_ms_median": statistics.median(self.step_ms), "peak_gib": self.peak_gib,
                "tflops": self.flops / self.seconds / 1e12, "tokens": self.tokens,
                "seconds": self.seconds, "loss": self.loss, "fill": self.tokens / self.positions,
                "step_ms": distribution(self.step_ms), "wait_ms": distribution(self.wait_ms),
                "idle_ms": distribution(self.idle_ms)}


LINE_HEADER = (f"{'run':<26} {'tok/s':>9} {'steady':>9} {'step ms':>7} "
               f"{'wait p50/p90/max':>17} {'idle p50/p90/max':>17} {'start':>6} {'GiB':>6} "
               f"{'TFLOP/s':>7} fill  loss")


def _triple(values: list[float]) -> str:
    """p50/p90/max of per-step ms, or '-' where there are none."""
    found = distribution(values)
    return "-" if found is None else "/".join(
        f"{found[k]:.1f}" for k in ("p50", "p90", "max"))


def combine(ranks: list[RunResult]) -> RunResult:
    """All ranks as one run: their tokens over the slowest rank's time, each step as long as
    its slowest rank, the fullest GPU's peak.  The loss is already the mean over ranks."""
    total = RunResult(ranks[0].name, loss=ranks[0].loss)
    total.tokens = sum(r.tokens for r in ranks)
    total.positions = sum(r.positions for r in ranks)
    total.flops = sum(r.flops for r in ranks)
    total.seconds = max(r.seconds for r in ranks)
    total.step_ms = [max(times) for times in zip(*(r.step_ms for r in ranks))]
    total.wait_ms = [max(times) for times in zip(*(r.wait_ms for r in ranks))]
    total.idle_ms = [max(times) for times in zip(*(r.idle_ms for r in ranks))]
    total.steady_tokens = sum(r.steady_tokens for r in ranks)
    total.steady_seconds = max(r.steady_seconds for r in ranks)
    startups = [r.startup_s for r in ranks if r.startup_s is not None]
    total.startup_s = max(startups) if startups else None
    total.peak_gib = max(r.peak_gib for r in ranks)
    return total


def timed_steps(name: str, step: Callable[[dict], dict], device: str, batches: Iterable[dict],
                dims: Dims, warmup: int, steps: int,
                primed: Callable[[], float | None] | None = None) -> RunResult:
    """Run warmup + steps; time the last ``steps`` (host clock around synchronized steps).

    Every step goes through ``StepClock`` (the training loop's timing), so start-up, which
    begins with the warm-up's first batch, ends where ``primed`` says the loader first held
    its whole prefetch; timed steps from then on are the steady state.
    """
    result = RunResult(name)
    clock = StepClock(device, primed)
    batches = clock.timed(batches)
    for _ in range(warmup):
        step(next(batches))
        clock.step_done()
    synchronize(device)
    reset_peak(device)
    for _ in range(steps):
        batch = next(batches)  # waiting for the loader counts: that is the point
        lengths = batch["lengths"].tolist()
        positions = batch["input_ids"].shape[-1]
        metrics = step(batch)  # .item() on its metrics synchronizes
        synchronize(device)
        timing = clock.step_done()
        result.seconds += timing.step_ms / 1e3
        result.step_ms.append(timing.step_ms)
        result.wait_ms.append(timing.wait_ms)
        if timing.idle_ms is not None:
            result.idle_ms.append(timing.idle_ms)
        if not timing.startup:
            result.steady_tokens += sum(lengths)
            result.steady_seconds += timing.step_ms / 1e3
        result.tokens += sum(lengths)
        result.positions += positions
        result.flops += step_flops(dims, positions, lengths)
        result.loss = metrics["loss"]
    result.peak_gib = peak_gib(device)
    result.startup_s = clock.startup_seconds()
    return result


def loader_alone(loader: PackedLoader, device: str,
                 stored_bytes: int | None = None) -> tuple[float, float]:
    """(GB/s of hidden states delivered, tokens/s) with no model running.

    ``stored_bytes``: bytes per delivered position as the shards store them (fp8 values and
    scales; the delivered tensors are dequantized); None counts the delivered tensors.

    Timed from the first batch's arrival: buffer pinning and thread start happen once per
    run (in training, during the first step), not per batch.
    """
    batches = iter(loader)
    next(batches)
    synchronize(device)
    nbytes, tokens, start = 0, 0, time.perf_counter()
    for batch in batches:
        nbytes += (sum(batch[k].numel() * batch[k].element_size() for k in HIDDEN_KEYS)
                   if stored_bytes is None else batch["input_ids"].numel() * stored_bytes)
        tokens += int(batch["lengths"].sum())
    synchronize(device)
    seconds = time.perf_counter() - start
    return nbytes / seconds / 1e9, tokens / seconds


# --------------------------------------------------------------------------- runs


@dataclasses.dataclass(frozen=True)
class Inputs:
    verifier: Path
    d2t: torch.Tensor
    t2d: torch.Tensor
    shards: list[Path]
    index: Path


def new_session(args: argparse.Namespace, dims: Dims, inputs: Inputs, device: str,
                precision: str, world: launch.World, ddp: bool) -> Session:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        model = build_draft(inputs.verifier, [2, 16, 29], inputs.d2t, inputs.t2d, dims.layers,
                            num_speculative_tokens=dims.ttt)
    compile = None if args.compile == "auto" else args.compile == "1"
    total = args.warmup * 2 + args.steps * 2 + 1  # keeps the LR schedule above zero
    settings = TrainSettings(lr=1e-4, ttt_steps=dims.ttt, device=device, precision=precision,
                             compile=compile, fused_optimizer=fused_optimizer(args))
    return make_session(model, settings, warmup_steps=0, total_steps=total, world=world, ddp=ddp)


def fused_optimizer(args: argparse.Namespace) -> bool | None:
    return {"auto": None, "fused": True, "unfused": False}[args.optimizer]


def disk_loader(args: argparse.Namespace, inputs: Inputs, session: Session, steps: int,
                tokens: int, staging: str) -> tuple[PackedLoader, list[int]]:
    """This rank's loader over its share of the shards, and the dataset rows it will read."""
    dataset = ShardSampleDataset(inputs.shards, formats.load_split(inputs.index, formats.TRAIN))
    world = session.world
    sampler = make_sampler(dataset.lengths, tokens, args.seed, world.rank, world.world_size)
    batches = [batch for _, batch in plan_steps(sampler, 0, steps)]
    loader = PackedLoader(dataset, batches, tokens, session.device,
                          session.precision.input_dtype, args.loader_threads, args.prefetch,
                          staging)
    return loader, [int(row) for batch in batches for row in batch]


def run_precision(args: argparse.Namespace, dims: Dims, inputs: Inputs, device: str,
                  precision: str, world: launch.World, ddp: bool) -> list[RunResult]:
    """The resident and the disk run of one precision, as this rank saw them."""
    torch.compiler.reset()  # a fresh model per precision: keep dynamo's recompile budget
    session = new_session(args, dims, inputs, device, precision, world, ddp)
    name = session.precision.name
    tokens = rank_tokens(args, world)
    mean = args.sample_len or max(2, tokens // 8)
    generator = torch.Generator().manual_seed(args.seed + 1 + 1000 * world.rank)
    resident = [as_stored(b, args.save_dtype)
                for b in resident_batches(dims, tokens, mean, device, 2, generator)]
    cycle = dequantized((resident[i % len(resident)] for i in range(args.warmup + args.steps)),
                        session.precision.input_dtype)
    results = [timed_steps(f"{name} resident", session.step, device, cycle, dims,
                           args.warmup, args.steps)]
    del resident, cycle
    for staging in args.loader_staging:
        if world.is_main:
            drop_page_cache(inputs.shards)
        loader, samples = disk_loader(args, inputs, session, args.warmup + args.steps, tokens,
                                      staging)
        results.append(timed_steps(disk_name(name, staging, args), session.step, device,
                                   loader, dims, args.warmup, args.steps,
                                   lambda: loader.primed_at))
        results[-1].samples = samples
    del session
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return results


def disk_name(precision: str, staging: str, args: argparse.Namespace) -> str:
    """``bf16 disk``, or with several stagings asked for ``bf16 disk (consumer)`` etc."""
    return (f"{precision} disk" if len(args.loader_staging) == 1
            else f"{precision} disk ({staging})")


def reference_run(args: argparse.Namespace, dims: Dims, inputs: Inputs,
                  device: str) -> RunResult:
    """The anchor: speculators 0.3.0's own training step on resident batches.

    What ``speculators.train.trainer.Trainer.train_epoch`` does per batch (``.to`` the
    device, forward, ``zero_grad``, backward, clip 1.0, ``AdamW(model.named_parameters())``
    with torch's default kernel, linear schedule, ``.item()`` per metric), with the forward
    under bf16 autocast over float32 weights and hidden states in float32 as its collate
    hands them over.  The draft is the same ``build_draft`` with speculators' compiled flex
    attention; on CPU, where inductor fails on it, eager with the dense kernel.
    """
    torch.compiler.reset()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        model = build_draft(inputs.verifier, [2, 16, 29], inputs.d2t, inputs.t2d, dims.layers,
                            num_speculative_tokens=dims.ttt)
    model.to(device).train()
    cuda = device.startswith("cuda")
    if not cuda:
        set_attention(model, "sdpa")
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-4)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, args.warmup + args.steps + 1)

    def step(batch: dict) -> dict:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with (contextlib.nullcontext() if cuda else torch.compiler.set_stance("force_eager")), \
                torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            _draft_tokens, loss, metrics = model(**batch, ttt_steps=dims.ttt,
                                                 ttt_step_loss_decay=1.0)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        scheduler.step()
        return {k: v.item() for k, v in metrics.items()}

    tokens = args.tokens_per_step
    generator = torch.Generator().manual_seed(args.seed + 1)
    resident = [{k: v.float() if k in HIDDEN_KEYS else v for k, v in batch.items()}
                for batch in resident_batches(dims, tokens, args.sample_len or max(2, tokens // 8),
                                              device, 2, generator)]
    cycle = (resident[i % len(resident)] for i in range(args.warmup + args.steps))
    result = timed_steps("anchor (speculators)", step, device, cycle, dims, args.warmup,
                         args.steps)
    model = optimizer = resident = None  # step's closure holds them: release, not del
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def prepare_inputs(args: argparse.Namespace, dims: Dims, workdir: Path, world: launch.World) -> None:
    """Verifier, vocabulary mapping, shards and split index, written under ``workdir``."""
    generator = torch.Generator().manual_seed(args.seed)
    write_verifier(workdir / "verifier", dims, generator)
    d2t, t2d = vocab_mapping(dims, generator)
    formats.write_vocab_mapping(workdir / "vocab.safetensors", d2t, t2d)
    per_rank = rank_tokens(args, world)
    tokens = args.disk_tokens or (args.warmup + args.steps) * per_rank * world.world_size
    mean = args.sample_len or max(2, per_rank // 8)
    start = time.perf_counter()
    shards, _ = write_shards(workdir / "shards", dims, tokens, args.shard_tokens, mean,
                             generator, args.save_dtype)
    size = sum(p.stat().st_size for p in shards)
    print(f"shards ({args.save_dtype}): {len(shards)} files, {tokens:,} tokens, "
          f"{size / 1e9:.2f} GB ({size / tokens:,.1f} bytes/token on disk) written in "
          f"{time.perf_counter() - start:.1f} s to {workdir}", flush=True)


def load_inputs(workdir: Path) -> Inputs:
    d2t, t2d = formats.load_vocab_mapping(workdir / "vocab.safetensors")
    shards = sorted((workdir / "shards").glob("shard-*.safetensors"))
    return Inputs(workdir / "verifier", d2t, t2d, shards, workdir / "shards" / "split.safetensors")


def measure_disk(args: argparse.Namespace, inputs: Inputs, device: str) -> None:
    """The disk's sequential read, then the loader alone from disk and from memory."""
    drop_page_cache(inputs.shards)
    print(f"sequential read (cold cache): {sequential_read(inputs.shards):.2f} GB/s",
          flush=True)
    dataset = ShardSampleDataset(inputs.shards, formats.load_split(inputs.index, formats.TRAIN))
    sampler = make_sampler(dataset.lengths, args.tokens_per_step, args.seed)
    batches = [batch for _, batch in plan_steps(sampler, 0, args.warmup + args.steps)]
    stored = SLOTS * formats.stored_bytes_per_slot(args.save_dtype, dataset.hidden_size)
    for staging in args.loader_staging:
        loader = PackedLoader(dataset, batches, args.tokens_per_step, device, None,
                              args.loader_threads, args.prefetch, staging)
        for cache in ("cold", "warm"):  # warm: the cold pass left the shards in memory
            if cache == "cold":
                drop_page_cache(inputs.shards)
            rate, tokens = loader_alone(loader, device, stored)
            print(f"loader alone ({cache} cache, to {device}, staging {staging}, "
                  f"{loader.threads} threads, prefetch {loader.prefetch}): {rate:.2f} GB/s of "
                  f"hidden states, {tokens:,.0f} tok/s", flush=True)


# --------------------------------------------------------------------------- processes


def launch_ranks(args: argparse.Namespace, argv: list[str]) -> int:
    """This benchmark again under torchrun (``--gpus`` processes); torchrun's exit code.

    The shards' folder is made here, so that every rank finds it, and removed afterwards.
    """
    if args.gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {args.gpus}")
    if launch.rank_device(args.device, setting="--device") != "cpu" and args.gpus > torch.cuda.device_count():
        raise ValueError(f"--gpus {args.gpus} but {torch.cuda.device_count()} CUDA GPU(s) here")
    workdir = args.workdir
    if workdir is None:
        workdir = tempfile.mkdtemp(prefix="draftline-bench-")
        argv = [*argv, "--workdir", workdir]
    try:
        return launch.relaunch("benchmarks.train", argv, args.gpus)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def this_world(args: argparse.Namespace) -> launch.World:
    """torchrun's ranks with ``--gpus``, else one plain process."""
    if args.gpus is None:
        return launch.World()
    current = launch.world()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", current.world_size))
    if local != args.gpus:
        raise ValueError(f"--gpus {args.gpus} but torchrun started {local} processes per node")
    return current


def barrier(world: launch.World) -> None:
    if world.distributed:
        torch.distributed.barrier()


def gather(result: RunResult, world: launch.World) -> list[RunResult]:
    """Every rank's result of one run, in rank order (on every rank)."""
    if world.distributed:
        found: list = [None] * world.world_size
        torch.distributed.all_gather_object(found, result)
        return found
    return [result]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.reference and args.gpus is not None:
        raise ValueError("--reference times speculators' single-process step: leave out --gpus")
    if args.gpus is not None and not launch.under_torchrun():
        sys.exit(launch_ranks(args, argv))
    world = this_world(args)
    ddp = args.gpus is not None
    device = launch.rank_device(args.device, world, "--device")
    if ddp:
        launch.init_process_group(device, args.collective_timeout_s)
    try:
        run_all(args, world, ddp, device)
    finally:
        launch.destroy_process_group()


def run_all(args: argparse.Namespace, world: launch.World, ddp: bool, device: str) -> None:
    dims = dims_from(args)
    precisions = ["bf16", "fp32"] if args.compare_precision else [args.precision]
    say = print if world.is_main else (lambda *a, **k: None)
    say(f"device {device}  processes {world.world_size} ({'DDP' if ddp else 'plain'})  "
        f"dims {dataclasses.asdict(dims)}  tokens/step per rank {rank_tokens(args, world)}  "
        f"warmup {args.warmup}  steps {args.steps}  compile {args.compile}  AdamW "
        f"{optimizer_implementation(device, fused_optimizer(args))}  shards "
        f"{args.save_dtype}  torch "
        f"{torch.__version__}", flush=True)
    say(f"FLOPs per position (no attention): {step_flops(dims, 1, []) / 1e9:.3f} GFLOP",
        flush=True)
    if ddp:
        say("NVLink multicast: " + " ".join(f"{k}={os.environ.get(k)}"
                                             for k in launch.NO_MULTICAST), flush=True)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="draftline-bench-"))
    try:
        if world.is_main:
            prepare_inputs(args, dims, workdir, world)
        barrier(world)  # the other ranks read what rank 0 wrote
        inputs = load_inputs(workdir)
        if not ddp:
            measure_disk(args, inputs, device)
        per_rank: dict[str, list[RunResult]] = {}
        if args.reference:
            per_rank["anchor (speculators)"] = [reference_run(args, dims, inputs, device)]
        for precision in precisions:
            for result in run_precision(args, dims, inputs, device, precision, world, ddp):
                ranks = gather(result, world)
                if ddp:
                    for rank, each in enumerate(ranks):
                        each.rank = rank
                        say(each.line(), flush=True)
                per_rank[result.name] = ranks
        barrier(world)  # nobody removes the shards while another rank reads them
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if world.is_main:
        report(args, dims, device, world, ddp, per_rank)


def report(args: argparse.Namespace, dims: Dims, device: str, world: launch.World, ddp: bool,
           per_rank: dict[str, list[RunResult]]) -> None:
    totals = {name: combine(ranks) for name, ranks in per_rank.items()}
    print_summary(totals, args.compare_precision, world.world_size)
    record = {
        "world_size": world.world_size, "ddp": ddp, "device": device,
        "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None,
        "torch": torch.__version__, "dims": dataclasses.asdict(dims),
        "tokens_per_step_per_rank": rank_tokens(args, world), "warmup": args.warmup,
        "steps": args.steps, "compile": args.compile, "save_dtype": args.save_dtype,
        "optimizer": optimizer_implementation(device, fused_optimizer(args)),
        "env": {k: os.environ.get(k) for k in launch.NO_MULTICAST},
        "runs": {name: {**totals[name].summary(),
                        "ranks": [{**r.summary(), "samples": r.samples} for r in ranks]}
                 for name, ranks in per_rank.items()},
    }
    if args.baseline:
        print_ratios(record, json.loads(Path(args.baseline).read_text()))
    if args.results:
        Path(args.results).write_text(json.dumps(record, indent=2))
        print(f"results: {args.results}")


def print_summary(results: dict[str, RunResult], compare: bool, processes: int = 1) -> None:
    """The runs' lines (tokens/s over all timed steps and over the steady ones; per-step wait
    for data and device idle, ms; start-up s), then disk / resident and run / anchor."""
    label = "run" if processes == 1 else f"all {processes} ranks"
    print("\n" + LINE_HEADER.replace("run ", f"{label} ", 1)[:len(LINE_HEADER)])
    for result in results.values():
        print(result.line())
    if compare:
        for source in ("resident", *(n.split(" ", 1)[1] for n in results
                                     if n.startswith("bf16 disk"))):
            bf16, fp32 = results[f"bf16 {source}"], results[f"fp32 {source}"]
            print(f"bf16 / fp32 tokens/s, {source}: "
                  f"{bf16.tokens_per_second / fp32.tokens_per_second:.2f}x")
    for name, disk in results.items():
        resident = results.get(f"{name.split(' ', 1)[0]} resident")
        if " disk" not in name or resident is None:
            continue
        steady = disk.steady_tokens_per_second
        # Per position too, so that the disk run's looser packing does not count against it.
        print(f"{name} / resident: tokens/s {disk.tokens_per_second / resident.tokens_per_second:.3f}"
              f", steady {'-' if steady is None else f'{steady / resident.tokens_per_second:.3f}'}"
              f", step rate {disk.positions_per_second / resident.positions_per_second:.3f}")
    anchor = results.get("anchor (speculators)")
    for name, result in results.items():
        if anchor is not None and result is not anchor:
            print(f"{name} / anchor tokens/s: "
                  f"{result.tokens_per_second / anchor.tokens_per_second:.3f}")


def print_ratios(record: dict, baseline: dict) -> None:
    """This run's total tokens/s over the baseline's, run by run (same names only)."""
    gpus, base_gpus = record["world_size"], baseline["world_size"]
    if record["dims"] != baseline["dims"]:
        raise ValueError(f"--baseline was measured at other dimensions: {baseline['dims']} "
                         f"vs {record['dims']}")
    common = [name for name in record["runs"] if name in baseline["runs"]]
    if not common:
        raise ValueError(f"--baseline has none of these runs: {sorted(record['runs'])} vs "
                         f"{sorted(baseline['runs'])}")
    for name in common:
        ratio = (record["runs"][name]["tokens_per_second"]
                 / baseline["runs"][name]["tokens_per_second"])
        print(f"{name}: {gpus} / {base_gpus} process(es) "
              f"({'DDP' if record['ddp'] else 'plain'} / "
              f"{'DDP' if baseline['ddp'] else 'plain'}) tokens/s: {ratio:.3f}x, scaling "
              f"efficiency {ratio * base_gpus / gpus:.1%}")


if __name__ == "__main__":
    main()
