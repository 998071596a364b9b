"""Every check extract can make before a (possibly 25-minute) model load."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig

from draftline import formats, target
from draftline.pipeline.cuda import fork_safe_cuda_checks

NUM_BUFFERS = 2  # rank 0's shard buffers: one fills while the writer thread writes the other

# Who writes the shards: the engine's rank 0, beside the forward (patches/speculators/0008),
# or this process after every byte crossed vLLM's RPC (the path before draftline issue 30,
# kept to hold the two to the same bytes and to measure one against the other).
RANK0, DRIVER = "rank0", "driver"
WRITERS = (RANK0, DRIVER)


def preflight(cfg: DictConfig, lengths: list[int], replicas: int | None = 1) -> target.TargetShape:
    """Config, target and devices against each other. ``replicas``: the engines this process
    may start, whose devices and shard buffers are checked (None: it starts none)."""
    if cfg.extract.save_dtype not in formats.SAVE_DTYPES:
        raise ValueError(f"extract.save_dtype={cfg.extract.save_dtype!r}: expected one of "
                         f"{sorted(formats.SAVE_DTYPES)}")
    if cfg.extract.writer not in WRITERS:
        raise ValueError(f"extract.writer={cfg.extract.writer!r}: expected one of {WRITERS}")
    target.check(cfg.model.path, bool(cfg.model.trust_remote_code))
    shape = target.read_target_shape(cfg.model.path)
    target.check_layer_ids(list(cfg.model.aux_layer_ids), shape)
    target.check_model_config(cfg.model, cfg.exp)
    if max(lengths) >= cfg.extract.max_model_len:
        raise ValueError(f"longest sample has {max(lengths)} tokens; extract.max_model_len="
            f"{cfg.extract.max_model_len} must exceed it (vLLM needs one more for the sampled token)")
    if replicas is not None:
        check_devices(int(cfg.model.tensor_parallel_size), replicas)
        if cfg.extract.writer == RANK0:
            check_host_memory(cfg, shape.hidden_size, replicas)
    return shape


def check_devices(tensor_parallel_size: int, replicas: int = 1) -> None:
    # Asked through NVML whoever imported this (not only after stages/__init__.py): a plain
    # torch.cuda query poisons fork, and vLLM forks its workers after this check.
    fork_safe_cuda_checks()
    import torch

    if replicas < 1:
        raise ValueError(f"extract.replicas={replicas}: need at least one engine")
    what = "" if replicas == 1 else f"{replicas} replicas x "
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if replicas * tensor_parallel_size > count:
            raise ValueError(f"{what}tensor_parallel_size={tensor_parallel_size} > {count} GPUs")
    else:
        if replicas * tensor_parallel_size > os.cpu_count():
            raise ValueError(f"{what}TP {tensor_parallel_size} > CPU cores")


def writer_timeout(cfg: DictConfig) -> float | None:
    """``extract.writer_timeout_s``: a positive number of seconds, or None (no bound)."""
    value = cfg.extract.get("writer_timeout_s")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"extract.writer_timeout_s must be a positive number of seconds or null, got {value!r}")
    return float(value)


def buffer_tokens(cfg: DictConfig) -> int:
    """Rows of one shard buffer: a shard closes at the first sample that brings it to
    extract.shard_tokens, and no sample reaches extract.max_model_len."""
    return int(cfg.extract.shard_tokens) + int(cfg.extract.max_model_len)


def pinned_size(nbytes: int) -> int:
    """What torch's pinned host allocator takes for ``nbytes``: it rounds every block up to a
    power of two (a 1.21 GB fp8 buffer of llama-3.1-8b takes 2.15 GB)."""
    return 1 << (int(nbytes) - 1).bit_length() if nbytes > 0 else 0


def buffer_bytes(cfg: DictConfig, hidden_size: int, pinned: bool = False) -> int:
    """Host memory of one engine's shard buffers: per buffer, the values [tokens, slots,
    hidden] and, for fp8, the scales [tokens, slots]; ``pinned`` (on CUDA) as the pinned
    allocator rounds each of them."""
    save_dtype = str(cfg.extract.save_dtype)
    rows = buffer_tokens(cfg) * (len(cfg.model.aux_layer_ids) + 1)
    tensors = [rows * hidden_size * formats.SAVE_DTYPES[save_dtype].itemsize]
    if formats.is_quantized(save_dtype):
        tensors.append(rows * formats.SCALE_DTYPE.itemsize)
    return NUM_BUFFERS * sum(pinned_size(n) if pinned else n for n in tensors)


def check_host_memory(cfg: DictConfig, hidden_size: int, replicas: int,
                      meminfo: Path = Path("/proc/meminfo"), pinned: bool | None = None) -> int:
    """Refuse a start whose shard buffers (every engine's) do not fit in available RAM;
    ``pinned``: whether they are pinned (None: whether torch sees a GPU)."""
    if pinned is None:
        fork_safe_cuda_checks()
        import torch

        pinned = torch.cuda.is_available()
    need = replicas * buffer_bytes(cfg, hidden_size, pinned)
    available = available_memory(meminfo)
    if available is not None and need > available:
        engines = f"{replicas} engines x " if replicas > 1 else ""
        raise ValueError(
            f"extract's shard buffers need {need / 2**30:.1f} GiB of host memory ({engines}"
            f"{NUM_BUFFERS} buffers of extract.shard_tokens={cfg.extract.shard_tokens} + "
            f"extract.max_model_len={cfg.extract.max_model_len} tokens, "
            f"{str(cfg.extract.save_dtype)}{', pinned: each rounded up to a power of two' if pinned else ''}), "
            f"{available / 2**30:.1f} GiB is available: lower extract.shard_tokens (smaller shards, "
            "same bytes per token)")
    return need


def available_memory(meminfo: Path) -> int | None:
    """MemAvailable in bytes (Linux), or None where the kernel does not say."""
    if not meminfo.exists():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None
