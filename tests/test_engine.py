"""draftline.engine: the one builder of engine options, and what each consumer makes of it."""

from __future__ import annotations

import os

import pytest
from conftest import compose

from draftline import engine


def _options(model_dir, *overrides, section="extract"):
    cfg = compose("tiny", f"model.path={model_dir}", *overrides)
    return engine.engine_options(cfg, cfg[section] if section != "evaluate" else cfg.evaluate.vllm)


def test_every_stage_gets_the_model_settings_and_its_own_section(model_dir, monkeypatch):
    monkeypatch.delenv(engine.THREADS_BIND, raising=False)
    extract = _options(model_dir)
    evaluate = _options(model_dir, section="evaluate")
    serve = _options(model_dir, section="serve")
    for options in (extract, evaluate, serve):
        assert (options.target, options.dtype, options.tensor_parallel_size) == (str(model_dir), "float32", 1)
        # No GPU here: eager, and this process's cores for the one rank.
        assert options.enforce_eager is True
        assert options.cpu_threads_bind == ",".join(map(str, sorted(os.sched_getaffinity(0))))
    assert (extract.max_model_len, extract.max_num_seqs) == (1024, 32)
    assert (evaluate.max_model_len, evaluate.max_num_seqs) == (2048, 4)
    assert (serve.max_model_len, serve.max_num_seqs) == (None, 64)
    assert _options(model_dir, "model.enforce_eager=false").enforce_eager is False


def test_cpu_ranks_get_disjoint_cores_or_the_binding_already_given(monkeypatch):
    monkeypatch.delenv(engine.THREADS_BIND, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert engine.cpu_threads_bind(2) == "0,1|2,3"
    assert engine.cpu_threads_bind(1) == "0,1,2,3"
    with pytest.raises(ValueError, match="need 8 CPU cores; 4 usable"):
        engine.cpu_threads_bind(8)
    # vLLM's own default asserts on a one-NUMA-node host at TP=2: it is replaced.
    monkeypatch.setenv(engine.THREADS_BIND, "auto")
    assert engine.cpu_threads_bind(2) == "0,1|2,3"
    # A replica's share from its parent (or the user's own binding) is kept, if it fits.
    monkeypatch.setenv(engine.THREADS_BIND, "2|3")
    assert engine.cpu_threads_bind(2) == "2|3"
    with pytest.raises(ValueError, match=r"names 2 core groups for tensor_parallel_size=1"):
        engine.cpu_threads_bind(1)
    options = engine.EngineOptions(target="t", cpu_threads_bind="2|3", mla_disable=True)
    assert options.environment()[engine.THREADS_BIND] == "2|3"
    assert options.environment()["VLLM_MLA_DISABLE"] == "1"


def test_serve_runs_evaluates_engine_and_names_each_difference():
    options = engine.EngineOptions(target="/m", dtype="bfloat16", tensor_parallel_size=8,
                                   enforce_eager=False, limit_mm_per_prompt={"vision_chunk": 0},
                                   trust_remote_code=True)
    measured = engine.llm_kwargs(options, "/d", 3)
    assert (measured["async_scheduling"], measured["enable_prefix_caching"]) == (False, False)
    assert measured["enforce_eager"] is False
    args = engine.serve_args(options, "/d", 3, host="127.0.0.1", port=8000)
    assert "--enforce-eager" not in args  # CUDA graphs, as evaluate ran it
    assert "--async-scheduling" in args and "--enable-prefix-caching" in args
    assert args[args.index("--tensor-parallel-size") + 1] == "8"
    assert args[args.index("--dtype") + 1] == "bfloat16"
    assert "--trust-remote-code" in args
    differences = engine.serving_differences(options)
    assert [(d["setting"], d["evaluate"], d["serve"]) for d in differences] == [
        ("async_scheduling", False, True), ("enable_prefix_caching", False, True)]
    assert all(d["why"] for d in differences)
    eager = engine.serve_args(engine.EngineOptions(target="/m"), "/d", 3, host="h", port=1)
    assert "--enforce-eager" in eager


def test_extract_generator_gets_the_same_options(model_dir):
    options = _options(model_dir, "model.tensor_parallel_size=2")
    kwargs = engine.generator_kwargs(options, max_num_batched_tokens=2048)
    assert kwargs == {"dtype": "float32", "tensor_parallel_size": 2, "gpu_memory_utilization": 0.85,
                      "max_num_seqs": 32, "trust_remote_code": False, "limit_mm_per_prompt": None,
                      "max_model_len": 1024, "max_num_batched_tokens": 2048,
                      "rpc_timeout": 300.0}  # extract.rank_timeout_s (patches/speculators/0007)
    assert options.environment()[engine.EXECUTE_TIMEOUT] == "300"
