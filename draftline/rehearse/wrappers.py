"""Vision-language wrappers in the miniature: Qwen2.5-VL, Qwen3-VL (dense and MoE), LLaVA.

A wrapper is a text model (``text_config``, or for Qwen2.5-VL's published form the config's own
top-level keys) plus a vision tower (``vision_config``) and the projector that maps the tower's
output into the text width. The miniature keeps all three:

* the text model is shrunk by draftline.rehearse.shrink's text rules;
* the tower keeps its first and last layer and every layer one of its index lists names
  (``fullatt_block_indexes``, ``deepstack_visual_indexes``), those lists remapped as the text
  model's are; its widths become a few dozen; its output width (``out_hidden_size``) the text's;
* the weights are transformers' own wrapper class (the config's ``architectures``) built from
  the miniature's config with random weights, so every tower, merger and projector tensor exists
  under the names transformers writes, which vLLM 0.16's loaders map (``hf_to_vllm_mapper`` of
  each class).

The rehearsal sends text only; the run's ``model.limit_mm_per_prompt`` (0 for every modality,
as `make init` writes it) makes vLLM skip building the tower (and LLaVA's projector), and the miniature's checkpoint is
still a whole one. The HF reference is the same wrapper class, run on token ids alone: its text
model's M-RoPE positions are then equal in all three streams, as vLLM's for a text-only prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

# model_type -> the modalities vLLM 0.16's class registers (get_supported_mm_limits), for every
# multimodal family: `make init` writes 0 for each, so a run is text-only and vLLM does not build
# the tower. BUILT_HERE: the wrappers whose miniature this module's rules build.
MODALITIES = {"qwen2_5_vl": ("image", "video"), "qwen3_vl": ("image", "video"),
              "qwen3_vl_moe": ("image", "video"), "llava": ("image",),
              "kimi_k25": ("vision_chunk",), "llama4": ("image",)}
BUILT_HERE = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava")  # Kimi-K2.5, Llama 4: draftline.rehearse.shrink's and .weights' own
# The tower's widths in the miniature (heads of 32: every tower's rotary and attention take it).
VISION_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "num_attention_heads": 2}
VISION_DEPTH = ("depth", "num_hidden_layers")  # the tower's layer count, by family
VISION_INDEX_LISTS = ("fullatt_block_indexes", "deepstack_visual_indexes")  # tower layer indices
VISION_NOT_INDEXED = VISION_DEPTH
FEATURE_LAYERS = ("vision_feature_layer",)  # LLaVA: the tower hidden state(s) the projector reads


def is_wrapper(config: dict) -> bool:
    return str(config.get("model_type")) in BUILT_HERE


def text_only_limits(architecture: str) -> dict[str, int] | None:
    """``limit_mm_per_prompt`` of a text-only run of a wrapper of this architecture (vLLM's
    class, docs/families.md), or None for any other."""
    from draftline import target

    types = [f.model_type for f in target.FAMILIES.values() if f.architecture == architecture]
    modalities = next((MODALITIES[t] for t in types if t in MODALITIES), None)
    return None if modalities is None else {m: 0 for m in modalities}


def _depth_key(vision: dict) -> str:
    keys = [key for key in VISION_DEPTH if key in vision]
    if len(keys) != 1:
        raise ValueError(f"vision_config: {keys or 'no layer count'} ({' or '.join(VISION_DEPTH)}): "
                         "the miniature builder cannot tell the tower's depth")
    return keys[0]


def shrink_vision(vision: dict, text_hidden: int) -> tuple[dict, list[int]]:
    """The miniature's ``vision_config`` and the tower layers it keeps (the target's indices):
    first, last, and every layer an index list names, the lists remapped to positions among
    them; other layer-named fields are refused, naming them."""
    depth_key = _depth_key(vision)
    depth = int(vision[depth_key])
    named = sorted({int(i) for key in VISION_INDEX_LISTS for i in (vision.get(key) or [])})
    bad = [i for i in named if not 0 <= i < depth]
    if bad:
        raise ValueError(f"vision_config: layer indices {bad} outside the tower's {depth} layers")
    kept = sorted({0, depth - 1, *named})
    position = {layer: index for index, layer in enumerate(kept)}
    mini = dict(vision)
    for key, value in vision.items():
        if key in VISION_INDEX_LISTS and value is not None:
            mini[key] = [position[int(i)] for i in value]
        elif "layer" in key and key not in VISION_NOT_INDEXED and not isinstance(value, bool) \
                and isinstance(value, (int, list)):
            raise ValueError(f"vision_config.{key}={value!r}: a layer-indexed field the miniature builder "
                             f"cannot keep consistent with its {len(kept)} of {depth} tower layers")
    mini[depth_key] = len(kept)
    mini.update({key: value for key, value in VISION_SIZES.items() if key in vision})
    if "out_hidden_size" in vision:  # the merger's output: the text model's width
        mini["out_hidden_size"] = text_hidden
    return mini, kept


def shrink_tower(config: dict, text_hidden: int) -> dict:
    """The miniature's ``vision_config`` (shrink_vision), after checking that the wrapper's
    indices into the tower's hidden states still name a layer of the miniature's tower: LLaVA's
    ``vision_feature_layer`` counts from the end (-2: the second-to-last), which a shorter tower
    keeps meaning; an index from the start would name another layer, and is refused."""
    vision, kept = shrink_vision(config["vision_config"], text_hidden)
    for key in FEATURE_LAYERS:
        value = config.get(key)
        indices = value if isinstance(value, list) else [value] if value is not None else []
        if any(not isinstance(i, int) or i >= 0 or -i > len(kept) + 1 for i in indices):
            raise ValueError(f"{key}={value!r}: the miniature builder keeps a tower hidden-state index only "
                             f"counted from the end, within its {len(kept)}-layer tower")
    return vision


def _config(config: dict):
    """transformers' config object of the wrapper (its class from ``model_type``)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "auto_map")}
    return AutoConfig.for_model(str(config["model_type"]), **fields)


def _model_class(config: dict):
    import transformers

    architecture = (config.get("architectures") or [""])[0]
    cls = getattr(transformers, architecture, None)
    if cls is None:
        raise ValueError(f"architectures {config.get('architectures')}: no transformers "
                         f"{transformers.__version__} class of that name")
    return cls


def build(config: dict, seed: int):
    """transformers' wrapper model of the miniature's ``config``: random weights from ``seed``."""
    from draftline.tiny.builders import seeded

    hf = _config(config)
    with seeded(seed):
        model = _model_class(config)(hf)
    return model.eval()


def load_reference(model_dir: str | Path):
    """The miniature's whole wrapper in transformers (float32, eager attention), every tensor of
    its model.safetensors loaded strictly (tower and projector included)."""
    import torch
    from safetensors import safe_open

    config = json.loads((Path(model_dir) / "config.json").read_text())
    model = build(config, 0).to(torch.float32)
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as weights:
        state = {name: weights.get_tensor(name).float() for name in weights.keys()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or []) if model.config.get_text_config().tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"{model_dir}: checkpoint and {type(model).__name__} differ: missing "
                         f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.tie_weights()
    model.config._attn_implementation = "eager"
    for sub in model.modules():
        if hasattr(sub, "config") and hasattr(sub.config, "_attn_implementation"):
            sub.config._attn_implementation = "eager"
    return model.eval()


def decoder_layers(model):
    """The text model's decoder layers of a transformers causal LM or wrapper."""
    inner = model.model
    return getattr(inner, "language_model", inner).layers
