"""Deterministic builders of the tiny random HF-format Llama and DeepseekV3 targets.

Every builder writes a complete Hugging Face model directory (float32 safetensors weights,
``config.json``, ``generation_config.json`` and the tokenizer files of draftline.tiny.tokenizer)
that both transformers and vLLM's CPU engine can load.  Nothing is downloaded: the weights are
drawn from a seeded torch generator (:func:`seeded`).  Kimi-K2.5, a wrapper around a tiny
DeepseekV3, is built by draftline.tiny.kimi_k25.

Same arguments -> byte-identical files (for a fixed torch / transformers / tokenizers stack:
``config.json`` records the transformers version; the tokenizer's corpus is committed, so the
interpreter does not matter).  Directories are written to a temporary sibling first and then
renamed into place, so a reader never sees a half-written model and rebuilding an existing
directory replaces it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from draftline.pipeline.artifacts import atomic_dir
from draftline.tiny.tokenizer import write_generation_config, write_tokenizer

__all__ = ["seeded", "build_tiny_llama", "build_tiny_deepseek_v3"]


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU RNG for the block without disturbing the caller's RNG state."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build_tiny_llama(
    out_dir,
    *,
    hidden_size: int = 256,
    num_layers: int = 6,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    initializer_range: float = 0.02,
    seed: int = 0,
    head_dim: int | None = None,
    chat: str = "plain",
) -> Path:
    """Write a random float32 ``LlamaForCausalLM`` plus tokenizer to ``out_dir``.

    head_dim = hidden_size // num_heads unless given (64 by default; vLLM's CPU attention
    accepts 32, 64, 80, 96, 112, 128, 160, 192, 224, 256); a given one makes a wide model
    with few heads cheap (benchmarks/extract.py's Kimi-width target).  Untied embeddings,
    no rope scaling.  ``chat``: its chat template and specials
    (:func:`draftline.tiny.tokenizer._chat`).  Returns ``out_dir`` as an absolute Path.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (head_dim is None and hidden_size % num_heads) or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads and num_heads by num_kv_heads")
    with atomic_dir(out_dir) as tmp:
        tok = write_tokenizer(tmp, None, vocab_size, chat)
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim or hidden_size // num_heads,
            hidden_act="silu",
            max_position_embeddings=max_position_embeddings,
            initializer_range=initializer_range,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            rope_scaling=None,
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            dtype="float32",
            architectures=["LlamaForCausalLM"],
        )
        with seeded(seed):
            model = LlamaForCausalLM(config).to(torch.float32).eval()
        write_generation_config(model, tok, chat)
        model.save_pretrained(str(tmp), safe_serialization=True)
    return Path(out_dir).absolute()


def build_tiny_deepseek_v3(
    out_dir,
    *,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 512,
    first_k_dense_replace: int = 1,
    n_routed_experts: int = 8,
    num_experts_per_tok: int = 2,
    n_shared_experts: int = 1,
    moe_intermediate_size: int = 128,
    routed_scaling_factor: float = 2.5,
    q_lora_rank: int | None = 64,
    kv_lora_rank: int = 64,
    qk_nope_head_dim: int = 32,
    qk_rope_head_dim: int = 32,
    v_head_dim: int = 64,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    initializer_range: float = 0.02,
    seed: int = 0,
    chat: str = "plain",
) -> Path:
    """Write a random float32 ``DeepseekV3ForCausalLM`` (MLA + MoE) plus tokenizer (``chat``:
    its chat template and specials, :func:`draftline.tiny.tokenizer._chat`).

    Layers ``< first_k_dense_replace`` use a dense MLP, the rest are MoE
    (sigmoid routing with ``topk_method="noaux_tc"``, n_group = topk_group = 1).
    Every MoE layer carries ``model.layers.N.mlp.gate.e_score_correction_bias``
    (small random values so the bias path is exercised).  For vLLM on CPU run
    with ``VLLM_MLA_DISABLE=1``: attention is then materialised with head size
    ``qk_nope_head_dim + qk_rope_head_dim`` (64 by default) and
    ``v_head_dim <= that``.  Interleaved rope as in DeepSeek-V3.

    Rope: plain (``rope_scaling=None``), the path vLLM 0.16's CPU rotary kernel
    got wrong for DeepseekV2Attention's 3-D query; patches/vllm/0003 fixes it.
    Returns ``out_dir`` as an absolute Path.
    """
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    if v_head_dim > qk_nope_head_dim + qk_rope_head_dim:
        raise ValueError("vLLM pads v to the qk head dim, so v_head_dim must not exceed it")
    with atomic_dir(out_dir) as tmp:
        tok = write_tokenizer(tmp, None, vocab_size, chat)
        config = DeepseekV3Config(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            moe_intermediate_size=moe_intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,  # MLA: one K/V per query head
            n_shared_experts=n_shared_experts,
            n_routed_experts=n_routed_experts,
            routed_scaling_factor=routed_scaling_factor,
            kv_lora_rank=kv_lora_rank,
            q_lora_rank=q_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            qk_nope_head_dim=qk_nope_head_dim,
            n_group=1,
            topk_group=1,
            num_experts_per_tok=num_experts_per_tok,
            first_k_dense_replace=first_k_dense_replace,
            norm_topk_prob=True,
            hidden_act="silu",
            max_position_embeddings=max_position_embeddings,
            initializer_range=initializer_range,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            rope_scaling=None,
            rope_interleave=True,
            attention_bias=False,
            tie_word_embeddings=False,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            dtype="float32",
            architectures=["DeepseekV3ForCausalLM"],
            # Read by vLLM's deepseek_v2 loader (HF's modeling ignores them):
            # noaux_tc creates the gate.e_score_correction_bias parameter,
            # scoring_func defaults to softmax there but DeepSeek-V3 is sigmoid.
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            moe_layer_freq=1,
            num_nextn_predict_layers=0,
        )
        with seeded(seed):
            model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
            with torch.no_grad():
                for layer in model.model.layers[first_k_dense_replace:]:
                    bias = layer.mlp.gate.e_score_correction_bias
                    bias.copy_(torch.randn(bias.shape) * initializer_range)
        write_generation_config(model, tok, chat)
        model.save_pretrained(str(tmp), safe_serialization=True)
    return Path(out_dir).absolute()
