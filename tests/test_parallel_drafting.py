"""Parallel drafting (P-EAGLE, draftline issue 45) on vLLM 0.16's CPU engine
(patches/vllm/0009): an EAGLE-3 draft with a learned ``mask_hidden`` and a mask token
(``ptd_token_id`` inside ``transformer_layer_config``, where vLLM reads the speculators
format's layer config) loads with ``parallel_drafting: true`` and decodes greedy-equal to the
plain engine; the torch layout of the drafting inputs matches the kernel's regions."""

from __future__ import annotations

import json

import pytest
import torch

from draftline.tiny import builders

K = 3


def parallel_draft(target_dir, out_dir, mask_token: int) -> None:
    """A random EAGLE-3 draft for ``target_dir`` made a parallel one: ``mask_hidden`` [3H] in
    its weights and the mask token in its layer config (what vLLM's proposer reads)."""
    from safetensors.torch import load_file, save_file

    from draftline.train.draft import build_draft

    vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    d2t, t2d = torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        draft = build_draft(target_dir, [1, 2, 3], d2t, t2d, num_speculative_tokens=K)
        draft.save_pretrained(str(out_dir))
        hidden = draft.config.transformer_layer_config.hidden_size
        weights = load_file(str(out_dir / "model.safetensors"))
        weights["mask_hidden"] = torch.randn(3 * hidden) * 0.02
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["transformer_layer_config"]["ptd_token_id"] = mask_token
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


@pytest.mark.vllm
@pytest.mark.long  # about 17 s on 2 cores: two vLLM engines
def test_a_parallel_draft_decodes_greedy_equal_to_the_plain_engine(tmp_path, monkeypatch):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from draftline.engine import EngineOptions, llm_kwargs
    from draftline.speculative.jobs import SpecCounters

    target = builders.build_tiny_llama(tmp_path / "target", num_layers=4)
    parallel_draft(target, tmp_path / "draft", mask_token=2)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(7, 500, (n,), generator=generator).tolist() for n in (9, 23, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    options = EngineOptions(target=str(target), dtype="float32", max_model_len=256, max_num_seqs=4,
                            gpu_memory_utilization=0.5, enforce_eager=True)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    outputs = {}
    for name, draft in (("plain", None), ("parallel", tmp_path / "draft")):
        kwargs = llm_kwargs(options, draft, K if draft else None)
        if draft is not None:
            kwargs["speculative_config"]["parallel_drafting"] = True
        llm = LLM(**kwargs)
        try:
            got = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            outputs[name] = [list(o.outputs[0].token_ids) for o in got]
            if draft is not None:  # it drafted K tokens a step
                counters = SpecCounters.read(llm.llm_engine, K)
        finally:
            engine = getattr(llm, "llm_engine", None)
            if engine is not None and hasattr(engine, "engine_core"):
                engine.engine_core.shutdown()
            del llm
    assert outputs["parallel"] == outputs["plain"]
    assert counters.drafts > 0 and counters.draft_tokens == K * counters.drafts, counters
    print(f"parallel drafting on the CPU engine: {counters.drafts} drafts of {K}, "
          f"{counters.accepted} accepted (a random draft), per position {counters.accepted_per_pos}")


def test_the_torch_layout_of_parallel_drafting_inputs_has_the_kernels_regions():
    """Two requests, K = 3, the second with one rejected token: per request the accepted tokens
    shifted by one, the bonus token, K - 1 mask tokens, then padding for the rejected slots;
    positions from the request's first, 0 where rejected; the K indices to sample; every input
    row's hidden state mapped to its output slot."""
    from vllm.v1.spec_decode.eagle import _copy_and_expand_eagle_inputs_torch

    tokens = torch.tensor([10, 11, 12, 20, 21, 22, 23], dtype=torch.int32)  # r0: 3 rows, r1: 4 rows
    positions = torch.tensor([5, 6, 7, 40, 41, 42, 43])
    bonus = torch.tensor([13, 24], dtype=torch.int32)
    query_start = torch.tensor([0, 3, 7], dtype=torch.int32)
    query_end = torch.tensor([2, 5], dtype=torch.int32)  # r1's last row (23) was rejected
    total = 7 + 2 * (K - 1)
    out_ids = torch.full((total,), -1, dtype=torch.int32)
    out_pos = torch.full((total,), -1, dtype=torch.int64)
    rejected, masked = torch.zeros(total, dtype=torch.bool), torch.zeros(total, dtype=torch.bool)
    sample = torch.empty(2 * K, dtype=torch.int32)
    mapping = torch.empty(7, dtype=torch.int32)
    _copy_and_expand_eagle_inputs_torch(tokens, positions, bonus, out_ids, out_pos, rejected, masked,
                                        sample, mapping, query_start, query_end, padding_token_id=0,
                                        parallel_drafting_token_id=99, num_padding_slots_per_request=K,
                                        shift_input_ids=True)
    assert out_ids.tolist() == [11, 12, 13, 99, 99, 21, 22, 24, 99, 99, 0]
    assert out_pos.tolist() == [5, 6, 7, 8, 9, 40, 41, 42, 43, 44, 0]
    assert masked.tolist() == [False, False, False, True, True, False, False, False, True, True, False]
    assert rejected.tolist() == [False] * 10 + [True]
    assert sample.tolist() == [2, 3, 4, 7, 8, 9]
    assert mapping.tolist() == [0, 1, 2, 5, 6, 7, 8]


def test_the_drafting_cost_benchmark_drafts_k_tokens_each_way():
    """benchmarks/draft_passes.py (the H200 table in docs/results.md) on CPU: both modes give k
    draft tokens per request, the sequential one from k passes over a cache that grows by
    one token a pass, the parallel one from one pass over the verified tokens and k-1 masks."""
    from benchmarks import draft_passes

    device, dtype = torch.device("cpu"), torch.bfloat16
    draft = draft_passes.Draft("tiny", device, dtype, max_batch=2, max_len=64)
    calls = []
    forward = draft.forward
    draft.forward = lambda tokens, feats, start: calls.append((tokens.shape[1], start)) or forward(tokens, feats, start)
    k, accepted, context = 4, 3, 32
    for mode in ("sequential", "parallel"):
        calls.clear()
        out = draft_passes.step_fn(draft, mode, 2, k, accepted, context, device, dtype)()
        assert out.shape == (2, k) and out.dtype == torch.long
        if mode == "sequential":
            assert calls == [(accepted, context)] + [(1, context + accepted + j - 1) for j in range(1, k)]
        else:
            assert calls == [(accepted + k - 1, context)]
