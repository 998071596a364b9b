"""The miniature's weights: transformers' config and random model of its text config, the
checkpoint's tensors (the target's names and dtype; INT4-packed where the quantization is
kept), and the Kimi-K2.5 and Llama 4 vision towers.
"""

from __future__ import annotations

import re

from draftline.rehearse.layers import DEEPSEEK_TYPES
from draftline.tiny.builders import seeded
from draftline.tiny.kimi_k25 import KIMI_K25_LANGUAGE_PREFIX, kimi_k25_vision_weights

WRAPPER_PREFIX = {"kimi_k25": KIMI_K25_LANGUAGE_PREFIX,  # text weights under this prefix
                  "llama4": "language_model."}


def hf_config(text: dict):
    """transformers' config of the miniature's text model; its validation (per-layer lists
    against the layer count, ...) is a one-line ValueError here, before any weight is made."""
    from transformers import AutoConfig, DeepseekV3Config

    fields = {k: v for k, v in text.items() if k not in ("auto_map", "quantization_config",
                                                          "architectures", "model_type")}
    try:
        if text.get("model_type") in DEEPSEEK_TYPES:
            return DeepseekV3Config(**fields)
        return AutoConfig.for_model(str(text.get("model_type")), **fields)
    except (ValueError, TypeError, KeyError) as error:
        first = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(f"transformers refuses the miniature's {text.get('model_type')} config: "
                         f"{type(error).__name__}: {first}") from error


def text_model(text: dict, seed: int):
    """A random transformers model for the miniature's text config."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

    config = hf_config(text)
    with seeded(seed):
        if text.get("model_type") in DEEPSEEK_TYPES:
            model = DeepseekV3ForCausalLM(config)
            with torch.no_grad():  # the routing bias vLLM's noaux_tc loader expects, exercised
                for layer in model.model.layers:
                    gate = getattr(layer.mlp, "gate", None)
                    if getattr(gate, "e_score_correction_bias", None) is not None:
                        gate.e_score_correction_bias.copy_(
                            torch.randn(gate.e_score_correction_bias.shape) * 0.02)
        else:
            model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # attention sinks as gpt-oss stores them: bfloat16 values (patches/vllm/0005)
        for name, param in model.named_parameters():
            if name.endswith(".sinks"):
                param.copy_(param.to(torch.bfloat16))
    return model.eval()


def _is_ignored(name: str, ignore: list[str]) -> bool:
    module = name.removesuffix(".weight")
    for pattern in ignore:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif module == pattern or module.endswith("." + pattern):
            return True
    return False


def quantize_int4(weight, group_size: int) -> dict:
    """compressed-tensors ``pack-quantized`` tensors of one Linear weight [out, in]: symmetric
    INT4 per group of ``group_size`` inputs, 8 values per int32."""
    import torch
    from compressed_tensors.compressors.quantized_compressors.pack_quantized import pack_to_int32

    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"input width {in_features} is no multiple of the group size {group_size}")
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 7
    values = (groups / scale).round().clamp(-8, 7).to(torch.int8).reshape(out_features, in_features)
    return {"weight_packed": pack_to_int32(values, 4), "weight_scale": scale[..., 0].to(torch.bfloat16),
            "weight_shape": torch.tensor([out_features, in_features], dtype=torch.int32)}


def checkpoint_state(model, prefix: str, dtype: str, quant: dict | None) -> dict:
    """The checkpoint tensors: names as the target's checkpoint has them, in its dtype."""
    import torch

    linear = {f"{name}.weight" for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear)}
    ignore = list((quant or {}).get("ignore") or [])
    group = int(next(iter((quant or {}).get("config_groups", {}).values()), {}).get("weights", {})
                .get("group_size") or 0) if quant else 0
    state, stored = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in stored:  # a tied weight (lm_head = embed_tokens): checkpoints hold it once
            continue
        stored.add(tensor.data_ptr())
        full = prefix + name
        if quant and name in linear and not _is_ignored(full, ignore):
            stem = full.removesuffix(".weight")
            state.update({f"{stem}.{k}": v for k, v in quantize_int4(tensor, group).items()})
        else:
            state[full] = tensor.to(getattr(torch, dtype)) if tensor.is_floating_point() else tensor
    return state


def kimi_vision(config: dict, seed: int, dtype: str) -> dict:
    """MoonViT tower and projector weights in vLLM's config classes' shapes (draftline.tiny.kimi_k25)."""
    import torch
    from vllm.transformers_utils.configs.kimi_k25 import KimiK25Config  # config class only

    parsed = KimiK25Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    weights = kimi_k25_vision_weights(parsed.vision_config, parsed.text_config.hidden_size, seed)
    return {name: tensor.to(getattr(torch, dtype)) for name, tensor in weights.items()}


def llama4_vision(config: dict, seed: int, dtype: str) -> dict:
    """Random weights of Llama 4's vision tower and projector, named as its checkpoints name
    them (``vision_model.*``, ``multi_modal_projector.*``): transformers' own modules."""
    import torch
    from transformers import Llama4Config
    from transformers.models.llama4.modeling_llama4 import Llama4MultiModalProjector, Llama4VisionModel

    parsed = Llama4Config(text_config=config["text_config"], vision_config=config["vision_config"])
    with seeded(seed + 1):  # its own stream: the text weights stay those of seed
        modules = {"vision_model.": Llama4VisionModel(parsed.vision_config),
                   "multi_modal_projector.": Llama4MultiModalProjector(parsed)}
    return {prefix + name: tensor.to(getattr(torch, dtype))
            for prefix, module in modules.items() for name, tensor in module.state_dict().items()}
