"""A miniature of a target model, built from its config.json and tokenizer alone.

`make rehearse` (draftline.rehearse) runs the real run's engine code on it: the same
``architectures``, ``model_type`` and config classes (a multimodal wrapper with its vision
config included), the target's tokenizer and chat template, random weights, a few layers.
No weight file of the target is opened, so a directory holding only config.json and the
tokenizer files is enough.

Layers. Aux id i captures the input of decoder layer i, which layer i - 1 produces. The
miniature keeps, in their order, the first layer, the last one, and layers i - 1 and i of
every aux id; the others go. An aux id becomes the position of its layer among the kept
ones (``LayerPlan.aux_layer_ids``; ``LayerPlan.mapping`` maps every kept layer). Kept layers
keep their kind: in the DeepseekV3 family (DeepseekV3, Kimi-K2, Kimi-K2.5's text model) a
layer is dense below ``first_k_dense_replace`` and MoE from it on; the kept dense layers are a
prefix of the kept ones, so the miniature's ``first_k_dense_replace`` is their count.

Widths. Hidden 256 (Llama-like models: heads x head size), MLP 512, 8 routed experts (top 2,
at most 2 expert groups), expert MLP 128, two query heads per tensor-parallel rank (GQA kept as
one KV head per rank). Per-head sizes, MLA's LoRA ranks, rope (YaRN included), the vocabulary
and the special tokens stay the target's: kernels are picked by them. On vLLM's CPU engine a
head size outside ``CPU_HEAD_SIZES`` is replaced (REFERENCE: CPU attention supports only
these); with MLA disabled the head size is ``qk_nope_head_dim + qk_rope_head_dim``.

``quantization_config`` is kept only where this platform's vLLM runs it and this builder can
write its weights (compressed-tensors INT4 ``pack-quantized`` groups, on CUDA; widths then
multiples of 128 per rank, which the group size and Marlin's tiles divide); otherwise it is
dropped and named in ``Miniature.dropped``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

from draftline import target
from draftline.pipeline.artifacts import atomic_dir
from draftline.rehearse import wrappers
from draftline.tiny import builders, kimi_k25, reference

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2")  # built as transformers' DeepseekV3
WRAPPER_PREFIX = {"kimi_k25": kimi_k25.KIMI_K25_LANGUAGE_PREFIX,  # text weights under this prefix
                  "llama4": "language_model."}
LLAMA4_TEXT = "llama4_text"  # Llama 4's text_config (the wrapper's model_type is "llama4")
# Files that hold weights (or their index): never opened, never copied.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt",
                   ".safetensors.index.json", ".bin.index.json")
HIDDEN, MLP, EXPERT_MLP, EXPERTS, TOP_K, HEADS_PER_RANK = 256, 512, 128, 8, 2, 2
# The miniature's context at most: vLLM computes a rope cache of every position at start
# (Llama 4 Scout's 10485760 positions: 5.4 GB of float32 per rank, 11 GB at its peak), and where
# the rope's frequencies do not depend on the context length (ROPE_WITHOUT_LENGTH), fewer
# positions rotate every kept position alike.
MAX_POSITIONS = 262144
ROPE_WITHOUT_LENGTH = ("default", "llama3")
QUANT_TILE = 128  # per-rank widths of a kept INT4 quantization (group 32 and Marlin tiles divide it)
VISION = {"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2,
          "intermediate_size": 128, "init_pos_emb_height": 8, "init_pos_emb_width": 8}
# Llama 4's tower (Llama4VisionModel): image_size and patch_size stay the target's (its processor
# tiles images at that size); intermediate_size follows from hidden_size (shrink_llama4_vision).
LLAMA4_VISION = {"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2,
                 "projector_input_dim": 128, "projector_output_dim": 128, "vision_output_dim": 128}
VISION_ALIASES = {"hidden_size": "vt_hidden_size", "num_attention_heads": "vt_num_attention_heads",
                  "num_hidden_layers": "vt_num_hidden_layers", "intermediate_size": "vt_intermediate_size"}


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Which of the target's layers the miniature keeps, and the aux ids among them."""

    num_layers: int                 # the target's
    kept: tuple[int, ...]           # the target's layer indices, in order
    kinds: tuple[str, ...]          # each kept layer's kind (layer_kinds: "moe", "dense/sliding", ...)
    target_aux_layer_ids: tuple[int, ...]
    aux_layer_ids: tuple[int, ...]  # the same layers' indices in the miniature

    @property
    def mapping(self) -> dict[int, int]:
        return {layer: index for index, layer in enumerate(self.kept)}

    @property
    def first_k_dense_replace(self) -> int:
        dense = [mlp_kind(kind) == "dense" for kind in self.kinds]
        return dense.index(False) if False in dense else len(dense)

    def describe(self) -> str:
        ids = ", ".join(f"{a}->{b}" for a, b in zip(self.target_aux_layer_ids, self.aux_layer_ids))
        return (f"{len(self.kept)} of {self.num_layers} layers {list(self.kept)} (first, last, and "
                f"i-1, i of each aux id i), aux ids {ids}")


# --------------------------------------------------------------------------- layer kinds
#
# A layer's kind is what vLLM 0.16 builds at that index: its MLP (dense or MoE), its attention
# (sliding or full, where the family has both) and whether it rotates positions. The miniature
# keeps every kept layer's kind; ``layer_kinds`` of the miniature's config must equal the kept
# layers' kinds in the target's, or the builder refuses.


def mlp_kind(kind: str) -> str:
    return kind.split("/")[0]


def _is_moe(text: dict, i: int) -> bool:
    model_type = text.get("model_type")
    if model_type in DEEPSEEK_TYPES:
        first_dense, every = int(text.get("first_k_dense_replace", 0)), int(text.get("moe_layer_freq", 1))
        return bool(text.get("n_routed_experts")) and i >= first_dense and i % every == 0
    if text.get("num_experts") and "decoder_sparse_step" in text:  # Qwen2/Qwen3-MoE (qwen3_moe.py)
        return (i + 1) % int(text["decoder_sparse_step"]) == 0 and i not in (text.get("mlp_only_layers") or [])
    if "interleave_moe_layer_step" in text:  # Llama 4 (vLLM's llama4.py reads the step, not moe_layers)
        step = int(text["interleave_moe_layer_step"])
        return step > 0 and (i + 1) % step == 0
    return bool(text.get("num_local_experts"))  # gpt-oss, Mixtral: every layer


def rope_flags(text: dict) -> list[int] | None:
    """``no_rope_layers`` as vLLM reads it (0: the layer has no rope), or None. Llama 4's
    config.json may leave it empty; transformers' config, which vLLM reads, then fills it from
    ``no_rope_layer_interval`` (every 4th layer, by index)."""
    flags = text.get("no_rope_layers")
    if flags or text.get("model_type") != LLAMA4_TEXT:
        return list(flags) if flags else None
    interval = int(text.get("no_rope_layer_interval", 4))
    return [int((i + 1) % interval != 0) for i in range(int(text["num_hidden_layers"]))]


def _attention_kind(text: dict, i: int) -> str | None:
    if text.get("model_type") == LLAMA4_TEXT:  # vLLM's llama4.py: rope layers attend in chunks, NoPE ones to all
        return ("full" if rope_flags(text)[i] == 0 else "chunked") if text.get("attention_chunk_size") else None
    if text.get("model_type") == "gpt_oss":  # vLLM's gpt_oss.py: even layers slide, whatever layer_types says
        return "sliding" if i % 2 == 0 else "full"
    if text.get("layer_types"):
        return str(text["layer_types"][i]).removesuffix("_attention")
    if text.get("use_sliding_window") and text.get("sliding_window"):  # Qwen2/Qwen3: from max_window_layers on
        return "sliding" if i >= int(text.get("max_window_layers") or 0) else "full"
    return None


def layer_kinds(text: dict) -> list[str]:
    """Each decoder layer's kind as vLLM builds it: "moe" or "dense", then "/sliding", "/full",
    "/chunked" where the family mixes attention kinds, "/nope" for a layer without rope."""
    kinds, flags = [], rope_flags(text)
    for i in range(int(text["num_hidden_layers"])):
        parts = ["moe" if _is_moe(text, i) else "dense"]
        attention = _attention_kind(text, i)
        if attention is not None:
            parts.append(attention)
        if flags and flags[i] == 0:
            parts.append("nope")
        kinds.append("/".join(parts))
    return kinds


def layer_period(text: dict) -> int:
    """The period of the kinds vLLM derives from a layer's index alone (not from a list the
    miniature can subset): gpt-oss alternates attention, a sparse step spaces MoE layers."""
    if text.get("model_type") == "gpt_oss":
        return 2
    for key in ("decoder_sparse_step", "interleave_moe_layer_step"):
        if int(text.get(key) or 1) > 1:
            return int(text[key])
    return 1


def _aligned(wanted: list[int], period: int) -> list[int]:
    """``wanted`` plus the fewest layers before each one that put every kept layer at a
    position congruent to its index modulo ``period`` (so index arithmetic gives its kind)."""
    kept: list[int] = []
    for layer in wanted:
        gap = (layer - len(kept)) % period
        kept.extend(range(layer - gap, layer + 1))
    return kept


def plan_layers(text: dict, aux_layer_ids: list[int]) -> LayerPlan:
    num_layers = int(text["num_hidden_layers"])
    bad = [i for i in aux_layer_ids if not 0 < int(i) < num_layers]
    if bad or len(set(aux_layer_ids)) != len(aux_layer_ids):
        raise ValueError(f"aux_layer_ids {list(aux_layer_ids)} invalid for a {num_layers}-layer "
                         f"target: need distinct ids in [1, {num_layers - 1}]")
    kinds = layer_kinds(text)
    wanted = sorted({0, num_layers - 1, *(int(i) - 1 for i in aux_layer_ids), *map(int, aux_layer_ids)})
    kept = _aligned(wanted, layer_period(text))
    kept_kinds = [kinds[i] for i in kept]
    mlp = [mlp_kind(k) for k in kept_kinds]
    if text.get("model_type") in DEEPSEEK_TYPES and "moe" in mlp and "dense" in mlp[mlp.index("moe"):]:
        raise ValueError(f"moe_layer_freq {text.get('moe_layer_freq')}: dense layers between MoE "
                         "layers cannot be kept by a first_k_dense_replace; no miniature for it")
    mapping = {layer: index for index, layer in enumerate(kept)}
    return LayerPlan(num_layers, tuple(kept), tuple(kept_kinds), tuple(map(int, aux_layer_ids)),
                     tuple(mapping[int(i)] for i in aux_layer_ids))


# Layer-indexed fields and how the miniature keeps them consistent with its kept layers.
INDEX_LISTS = ("mlp_only_layers", "moe_layers")  # layer indices: remapped, dropped layers left out
PREFIX_COUNTS = ("max_window_layers",)  # "layers below this index": the kept ones below it
STEPS = ("decoder_sparse_step", "interleave_moe_layer_step")  # kept: the plan aligns positions
NOT_INDEXED = ("num_hidden_layers", "num_nextn_predict_layers", "output_router_logits",
               "no_rope_layer_interval")  # Llama 4's: unused once the miniature writes no_rope_layers out


def layer_fields(text: dict, plan: LayerPlan) -> dict:
    """The miniature's values of ``text``'s layer-indexed fields: a list as long as the layer
    count is subset to the kept layers, index lists and prefix counts are remapped, steps kept.
    A field named for layers that none of these rules covers is refused, naming it."""
    num_layers, mapping, updates = plan.num_layers, plan.mapping, {}
    for key, value in text.items():
        if key in INDEX_LISTS and isinstance(value, list):
            updates[key] = [mapping[int(i)] for i in value if int(i) in mapping]
        elif isinstance(value, list) and len(value) == num_layers:
            updates[key] = [value[i] for i in plan.kept]
        elif key in PREFIX_COUNTS and value is not None:
            updates[key] = sum(1 for i in plan.kept if i < int(value))
        elif ("layer" in key and key not in NOT_INDEXED + STEPS and key != "moe_layer_freq"
              and isinstance(value, (int, list)) and not isinstance(value, bool)):
            raise ValueError(f"{key}={value!r}: a layer-indexed field the miniature builder cannot "
                             f"keep consistent with its {len(plan.kept)} of {num_layers} layers")
    return updates


def _rope_flags_written_out(text: dict) -> dict:
    """``text`` with Llama 4's derived ``no_rope_layers`` as a list, so that the per-layer rule
    subsets it: derived again from the interval at the kept layers' new indices, it would
    give a kept layer another kind."""
    if text.get("model_type") != LLAMA4_TEXT or text.get("no_rope_layers"):
        return text
    return {**text, "no_rope_layers": rope_flags(text)}


def check_kinds(mini: dict, plan: LayerPlan) -> None:
    """The miniature's config gives every kept layer the kind it has in the target."""
    got = layer_kinds(mini)
    wrong = [(layer, want, have) for layer, want, have in zip(plan.kept, plan.kinds, got) if want != have]
    if wrong:
        layer, want, have = wrong[0]
        fields = [k for k in (*STEPS, *INDEX_LISTS, *PREFIX_COUNTS, "layer_types", "no_rope_layers",
                              "first_k_dense_replace", "moe_layer_freq") if k in mini]
        raise ValueError(f"{', '.join(fields) or 'layer kinds'}: the miniature's layer {plan.mapping[layer]} "
                         f"would be {have}, the target's layer {layer} is {want}; no miniature for it")


@dataclasses.dataclass(frozen=True)
class Miniature:
    path: Path
    architecture: str
    model_type: str
    layers: LayerPlan
    shrunk: dict            # config key -> [target's value, miniature's]
    dropped: list[dict]     # {"what", "reason"}: what the miniature does not have
    quantization: dict | None  # the kept quantization_config, or None

    def record(self) -> dict:
        return {"path": str(self.path), "architecture": self.architecture,
                "model_type": self.model_type, "layers": self.layers.describe(),
                "kept_layers": list(self.layers.kept), "layer_kinds": list(self.layers.kinds),
                "layer_mapping": {str(k): v for k, v in self.layers.mapping.items()},
                "aux_layer_ids": list(self.layers.aux_layer_ids),
                "target_aux_layer_ids": list(self.layers.target_aux_layer_ids),
                "shrunk": self.shrunk, "dropped": self.dropped,
                "quantization_kept": self.quantization is not None}


# --------------------------------------------------------------------------- config


def quantization_plan(quant: dict | None, device: str) -> tuple[dict | None, dict | None]:
    """(the quantization_config to keep, or None; what was dropped and why, or None)."""
    if not quant:
        return None, None
    method = str(quant.get("quant_method"))
    weights = [g.get("weights") or {} for g in (quant.get("config_groups") or {}).values()]
    int4 = (method == "compressed-tensors" and quant.get("format") == "pack-quantized" and weights
            and all(w.get("num_bits") == 4 and w.get("type") == "int" and w.get("strategy") == "group"
                    for w in weights))
    blocks = quant.get("weight_block_size") if method == "fp8" else None  # DeepSeek-V3, Kimi-K2
    what = f"quantization_config ({', '.join(filter(None, (method, quant.get('format'))))}" + (
        f", INT4 groups of {weights[0].get('group_size')})" if int4 else
        f", {quant.get('fmt') or 'fp8'} blocks of {'x'.join(map(str, blocks))})" if blocks else ")")
    if device != "cuda":
        reason = ("INT4 MoE: no CPU kernel (vLLM 0.16 runs compressed-tensors INT4 experts with "
                  "Marlin or Triton only); the miniature's weights are unquantized") if int4 else (
                  "FP8 block MoE: no CPU kernel (vLLM 0.16 runs fp8 experts with Triton, DeepGEMM, "
                  "CUTLASS, Marlin or FlashInfer only); the miniature's weights are unquantized") if blocks else (
                  f"{method}: not run by vLLM 0.16's CPU engine; the miniature's weights are unquantized")
        return None, {"what": what, "reason": reason}
    if not int4:
        return None, {"what": what, "reason": f"the miniature builder writes no {method} weights "
                                              "of this format; its weights are unquantized"}
    return quant, None


def _heads(text: dict, tensor_parallel_size: int) -> tuple[int, int]:
    heads = int(text["num_attention_heads"])
    kv = int(text.get("num_key_value_heads") or heads)
    mini = HEADS_PER_RANK * tensor_parallel_size
    return mini, (mini if kv == heads else tensor_parallel_size)


def _cpu_head_size(size: int) -> int:
    return size if size in CPU_HEAD_SIZES else 64


EXPERT_COUNTS = ("num_experts", "num_local_experts")  # Qwen-MoE; gpt-oss, Mixtral, Llama 4
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token")  # gpt-oss spells it both ways


def _experts(text: dict, expert_mlp: int, mlp: int) -> dict:
    """Fewer, narrower routed experts; the router (its scoring, top-k normalisation, bias) is
    the target's. gpt-oss's experts are ``intermediate_size`` wide, already shrunk."""
    if not any(text.get(key) for key in EXPERT_COUNTS):
        return {}
    mini = {key: EXPERTS for key in EXPERT_COUNTS if text.get(key)}
    mini.update({key: min(int(text[key]), TOP_K) for key in TOP_K_KEYS if text.get(key)})
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size_mlp"):
        if text.get(key):
            mini[key] = expert_mlp if key == "moe_intermediate_size" else mlp
    return mini


def _cap_positions(text: dict, mini: dict) -> list[dict]:
    """Cap ``mini``'s max_position_embeddings at MAX_POSITIONS where the rope allows it; what
    was dropped."""
    positions = int(text.get("max_position_embeddings") or 0)
    rope = str((text.get("rope_scaling") or {}).get("rope_type") or "default")
    if positions <= MAX_POSITIONS or rope not in ROPE_WITHOUT_LENGTH:
        return []
    mini["max_position_embeddings"] = MAX_POSITIONS
    return [{"what": f"max_position_embeddings {positions}",
             "reason": f"the miniature has {MAX_POSITIONS}: vLLM computes a rope cache of every position at "
                       f"start ({positions * int(mini['head_dim']) * 4 / 1e9:.1f} GB of float32 per rank); "
                       f"{rope} rope rotates the positions below the cap alike"}]


def shrink_text(text: dict, plan: LayerPlan, *, device: str, tensor_parallel_size: int,
                mla_disable: bool, quantized: bool) -> tuple[dict, dict, list[dict]]:
    """The miniature's text config (a copy of ``text`` with its sizes changed), the changes
    ({key: [target's, miniature's]}), and what it drops."""
    mini, dropped = dict(text), []
    heads, kv_heads = _heads(text, tensor_parallel_size)
    per_rank = QUANT_TILE if quantized else None
    mini.update(num_hidden_layers=len(plan.kept), num_attention_heads=heads,
                num_key_value_heads=kv_heads, intermediate_size=MLP * max(1, tensor_parallel_size))
    model_type = text.get("model_type")
    if model_type in DEEPSEEK_TYPES:
        mini["hidden_size"] = HIDDEN
        if text.get("n_routed_experts"):
            groups = min(int(text.get("n_group") or 1), 2)
            mini.update(first_k_dense_replace=plan.first_k_dense_replace, n_routed_experts=EXPERTS,
                        num_experts_per_tok=min(int(text["num_experts_per_tok"]), TOP_K),
                        n_group=groups, topk_group=min(int(text.get("topk_group") or 1), groups),
                        moe_intermediate_size=(per_rank or EXPERT_MLP) * max(1, tensor_parallel_size))
        if text.get("num_nextn_predict_layers"):
            mini["num_nextn_predict_layers"] = 0
            dropped.append({"what": f"multi-token-prediction layers ({text['num_nextn_predict_layers']})",
                            "reason": "not used by extraction or EAGLE-3 serving; not built"})
        size = int(text["qk_nope_head_dim"]) + int(text["qk_rope_head_dim"])
        if device != "cuda" and mla_disable and size not in CPU_HEAD_SIZES:
            mini.update(qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)
            dropped.append({"what": f"MLA head size {size}", "reason": "not a CPU attention head "
                            "size; the miniature uses 64 + 32 (v 64)"})
    else:
        head = int(text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"]))
        if device != "cuda" and head not in CPU_HEAD_SIZES:
            dropped.append({"what": f"head size {head}", "reason": "not a CPU attention head size; "
                            f"the miniature uses {_cpu_head_size(head)}"})
            head = _cpu_head_size(head)
        mini.update(head_dim=head, hidden_size=heads * head)
        if "attention_head_dim" in text:  # HunYuan's second spelling of head_dim (vLLM reads either)
            mini["attention_head_dim"] = head
        mini.update(_experts(text, (per_rank or EXPERT_MLP) * max(1, tensor_parallel_size),
                             MLP * max(1, tensor_parallel_size)))
        if model_type == LLAMA4_TEXT:  # its intermediate_size is the routed and shared experts' width
            mini["intermediate_size"] = (per_rank or EXPERT_MLP) * max(1, tensor_parallel_size)
        dropped += _cap_positions(text, mini)
    mini.update(layer_fields(_rope_flags_written_out(text), plan))
    check_kinds(mini, plan)
    if not quantized:
        mini.pop("quantization_config", None)
    changed = {key: [text.get(key), value] for key, value in sorted(mini.items()) if text.get(key) != value}
    return mini, changed, dropped


def shrink_vision(vision: dict, text_hidden: int) -> dict:
    """A two-layer MoonViT: vLLM's own keys and the target's ``vt_*`` spelling of them."""
    mini = dict(vision)
    for key, value in VISION.items():
        mini[key] = value
        if VISION_ALIASES.get(key, "") in vision:
            mini[VISION_ALIASES[key]] = value
    # vLLM's KimiK25Config sets the projector's output width to the text width when
    # mm_hidden_size equals the tower's width; the target's text_hidden_size says the same.
    mini["mm_hidden_size"] = VISION["hidden_size"]
    if "text_hidden_size" in vision:
        mini["text_hidden_size"] = text_hidden
    return mini


def shrink_llama4_vision(vision: dict, text_hidden: int) -> dict:
    """A two-layer Llama 4 vision tower. Its pixel shuffle hands the adapter's MLP
    ``hidden_size / pixel_shuffle_ratio**2`` channels, which it reads as ``intermediate_size``,
    and the adapter's output (``projector_output_dim``) is the projector's input
    (``vision_output_dim``): both identities hold in the miniature as in the target, or the
    field that breaks one is refused. (``text_hidden``: the projector reads the text config.)"""
    ratio = float(vision["pixel_shuffle_ratio"])
    shuffled = int(vision["hidden_size"] / ratio ** 2)
    if int(vision["intermediate_size"]) != shuffled:
        raise ValueError(f"vision_config.intermediate_size={vision['intermediate_size']}: not hidden_size / "
                         f"pixel_shuffle_ratio**2 ({shuffled}), which vLLM's pixel shuffle feeds it; no miniature for it")
    if vision["projector_output_dim"] != vision["vision_output_dim"]:
        raise ValueError(f"vision_config.projector_output_dim={vision['projector_output_dim']}: not "
                         f"vision_output_dim ({vision['vision_output_dim']}); no miniature for it")
    mini = {**vision, **LLAMA4_VISION}
    mini["intermediate_size"] = int(LLAMA4_VISION["hidden_size"] / ratio ** 2)
    return mini


VISION_SHRINKERS = {"llama4": shrink_llama4_vision}  # model_type -> its tower's; others: shrink_vision


# --------------------------------------------------------------------------- weights


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


def _text_model(text: dict, seed: int):
    """A random transformers model for the miniature's text config."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

    config = hf_config(text)
    with builders.seeded(seed):
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


def _state(model, prefix: str, dtype: str, quant: dict | None) -> dict:
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


def _checkpoint_dtype(config: dict) -> str:
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "float32"


def _copy_tokenizer_files(target_dir: Path, out_dir: Path) -> list[str]:
    """Every top-level file but config.json and weights: tokenizer, chat template, generation
    config, processor configs, Python the directory ships."""
    copied = []
    for path in sorted(Path(target_dir).iterdir()):
        name = path.name
        if (not path.is_file() or name.startswith(".") or name == "config.json"
                or name.endswith(WEIGHT_SUFFIXES)):
            continue
        shutil.copy2(path, out_dir / name)
        copied.append(name)
    return copied


# --------------------------------------------------------------------------- builder


def build_miniature(target_dir: str | Path, out_dir: str | Path, aux_layer_ids: list[int], *,
                    device: str = "cpu", tensor_parallel_size: int = 1, mla_disable: bool = False,
                    seed: int = 0) -> Miniature:
    """Write the miniature of ``target_dir`` to ``out_dir`` (atomically); see the module doc.

    ``device`` is the platform the rehearsal runs on ("cpu" or "cuda"), ``tensor_parallel_size``
    the TP it will run with (heads and widths divide by it), ``mla_disable`` whether MLA is off.
    """
    from safetensors.torch import save_file

    target_dir = Path(target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    family = target.family_of(config)
    if not family.miniature:
        raise NotImplementedError(f"model_type {family.model_type!r}: the miniature builder does not make "
                                  f"this family yet; see {target.FAMILY_TABLE}")
    text = target.text_config(config)
    plan = plan_layers(text, list(aux_layer_ids))
    quant, quant_dropped = quantization_plan(config.get("quantization_config") or text.get("quantization_config"),
                                             device)
    mini_text, shrunk, dropped = shrink_text(text, plan, device=device,
                                             tensor_parallel_size=tensor_parallel_size,
                                             mla_disable=mla_disable, quantized=quant is not None)
    hf_config(mini_text)  # transformers' own checks of the config, before any weight is made
    dropped = ([quant_dropped] if quant_dropped else []) + dropped
    mini = dict(config)
    if "text_config" in config:
        mini["text_config"] = mini_text
        if quant is None:
            mini.pop("quantization_config", None)
        if "vision_config" in config and not wrappers.is_wrapper(config):
            shrink = VISION_SHRINKERS.get(str(config.get("model_type")), shrink_vision)
            mini["vision_config"] = shrink(config["vision_config"], mini_text["hidden_size"])
    else:
        mini = mini_text
    if wrappers.is_wrapper(config):  # a vision-language wrapper: its tower and projector too
        mini["vision_config"] = wrappers.shrink_tower(config, mini_text["hidden_size"])
        shrunk.update({f"vision_config.{k}": [config["vision_config"].get(k), v]
                       for k, v in sorted(mini["vision_config"].items()) if config["vision_config"].get(k) != v})
    dtype = _checkpoint_dtype(config)
    model_type = str(config.get("model_type"))
    with atomic_dir(out_dir) as tmp:
        _copy_tokenizer_files(target_dir, tmp)
        (tmp / "config.json").write_text(json.dumps(mini, indent=2, sort_keys=True) + "\n")
        if wrappers.is_wrapper(config):
            state = _state(wrappers.build(mini, seed), "", dtype, quant)
        else:
            state = _state(_text_model(mini_text, seed), WRAPPER_PREFIX.get(model_type, ""), dtype, quant)
        if model_type == "kimi_k25":
            state.update(_kimi_vision(mini, seed, dtype))
            if not (tmp / "preprocessor_config.json").exists():
                (tmp / "preprocessor_config.json").write_text(
                    json.dumps(kimi_k25.KIMI_K25_PREPROCESSOR_CONFIG, indent=2, sort_keys=True) + "\n")
        if model_type == "llama4":
            state.update(_llama4_vision(mini, seed, dtype))
        save_file(dict(sorted(state.items())), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return Miniature(Path(out_dir).absolute(), (config.get("architectures") or ["unknown"])[0],
                     model_type, plan, shrunk, dropped, quant)


def _kimi_vision(config: dict, seed: int, dtype: str) -> dict:
    """MoonViT tower and projector weights in vLLM's config classes' shapes (draftline.tiny.kimi_k25)."""
    import torch
    from vllm.transformers_utils.configs.kimi_k25 import KimiK25Config  # config class only

    parsed = KimiK25Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    weights = kimi_k25.kimi_k25_vision_weights(parsed.vision_config, parsed.text_config.hidden_size, seed)
    return {name: tensor.to(getattr(torch, dtype)) for name, tensor in weights.items()}


def _llama4_vision(config: dict, seed: int, dtype: str) -> dict:
    """Random weights of Llama 4's vision tower and projector, named as its checkpoints name
    them (``vision_model.*``, ``multi_modal_projector.*``): transformers' own modules."""
    import torch
    from transformers import Llama4Config
    from transformers.models.llama4.modeling_llama4 import Llama4MultiModalProjector, Llama4VisionModel

    parsed = Llama4Config(text_config=config["text_config"], vision_config=config["vision_config"])
    with builders.seeded(seed + 1):  # its own stream: the text weights stay those of seed
        modules = {"vision_model.": Llama4VisionModel(parsed.vision_config),
                   "multi_modal_projector.": Llama4MultiModalProjector(parsed)}
    return {prefix + name: tensor.to(getattr(torch, dtype))
            for prefix, module in modules.items() for name, tensor in module.state_dict().items()}


# --------------------------------------------------------------------------- reference


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
        return kimi_k25.load_hf_kimi_k25_language_model(model_dir), None
    if model_type in DEEPSEEK_TYPES or model_type in WRAPPER_PREFIX:
        prefix = WRAPPER_PREFIX.get(model_type, "")
        model = _text_model(text, 0).to(torch.float32)
        with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as weights:
            model.load_state_dict({n[len(prefix):]: weights.get_tensor(n).float() for n in weights.keys()
                                   if n.startswith(prefix)}, strict=True)
        model.config._attn_implementation = "eager"
        return model.eval(), None
    return reference.load_hf_model(model_dir), None


def reference_hidden_states(model, token_ids: list[int]) -> list:
    """transformers' hidden states of one sequence: entry k < L the input of layer k, entry L
    the final state after the norm (draftline.tiny.reference.hf_hidden_states), each [T, H]
    float32; the decoder stack alone, so no [T, vocab] logits are made."""
    import torch

    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    with torch.no_grad():
        out = model.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return [h[0].float() for h in out.hidden_states]
