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
from draftline.rehearse import miniature

ASSETS = Path(__file__).resolve().parent / "assets"
# weightless directory -> model_type; each a public model's config.json (its README.md says where from)
SHAPED = {"llama-3.1-8b-shaped": "llama", "qwen2.5-7b-shaped": "qwen2", "qwen3-8b-shaped": "qwen3",
          "qwen3-30b-a3b-shaped": "qwen3_moe", "gpt-oss-20b-shaped": "gpt_oss",
          "kimi-k2.5-shaped": "kimi_k25", "hy-mt2-7b-shaped": "hunyuan_v1_dense"}


def text_of(name: str) -> dict:
    config = json.loads((ASSETS / name / "config.json").read_text())
    return config.get("text_config", config)


@pytest.mark.parametrize("name", sorted(SHAPED))
def test_each_weightless_directory_is_its_family_with_a_tokenizer(name):
    config = json.loads((ASSETS / name / "config.json").read_text())
    assert target.family_of(config).model_type == SHAPED[name]
    assert (ASSETS / name / "tokenizer.json").is_file() and (ASSETS / name / "chat_template.jinja").is_file()
    assert not list((ASSETS / name).glob("*.safetensors"))


@pytest.mark.parametrize("name", sorted(SHAPED))
def test_the_plan_keeps_each_layers_kind_and_every_layer_field_consistent(name):
    text = text_of(name)
    plan = miniature.plan_layers(text, aux_layer_ids(int(text["num_hidden_layers"])))
    mini, _, _ = miniature.shrink_text(text, plan, device="cpu", tensor_parallel_size=1,
                                       mla_disable=True, quantized=False)
    assert miniature.layer_kinds(mini) == list(plan.kinds) == [miniature.layer_kinds(text)[i] for i in plan.kept]
    for key, value in mini.items():  # every per-layer list is as long as the miniature
        if isinstance(value, list) and len(text[key]) == text["num_hidden_layers"]:
            assert len(value) == len(plan.kept), key
    miniature.hf_config(mini)  # transformers' own validation of the config
    for old, new in zip(plan.target_aux_layer_ids, plan.aux_layer_ids):
        assert plan.mapping[old] == new and plan.mapping[old - 1] == new - 1


def test_gpt_oss_keeps_vllms_alternation_by_adding_a_layer_where_parity_would_flip():
    """vLLM's gpt_oss.py slides the even layers whatever layer_types says; so each kept layer
    sits at a position of its own parity (layers 11, 19 and 22 come in for 12, 20 and 23)."""
    plan = miniature.plan_layers(text_of("gpt-oss-20b-shaped"), [2, 12, 21])
    assert plan.kept == (0, 1, 2, 11, 12, 19, 20, 21, 22, 23)
    assert all(layer % 2 == position % 2 for position, layer in enumerate(plan.kept))
    assert plan.aux_layer_ids == (2, 4, 7)


def test_a_sparse_step_and_dense_only_layers_are_kept():
    """Qwen3-MoE with MoE on every second layer and layer 1 forced dense (mlp_only_layers)."""
    text = {**text_of("qwen3-30b-a3b-shaped"), "decoder_sparse_step": 2, "mlp_only_layers": [1, 30]}
    plan = miniature.plan_layers(text, [2, 24, 45])
    mini, _, _ = miniature.shrink_text(text, plan, device="cpu", tensor_parallel_size=1,
                                       mla_disable=False, quantized=False)
    assert miniature.layer_kinds(mini) == list(plan.kinds)
    assert mini["mlp_only_layers"] == [plan.mapping[1]] and mini["decoder_sparse_step"] == 2
    assert "moe" in plan.kinds and "dense" in plan.kinds


def test_per_layer_lists_are_subset_and_window_prefixes_remapped():
    text = {**text_of("qwen3-8b-shaped"), "use_sliding_window": True, "sliding_window": 4096,
            "max_window_layers": 20}
    text["layer_types"] = ["full_attention" if i < 20 else "sliding_attention" for i in range(36)]
    plan = miniature.plan_layers(text, [2, 18, 33])
    mini, _, _ = miniature.shrink_text(text, plan, device="cpu", tensor_parallel_size=1,
                                       mla_disable=False, quantized=False)
    assert mini["layer_types"] == [text["layer_types"][i] for i in plan.kept]
    assert mini["max_window_layers"] == sum(1 for i in plan.kept if i < 20)
    assert miniature.layer_kinds(mini) == list(plan.kinds) and "dense/sliding" in plan.kinds


def test_a_layer_field_without_a_rule_is_a_one_line_refusal_naming_it():
    text = {**text_of("qwen3-8b-shaped"), "global_attention_layers": [3, 9]}
    plan = miniature.plan_layers(text, [2, 18, 33])
    with pytest.raises(ValueError, match=r"^global_attention_layers=\[3, 9\]: a layer-indexed field"):
        miniature.shrink_text(text, plan, device="cpu", tensor_parallel_size=1, mla_disable=False,
                              quantized=False)


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
                                  pytest.param("hy-mt2-7b-shaped", marks=pytest.mark.long)])
def test_the_miniature_loads_and_runs_in_transformers_with_each_layers_kind(tmp_path, name):
    text = text_of(name)
    built = miniature.build_miniature(ASSETS / name, tmp_path / "mini", aux_layer_ids(int(text["num_hidden_layers"])))
    model, why = miniature.load_reference(built.path)
    assert why is None
    kinds = [("moe" if hasattr(layer.mlp, "experts") else "dense") + (
        f"/{model.config.layer_types[i].removesuffix('_attention')}" if "/" in built.layers.kinds[i] else "")
        for i, layer in enumerate(model.model.layers)]
    assert kinds == list(built.layers.kinds)
    states = miniature.reference_hidden_states(model, list(range(3, 40)))
    assert len(states) == len(built.layers.kept) + 1 and all(s.isfinite().all() for s in states)
    sinks = [p for n, p in model.named_parameters() if n.endswith(".sinks")]
    assert len(sinks) == (len(states) - 1 if name.startswith("gpt-oss") else 0)
    # bfloat16 values, as in gpt-oss's checkpoints: the CPU kernel's bfloat16 copy is exact (patches/vllm/0005)
    assert all(p.equal(p.bfloat16().float()) and p.abs().sum() > 0 for p in sinks)


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
