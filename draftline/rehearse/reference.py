"""transformers' reference of a miniature: its text model, and that model's hidden states."""

from __future__ import annotations

import json
from pathlib import Path

from draftline import target
from draftline.rehearse import wrappers
from draftline.rehearse.layers import DEEPSEEK_TYPES
from draftline.rehearse.weights import WRAPPER_PREFIX, text_model
from draftline.tiny.kimi_k25 import load_hf_kimi_k25_language_model
from draftline.tiny.reference import load_hf_model


def load_reference(model_dir: str | Path):
    """The miniature's text model in transformers (float32, eager), or None with the reason."""
    import torch
    from safetensors import safe_open

    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = target.text_config(config)
    if (config.get("quantization_config") or text.get("quantization_config")):
        return None, "quantized miniature: transformers' reference would need its INT4 kernels"
    model_type = config.get("model_type")
    if wrappers.is_wrapper(config):
        return wrappers.load_reference(model_dir), None
    if model_type == "kimi_k25":
        return load_hf_kimi_k25_language_model(model_dir), None
    if model_type in DEEPSEEK_TYPES or model_type in WRAPPER_PREFIX:
        prefix = WRAPPER_PREFIX.get(model_type, "")
        model = text_model(text, 0).to(torch.float32)
        with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as weights:
            model.load_state_dict({n[len(prefix):]: weights.get_tensor(n).float() for n in weights.keys()
                                   if n.startswith(prefix)}, strict=True)
        model.config._attn_implementation = "eager"
        return model.eval(), None
    return load_hf_model(model_dir), None


def reference_hidden_states(model, token_ids: list[int]) -> list:
    """transformers' hidden states of one sequence: entry k < L the input of layer k, entry L
    the final state after the norm (draftline.tiny.reference.hf_hidden_states), each [T, H]
    float32; the decoder stack alone, so no [T, vocab] logits are made."""
    import torch

    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    with torch.no_grad():
        out = model.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return [h[0].float() for h in out.hidden_states]
