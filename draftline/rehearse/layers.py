"""Which of a target's decoder layers a miniature keeps, and each layer's kind.

Aux id i captures the input of decoder layer i, which layer i - 1 produces. The miniature
keeps, in their order, the first layer, the last one, and layers i - 1 and i of every aux id;
the others go. An aux id becomes the position of its layer among the kept ones
(``LayerPlan.aux_layer_ids``; ``LayerPlan.mapping`` maps every kept layer). Kept layers keep
their kind: in the DeepseekV3 family (DeepseekV3, Kimi-K2, Kimi-K2.5's text model) a layer is
dense below ``first_k_dense_replace`` and MoE from it on; the kept dense layers are a prefix of
the kept ones, so the miniature's ``first_k_dense_replace`` is their count. The config's
layer-indexed fields follow the kept layers (``layer_fields``), and the miniature's config must
give each kept layer its kind (``check_kinds``).
"""

from __future__ import annotations

import dataclasses

DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2")  # built as transformers' DeepseekV3
LLAMA4_TEXT = "llama4_text"  # Llama 4's text_config (the wrapper's model_type is "llama4")


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


def rope_flags_written_out(text: dict) -> dict:
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

