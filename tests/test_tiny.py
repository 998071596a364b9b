"""Tests for draftline.tiny's tokenizer, builders, kimi_k25 and reference: tiny random HF target
models (no vLLM here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftline.tiny import builders, kimi_k25, reference, tokenizer

from conftest import REPO

WEIGHTS = "model.safetensors"


def _bytes(d: Path, name: str = WEIGHTS) -> bytes:
    return (d / name).read_bytes()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each builder run twice with seed 0 and once with seed 1."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for name, fn in (("llama", builders.build_tiny_llama), ("dsv3", builders.build_tiny_deepseek_v3),
                     ("kimi", kimi_k25.build_tiny_kimi_k25)):
        out[name] = (
            fn(root / f"{name}_a", seed=0),
            fn(root / f"{name}_b", seed=0),
            fn(root / f"{name}_c", seed=1),
        )
    return out


# ---------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tokenizer.build_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


def test_tokenizer_special_tokens(tok):
    assert len(tok) == 512
    ids = tok.convert_tokens_to_ids(tokenizer.SPECIAL_TOKENS)
    assert ids == list(range(len(tokenizer.SPECIAL_TOKENS)))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    # a role marker in text is one token, not split by BPE
    assert tok("<|user|>hi", add_special_tokens=False).input_ids[0] == ids[4]


@pytest.mark.parametrize(
    "text",
    [
        "Return a new list containing all items from the iterable in ascending order.",
        "  leading spaces,\ttabs\nand newlines\n\n",
        "unicode: naïve café – 日本語 🙂",
        "",
    ],
)
def test_tokenizer_round_trip(tok, text):
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id  # plain encodes start with <|bos|>
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


def test_chat_template(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|bos|><|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>Hello!<|end|>"
    gen = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert gen == "<|bos|><|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>"

    enc = tok.apply_chat_template(
        msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assistant_ids = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(assistant_ids) == "Hello!<|end|>"

    with pytest.raises(Exception, match="unsupported role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_tokenizer_custom_corpus_and_determinism(tmp_path):
    corpus = ["the cat sat on the mat"] * 50 + ["a dog ran in the fog"] * 50
    a = tokenizer.build_tokenizer(tmp_path / "a", corpus=corpus, vocab_size=300)
    tokenizer.build_tokenizer(tmp_path / "b", corpus=corpus, vocab_size=300)
    assert _bytes(tmp_path / "a", "tokenizer.json") == _bytes(tmp_path / "b", "tokenizer.json")
    assert len(a) <= 300
    assert len(a("the cat sat", add_special_tokens=False).input_ids) < len("the cat sat")


def test_tokenizer_deterministic_across_processes():
    """Another interpreter (other hash seed) trains the identical default BPE."""
    code = "from draftline.tiny.tokenizer import _train_bpe; print(_train_bpe(None, 512).to_str())"
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(REPO))
    other = subprocess.run(
        [sys.executable, "-c", code], check=True, env=env, capture_output=True, text=True
    ).stdout.strip()
    assert other == tokenizer._train_bpe(None, 512).to_str()


# ---------------------------------------------------------------- builders


@pytest.mark.parametrize("name", ["llama", "dsv3", "kimi"])
def test_builders_deterministic(built, name):
    a, b, c = built[name]
    for f in sorted(p.name for p in a.iterdir()):
        assert _bytes(a, f) == _bytes(b, f), f
    assert _bytes(a) != _bytes(c)  # the seed matters
    assert _bytes(a, "tokenizer.json") == _bytes(c, "tokenizer.json")


def test_builder_rng_isolated(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    builders.build_tiny_llama(tmp_path / "m", num_layers=1)
    assert torch.equal(torch.rand(3), expected)


def test_rebuild_replaces_atomically(tmp_path):
    out = tmp_path / "m"
    builders.build_tiny_llama(out, num_layers=1, seed=0)
    (out / "stale.txt").write_text("x")
    first = _bytes(out)
    builders.build_tiny_llama(out, num_layers=1, seed=1)
    assert not (out / "stale.txt").exists()
    assert _bytes(out) != first
    with pytest.raises(ValueError):
        builders.build_tiny_llama(out, vocab_size=100)  # fails inside the temp dir
    assert _bytes(out) != first  # the previous build survives a failed rebuild
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp dirs left


def test_llama_files(built):
    d = built["llama"][0]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["head_dim"] == 64 and cfg["num_key_value_heads"] == 2
    assert cfg["tie_word_embeddings"] is False and cfg["rope_scaling"] is None
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 6] and gen["bos_token_id"] == 0
    sd = load_file(str(d / WEIGHTS))
    assert all(t.dtype == torch.float32 for t in sd.values())
    assert "lm_head.weight" in sd and sd["model.embed_tokens.weight"].shape == (512, 256)


def test_deepseek_v3_files(built):
    d = built["dsv3"][0]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"
    assert cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] == 64 and cfg["v_head_dim"] == 64
    assert cfg["num_key_value_heads"] == cfg["num_attention_heads"]
    assert cfg["first_k_dense_replace"] == 1 and cfg["num_hidden_layers"] == 4
    assert cfg["rope_scaling"] is None and cfg["tie_word_embeddings"] is False
    sd = load_file(str(d / WEIGHTS))
    assert all(t.dtype == torch.float32 for t in sd.values())
    assert "model.layers.0.mlp.gate_proj.weight" in sd  # dense layer
    assert "model.layers.0.mlp.gate.e_score_correction_bias" not in sd
    for i in range(1, 4):
        bias = sd[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
        assert bias.shape == (8,) and bias.abs().sum() > 0
        assert sd[f"model.layers.{i}.mlp.experts.7.down_proj.weight"].shape == (256, 128)
        assert f"model.layers.{i}.mlp.shared_experts.up_proj.weight" in sd


# Kimi-K2.5's text model as a plain DeepseekV3 build: the dims build_tiny_kimi_k25 passes on.
KIMI_TEXT_DIMS = dict(q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32,
                      v_head_dim=64, routed_scaling_factor=2.827)
CPU_ATTENTION_HEAD_SIZES = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256}


@pytest.fixture(scope="module")
def kimi_text_twin(tmp_path_factory):
    """build_tiny_deepseek_v3 with the Kimi dims and seed 0: the Kimi build's text model."""
    return builders.build_tiny_deepseek_v3(tmp_path_factory.mktemp("twin") / "dsv3", **KIMI_TEXT_DIMS)


def test_kimi_k25_files(built, kimi_text_twin):
    from transformers import AutoImageProcessor, DeepseekV3Config
    from vllm.transformers_utils.configs.kimi_k25 import KimiK25Config

    from draftline import target

    d = built["kimi"][0]
    assert target.remote_code_references(d) == []  # no auto_map anywhere
    raw = json.loads((d / "config.json").read_text())
    assert raw["model_type"] == "kimi_k25" and raw["architectures"] == [kimi_k25.KIMI_K25_ARCHITECTURE]
    cfg = KimiK25Config.from_pretrained(str(d))  # vLLM's own config class parses it
    text, vision = cfg.text_config, cfg.vision_config
    assert isinstance(text, DeepseekV3Config) and text.model_type == "deepseek_v3"
    assert text.qk_nope_head_dim + text.qk_rope_head_dim in CPU_ATTENTION_HEAD_SIZES  # MLA off
    assert (text.qk_nope_head_dim, text.qk_rope_head_dim, text.v_head_dim) == (64, 32, 64)
    assert text.topk_method == "noaux_tc" and text.routed_scaling_factor == 2.827
    assert text.num_hidden_layers == 4 and text.hidden_size == 256 and text.vocab_size == 512
    assert cfg.media_placeholder_token_id == 512  # outside the tokenizer's 512 ids
    assert vision.mm_hidden_size == 256 and vision.hidden_size // vision.num_attention_heads == 32
    # The text model is the DeepseekV3 build's, tensor for tensor, under language_model.
    sd = load_file(str(d / WEIGHTS))
    assert all(t.dtype == torch.float32 for t in sd.values())
    twin = load_file(str(kimi_text_twin / WEIGHTS))
    language = {k[len("language_model."):]: v for k, v in sd.items() if k.startswith("language_model.")}
    assert language.keys() == twin.keys()
    assert all(torch.equal(language[k], twin[k]) for k in twin)
    others = sorted(k for k in sd if not k.startswith("language_model."))
    assert all(k.startswith(("vision_tower.", "mm_projector.")) for k in others)
    assert "mm_projector.proj.0.weight" in others and "vision_tower.encoder.blocks.1.wqkv.bias" in others
    assert sd["mm_projector.proj.2.weight"].shape == (256, 4 * vision.hidden_size)
    # The tokenizer is the project's; the image processor a built-in stub (text-only).
    assert _bytes(d, "tokenizer.json") == _bytes(kimi_text_twin, "tokenizer.json")
    processor = AutoImageProcessor.from_pretrained(str(d))
    assert type(processor).__name__ == "BaseImageProcessor"
    assert processor.media_tokens_calculator is None


def test_kimi_k25_hf_reference(built, kimi_text_twin, tmp_path):
    d = built["kimi"][0]
    model = reference.load_hf_model(d)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert model.config._attn_implementation == "eager"
    ids = list(range(7, 47))
    expected = reference.hf_hidden_states(kimi_text_twin, ids)
    for got, want in zip(reference.hf_hidden_states(model, ids), expected, strict=True):
        assert torch.equal(got, want)
    plain = kimi_k25.write_kimi_k25_language_model(d, tmp_path / "plain")
    cfg = json.loads((plain / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and "text_config" not in cfg
    assert (plain / "tokenizer.json").exists() and not (plain / "preprocessor_config.json").exists()
    twin = load_file(str(kimi_text_twin / WEIGHTS))
    written = load_file(str(plain / WEIGHTS))
    assert written.keys() == twin.keys() and all(torch.equal(written[k], twin[k]) for k in twin)
    for got, want in zip(reference.hf_hidden_states(plain, ids), expected, strict=True):
        assert torch.equal(got, want)


# ---------------------------------------------------------------- HF hidden states


@pytest.mark.parametrize("name,num_layers", [("llama", 6), ("dsv3", 4), ("kimi", 4)])
def test_hf_hidden_states(built, tok, name, num_layers):
    d = built[name][0]
    ids = tok("import json\nprint(json.dumps({'a': [1, 2, 3]}))").input_ids
    model = reference.load_hf_model(d)
    assert model.config._attn_implementation == "eager"
    hs = reference.hf_hidden_states(model, ids)
    assert len(hs) == num_layers + 1
    for h in hs:
        assert h.shape == (len(ids), 256) and h.dtype == torch.float32
        assert torch.isfinite(h).all()
        assert h.std() > 1e-3
    # consecutive entries differ (every layer does something)
    for x, y in zip(hs, hs[1:]):
        assert not torch.allclose(x, y)

    with torch.no_grad():
        emb = model.get_input_embeddings()(torch.tensor(ids))
        logits = model(torch.tensor([ids])).logits[0]
    # entry 0 is the embedding output; the last entry is post-final-norm
    torch.testing.assert_close(hs[0], emb)
    torch.testing.assert_close(model.lm_head(hs[-1]), logits)
    rms = hs[-1].pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-3, rtol=0)
