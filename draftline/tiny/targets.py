"""Deterministic builders of tiny random HF-format target models.

Every builder writes a complete Hugging Face model directory (float32
safetensors weights, ``config.json``, ``generation_config.json`` and the
tokenizer files) that both transformers and vLLM's CPU engine can load.
Nothing is downloaded: the tokenizer is a byte-level BPE trained in-process on
the committed corpus of Python standard-library docstrings (draftline.tiny.embedded),
and the weights are drawn from a seeded torch generator.

Same arguments -> byte-identical files (for a fixed torch / transformers /
tokenizers stack: ``config.json`` records the transformers version; the corpus
is committed, so the interpreter does not matter).  Directories are written to
a temporary sibling first and then renamed into place, so a reader never sees
a half-written model and rebuilding an existing directory replaces it.

``build_tiny_kimi_k25`` wraps a tiny DeepseekV3 (built by ``build_tiny_deepseek_v3``) in
vLLM's own Kimi-K2.5 config and checkpoint layout; its HF reference is the text model as a
plain ``DeepseekV3ForCausalLM`` (``load_hf_model`` does that for a Kimi directory).

``hf_hidden_states`` runs a built model with transformers and returns its
``output_hidden_states`` tuple.  Convention (transformers 4.57, both Llama and
DeepseekV3, via ``utils.generic.check_model_inputs``): with ``L`` decoder
layers the tuple has ``L + 1`` entries; entry ``k < L`` is the input of
decoder layer ``k`` (entry 0 = token embeddings, entry ``k`` = output of layer
``k - 1``), and entry ``L`` is the final hidden state *after* the final
RMSNorm (the raw output of the last layer is replaced by ``last_hidden_state``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from draftline.pipeline.artifacts import atomic_dir

__all__ = [
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "default_corpus",
    "build_tokenizer",
    "build_tiny_llama",
    "build_tiny_deepseek_v3",
    "build_tiny_kimi_k25",
    "load_hf_kimi_k25_language_model",
    "write_kimi_k25_language_model",
    "hf_hidden_states",
    "load_hf_model",
]

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
# Order fixes the ids: <|bos|>=0, <|eos|>=1, <|pad|>=2, <|system|>=3,
# <|user|>=4, <|assistant|>=5, <|end|>=6.
SPECIAL_TOKENS = [BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, END]

# Renders ``<|bos|><|role|>content<|end|>...`` and, with
# ``add_generation_prompt``, a trailing ``<|assistant|>``.  Assistant turns are
# wrapped in ``{% generation %}`` so ``return_assistant_tokens_mask=True`` works.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('unsupported role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|assistant|>' -}}"
    "{%- generation -%}{{- message['content'] + '<|end|>' -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)



# --------------------------------------------------------------------------
# helpers


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU RNG for the block without disturbing the caller's RNG state."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def default_corpus() -> list[str]:
    """The tokenizer's training text: the committed stdlib-docstring corpus
    (draftline.tiny.embedded), identical on every interpreter."""
    from draftline.tiny import embedded

    return embedded.tokenizer_corpus()


def _train_bpe(corpus: list[str] | None, vocab_size: int):
    """Train the byte-level BPE (a ``tokenizers.Tokenizer``); deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if corpus is None:
        corpus = default_corpus()
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(SPECIAL_TOKENS) + len(byte_alphabet):
        raise ValueError(
            f"vocab_size={vocab_size} is below the {len(SPECIAL_TOKENS) + len(byte_alphabet)} "
            "special + byte tokens of a byte-level BPE"
        )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=sorted(byte_alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    # Plain encodes (add_special_tokens=True) start with <|bos|>, like Llama.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A $B:1",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    return tok


def _chat(chat: str) -> tuple[list[str], str, str]:
    """``(extra special tokens, chat template, end-of-turn token)`` of a tiny target's chat:
    ``plain`` (:data:`CHAT_TEMPLATE`) or ``kimi`` (Kimi-K2.5's thinking template,
    draftline.tiny.templates)."""
    if chat == "plain":
        return [], CHAT_TEMPLATE, END
    if chat == "kimi":
        from draftline.tiny.templates import KIMI_END_OF_TURN, KIMI_SPECIALS, KIMI_TEMPLATE

        return list(KIMI_SPECIALS), KIMI_TEMPLATE, KIMI_END_OF_TURN
    raise ValueError(f"chat={chat!r}: a tiny target's chat is plain or kimi")


def _write_tokenizer(out_dir: Path, corpus: list[str] | None, vocab_size: int, chat: str = "plain"):
    """The BPE, with ``chat``'s special tokens within ``vocab_size`` (the BPE learns fewer merges)."""
    from transformers import PreTrainedTokenizerFast

    extra, template, _ = _chat(chat)
    tok = _train_bpe(corpus, vocab_size - len(extra))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT, END, *extra],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    fast.chat_template = template
    fast.save_pretrained(str(out_dir))
    return fast


def _write_generation_config(model, tokenizer, chat: str = "plain") -> None:
    """eos: the tokenizer's and the chat's end of turn (where a reply ends)."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(_chat(chat)[2])],
        pad_token_id=tokenizer.pad_token_id,
    )


# --------------------------------------------------------------------------
# public builders


def build_tokenizer(out_dir, corpus: list[str] | None = None, vocab_size: int = 512):
    """Train a byte-level BPE in-process and save it (HF format) to ``out_dir``.

    Special tokens (ids 0-6): ``<|bos|> <|eos|> <|pad|> <|system|> <|user|>
    <|assistant|> <|end|>``.  Encoding with special tokens prepends ``<|bos|>``.
    The chat template renders ``<|bos|><|role|>content<|end|>...`` (roles
    system/user/assistant) plus ``<|assistant|>`` for ``add_generation_prompt``.
    ``corpus=None`` uses :func:`default_corpus` (which reaches ``vocab_size``
    512); a small custom corpus may yield fewer tokens.  Returns the
    ``PreTrainedTokenizerFast`` loaded back from ``out_dir``.
    """
    from transformers import PreTrainedTokenizerFast

    with atomic_dir(out_dir) as tmp:
        _write_tokenizer(tmp, corpus, vocab_size)
    return PreTrainedTokenizerFast.from_pretrained(str(out_dir))


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
    no rope scaling.  ``chat``: its chat template and specials (:func:`_chat`).  Returns
    ``out_dir`` as an absolute Path.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (head_dim is None and hidden_size % num_heads) or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads and num_heads by num_kv_heads")
    with atomic_dir(out_dir) as tmp:
        tok = _write_tokenizer(tmp, None, vocab_size, chat)
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
        with _seeded(seed):
            model = LlamaForCausalLM(config).to(torch.float32).eval()
        _write_generation_config(model, tok, chat)
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
    its chat template and specials, :func:`_chat`).

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
        tok = _write_tokenizer(tmp, None, vocab_size, chat)
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
        with _seeded(seed):
            model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
            with torch.no_grad():
                for layer in model.model.layers[first_k_dense_replace:]:
                    bias = layer.mlp.gate.e_score_correction_bias
                    bias.copy_(torch.randn(bias.shape) * initializer_range)
        _write_generation_config(model, tok, chat)
        model.save_pretrained(str(tmp), safe_serialization=True)
    return Path(out_dir).absolute()


# --------------------------------------------------------------------------
# Kimi-K2.5: vLLM's KimiK25Config around a tiny DeepseekV3 text model

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


def _kimi_k25_vision_weights(vision, text_hidden_size: int, seed: int) -> dict:
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
            _kimi_k25_vision_weights(config.vision_config, text_config["hidden_size"], seed)
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


def _is_kimi_k25(model_dir) -> bool:
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
    with _seeded(0):  # the random init is overwritten; keep the caller's RNG untouched
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


# --------------------------------------------------------------------------
# reference hidden states


def hf_hidden_states(model_dir, token_ids: list[int]) -> tuple:
    """Run a model with transformers (float32, CPU, eager attention).

    ``model_dir`` is a model directory (loaded here) or an already loaded HF
    causal LM (used as is; pass one to avoid reloading for many sequences).
    Returns ``output_hidden_states`` for the single sequence ``token_ids`` as a
    tuple of ``num_layers + 1`` float32 tensors of shape ``[len(token_ids),
    hidden_size]`` (batch dimension removed).  Entry ``k < num_layers`` is the
    input of decoder layer ``k`` (entry 0 = token embeddings); entry
    ``num_layers`` is the final hidden state after the final norm (what
    ``lm_head`` consumes), not the raw output of the last layer.
    """
    import torch

    model = model_dir
    if not isinstance(model, torch.nn.Module):
        model = load_hf_model(model_dir)
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return tuple(h[0].detach().clone() for h in out.hidden_states)


def load_hf_model(model_dir):
    """Load ``model_dir`` with transformers: float32, CPU, eager attention, eval mode.

    A Kimi-K2.5 directory (model_type ``kimi_k25``) loads as its text model, a plain
    ``DeepseekV3ForCausalLM`` (:func:`load_hf_kimi_k25_language_model`).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if _is_kimi_k25(model_dir):
        return load_hf_kimi_k25_language_model(model_dir)
    return AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager", device_map=None
    ).eval()
