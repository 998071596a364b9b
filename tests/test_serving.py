"""Serving EAGLE-3 drafts with vLLM 0.16 on the CPU engine, with the vLLM patch queue applied.

patches/vllm/0001: DeepseekV3 / Kimi-K2.5 targets serve EAGLE-3 (aux hidden states, config).
patches/vllm/0002: speculative decoding on the CPU engine (runner, torch versions of the
Triton kernels of the rejection sampler and of the EAGLE proposer).
patches/vllm/0003: the CPU rotary kernel on 3-D [tokens, heads, rope_dim] queries.

The engine tests start a few tiny engines once per module (float32, eager); each engine
answers every question asked of it. The Llama and Kimi-K2.5 families run here; Kimi-K2.5's
text model is a tiny DeepseekV3 (``build_tiny_kimi_k25``), so a bare DeepseekV3 family would
run the same vLLM model code again: it runs in the long tier (tests/test_branches.py and the
tiny-deepseek rehearsal in tests/test_rehearse.py).  The drafts are
random (untrained) speculators-format EAGLE-3 drafts: acceptance is low, but greedy
speculative decoding must still reproduce the non-speculative tokens exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import environment
from draftline.tiny import builders, kimi_k25, reference
from harness import capture

pytestmark = pytest.mark.vllm

LLAMA_LAYERS = 6
LLAMA_AUX_IDS = [1, 3, 4]  # not vLLM's default (2, 3, 3): the draft's ids must be used
DSV3_LAYERS = 4
KIMI_TEXT_ONLY = {"vision_chunk": 0}  # Kimi-K2.5's only modality; text-only serving
DSV3_AUX_IDS = [1, 2, 3]  # layer 0 is dense, 1..3 are MoE (inputs of layers 1..3)
NUM_SPEC = 3
PROMPT_LENGTHS = (5, 17, 33, 9, 60, 2)
MAX_TOKENS = 24
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_MLA_DISABLE": "1",  # DeepseekV3 on CPU
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # LLM.apply_model sends functions
}
SPEC_METRICS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)


# --------------------------------------------------------------------------- unit: kernels


def _loop_greedy(out, cu, draft, argmax, bonus, is_greedy):
    """The Triton greedy kernel's loop, in Python."""
    start = 0
    for r, end in enumerate(cu.tolist()):
        if is_greedy is None or bool(is_greedy[r]):
            rejected = False
            for p in range(end - start):
                out[r, p] = argmax[start + p]
                if draft[start + p] != argmax[start + p]:
                    rejected = True
                    break
            if not rejected:
                out[r, end - start] = bonus[r, 0]
        start = end


def _loop_random(out, cu, draft, draft_probs, target_probs, bonus, recovered, u, is_greedy):
    """The Triton random-sampling kernel's loop, in Python."""
    start = 0
    for r, end in enumerate(cu.tolist()):
        if not bool(is_greedy[r]):
            rejected = False
            for p in range(end - start):
                t = int(draft[start + p])
                dp = 1.0 if draft_probs is None else float(draft_probs[start + p, t])
                tp = float(target_probs[start + p, t])
                if dp > 0 and tp / dp >= float(u[start + p]):
                    out[r, p] = t
                else:
                    out[r, p] = recovered[start + p]
                    rejected = True
                    break
            if not rejected:
                out[r, end - start] = bonus[r, 0]
        start = end


def _batch(seed: int, vocab: int = 11, max_spec: int = 4):
    g = torch.Generator().manual_seed(seed)
    num_draft = torch.randint(0, max_spec + 1, (6,), generator=g)
    cu = num_draft.cumsum(0).to(torch.int32)
    n = int(num_draft.sum())
    argmax = torch.randint(0, vocab, (n,), generator=g)
    # Mostly matching drafts, so accepted prefixes of every length occur.
    draft = torch.where(torch.rand(n, generator=g) < 0.7, argmax,
                        torch.randint(0, vocab, (n,), generator=g)).to(torch.int32)
    bonus = torch.randint(0, vocab, (6, 1), generator=g).to(torch.int32)
    is_greedy = torch.rand(6, generator=g) < 0.5
    return num_draft, cu, draft, argmax, bonus, is_greedy, g


@pytest.mark.parametrize("seed", range(20))
def test_cpu_rejection_kernels_match_the_triton_loops(seed):
    """The torch versions (CPU) write exactly what the Triton kernels' loops write."""
    from vllm.v1.sample import rejection_sampler as rs

    vocab, max_spec = 11, 4
    num_draft, cu, draft, argmax, bonus, is_greedy, g = _batch(seed, vocab, max_spec)
    n = draft.numel()
    for greedy_mask in (None, is_greedy):
        ours = torch.full((6, max_spec + 1), -1, dtype=torch.int32)
        ref = ours.clone()
        rs._rejection_greedy_sample_torch(ours, cu, draft, argmax, bonus, greedy_mask)
        _loop_greedy(ref, cu, draft, argmax, bonus, greedy_mask)
        assert torch.equal(ours, ref)

    target_probs = torch.rand(n, vocab, generator=g).softmax(-1)
    for draft_probs in (None, torch.rand(n, vocab, generator=g).softmax(-1)):
        u = torch.rand(n, dtype=torch.float64, generator=g)
        q = torch.empty(6, vocab).exponential_(generator=g)
        recovered = torch.empty_like(draft)
        rs._sample_recovered_tokens_torch(recovered, cu, draft, draft_probs, target_probs, q)
        req = torch.repeat_interleave(torch.arange(6), num_draft)
        for i in range(n):  # the recovered-token kernel, one (request, position) at a time
            if draft_probs is None:
                prob = target_probs[i].clone()
                prob[int(draft[i])] = 0
            else:
                prob = (target_probs[i] - draft_probs[i]).clamp_min(0)
            assert int(recovered[i]) == int((prob / q[req[i]]).argmax())
        ours = torch.full((6, max_spec + 1), -1, dtype=torch.int32)
        ref = ours.clone()
        rs._rejection_random_sample_torch(ours, cu, draft, draft_probs, target_probs, bonus,
                                          recovered, u, is_greedy)
        _loop_random(ref, cu, draft, draft_probs, target_probs, bonus, recovered, u, is_greedy)
        assert torch.equal(ours, ref)

    temps = torch.rand(6, generator=g)
    temps[0] = 0
    expanded = rs._expand_batch_to_tokens_torch(temps, cu, n, 0, 1)
    assert torch.equal(expanded, torch.repeat_interleave(torch.where(temps == 0, 1.0, temps),
                                                         num_draft))


@pytest.mark.parametrize("seed", range(10))
def test_cpu_eagle_padded_helpers_match_the_triton_kernels(seed):
    from vllm.v1.spec_decode import eagle

    g = torch.Generator().manual_seed(seed)
    vocab, k, reqs = 50, 3, 5
    sampled = torch.randint(0, vocab, (reqs, k + 1), generator=g)
    valid_len = torch.randint(0, k + 2, (reqs,), generator=g)  # accepted + 1 (or 0)
    sampled[torch.arange(k + 1)[None, :] >= valid_len[:, None]] = -1
    discard = torch.rand(reqs, generator=g) < 0.3
    backup = torch.randint(0, vocab, (reqs,), generator=g).to(torch.int32)
    nxt, count = eagle._prepare_next_token_padded_torch(sampled, discard, backup, vocab)
    for r in range(reqs):
        valid = [int(t) for t in sampled[r] if t != -1]
        want_count = 0 if discard[r] else len(valid)
        want_next = int(backup[r]) if discard[r] or not valid else valid[-1]
        assert (int(nxt[r]), int(count[r])) == (want_next, want_count)

    num_draft = torch.randint(0, k + 1, (reqs,), generator=g)
    cu = num_draft.cumsum(0).to(torch.int32)
    query_len = num_draft + 1
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), query_len.cumsum(0)]).to(torch.int32)
    valid_count = (torch.rand(reqs, generator=g) * (num_draft + 1).float()).long() + 1
    idx = torch.empty(reqs, dtype=torch.int32)
    rej = torch.empty(reqs, dtype=torch.int32)
    eagle._prepare_inputs_padded_torch(cu, valid_count.to(torch.int32), qsl, idx, rej)
    for r in range(reqs):
        want_rej = int(num_draft[r] + 1 - valid_count[r]) if num_draft[r] > 0 else 0
        assert int(rej[r]) == want_rej
        assert int(idx[r]) == int(qsl[r + 1]) - 1 - want_rej


@pytest.mark.parametrize("num_tokens", [7, 1])
def test_cpu_rope_kernel_handles_3d_queries(num_tokens):
    """The CPU rotary kernel on DeepseekV2Attention's q_pe/k_pe views equals torch's rope
    (one token: the views reshape to 2-D without a copy)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(32, max_position=256, is_neox_style=False, dtype=torch.float32,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    g = torch.Generator().manual_seed(0)
    T, H = num_tokens, 4
    q = torch.randn(T, H, 64, generator=g)
    latent = torch.randn(T, 1, 96, generator=g)
    positions = torch.arange(T) * 3 + 5
    results = []
    for forward in (rope.forward_native, rope.forward_cpu):
        q_, latent_ = q.clone(), latent.clone()
        q_pe, k_pe = forward(positions, q_[..., 32:], latent_[..., 64:])
        results.append((q_pe.clone(), k_pe.clone()))
    (q_ref, k_ref), (q_cpu, k_cpu) = results
    assert (q_cpu - q_ref).abs().max() < 1e-5
    assert (k_cpu - k_ref).abs().max() < 1e-5
    # In place, as on the 2-D path: the views' storage holds the rotated values.
    q_, latent_ = q.clone(), latent.clone()
    rope.forward_cpu(positions, q_[..., 32:], latent_[..., 64:])
    assert torch.allclose(q_[..., 32:], q_ref, atol=1e-5)
    assert torch.equal(q_[..., :32], q[..., :32])


def test_pristine_vllm_refuses_eagle3_for_deepseek_and_the_patch_accepts_it():
    """Pristine vLLM 0.16's list (read from the patch's context) lacks deepseek_v3; the
    installed, patched list has it, plus both Kimi model types."""
    import inspect

    from vllm.config import speculative

    source = inspect.getsource(speculative.SpeculativeConfig)
    assert "Eagle3 is only supported for" in source
    patch = (Path(__file__).resolve().parents[1]
             / "patches/vllm/0001-eagle3-deepseek-kimi-targets.diff").read_text()
    removed_or_context = [line[1:] for line in patch.splitlines()
                          if line.startswith((" ", "-")) and '"' in line]
    pristine = [s.strip().strip('",') for s in removed_or_context
                if s.strip().startswith('"') and s.strip().endswith('",')]
    assert "deepseek_v3" not in pristine and "afmoe" in pristine
    for model_type in ("deepseek_v3", "kimi_k2", "kimi_k25"):
        assert f'"{model_type}",' in source


# --------------------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def engine_env():
    with environment(ENGINE_ENV):
        yield


def _prompts(vocab_size: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(7, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _save_draft(target_dir: Path, aux_ids: list[int], out_dir: Path) -> Path:
    """A random EAGLE-3 draft for ``target_dir`` in speculators' format (as train saves it).

    Token 0 is in the draft vocabulary (draft id 0), which the agreeing pair below needs.
    """
    from draftline.tokenize import vocab
    from draftline.train.draft import build_draft

    freq = torch.randint(0, 100, (512,), generator=torch.Generator().manual_seed(0))
    freq[0] = 1000
    d2t, t2d = vocab.draft_vocab_mapping(freq, 256)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        draft = build_draft(target_dir, aux_ids, d2t, t2d, num_speculative_tokens=NUM_SPEC)
    draft.save_pretrained(str(out_dir))
    return out_dir


def _metrics(llm) -> dict:
    found = {}
    for metric in llm.get_metrics():
        if metric.name in SPEC_METRICS:
            found[metric.name] = list(metric.values) if hasattr(metric, "values") else metric.value
    return found


def _run(model_dir: Path, draft_dir: Path | None, capture_prompt: list[int] | None = None,
         dtype: str = "float32", enforce_eager: bool = True, logprobs: int | None = None,
         **kwargs):
    """Start an engine, answer every question, shut it down; returns plain data. With
    ``logprobs``, the greedy replies' top-``logprobs`` log-probabilities too (per token:
    {token id: logprob})."""
    from vllm import LLM, SamplingParams

    if draft_dir is not None:
        kwargs["speculative_config"] = {"method": "eagle3", "model": str(draft_dir),
                                        "num_speculative_tokens": NUM_SPEC}
    llm = LLM(model=str(model_dir), dtype=dtype, enforce_eager=enforce_eager, max_model_len=512,
              max_num_seqs=4, disable_log_stats=False, seed=0, **kwargs)
    try:
        out = {}
        if capture_prompt is not None:
            llm.apply_model(capture.install)
            llm.generate([{"prompt_token_ids": capture_prompt}],
                         SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            out["aux"] = llm.apply_model(capture.take)[0]
        prompts = [{"prompt_token_ids": p} for p in _prompts()]
        greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                      ignore_eos=True, logprobs=logprobs), use_tqdm=False)
        out["greedy"] = [list(o.outputs[0].token_ids) for o in greedy]
        if logprobs is not None:
            out["greedy_logprobs"] = [[{int(t): float(lp.logprob) for t, lp in step.items()}
                                       for step in o.outputs[0].logprobs] for o in greedy]
        if draft_dir is not None:
            out["metrics"] = _metrics(llm)
            sampled = llm.generate(prompts, [SamplingParams(temperature=1.0, seed=s,
                                                            max_tokens=MAX_TOKENS,
                                                            ignore_eos=True)
                                             for s in range(len(prompts))], use_tqdm=False)
            out["sampled"] = [list(o.outputs[0].token_ids) for o in sampled]
            out["metrics_after_sampling"] = _metrics(llm)
        return out
    finally:
        engine = getattr(llm, "llm_engine", None)
        if engine is not None and hasattr(engine, "engine_core"):
            engine.engine_core.shutdown()


def _capture_prompt() -> list[int]:
    return torch.randint(7, 512, (40,), generator=torch.Generator().manual_seed(2)).tolist()


def _family(target: Path, aux_ids: list[int], **engine_kwargs) -> dict:
    """One target family: a random draft, a speculative engine (with the aux capture) and a
    plain engine, each answering the same prompts."""
    draft = _save_draft(target, aux_ids, target.parent / "draft")
    return {"target": target, "aux_ids": aux_ids,
            "spec": _run(target, draft, _capture_prompt(), **engine_kwargs),
            "plain": _run(target, None, **engine_kwargs)}


@pytest.fixture(scope="module")
def llama(tmp_path_factory, engine_env):
    root = tmp_path_factory.mktemp("llama")
    return _family(builders.build_tiny_llama(root / "target", num_layers=LLAMA_LAYERS), LLAMA_AUX_IDS)


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory, engine_env):
    """A Llama target whose lm_head is zero, so its greedy token is always 0 (argmax of equal
    logits), and a draft carrying the same (zero) head: it always proposes draft id 0 =
    token 0, so every drafted token is accepted (the accept-all and bonus-token paths)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("agreeing")
    target = builders.build_tiny_llama(root / "target", num_layers=LLAMA_LAYERS)
    weights = load_file(str(target / "model.safetensors"))
    weights["lm_head.weight"].zero_()
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    draft = _save_draft(target, LLAMA_AUX_IDS, root / "draft")
    return {"spec": _run(target, draft)}


def test_a_draft_that_always_agrees_is_always_accepted(agreeing):
    spec = agreeing["spec"]
    assert spec["greedy"] == [[0] * MAX_TOKENS] * len(PROMPT_LENGTHS)
    m = spec["metrics"]
    drafts = m["vllm:spec_decode_num_drafts"]
    assert drafts > 0
    assert m["vllm:spec_decode_num_accepted_tokens"] == m["vllm:spec_decode_num_draft_tokens"]
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos"] == [drafts] * NUM_SPEC
    # tau = 1 + k: each round emits k + 1 tokens, so a reply takes about
    # MAX_TOKENS / (k + 1) rounds.
    assert drafts <= len(PROMPT_LENGTHS) * -(-MAX_TOKENS // (NUM_SPEC + 1))


@pytest.fixture(scope="module")
def kimi(tmp_path_factory, engine_env):
    """Kimi-K2.5 (KimiK25ForConditionalGeneration around a tiny DeepseekV3), text-only."""
    root = tmp_path_factory.mktemp("kimi")
    target = kimi_k25.build_tiny_kimi_k25(root / "target", num_layers=DSV3_LAYERS)
    return {**_family(target, DSV3_AUX_IDS, limit_mm_per_prompt=KIMI_TEXT_ONLY),
            "hf": kimi_k25.load_hf_kimi_k25_language_model(target)}


# Kimi-K2.5 (30-50 s more) in the long tier: the default tier keeps its 15 minutes.
@pytest.fixture(params=["llama", pytest.param("kimi", marks=pytest.mark.long)])
def served(request):
    return request.getfixturevalue(request.param)


def test_greedy_speculative_decoding_equals_the_plain_run(served):
    spec, plain = served["spec"]["greedy"], served["plain"]["greedy"]
    assert [len(t) for t in spec] == [MAX_TOKENS] * len(PROMPT_LENGTHS)
    assert spec == plain


def test_spec_decode_counters_are_present_and_consistent(served):
    m = served["spec"]["metrics"]
    assert set(m) == set(SPEC_METRICS)
    drafts = m["vllm:spec_decode_num_drafts"]
    draft_tokens = m["vllm:spec_decode_num_draft_tokens"]
    accepted = m["vllm:spec_decode_num_accepted_tokens"]
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert drafts > 0 and draft_tokens == NUM_SPEC * drafts
    assert len(per_pos) == NUM_SPEC and sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    # Every drafting round emits 1 + accepted tokens; the prefill step emits one more per
    # prompt without a draft.
    emitted = len(PROMPT_LENGTHS) * MAX_TOKENS
    assert drafts + accepted <= emitted


def test_sampling_with_speculative_decoding_runs(served):
    sampled = served["spec"]["sampled"]
    assert [len(t) for t in sampled] == [MAX_TOKENS] * len(PROMPT_LENGTHS)
    assert all(0 <= t < 512 for seq in sampled for t in seq)
    after, before = served["spec"]["metrics_after_sampling"], served["spec"]["metrics"]
    assert after["vllm:spec_decode_num_drafts"] > before["vllm:spec_decode_num_drafts"]
    assert sampled != served["spec"]["greedy"]  # temperature 1 really sampled


def test_served_aux_hidden_states_equal_hf_training_features(served):
    """The target's aux outputs, set from the draft's eagle_aux_hidden_state_layer_ids by the
    model runner, are transformers' hidden_states[i] (the input of layer i)."""
    prompt = _capture_prompt()
    captured = served["spec"]["aux"]
    assert captured, "the target returned no aux hidden states"
    aux = captured[0]  # the prefill of the capture prompt
    hf = reference.hf_hidden_states(served["hf"] if "hf" in served else served["target"], prompt)
    assert len(aux) == len(served["aux_ids"])
    for slot, layer in enumerate(served["aux_ids"]):
        got = aux[slot][: len(prompt)]
        assert got.shape == hf[layer].shape
        err = (got - hf[layer]).abs().max().item()
        assert err <= 1e-5, f"slot {slot} (layer {layer}): max |aux - HF| = {err}"


def test_served_aux_hidden_states_equal_the_extracted_rows(served, request):
    """Serving features = training features: what the patched target hands the draft equals
    what extraction (the patched speculators generator) stores for the same tokens."""
    from speculators.data_generation import VllmHiddenStatesGenerator

    prompt = _capture_prompt()
    kwargs = {"limit_mm_per_prompt": KIMI_TEXT_ONLY} if "hf" in served else {}
    generator = VllmHiddenStatesGenerator(str(served["target"]), layer_ids=served["aux_ids"],
                                          max_model_len=512, dtype="float32", max_num_seqs=2,
                                          max_num_batched_tokens=64, **kwargs)
    try:
        stored = generator.generate([prompt])[0]["hidden_states"]  # aux slots..., final
    finally:
        generator.shutdown()
    aux = served["spec"]["aux"][0]
    worst = [(aux[slot][: len(prompt)] - stored[slot].float()).abs().max().item()
             for slot in range(len(served["aux_ids"]))]
    print(f"\n{request.node.callspec.id}: max |served aux - stored row| per slot {worst}")
    assert max(worst) <= 1e-5, worst


def test_deepseek_v3_greedy_replies_match_hf_generate(kimi):
    """Kimi-K2.5's DeepseekV3 text model (rope_scaling=None: plain RotaryEmbedding through
    vLLM's CPU kernel, patch 0003) served through the wrapper equals HF's greedy."""
    model = kimi["hf"]
    assert model.config.rope_scaling is None
    for prompt, served_reply in list(zip(_prompts(), kimi["plain"]["greedy"]))[:4]:
        # Plain greedy with no stop tokens (the engine ran with ignore_eos=True).
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
                ids.append(int(logits[0, -1].argmax()))
        assert ids[len(prompt):] == served_reply
