"""The tiny Kimi-K2.5: vLLM's KimiK25Config around a tiny DeepseekV3 text model.

``build_tiny_kimi_k25`` wraps a tiny DeepseekV3 (built by
draftline.tiny.builders.build_tiny_deepseek_v3) in vLLM's own Kimi-K2.5 config and checkpoint
layout, with a tiny MoonViT tower and projector; its HF reference is the text model as a plain
``DeepseekV3ForCausalLM`` (:func:`load_hf_kimi_k25_language_model`;
draftline.tiny.reference.load_hf_model does that for a Kimi directory).  Deterministic and
written atomically, as the other builders.
"""

from __future__ import annotations

from pathlib import Path

from draftline.pipeline.artifacts import atomic_dir
from draftline.tiny.builders import build_tiny_deepseek_v3, seeded

__all__ = [
    "KIMI_K25_ARCHITECTURE",
    "KIMI_K25_LANGUAGE_PREFIX",
    "KIMI_K25_PREPROCESSOR_CONFIG",
    "build_tiny_kimi_k25",
    "is_kimi_k25",
    "kimi_k25_vision_weights",
    "load_hf_kimi_k25_language_model",
    "write_kimi_k25_language_model",
]

KIMI_K25_ARCHITECTURE = "KimiK25ForConditionalGeneration"
# Checkpoint prefixes read by vLLM 0.16's KimiK25ForConditionalGeneration.load_weights
# (an AutoWeightsLoader over its children plus hf_to_vllm_mapper): the text model's HF
# DeepseekV3ForCausalLM names under "language_model.", the MoonViT tower under
# "vision_tower.", the projector under "mm_projector." ("proj.0"/"proj.2" are mapped to
# vLLM's "linear_1"/"linear_2").
KIMI_K25_LANGUAGE_PREFIX = "language_model."
# Files of the DeepseekV3 build that the Kimi directory replaces (the rest move over as is).
_KIMI_K25_REPLACED = ("model.safetensors", "config.json")
_KIMI_K25_VISION_SEED_OFFSET = 0x4B494D49  # "KIMI": vision weights draw from their own stream
# Minimal image-processor stub for text-only serving (see build_tiny_kimi_k25).
KIMI_K25_PREPROCESSOR_CONFIG = {
    "image_processor_type": "BaseImageProcessor",
    "media_tokens_calculator": None,
}


def kimi_k25_vision_weights(vision, text_hidden_size: int, seed: int) -> dict:
    """Random float32 MoonViT tower + patch-merger projector, in checkpoint names and shapes.

    Shapes follow vLLM 0.16's kimi_k25_vit.py: a Conv2d patch embedding, a learnable
    ``[pos_h, pos_w, D]`` position table, pre-norm blocks with a fused ``wqkv`` (bias) and a
    two-layer GELU MLP, a final LayerNorm; the projector LayerNorms ``D``, then maps the
    ``merge_h * merge_w * D`` merged patch to ``D_merged`` and then to the text width.
    Drawn from a private generator seeded apart from the text model's stream (the caller's
    torch RNG is untouched).
    """
    import torch

    generator = torch.Generator().manual_seed(_KIMI_K25_VISION_SEED_OFFSET + seed)
    std = 0.02

    def normal(*shape):
        return (torch.randn(*shape, generator=generator) * std).to(torch.float32)

    def layer_norm(prefix, dim):
        return {f"{prefix}.weight": torch.ones(dim), f"{prefix}.bias": torch.zeros(dim)}

    dim, mlp_dim, patch = vision.hidden_size, vision.intermediate_size, vision.patch_size
    merged = dim * vision.merge_kernel_size[0] * vision.merge_kernel_size[1]
    tower = "vision_tower"
    weights = {
        f"{tower}.patch_embed.proj.weight": normal(dim, 3, patch, patch),
        f"{tower}.patch_embed.proj.bias": normal(dim),
        f"{tower}.patch_embed.pos_emb.weight": normal(
            vision.init_pos_emb_height, vision.init_pos_emb_width, dim
        ),
    }
    for i in range(vision.num_hidden_layers):
        block = f"{tower}.encoder.blocks.{i}"
        weights.update(layer_norm(f"{block}.norm0", dim))
        weights.update(layer_norm(f"{block}.norm1", dim))
        weights.update({
            f"{block}.wqkv.weight": normal(3 * dim, dim),
            f"{block}.wqkv.bias": normal(3 * dim),
            f"{block}.wo.weight": normal(dim, dim),
            f"{block}.wo.bias": normal(dim),
            f"{block}.mlp.fc0.weight": normal(mlp_dim, dim),
            f"{block}.mlp.fc0.bias": normal(mlp_dim),
            f"{block}.mlp.fc1.weight": normal(dim, mlp_dim),
            f"{block}.mlp.fc1.bias": normal(dim),
        })
    weights.update(layer_norm(f"{tower}.encoder.final_layernorm", dim))
    weights.update(layer_norm("mm_projector.pre_norm", dim))
    weights.update({
        "mm_projector.proj.0.weight": normal(merged, merged),
        "mm_projector.proj.0.bias": normal(merged),
        "mm_projector.proj.2.weight": normal(text_hidden_size, merged),
        "mm_projector.proj.2.bias": normal(text_hidden_size),
    })
    return weights


def build_tiny_kimi_k25(
    out_dir,
    *,
    num_layers: int = 4,
    num_heads: int = 4,
    q_lora_rank: int | None = 96,
    kv_lora_rank: int = 64,
    qk_nope_head_dim: int = 64,
    qk_rope_head_dim: int = 32,
    v_head_dim: int = 64,
    routed_scaling_factor: float = 2.827,
    vision_hidden_size: int = 64,
    vision_num_layers: int = 2,
    vision_num_heads: int = 2,
    vision_intermediate_size: int = 128,
    vision_patch_size: int = 14,
    vision_pos_emb_size: int = 8,
    seed: int = 0,
    **text_kwargs,
) -> Path:
    """Write a random float32 Kimi-K2.5 (``KimiK25ForConditionalGeneration``) plus tokenizer.

    ``config.json`` is vLLM 0.16's own ``KimiK25Config`` (model_type ``kimi_k25``; vLLM
    registers it, so no remote code): ``text_config`` is the ``DeepseekV3Config`` of a
    tiny DeepseekV3 built by :func:`build_tiny_deepseek_v3` (MoE, ``noaux_tc``; extra
    keyword arguments such as ``hidden_size``, ``vocab_size`` or the MoE sizes go to it
    unchanged), ``vision_config`` a tiny
    ``KimiK25VisionConfig`` (MoonViT, ``vision_num_heads`` heads of
    ``vision_hidden_size // vision_num_heads``).  Attention is Kimi-K2-shaped, scaled
    down: qk_nope : qk_rope : v = 2 : 1 : 2 (Kimi-K2 128 : 64 : 128), so with MLA disabled
    (CPU) the head size is ``qk_nope_head_dim + qk_rope_head_dim`` = 96 (CPU attention
    supports 32, 64, 80, 96, ...) and v (64) is padded to it; routed_scaling_factor 2.827
    as in Kimi-K2.

    Weights (one ``model.safetensors``): the DeepseekV3 build's tensors, byte-identical,
    under ``language_model.`` (so :func:`load_hf_kimi_k25_language_model` gives the HF
    reference), plus ``vision_tower.*`` and ``mm_projector.*`` from a separate seeded
    generator.  The tokenizer is the project's tiny BPE; it has no media tokens, so
    ``media_placeholder_token_id`` is ``vocab_size`` (never produced by the tokenizer):
    the model is meant to run text-only (vLLM ``limit_mm_per_prompt={"vision_chunk": 0}``,
    Kimi-K2.5's only modality, which also skips building the vision tower).

    ``preprocessor_config.json``: vLLM's Kimi-K2.5 processing info loads an image
    processor from the model directory even in text-only mode (it reads its
    ``media_tokens_calculator`` when the engine asks whether the model takes multimodal
    inputs; without the file the engine fails to start), so the directory carries a stub:
    transformers' built-in ``BaseImageProcessor`` (no remote code, preprocesses nothing)
    with ``media_tokens_calculator`` null, which fails loudly if media ever reach it.
    Returns ``out_dir`` as an absolute Path.
    """
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from vllm.transformers_utils.configs.kimi_k25 import KimiK25Config  # config class only

    if vision_hidden_size % vision_num_heads or (vision_hidden_size // vision_num_heads) % 4:
        raise ValueError("MoonViT's 2-D rope needs a vision head size divisible by 4")
    with atomic_dir(out_dir) as tmp:
        text_dir = build_tiny_deepseek_v3(
            tmp / "_text",
            num_layers=num_layers,
            num_heads=num_heads,
            q_lora_rank=q_lora_rank,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            routed_scaling_factor=routed_scaling_factor,
            seed=seed,
            **text_kwargs,
        )
        text_config = json.loads((text_dir / "config.json").read_text())
        config = KimiK25Config(
            text_config=text_config,
            vision_config={
                "patch_size": vision_patch_size,
                "init_pos_emb_height": vision_pos_emb_size,
                "init_pos_emb_width": vision_pos_emb_size,
                "init_pos_emb_time": 4,
                "num_attention_heads": vision_num_heads,
                "num_hidden_layers": vision_num_layers,
                "hidden_size": vision_hidden_size,
                "intermediate_size": vision_intermediate_size,
                "merge_kernel_size": [2, 2],
            },
            media_placeholder_token_id=text_config["vocab_size"],
            pad_token_id=text_config["pad_token_id"],
            bos_token_id=text_config["bos_token_id"],
            eos_token_id=text_config["eos_token_id"],
            tie_word_embeddings=False,
            architectures=[KIMI_K25_ARCHITECTURE],
            dtype="float32",
        )
        config.to_json_file(str(tmp / "config.json"))  # diff against the class defaults

        weights = {
            KIMI_K25_LANGUAGE_PREFIX + name: tensor
            for name, tensor in load_file(str(text_dir / "model.safetensors")).items()
        }
        weights.update(
            kimi_k25_vision_weights(config.vision_config, text_config["hidden_size"], seed)
        )
        save_file(dict(sorted(weights.items())), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "preprocessor_config.json").write_text(
            json.dumps(KIMI_K25_PREPROCESSOR_CONFIG, indent=2, sort_keys=True) + "\n"
        )
        for path in sorted(text_dir.iterdir()):  # tokenizer files, generation_config.json
            if path.name not in _KIMI_K25_REPLACED:
                shutil.move(str(path), str(tmp / path.name))
        shutil.rmtree(text_dir)
    return Path(out_dir).absolute()


def is_kimi_k25(model_dir) -> bool:
    import json

    config = Path(model_dir) / "config.json"
    return config.exists() and json.loads(config.read_text()).get("model_type") == "kimi_k25"


def load_hf_kimi_k25_language_model(model_dir):
    """The text model of a Kimi-K2.5 directory as a plain HF ``DeepseekV3ForCausalLM``.

    Built from ``config.json``'s ``text_config`` and loaded (strictly: every tensor used,
    none missing) from the ``language_model.*`` weights; float32, CPU, eager attention,
    eval mode.  This is the HF reference for the wrapper's hidden states.
    """
    import json

    import torch
    from safetensors import safe_open
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    model_dir = Path(model_dir)
    text_config = json.loads((model_dir / "config.json").read_text())["text_config"]
    config = DeepseekV3Config.from_dict(text_config)
    config._attn_implementation = "eager"
    state = {}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as weights:
        for name in weights.keys():
            if name.startswith(KIMI_K25_LANGUAGE_PREFIX):
                state[name[len(KIMI_K25_LANGUAGE_PREFIX):]] = weights.get_tensor(name)
    with seeded(0):  # the random init is overwritten; keep the caller's RNG untouched
        model = DeepseekV3ForCausalLM(config).to(torch.float32)
    model.load_state_dict(state, strict=True)
    return model.eval()


def write_kimi_k25_language_model(model_dir, out_dir) -> Path:
    """Write the text model of a Kimi-K2.5 directory as a plain DeepseekV3 model directory.

    Same tensors (``language_model.`` stripped), ``text_config`` as ``config.json``, and the
    Kimi directory's tokenizer and generation config; loadable by transformers and vLLM
    like a :func:`build_tiny_deepseek_v3` build.  Returns ``out_dir`` as an absolute Path.
    """
    import shutil

    model = load_hf_kimi_k25_language_model(model_dir)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        for path in sorted(Path(model_dir).iterdir()):
            if path.name not in ("config.json", "model.safetensors", "preprocessor_config.json"):
                shutil.copy2(path, tmp / path.name)
    return Path(out_dir).absolute()
