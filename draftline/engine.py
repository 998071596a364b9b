"""How every vLLM engine of the project starts: one builder of engine options.

extract's hidden-state generator, regenerate's replies, evaluate's measurement in vLLM, the
rehearsal, `make serve` and the benchmarks take their settings from ``engine_options(cfg,
section)``: the model group (target, dtype, TP, MLA, remote code, eager or compiled) plus one
stage's section (context length, sequence slots, memory). Every choice that depends on the
machine (eager or compiled, the CPU cores each TP rank's threads use) is decided here, at the
stage boundary, into plain values, so a child process or `vllm serve` never decides again.

What each consumer turns them into: ``llm_kwargs`` (``vllm.LLM``: evaluate, regenerate,
benchmarks), ``generator_kwargs`` (speculators' hidden-state generator: extract),
``serve_args`` (`vllm serve`). Serving keeps two of vLLM's throughput defaults that evaluate
turns off; ``serving_differences`` names them and why, for serve/command.json and the log.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from draftline.pipeline.cuda import fork_safe_cuda_checks

THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM CPU platform: cores per TP rank, "0,1|2,3"
KVCACHE = "VLLM_CPU_KVCACHE_SPACE"           # vLLM CPU platform: KV cache (GiB)
EXECUTE_TIMEOUT = "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"  # multiproc executor: one step's answer (s)
PARALLEL_MASK_TOKEN = "ptd_token_id"  # draftline.train.parallel.MASK_TOKEN (engine sits below train)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How to start vLLM on the target: plain values, decided at the stage boundary."""

    target: str                      # HF-layout model directory
    dtype: str = "auto"              # torch dtype vLLM runs the target in
    max_model_len: int | None = 2048  # tokens per sequence; None = the model config's
    tensor_parallel_size: int = 1    # GPUs (or CPU ranks)
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 16           # sequences per batch
    trust_remote_code: bool = False  # run Python shipped in the model directory
    limit_mm_per_prompt: dict | None = None  # {"vision_chunk": 0}: a multimodal target (Kimi-K2.5) run text-only
    mla_disable: bool = False        # VLLM_MLA_DISABLE=1 (vLLM's CPU platform has no MLA)
    cpu_kvcache_gib: float = 1.0     # VLLM_CPU_KVCACHE_SPACE on the CPU platform (GiB)
    seed: int = 0
    enforce_eager: bool = True       # False: torch.compile (inductor) and, on CUDA, CUDA graphs
    cpu_threads_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND (CPU platform); None on GPUs
    # Seconds the driver waits for the TP ranks to answer one engine call before the stage
    # fails (a rank that hangs without raising); None: vLLM's default for execute_model (300)
    # and no limit on speculators' capture calls.
    rank_timeout_s: float | None = None

    def environment(self) -> dict[str, str]:
        """Environment variables vLLM reads at start-up for these options (a value the user
        set in the environment wins)."""
        env = {KVCACHE: os.environ.get(KVCACHE, f"{self.cpu_kvcache_gib:g}")}
        if self.mla_disable:
            env["VLLM_MLA_DISABLE"] = "1"
        if self.cpu_threads_bind is not None:
            env[THREADS_BIND] = self.cpu_threads_bind
        if self.rank_timeout_s is not None:
            env[EXECUTE_TIMEOUT] = str(max(1, round(self.rank_timeout_s)))
        return env


def cuda_available() -> bool:
    """Whether this process sees a GPU, asked without creating a CUDA context (vLLM may fork
    its workers afterwards)."""
    fork_safe_cuda_checks()
    import torch

    return torch.cuda.is_available()


def cpu_threads_bind(tensor_parallel_size: int, environ=os.environ) -> str:
    """The cores of each TP rank on vLLM's CPU platform: this process's cores split evenly over
    the ranks, or what the environment already says (a replica's share from its parent, or the
    user's own binding). vLLM's default ("auto") binds one NUMA node per rank and asserts on a
    host with fewer nodes than ranks, which is every one-socket machine at TP=2."""
    from draftline.pipeline import launch

    given = environ.get(THREADS_BIND, "").strip()
    if given and given != "auto":
        ranks = len(given.split("|"))
        if given != "nobind" and ranks != tensor_parallel_size:
            raise ValueError(f"{THREADS_BIND}={given} names {ranks} core groups for "
                             f"tensor_parallel_size={tensor_parallel_size}: one per TP rank")
        return given
    return launch.split_cores(sorted(os.sched_getaffinity(0)), 1, tensor_parallel_size)[0]


def engine_options(cfg, section, cpu_kvcache_gib: float = 1.0) -> EngineOptions:
    """How to start vLLM on the run's target: the model group plus one stage's engine section
    (``section`` holds max_model_len, and optionally max_num_seqs, gpu_memory_utilization,
    cpu_kvcache_gib)."""
    from draftline import target
    from draftline.pipeline.config import mm_limits

    model = cfg.model
    tensor_parallel_size = int(model.tensor_parallel_size)
    on_gpu = cuda_available()
    eager = model.get("enforce_eager")
    return EngineOptions(
        target=str(model.path), dtype=str(model.dtype),
        max_model_len=None if section.max_model_len is None else int(section.max_model_len),
        tensor_parallel_size=tensor_parallel_size,
        gpu_memory_utilization=float(section.get("gpu_memory_utilization", 0.85)),
        max_num_seqs=int(section.get("max_num_seqs", 16)),
        trust_remote_code=target.check(model.path, bool(model.trust_remote_code)),
        limit_mm_per_prompt=mm_limits(cfg),
        mla_disable=bool(model.mla_disable),
        cpu_kvcache_gib=float(section.get("cpu_kvcache_gib", cpu_kvcache_gib)),
        seed=int(cfg.seed),
        # null: compiled with CUDA graphs on GPUs; eager on the CPU engine, where inductor
        # needs a C++ compiler (the cpu image has none) and there are no graphs to capture.
        enforce_eager=(not on_gpu) if eager is None else bool(eager),
        cpu_threads_bind=None if on_gpu else cpu_threads_bind(tensor_parallel_size),
        rank_timeout_s=_positive_or_none(section.get("rank_timeout_s")))


def _positive_or_none(value) -> float | None:
    if value is None:
        return None
    if float(value) <= 0:
        raise ValueError(f"rank_timeout_s must be a positive number of seconds or null, got {value!r}")
    return float(value)


def speculative_config(draft: str | Path, k: int) -> dict:
    """vLLM's speculative_config for an EAGLE-3 draft in speculators format; a draft trained
    to draft in parallel (its layer config names the mask token, draftline.train.parallel)
    gets ``parallel_drafting``, which vLLM reads from here only."""
    config = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": int(k)}
    saved = Path(draft) / "config.json"
    if saved.is_file() and PARALLEL_MASK_TOKEN in json.loads(saved.read_text()).get("transformer_layer_config", {}):
        config["parallel_drafting"] = True
    return config


def llm_kwargs(options: EngineOptions, draft: str | Path | None = None, k: int | None = None,
               **stage) -> dict:
    """Keyword arguments of ``vllm.LLM`` for the target, with the draft when given; ``stage``
    adds or replaces a stage's own scheduler keys (regenerate's max_num_batched_tokens)."""
    kwargs = dict(
        model=options.target, dtype=options.dtype, tensor_parallel_size=options.tensor_parallel_size,
        gpu_memory_utilization=options.gpu_memory_utilization, max_num_seqs=options.max_num_seqs,
        trust_remote_code=options.trust_remote_code, seed=options.seed,
        # Every token of a prompt is computed, as in the offline estimate; and one step's stats
        # arrive with that step's outputs (no overlap between steps).
        enable_prefix_caching=False, async_scheduling=False,
        disable_log_stats=False, enforce_eager=options.enforce_eager)
    kwargs.update(stage)
    if options.max_model_len is not None:
        kwargs["max_model_len"] = options.max_model_len
    if options.limit_mm_per_prompt is not None:
        kwargs["limit_mm_per_prompt"] = dict(options.limit_mm_per_prompt)
    if draft is not None:
        kwargs["speculative_config"] = speculative_config(draft, int(k))
    return kwargs


def generator_kwargs(options: EngineOptions, **stage) -> dict:
    """Keyword arguments of speculators' ``VllmHiddenStatesGenerator`` (extract). It always runs
    eager with prefix caching and async scheduling off: its capture hooks need every token's
    forward, step by step (speculators' generator sets that itself)."""
    return dict(dtype=options.dtype, tensor_parallel_size=options.tensor_parallel_size,
                gpu_memory_utilization=options.gpu_memory_utilization,
                max_num_seqs=options.max_num_seqs, trust_remote_code=options.trust_remote_code,
                rpc_timeout=options.rank_timeout_s,  # patches/speculators/0007
                limit_mm_per_prompt=(None if options.limit_mm_per_prompt is None
                                     else dict(options.limit_mm_per_prompt)),
                **({} if options.max_model_len is None else {"max_model_len": options.max_model_len}),
                **stage)


# What `make serve` runs differently from the engine evaluate measured, and why: neither
# changes which tokens a greedy request gets or which draft tokens are accepted, only how
# requests share the machine. On vLLM's CPU engine async scheduling is forced off anyway.
SERVING_KEEPS = {
    "async_scheduling": (True, "overlaps scheduling the next step with the running forward pass "
                               "(vLLM's default with EAGLE on GPUs); evaluate turns it off only "
                               "to read each step's acceptance with that step's outputs"),
    "enable_prefix_caching": (True, "reuses the KV cache of prompt prefixes shared between "
                                    "requests (system prompts); evaluate turns it off so every "
                                    "prompt token is computed as in the offline estimate"),
}


def serving_differences(options: EngineOptions) -> list[dict]:
    """Each setting `make serve` runs differently from evaluate's engine, with why."""
    measured = llm_kwargs(options)
    return [{"setting": key, "evaluate": measured[key], "serve": served, "why": why}
            for key, (served, why) in SERVING_KEEPS.items() if measured[key] != served]


def serve_args(options: EngineOptions, draft: str | Path, k: int, *, host: str,
               port: int) -> list[str]:
    """`vllm serve` arguments (after ``serve``) for the target with its draft: evaluate's
    engine, with ``serving_differences`` applied."""
    kwargs = {**llm_kwargs(options, draft, k),
              **{key: served for key, (served, _) in SERVING_KEEPS.items()}}
    args = [options.target, "--host", host, "--port", str(port),
            "--dtype", options.dtype, "--tensor-parallel-size", str(options.tensor_parallel_size),
            "--gpu-memory-utilization", str(options.gpu_memory_utilization),
            "--max-num-seqs", str(options.max_num_seqs), "--seed", str(options.seed),
            "--speculative-config", _json(kwargs["speculative_config"])]
    if options.max_model_len is not None:
        args += ["--max-model-len", str(options.max_model_len)]
    if options.trust_remote_code:
        args.append("--trust-remote-code")
    if options.limit_mm_per_prompt is not None:
        args += ["--limit-mm-per-prompt", _json(dict(options.limit_mm_per_prompt))]
    if options.enforce_eager:
        args.append("--enforce-eager")
    args.append("--async-scheduling" if kwargs["async_scheduling"] else "--no-async-scheduling")
    args.append("--enable-prefix-caching" if kwargs["enable_prefix_caching"]
                else "--no-enable-prefix-caching")
    return args


def _json(value) -> str:
    import json

    return json.dumps(value)


def worker_failure(executor) -> str | None:
    """After a call into vLLM's multiproc executor failed: the reason, if a worker process
    ended it. A worker that raises where only another rank answers ends its process
    (patches/vllm/0004); the executor then shuts down and the caller sees only "cancelled"."""
    if executor is None or not getattr(executor, "is_failed", False):
        return None
    return ("vLLM's engine was shut down because one of its worker processes died: the log "
            "above names it (\"Worker proc ... died unexpectedly\") and holds its traceback "
            "(\"WorkerProc hit an exception\")")


def timed_out(error: BaseException) -> bool:
    """Whether ``error`` is, or was raised from, an engine call that timed out
    (``rank_timeout_s``)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, TimeoutError):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False
