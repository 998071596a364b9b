"""The tiny targets through the CUDA vLLM engine: what `make selftest` checks on a user's GPU host.

No CPU machine can run these (vLLM's CPU build has no MLA backend, no CUDA graphs, no NCCL).
Each target family (the tiny Llama, DeepseekV3 and Kimi-K2.5, random weights) runs as the real
run does: bf16, compiled with CUDA graphs, MLA on for DeepseekV3 and Kimi-K2.5 with DeepSeek's
own per-head sizes (kv_lora_rank 512, rope 64, nope 128, v 128: the sizes the CUDA MLA kernels
are built for). Per family, three engines: speculators' patched extraction generator, a
speculative engine with a random EAGLE-3 draft, and a plain engine (the CPU helpers of
tests/test_extraction.py and tests/test_serving.py, run with the GPU's settings):

* extraction vs transformers (float32, CPU) on the same weights: every slot nearest to the
  layer input it names, the median token within ``checks.TOLERANCE["other"]`` (5e-2 of
  |row - HF| / |HF| per token) and at most ``checks.FLIPPED_SHARE["other"]`` (5%) of the tokens
  beyond it (MoE tokens whose expert choice flips under bf16's rounding). Why that bound: bf16 keeps 8 bits of mantissa (2^-8 = 0.4% per rounding); the
  residual stream accumulates a few of those per layer, and MLA on CUDA runs the absorbed form
  (W_UK folded into the query, W_UV into the output), which rounds in another order than
  transformers' per-head form; about 1% is measured on the CPU engine's bf16 branch, and the
  neighbouring layer's input is tens of percent away, so 5e-2 still names the slot. The same
  bound and comparison as the rehearsal's (draftline.rehearse.checks.compare_rows).
* greedy speculative decoding equals the plain engine's greedy, except at counted near-ties:
  in bf16 the verification forward (k + 1 tokens) and the plain decode (one token) run
  GEMMs of other shapes, so a top-two pair closer than their rounding may swap; a departure
  counts as a near-tie only where the plain engine's log-probabilities of its token and the
  speculative one differ by at most ``NEAR_TIE`` nats; a broken draft path departs by a wide
  margin (the draft's random token against the target's top).
* the aux hidden states the served target hands the draft equal extraction's stored rows for
  the same tokens within ``SERVED_VS_STORED`` (both bf16 through vLLM's model code; they
  differ only by batch shape and compiled-vs-eager rounding).
* TP=2 (two GPUs visible; skipped with the count otherwise): extraction vs HF and greedy
  speculative decoding again, over NCCL.

A host where torch sees no GPU fails here (conftest.require_cuda), as `make selftest` does.
"""

from __future__ import annotations

import pytest

from conftest import environment, require_cuda
from draftline.rehearse.checks import FLIPPED_SHARE, TOLERANCE, compare_rows, judge
from draftline.tiny import builders, kimi_k25
from draftline.tiny import reference as tiny_reference
from test_extraction import _make_generator
from test_serving import KIMI_TEXT_ONLY, MAX_TOKENS, PROMPT_LENGTHS, _capture_prompt, _family, _prompts

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

MLA_DIMS = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
FAMILIES = {  # builder, layers, aux ids (layer 0 dense, the rest MoE), builder kwargs
    "llama": (builders.build_tiny_llama, 6, [1, 3, 4], {}),
    "deepseek": (builders.build_tiny_deepseek_v3, 4, [1, 2, 3], MLA_DIMS),
    "kimi": (kimi_k25.build_tiny_kimi_k25, 4, [1, 2, 3], MLA_DIMS),
}
GPU_ENGINE = {"dtype": "bfloat16", "gpu_memory_utilization": 0.3}  # GPU memory fraction
NEAR_TIE = 0.05  # nats: a bf16 logit pair closer than this may swap between GEMM shapes
SERVED_VS_STORED = 2e-2  # max |served - stored| / max |stored|, both bf16


@pytest.fixture(scope="module")
def cuda_env():
    """MLA on (the CPU tests turn it off), apply_model's pickled functions allowed."""
    require_cuda()
    with environment({"VLLM_MLA_DISABLE": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}):
        yield


def _engine_kwargs(name: str) -> dict:
    return {"limit_mm_per_prompt": KIMI_TEXT_ONLY} if name == "kimi" else {}


def _extract(target, aux_ids: list[int], name: str, prompts: list[list[int]], **kwargs) -> dict:
    """Extraction's generator in bf16 on ``prompts``: its rows and whether it ran MLA."""
    generator = _make_generator(target, aux_ids, **GPU_ENGINE, **_engine_kwargs(name), **kwargs)
    try:
        results = generator.generate(prompts)
        use_mla = bool(generator.vllm_config.model_config.use_mla)
    finally:
        generator.shutdown()
    return {"rows": [r["hidden_states"] for r in results], "use_mla": use_mla}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, cuda_env):
    name = request.param
    build, num_layers, aux_ids, build_kwargs = FAMILIES[name]
    target = build(tmp_path_factory.mktemp(name) / "target", num_layers=num_layers, **build_kwargs)
    prompts = [*_prompts(), _capture_prompt()]
    served = _family(target, aux_ids, enforce_eager=False, logprobs=2, **GPU_ENGINE,
                     **_engine_kwargs(name))
    return {**served, "name": name, "prompts": prompts, "hf": tiny_reference.load_hf_model(target),
            "extracted": _extract(target, aux_ids, name, prompts)}


def _assert_rows_match_hf(family: dict, extracted: dict) -> list[float]:
    import torch

    per_slot = [[] for _ in range(len(family["aux_ids"]) + 1)]
    for prompt, slots in zip(family["prompts"], extracted["rows"], strict=True):
        reference = tiny_reference.hf_hidden_states(family["hf"], prompt)  # num_layers + 1 entries
        for slot, e in enumerate(compare_rows(torch.stack(slots, dim=1).cpu(), reference, family["aux_ids"])):
            per_slot[slot].append(e)
    summary = judge([torch.cat(e) for e in per_slot], TOLERANCE["other"], FLIPPED_SHARE["other"])
    return [r["median"] for r in summary]


def _departures(spec: list[list[int]], plain: list[list[int]], plain_logprobs: list[list[dict]]) -> list[dict]:
    """Prompts whose speculative greedy reply leaves the plain one: where, and the plain
    engine's log-probability margin of its token over the speculative one there."""
    departed = []
    for prompt, (s, p, logprobs) in enumerate(zip(spec, plain, plain_logprobs, strict=True)):
        at = next((i for i, (a, b) in enumerate(zip(s, p)) if a != b), None)
        if at is not None:
            margin = logprobs[at][p[at]] - logprobs[at].get(s[at], float("-inf"))
            departed.append({"prompt": prompt, "position": at, "margin": margin})
    return departed


def _assert_lossless(spec: dict, plain: dict) -> list[dict]:
    assert [len(t) for t in spec["greedy"]] == [MAX_TOKENS] * len(PROMPT_LENGTHS)
    assert spec["metrics"]["vllm:spec_decode_num_drafts"] > 0, "vLLM verified no drafts"
    departed = _departures(spec["greedy"], plain["greedy"], plain["greedy_logprobs"])
    wide = [d for d in departed if d["margin"] > NEAR_TIE]
    assert not wide, f"greedy speculative decoding left the plain engine's greedy by more than a near-tie: {wide}"
    return departed


def test_extraction_in_bf16_matches_hf_with_mla_on(family):
    assert family["extracted"]["use_mla"] is (family["name"] != "llama")
    worst = _assert_rows_match_hf(family, family["extracted"])
    print(f"\n{family['name']}: median token relative |row - HF| per slot {[f'{w:.2g}' for w in worst]} "
          f"(tolerance {TOLERANCE['other']:g})")


def test_greedy_speculative_decoding_is_lossless(family):
    departed = _assert_lossless(family["spec"], family["plain"])
    print(f"\n{family['name']}: {len(departed)} near-tie departures of {len(PROMPT_LENGTHS)} prompts: {departed}")


def test_served_aux_hidden_states_equal_the_stored_rows(family):
    prompt = family["prompts"][-1]  # the capture prompt: the speculative engine's first prefill
    served, stored = family["spec"]["aux"][0], family["extracted"]["rows"][-1]
    assert len(served) == len(family["aux_ids"])
    worst = [float((served[slot][:len(prompt)].float() - stored[slot].float()).abs().max()
                   / stored[slot].float().abs().max()) for slot in range(len(served))]
    print(f"\n{family['name']}: max relative |served aux - stored row| per slot {worst}")
    assert max(worst) <= SERVED_VS_STORED, worst


def test_tensor_parallel_2_extracts_and_decodes_losslessly(family):
    import torch

    from draftline.pipeline.cuda import fork_safe_cuda_checks

    fork_safe_cuda_checks()  # the count through NVML: the engines below fork their workers
    if torch.cuda.device_count() < 2:
        pytest.skip(f"TP=2 needs two visible GPUs; this host shows {torch.cuda.device_count()}")
    name, aux_ids = family["name"], family["aux_ids"]
    _assert_rows_match_hf(family, _extract(family["target"], aux_ids, name, family["prompts"],
                                           tensor_parallel_size=2))
    tp2 = _family(family["target"], aux_ids, enforce_eager=False, logprobs=2, tensor_parallel_size=2,
                  **GPU_ENGINE, **_engine_kwargs(name))
    _assert_lossless(tp2["spec"], tp2["plain"])
