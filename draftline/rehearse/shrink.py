"""The miniature's config: a target's text config (and vision tower) made small.

Widths. Hidden 256 (Llama-like models: heads x head size), MLP 512, 8 routed experts (top 2,
at most 2 expert groups), expert MLP 128, two query heads per tensor-parallel rank (GQA kept as
one KV head per rank). Per-head sizes, MLA's LoRA ranks, rope (YaRN included), the vocabulary
and the special tokens stay the target's: kernels are picked by them. On vLLM's CPU engine a
head size outside ``CPU_HEAD_SIZES`` is replaced (REFERENCE: CPU attention supports only
these); with MLA disabled the head size is ``qk_nope_head_dim + qk_rope_head_dim``. Layers:
draftline.rehearse.layers.

``quantization_config`` is kept only where this platform's vLLM runs it and this builder can
write its weights (compressed-tensors INT4 ``pack-quantized`` groups, on CUDA; widths then
multiples of 128 per rank, which the group size and Marlin's tiles divide); otherwise it is
dropped and named in ``Miniature.dropped``.
"""

from __future__ import annotations

from draftline.rehearse.layers import (DEEPSEEK_TYPES, LLAMA4_TEXT, LayerPlan, check_kinds, layer_fields,
                                       rope_flags_written_out)

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
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
    mini.update(layer_fields(rope_flags_written_out(text), plan))
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
