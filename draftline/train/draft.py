"""The EAGLE-3 draft: speculators' ``Eagle3DraftModel`` built against a real verifier.

What is speculators' and what is ours:

* config classes (``Eagle3SpeculatorConfig``, ``SpeculatorsConfig``, ``VerifierConfig``,
  ``GreedyTokenProposalConfig``), the model, its forward/loss/metrics and its
  ``save_pretrained`` format are speculators' own.
* Ours: reading the verifier (``text_config`` of multimodal wrappers, tensor names found by
  suffix so ``language_model.``-prefixed checkpoints such as Kimi-K2.5 work) -- speculators
  0.3.0 hard-codes ``model.embed_tokens.weight``/``lm_head.weight`` and ``AutoConfig`` of the
  verifier, which needs remote code for Kimi.  That one step is overridden below.
* A dense-mask SDPA attention kernel for CPU runs (see ``register_dense_attention``).
* The precision policy (``resolve_precision``): speculators 0.3.0 trains in float32 on a
  single GPU and in bf16 only under FSDP (``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``).  Here one GPU gets the same split as many: float32 master weights,
  gradients and AdamW state, bf16 compute (autocast).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel as _SpeculatorsEagle3DraftModel
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig
from transformers.modeling_utils import AttentionInterface

from draftline import target
from draftline.target import check_layer_ids, read_target_shape

__all__ = [
    "Eagle3DraftModel",
    "VerifierInfo",
    "read_verifier",
    "load_verifier_head",
    "draft_layer_config",
    "build_draft",
    "register_dense_attention",
    "set_attention",
    "PRECISIONS",
    "Precision",
    "resolve_precision",
    "apply_precision",
]

FLEX_ATTENTION = "simple_flex_attention"  # registered by speculators.models.eagle3.attention
DENSE_ATTENTION = "draftline_dense_sdpa"
NUM_AUX_LAYERS = 3  # speculators' fc is Linear(3 * hidden, hidden)
PRECISIONS = ("auto", "bf16", "fp32")


@dataclasses.dataclass(frozen=True)
class VerifierInfo:
    """The verifier as the draft needs it: where, what architecture, its text config."""

    path: Path
    architectures: list[str]
    text: dict  # ``text_config`` for multimodal wrappers, else the whole config


def read_verifier(verifier_dir: str | Path) -> VerifierInfo:
    """Parse config.json directly: ``AutoConfig`` would need remote code for Kimi-K2.5."""
    path = Path(verifier_dir).absolute()
    config = json.loads((path / "config.json").read_text())
    architectures = list(config.get("architectures") or [])
    if not architectures:
        raise ValueError(f"{path}/config.json names no architectures")
    return VerifierInfo(path, architectures, target.text_config(config))


def _weight_files(verifier_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the shard index or by opening every file."""
    index = verifier_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: verifier_dir / file for name, file in weight_map.items()}
    names: dict[str, Path] = {}
    for file in sorted(verifier_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            names.update(dict.fromkeys(handle.keys(), file))
    if not names:
        raise FileNotFoundError(f"no safetensors weights in {verifier_dir}")
    return names


def _shape(file: Path, name: str) -> list[int]:
    with safe_open(str(file), framework="pt") as handle:
        return list(handle.get_slice(name).get_shape())


def _find_tensor(files: dict[str, Path], suffix: str, shape: list[int]) -> str | None:
    """The one tensor named ``suffix`` or ``<prefix>.suffix`` with the given shape.

    Shape disambiguates e.g. a vision tower's own ``embed_tokens`` from the language
    model's; more than one match is an error rather than a guess.
    """
    named = [n for n in files if n == suffix or n.endswith("." + suffix)]
    matching = [n for n in named if _shape(files[n], n) == shape]
    if len(matching) > 1:
        raise ValueError(f"ambiguous verifier tensors for {suffix} {shape}: {matching}")
    return matching[0] if matching else None


def _read_tensor(file: Path, name: str) -> torch.Tensor:
    with safe_open(str(file), framework="pt") as handle:
        return handle.get_tensor(name)


def load_verifier_head(info: VerifierInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier's input embedding and lm_head weights, each [vocab, hidden]."""
    shape = [int(info.text["vocab_size"]), int(info.text["hidden_size"])]
    files = _weight_files(info.path)
    embed_name = _find_tensor(files, "embed_tokens.weight", shape)
    if embed_name is None:
        raise ValueError(f"{info.path}: no '*embed_tokens.weight' of shape {shape}")
    head_name = _find_tensor(files, "lm_head.weight", shape)
    if head_name is None:
        # Tied checkpoints store only the embedding; untied ones must have a head.
        if info.text.get("tie_word_embeddings", True) is False:
            raise ValueError(f"{info.path}: untied model without '*lm_head.weight' {shape}")
        head_name = embed_name
    return _read_tensor(files[embed_name], embed_name), _read_tensor(files[head_name], head_name)


class Eagle3DraftModel(_SpeculatorsEagle3DraftModel):
    """speculators' ``Eagle3DraftModel`` with the verifier weights found by ``read_verifier``.

    Only ``_setup_embeddings_and_lm_heads`` differs, and only in *where* the weights and the
    verifier sizes come from; the modules it creates are speculators'.  The class keeps the
    name ``Eagle3DraftModel`` on purpose: transformers writes ``type(model).__name__`` into
    config.json's ``architectures``, and the save must look exactly like speculators' own.
    """

    @classmethod
    def layer_config_fields(cls, verifier_text: dict) -> dict:
        """What a draft of this class adds to its ``transformer_layer_config`` for a verifier of
        this config (nothing; :class:`draftline.train.parallel.ParallelDraft` its mask token)."""
        return {}

    def _setup_embeddings_and_lm_heads(self, config: VerifierConfig, t2d: torch.Tensor):
        info = read_verifier(config.name_or_path)
        vocab, hidden = int(info.text["vocab_size"]), int(info.text["hidden_size"])
        if hidden != self.hidden_size or t2d.shape[0] != vocab:
            raise ValueError(f"verifier hidden/vocab {hidden}/{vocab} vs draft hidden "
                             f"{self.hidden_size}, t2d {t2d.shape[0]}")
        embed, head = load_verifier_head(info)  # [vocab, hidden] each
        pad = info.text.get("pad_token_id")
        self.embed_tokens = torch.nn.Embedding(
            vocab, hidden, padding_idx=pad if isinstance(pad, int) and 0 <= pad < vocab else None
        )
        dtype = self.embed_tokens.weight.dtype
        self.embed_tokens.load_state_dict({"weight": embed.to(dtype)})
        self.embed_tokens.weight.requires_grad = False
        draft_head = head.to(dtype)[t2d.to(torch.bool)]  # [draft_vocab, hidden]
        self.lm_head = torch.nn.Linear(hidden, self.draft_vocab_size, bias=False)
        self.verifier_lm_head = torch.nn.Linear(hidden, self.draft_vocab_size, bias=False)
        self.lm_head.weight.data = draft_head.clone()
        self.verifier_lm_head.weight.data = draft_head.clone()
        self.verifier_lm_head.weight.requires_grad = False


def _head_dim(text: dict) -> int:
    """The verifier's head_dim, except for MLA (DeepSeek-V3, Kimi), where it is the rope part."""
    heads = int(text["num_attention_heads"])
    if text.get("head_dim") and text.get("kv_lora_rank") is None:
        return int(text["head_dim"])
    return int(text["hidden_size"]) // heads


def draft_layer_config(text: dict, num_layers: int, intermediate_size: int | None = None,
                       head_dim: int | None = None,
                       rope_scaling: dict | None = None) -> LlamaConfig:
    """Llama decoder config for the draft, sized from the verifier's text config.

    speculators 0.3.0 only has Llama draft layers (and vLLM serves Eagle3 drafts as
    ``Eagle3LlamaForCausalLM``), whatever the verifier is.  Rope scaling is not copied by
    default: the draft's rope only has to agree between HF training and vLLM serving, and
    plain rope is the variant both implement identically (DeepSeek-style YaRN is not).
    """
    heads = int(text["num_attention_heads"])
    config = LlamaConfig(
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        intermediate_size=int(intermediate_size or text["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=head_dim or _head_dim(text),
        hidden_act=text.get("hidden_act", "silu"),
        max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
        initializer_range=float(text.get("initializer_range", 0.02)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=float(text.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings=False,
    )
    config._attn_implementation = FLEX_ATTENTION  # what speculators' train script sets
    return config


def build_draft(verifier_dir: str | Path, aux_layer_ids: Sequence[int], d2t: torch.Tensor,
                t2d: torch.Tensor, num_layers: int = 1, *, intermediate_size: int | None = None,
                head_dim: int | None = None, num_speculative_tokens: int = 3,
                norm_before_residual: bool = False,
                rope_scaling: dict | None = None,
                draft_class: type[Eagle3DraftModel] = Eagle3DraftModel) -> Eagle3DraftModel:
    """A fresh float32 draft (CPU) for ``verifier_dir`` with the verifier's embeddings/head.

    ``eagle_aux_hidden_state_layer_ids`` is set explicitly: it is the top-level key vLLM 0.16
    copies into the draft's hf_config, which then tells the target which layers to tap.
    The verifier's real ``architectures`` go into ``speculators_config.verifier``, with its
    path as given (the run's ``model.path``), not made absolute: the saved config.json then
    holds no path of the machine that trained it (evaluate and serve name the target anyway).
    ``draft_class``: the model class, ``Eagle3DraftModel`` or a subclass such as
    ``draftline.train.parallel.ParallelDraft`` (``draftline.train.parallel.draft_class``).
    """
    info = read_verifier(verifier_dir)
    if len(aux_layer_ids) != NUM_AUX_LAYERS:
        raise ValueError(f"EAGLE-3 drafts take {NUM_AUX_LAYERS} aux layers, got {aux_layer_ids}")
    check_layer_ids(list(aux_layer_ids), read_target_shape(info.path))
    verifier = VerifierConfig(name_or_path=str(verifier_dir), architectures=info.architectures)
    layer_config = draft_layer_config(info.text, num_layers, intermediate_size, head_dim, rope_scaling)
    for key, value in draft_class.layer_config_fields(info.text).items():
        setattr(layer_config, key, value)
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=int(d2t.numel()),
        norm_before_residual=norm_before_residual,
        eagle_aux_hidden_state_layer_ids=[int(i) for i in aux_layer_ids],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=num_speculative_tokens)],
            default_proposal_method="greedy",
            verifier=verifier,
        ),
    )
    return draft_class(config, t2d=t2d.to(torch.bool).clone(), d2t=d2t.to(torch.long).clone())


def _dense_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, attention_mask, scaling: float | None = None,
                **_kwargs) -> tuple[torch.Tensor, None]:
    """speculators' attention contract, computed by SDPA on the BlockMask's dense mask.

    query [B, heads, Q, D], key/value [B, kv_heads, KV, D]; returns [B, Q, heads, D].
    ``attention_mask`` is the BlockMask the model builds; its ``mask_mod`` (document-causal
    plus the TTT diagonal) is evaluated once on the full [Q, KV] grid by broadcasting.
    """
    device = query.device
    q_idx = torch.arange(query.shape[-2], device=device)[:, None]  # [Q, 1]
    kv_idx = torch.arange(key.shape[-2], device=device)[None, :]  # [1, KV]
    zero = torch.zeros((), dtype=torch.long, device=device)
    mask = attention_mask.mask_mod(zero, zero, q_idx, kv_idx)  # [Q, KV] bool
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )  # [B, heads, Q, D]
    return out.transpose(1, 2).contiguous(), None


def register_dense_attention() -> str:
    """Register the dense-mask kernel with transformers; return its name.

    Why: without torch.compile (which fails on CPU here), flex_attention falls back to an
    unfused path that evaluates ``mask_mod`` through nested vmaps in forward and backward,
    about 3x slower per step than SDPA on the same mask.  Same numerics up to float error.
    """
    AttentionInterface.register(DENSE_ATTENTION, _dense_sdpa)
    return DENSE_ATTENTION


def set_attention(model: _SpeculatorsEagle3DraftModel, kind: str) -> None:
    """``"flex"`` (speculators' kernel) or ``"sdpa"`` (dense mask); not saved to config.json."""
    names = {"flex": FLEX_ATTENTION, "sdpa": DENSE_ATTENTION}
    if kind not in names:
        raise ValueError(f"attention must be one of {sorted(names)}, got {kind!r}")
    if kind == "sdpa":
        register_dense_attention()
    # The decoder layers read this shared config object on every call.
    model.config.transformer_layer_config._attn_implementation = names[kind]


@dataclasses.dataclass(frozen=True)
class Precision:
    """How the draft computes; master weights, gradients and optimizer state stay float32.

    ``bf16``: the forward runs under ``torch.autocast(bfloat16)`` -- matmuls (linear, SDPA,
    flex attention) in bf16 with float32 accumulation, softmax/KL in float32 -- and the
    backward follows the forward's dtypes.  ``fp32``: no autocast (speculators' single-GPU
    default; PyTorch's default float32 matmul precision, no TF32).
    """

    name: str  # "bf16" | "fp32"
    device_type: str  # "cuda" | "cpu"

    @property
    def input_dtype(self) -> torch.dtype:
        """What hidden-state inputs are cast to (on the device): what the first matmul takes."""
        return torch.bfloat16 if self.name == "bf16" else torch.float32

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=torch.bfloat16)


def resolve_precision(precision: str, device: str | torch.device) -> Precision:
    """``auto`` is bf16 on CUDA and fp32 elsewhere.

    Why fp32 on CPU: CPU autocast runs only the matmuls in bf16 and adds a cast around each;
    bf16 GEMMs are fast only on CPUs with AMX/AVX512-BF16 and even there the draft's small
    per-layer matmuls gain little (``python -m benchmarks.train --device cpu
    --compare-precision`` measures it), while CPU runs exist for tests and tiny drafts.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    device_type = torch.device(device).type
    if precision == "auto":
        precision = "bf16" if device_type == "cuda" else "fp32"
    return Precision(precision, device_type)


def apply_precision(model: torch.nn.Module, precision: Precision) -> None:
    """Under bf16, store the frozen verifier weights (embedding, verifier head) in bf16.

    They get no gradient or optimizer state, autocast would cast the head to bf16 on every
    call anyway, and the verifier checkpoint holds them in bf16 to begin with; halving them
    saves GBs for large vocabularies (Kimi-K2.5: 163840 x 7168).  Trainable weights stay
    float32 (the master copy).
    """
    if precision.name != "bf16":
        return
    for parameter in model.parameters():
        if not parameter.requires_grad and parameter.is_floating_point():
            parameter.data = parameter.data.to(torch.bfloat16)
