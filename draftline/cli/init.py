"""`make init MODEL=<dir> DATA=<file> [EXP=<name>]`: the config of your own target.

Writes the tracked conf/model/<name>.yaml and conf/experiment/<name>.yaml from the model
directory's own config.json, and this machine's paths (model.path, data.path) into the untracked
conf/local.<name>.yaml, never into a tracked file: the experiment leaves them required (``???``) and
``config.fill_from_local`` fills them. Everything it can check without loading the weights is
checked first (config.json, the tokenizer and its chat template, the first conversation of the
data rendered with it), so a mistake is one line and exit 2 here, not a failed stage later.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from draftline import target
from draftline.errors import UserConfigError
from draftline.pipeline.config import CONF_DIR, local_of
from draftline.rehearse import wrappers

# Extraction runs on GPUs of at least this size (GB, 1e9 bytes): the common size of an A100 or
# H100. Bigger GPUs (141 GB H200) fit more per GPU: lower tensor_parallel_size by hand there.
GPU_GB = 80
# Share of a GPU the weights may take: vLLM gets extract.gpu_memory_utilization (0.85) of it,
# and the KV cache and activations of a 64-sequence prefill batch need the rest.
WEIGHT_SHARE = 0.6
MAX_TP = 8  # the GPUs of one host: extraction runs tensor parallel within one host
DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}  # what vLLM runs a target in (bytes)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# Sizes of the one real run the project has configured (conf/experiment/kimi-k2.5.yaml), capped
# below by the target's context and vocabulary.
SEQ_LENGTH, MAX_MODEL_LEN, DRAFT_VOCAB = 4096, 8192, 32000
# On a host without a GPU: EXP=smollm2's sizes (conf/experiment/smollm2.yaml).
CPU_SEQ_LENGTH, CPU_DRAFT_VOCAB = 1536, 8192


def text_only_limits(architecture: str) -> tuple[dict[str, int], str] | None:
    """The ``limit_mm_per_prompt`` of a text-only run of a multimodal wrapper (the conversations
    carry no images), and why; None for a text model."""
    limits = wrappers.text_only_limits(architecture)
    return (limits, "vLLM 0.16's modalities of this class, 0 per prompt: vLLM builds no vision tower") \
        if limits else None


DATA_FORMATS = ('one record per JSONL line (or a JSON list, parquet, a datasets directory): ShareGPT '
                '{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]} '
                'or OpenAI {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}')


@dataclasses.dataclass(frozen=True)
class Target:
    """What the two yaml files say about a target, read from its config.json."""

    name: str
    shape: target.TargetShape
    dtype: str  # float16 | bfloat16 | float32 | auto
    remote_code: list[str]  # auto_map references (target.remote_code_references); [] = none
    weight_bytes: int
    weights_from: str  # where weight_bytes comes from, for the comment
    vocab_size: int
    max_positions: int

    @property
    def aux_layer_ids(self) -> list[int]:
        return aux_layer_ids(self.shape.num_layers)

    @property
    def tensor_parallel_size(self) -> int:
        return tensor_parallel_size(self.weight_bytes)


# --------------------------------------------------------------------------- reading config.json


def experiment_name(model_dir: str | Path) -> str:
    """The directory's name, lower-cased, other characters than [a-z0-9.-] as '-'; a Hugging
    Face cache snapshot (models--org--name/snapshots/<hash>) is named after its repository."""
    path = Path(model_dir).absolute()
    base = path.name
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        base = path.parent.parent.name.split("--")[-1]
    return re.sub(r"[^a-z0-9.-]", "-", base.lower()).strip("-.")


def aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM 0.16's EAGLE-3 default, (2, n // 2, n - 3) (get_eagle3_aux_hidden_state_layers of
    its Llama, Qwen, DeepseekV2/V3 models). Below 7 layers it repeats an id, so tiny targets
    take the three middle layers instead, as conf/model/tiny-*.yaml do."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == 3:
        return ids
    middle = num_layers // 2
    return [middle - 1, middle, middle + 1]


def tensor_parallel_size(weight_bytes: int) -> int:
    """The smallest power of two of GPU_GB GPUs whose WEIGHT_SHARE holds the weights, up to MAX_TP."""
    tp = 1
    while tp < MAX_TP and weight_bytes > tp * GPU_GB * 1e9 * WEIGHT_SHARE:
        tp *= 2
    return tp


def checkpoint_dtype(config: dict) -> str:
    """config.json's torch_dtype (``dtype`` from transformers 5 on; a wrapper's text_config's when
    it has none itself); ``auto`` for anything vLLM does not run a target in."""
    text = config.get("text_config", {})
    for source in (config, text):
        for key in ("torch_dtype", "dtype"):
            if source.get(key):
                return source[key] if source[key] in DTYPES else "auto"
    return "auto"


def quantized_bytes(quant: dict | None) -> float | None:
    """Bytes per quantized weight (one 16-bit scale per group included): compressed-tensors'
    config_groups, GPTQ/AWQ's bits and group size, or fp8; None when not quantized."""
    if not quant:
        return None
    groups = quant.get("config_groups") or {}
    weights = next((g["weights"] for g in groups.values() if g.get("weights")), None) or {}
    bits = weights.get("num_bits") or quant.get("bits") or quant.get("w_bit")
    group = weights.get("group_size") or quant.get("group_size") or quant.get("q_group_size")
    if not bits and quant.get("quant_method") == "fp8":
        bits = 8
    if not bits and quant.get("quant_method") == "mxfp4":  # 4-bit values, one 8-bit scale per 32
        return (4 + 8 / 32) / 8
    if not bits:
        return None
    return (bits + (16 / group if group and group > 0 else 0)) / 8


def estimate_weight_bytes(config: dict) -> int:
    """The weights' size from config.json's shape, for a directory without weight files yet:
    embeddings, attention (MLA's low-rank projections too) and MLPs (MoE experts, shared ones,
    leading dense layers). A quantized checkpoint's MLP weights are counted at its bit width,
    everything else at the dtype's: Kimi-K2.5 (INT4 experts) comes to 590 GB against the 554 GB
    its checkpoint is quoted at (549 GiB: the quote may be GiB), Qwen3-8B to 16.4 GB as on disk."""
    text = target.text_config(config)
    h, n = int(text["hidden_size"]), int(text["num_hidden_layers"])
    heads = int(text.get("num_attention_heads") or 1)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or h // heads)
    if text.get("kv_lora_rank"):  # MLA (DeepseekV2/V3, Kimi): low-rank q and kv projections
        qk = text["qk_nope_head_dim"] + text["qk_rope_head_dim"]
        q_rank = text.get("q_lora_rank")
        q = h * q_rank + q_rank * heads * qk if q_rank else h * heads * qk
        kv = h * (text["kv_lora_rank"] + text["qk_rope_head_dim"]) + \
            text["kv_lora_rank"] * heads * (text["qk_nope_head_dim"] + text["v_head_dim"])
        attention = q + kv + heads * text["v_head_dim"] * h
    else:
        attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
    dense = 3 * h * int(text.get("intermediate_size") or 4 * h)  # gate, up, down
    experts = int(text.get("n_routed_experts") or text.get("num_experts") or text.get("num_local_experts") or 0)
    if experts:
        width = int(text.get("moe_intermediate_size") or text["intermediate_size"])
        num_dense = int(text.get("first_k_dense_replace") or 0)
        # Llama 4 has one shared expert in every MoE layer without a field saying so
        shared = int(text.get("n_shared_experts") or (text.get("model_type") == "llama4_text"))
        mlp = num_dense * dense + (n - num_dense) * 3 * h * width * (experts + shared)
    else:
        mlp = n * dense
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    embeddings = int(text.get("vocab_size") or 0) * h * (1 if tied else 2)
    dtype_bytes = DTYPES.get(checkpoint_dtype(config), 2)
    mlp_bytes = quantized_bytes(text.get("quantization_config") or config.get("quantization_config")) or dtype_bytes
    return int((n * attention + embeddings) * dtype_bytes + mlp * mlp_bytes)


def describe(name: str, config: dict, remote_code: list[str], weight_bytes: int = 0,
             weights_from: str = "its weight files") -> Target:
    """A Target from config.json's values; ``weight_bytes`` 0: estimated from the shape."""
    text = target.text_config(config)
    shape = target.shape_of(config)
    if not weight_bytes:
        weight_bytes, weights_from = estimate_weight_bytes(config), "estimated from config.json"
    return Target(name=name, shape=shape, dtype=checkpoint_dtype(config), remote_code=remote_code,
                  weight_bytes=weight_bytes, weights_from=weights_from,
                  vocab_size=int(text.get("vocab_size") or DRAFT_VOCAB),
                  max_positions=int(text.get("max_position_embeddings") or MAX_MODEL_LEN))


# --------------------------------------------------------------------------- the checks


def read_model(model_dir: Path, name: str):
    """The Target of ``model_dir`` and its tokenizer, or UserConfigError naming what is missing."""
    if not model_dir.is_dir():
        raise UserConfigError(f"MODEL={model_dir}: no such directory",
                              "MODEL is the target's Hugging Face directory on this machine (config.json, tokenizer, weights)")
    path = model_dir / "config.json"
    if not path.is_file():
        raise UserConfigError(f"MODEL={model_dir}: no config.json",
                              "point MODEL at the directory holding config.json (in the HF cache: models--ORG--NAME/snapshots/HASH)")
    try:
        config = json.loads(path.read_text())
        text = target.text_config(config)
        target.shape_of(config)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise UserConfigError(f"{path}: no num_hidden_layers and hidden_size ({type(error).__name__}: {error})",
                              "a decoder LLM's config.json names both (a multimodal wrapper's in text_config)") from None
    target.family_of(config)  # a model_type vLLM serves with EAGLE-3, or the table's path
    if int(text["num_hidden_layers"]) < 4:
        raise UserConfigError(f"{path}: {text['num_hidden_layers']} layers",
                              "EAGLE-3 reads three distinct decoder layers past the first: the target needs at least 4")
    found = "its safetensors files" if any(model_dir.glob("*.safetensors")) else "its weight files"
    facts = describe(name, config, target.remote_code_references(model_dir), target.weight_bytes(model_dir), found)
    return facts, load_tokenizer(model_dir, bool(facts.remote_code))


def load_tokenizer(model_dir: Path, trust_remote_code: bool):
    """The directory's tokenizer, which must have a chat template: tokenize renders every
    conversation with it (draftline/tokenize/chat.py)."""
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise UserConfigError(f"MODEL={model_dir}: no tokenizer ({', '.join(TOKENIZER_FILES)})",
                              "copy the checkpoint's tokenizer files next to its config.json")
    from draftline.tokenize import encode

    try:
        return encode.load_tokenizer(str(model_dir), trust_remote_code)  # as tokenize will load it
    except encode.NoChatTemplate:
        raise UserConfigError(f"MODEL={model_dir}: its tokenizer has no chat template",
                              "draftline renders every conversation with the target's own template: use the "
                              "chat/instruct checkpoint's tokenizer, or add its chat_template.jinja to the directory") from None
    except (OSError, ValueError, ImportError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise UserConfigError(f"MODEL={model_dir}: its tokenizer does not load ({type(error).__name__}: {first})",
                              "check the tokenizer files; remote code must be present where auto_map names it") from None


def check_data(data: str, tokenizer) -> None:
    """The first record of ``data`` is a conversation tokenize reads, and renders with the
    target's chat template; the rest is tokenize's business (tokenize.max_skipped)."""
    from draftline.tokenize.chat import assistant_char_spans
    from draftline.errors import DataError
    from draftline.tokenize.conversations import RecordSkip, normalize
    from draftline.tokenize.sources import open_source

    try:
        where, record, error = next(iter(open_source(data).stream()), (data, None, "no records"))
    except DataError as exc:
        raise UserConfigError(f"DATA={data}: {exc}", DATA_FORMATS) from None
    if error is not None:
        raise UserConfigError(f"DATA={data}: {where}: {error}", DATA_FORMATS)
    try:
        messages = normalize(record).messages
    except RecordSkip as exc:
        raise UserConfigError(f"DATA={data}: {where}: {exc}", DATA_FORMATS) from None
    try:
        assistant_char_spans(tokenizer, messages, sample=where)
    except DataError as exc:
        raise UserConfigError(f"DATA={data}: the target's chat template cannot render it: {exc}",
                              "the template is the target's: check the record's roles against what it accepts") from None


# --------------------------------------------------------------------------- the files


def _line(key_value: str, comment: str) -> str:
    """``key: value`` with its comment at column 27, as conf/ aligns them."""
    return f"{key_value:<26} # {comment}"


def _gb(size: int) -> str:
    if size < 1e9:
        return f"{size / 1e6:.0f} MB"
    return f"{size / 1e9:.1f} GB" if size < 1e11 else f"{size / 1e9:.0f} GB"


# vLLM's reasoning parser for a thinking target, by the architecture's family (its name in
# vllm.reasoning's registry): regenerate splits the target's replies with it.
REASONING_PARSERS = (("Kimi", "kimi_k2"), ("Qwen3", "qwen3"), ("DeepseekV3", "deepseek_r1"),
                     ("DeepseekV2", "deepseek_r1"))


def reasoning_parser_line(architecture: str, thinking: bool) -> str:
    if not thinking:
        return _line("reasoning_parser: null", "its template does not think: replies are text only")
    name = next((parser for prefix, parser in REASONING_PARSERS if architecture.startswith(prefix)), None)
    if name is None:
        return _line("reasoning_parser: null", "a thinking template: set vLLM's reasoning parser for the "
                     "family before regenerate.replies=target (regenerate refuses without one)")
    return _line(f"reasoning_parser: {name}", "vLLM's reasoning parser for the family (regenerate splits "
                 "the target's replies with it)")


def model_yaml(facts: Target, thinking: bool = False) -> str:
    s = facts.shape
    tp = facts.tensor_parallel_size
    weights = f"{_gb(facts.weight_bytes)} of weights ({facts.weights_from})"
    if tp == 1:
        tp_why = [f"{weights} fit one {GPU_GB} GB GPU (assumed): on a host of N GPUs,",
                  "extract.replicas=N runs one engine on each."]
    elif facts.weight_bytes > tp * GPU_GB * 1e9 * WEIGHT_SHARE:
        tp_why = [f"{weights} leave little room on {tp} {GPU_GB} GB GPUs (assumed):",
                  "run it on bigger ones (kimi-k2.5 runs on 8 H200s of 141 GB)."]
    else:
        tp_why = [f"{weights} over {GPU_GB} GB GPUs (assumed), at most {WEIGHT_SHARE:.0%}",
                  "of each (the rest holds the KV cache); bigger GPUs need fewer."]
    if facts.remote_code:
        remote = "its directory ships Python (auto_map in " + \
            ", ".join(sorted({r.split(":")[0] for r in facts.remote_code})) + "): read it before you run it"
    else:
        remote = "no auto_map needing its Python: transformers' and vLLM's own classes"
    lines = [
        f"# {s.architecture} target ({s.num_layers} layers, hidden {s.hidden_size}), written by `make init` from its",
        "# config.json (draftline/cli/init.py). Its directory on this machine is model.path in the",
        f"# untracked conf/local.{facts.name}.yaml, never here.",
        f"name: {facts.name}",
        _line("path: ???", "HF-layout model directory (required: conf/local.<exp>.yaml, conf/local.yaml or OVERRIDES)"),
        _line("build: null", "real model: never built"),
        _line(f"dtype: {facts.dtype}", "torch dtype vLLM runs the target in (config.json's; auto = checkpoint dtype)"),
        _line(f"trust_remote_code: {str(bool(facts.remote_code)).lower()}", remote),
        reasoning_parser_line(s.architecture, thinking),
        _line(f"num_layers: {s.num_layers}", "decoder layers (checked against config.json)"),
        _line(f"hidden_size: {s.hidden_size}", "hidden width (checked against config.json)"),
        _line(f"aux_layer_ids: {facts.aux_layer_ids}",
              "vLLM's default (2, n//2, n-3)" if facts.aux_layer_ids == [2, s.num_layers // 2, s.num_layers - 3]
              else "the middle three: vLLM's (2, n//2, n-3) repeats an id below 7 layers"),
        *(f"# {line}" for line in tp_why),
        _line(f"tensor_parallel_size: {tp}", "vLLM TP degree (GPUs)"),
        _line("enforce_eager: null", "null: compiled (torch.compile, CUDA graphs) on GPUs, eager on the CPU engine; true/false forces it"),
        _line("mla_disable: false", "GPUs run MLA natively (true only on vLLM's CPU platform)"),
    ]
    text_only = text_only_limits(s.architecture)
    if text_only:
        limits, why = text_only
        lines.append(_line(f"limit_mm_per_prompt: {{{', '.join(f'{m}: 0' for m in limits)}}}", f"text-only: {why}"))
    return "\n".join(lines) + "\n"


def reasoning_lines(thinking: bool) -> list[str]:
    """``tokenize.reasoning`` for a thinking target (its chat template takes reasoning_content
    or writes a think block), with why; nothing for another (the default trains the same)."""
    if not thinking:
        return []
    return [
        "  # A thinking target: most of what it generates is reasoning, and its template drops the",
        "  # reasoning of finished turns from the history, so a render of the whole record trains little",
        "  # or none of it. as_generated trains each reply as the target writes it, after the prompt",
        "  # the server renders (docs/pipeline.md, \"Tool calls and reasoning\").",
        _line("  reasoning: as_generated", "as_generated | template | preserve"),
    ]


def experiment_yaml(facts: Target, on_gpu: bool = True, thinking: bool = False) -> str:
    """The experiment's sizes: kimi-k2.5's on a GPU host; on a host where torch sees no GPU,
    those of EXP=smollm2, measured on 2 CPU cores (docs/results.md): bf16 autocast, a smaller
    draft vocabulary and token budget per step (the levers of a CPU's training step), bf16
    shards and a step count that trains in about half an hour at SmolLM2's width.  ``thinking``:
    the target's template is a thinking model's (:func:`reasoning_lines`)."""
    seq_length = min(SEQ_LENGTH, facts.max_positions // 2)
    max_model_len = min(MAX_MODEL_LEN, facts.max_positions)
    header = [
        "# @package _global_",
        f"# The run on {facts.name}, written by `make init` (draftline/cli/init.py). model.path and",
        f"# data.path are this machine's: the untracked conf/local.{facts.name}.yaml (or OVERRIDES) sets them.",
        "defaults:",
        f"  - override /model: {facts.name}",
        "  - override /data: file",
        f"exp: {facts.name}",
    ]
    benchmarks = [
        "evaluate:",
        "  benchmarks:",
        _line("    names: [mt_bench, humaneval, bfcl_simple]", "tau per standard benchmark in vLLM (docs/pipeline.md)"),
    ]
    if not on_gpu:
        draft_vocab = min(CPU_DRAFT_VOCAB, facts.vocab_size)
        return "\n".join([
            *header,
            "# Sizes for this host, where torch sees no GPU: EXP=smollm2's, measured on 2 CPU cores",
            f"# (docs/results.md), capped by this target's context ({facts.max_positions} positions)"
            f" and vocabulary ({facts.vocab_size} tokens). On a GPU host `make init` writes larger ones.",
            "tokenize:",
            _line(f"  seq_length: {min(CPU_SEQ_LENGTH, seq_length)}", "tokens per sample"),
            _line(f"  draft_vocab_size: {draft_vocab}", "draft vocabulary (tokens): the draft head is a CPU step's largest matmul"),
            *reasoning_lines(thinking),
            "extract:",
            _line(f"  max_model_len: {min(2048, max_model_len)}", "vLLM context length (tokens)"),
            _line("  shard_tokens: 65536", "tokens per safetensors shard"),
            _line("  save_dtype: bfloat16", "hidden states on disk"),
            "train:",
            _line("  precision: bf16", "bf16 autocast on the CPU too (docs/results.md: the CPU's lever)"),
            _line("  max_tokens_per_step: 2048", "packed tokens per step (a CPU's dense attention mask grows with its square)"),
            _line("  steps: 300", "optimizer steps"),
            _line("  lr: 1.0e-3", "AdamW peak learning rate"),
            _line("  checkpoint_every: 100", "steps between resumable checkpoints"),
            *benchmarks,
            _line("    max_prompts: 80", "first N prompts of each benchmark (count)"),
        ]) + "\n"
    draft_vocab = min(DRAFT_VOCAB, facts.vocab_size)
    return "\n".join([
        *header,
        "# Sizes of the kimi-k2.5 experiment (a real target on GPUs), capped by this target's context",
        f"# ({facts.max_positions} positions) and vocabulary ({facts.vocab_size} tokens). Edit freely.",
        "tokenize:",
        _line(f"  seq_length: {seq_length}", "tokens per sample"),
        _line(f"  draft_vocab_size: {draft_vocab}", "draft vocabulary (tokens)"),
        *reasoning_lines(thinking),
        "extract:",
        _line("  token_budget: 65536", "prompt tokens per generate() call (tokens)"),
        _line("  shard_tokens: 65536", "tokens per safetensors shard"),
        _line("  max_num_batched_tokens: 16384", "vLLM per-step token budget"),
        _line(f"  max_model_len: {max_model_len}", "vLLM context length (tokens)"),
        _line("  max_num_seqs: 64", "vLLM scheduler sequence slots"),
        _line("  save_dtype: float8_e4m3fn", "half bf16's bytes, acceptance held (conf/experiment/kimi-k2.5.yaml)"),
        "train:",
        _line("  max_tokens_per_step: 8192", "packed tokens per optimizer step"),
        _line("  steps: 20000", "optimizer steps"),
        _line("  checkpoint_every: 500", "steps between resumable checkpoints"),
        *benchmarks,
    ]) + "\n"


def machine_path(path: str, repo: Path) -> str:
    """``path`` relative to the checkout when inside it (models/<name> then holds inside the
    containers too, README), else absolute; a hub dataset name as it is."""
    local = Path(path)
    if not local.exists():
        return path
    try:
        return str(local.absolute().relative_to(repo.absolute()))
    except ValueError:
        return str(local.absolute())


def local_paths(local: Path, wanted: dict[str, str]) -> tuple[str, dict[str, str]]:
    """Put ``wanted`` (model.path, data.path) into the experiment's own conf/local.<name>.yaml
    (config.local_of), so that conf/local.yaml, or another experiment's file, never fills them.
    An existing file (a removed experiment's, or the user's) is never rewritten: returns what it
    printed and the OVERRIDES every command then needs."""
    import yaml
    from omegaconf import OmegaConf

    nested = {}
    for key, value in wanted.items():
        group, leaf = key.split(".")
        nested.setdefault(group, {})[leaf] = value
    if not local.exists():
        local.write_text("# This machine's paths for one experiment (untracked): they fill what it leaves required (???).\n"
                         + yaml.safe_dump(nested, sort_keys=False))
        return f"wrote {local} (untracked): {', '.join(f'{k}={v}' for k, v in wanted.items())}", {}
    loaded = OmegaConf.load(local)
    todo = {k: v for k, v in wanted.items() if OmegaConf.select(loaded, k) != v}
    if not todo:
        return f"{local} already sets {', '.join(wanted)}", {}
    return (f"{local} exists and sets other paths: it is left as it is; pass this target's paths "
            "with OVERRIDES on every command below, or edit it"), todo


def init(model: str, data: str, name: str | None = None, conf_dir: Path = CONF_DIR,
         on_gpu: bool | None = None) -> list[str]:
    """Check MODEL and DATA, write the two yaml files and conf/local.<name>.yaml; the lines to
    print. ``on_gpu``: which sizes (None: whether torch sees a GPU here)."""
    name = name or experiment_name(model)
    if not NAME.fullmatch(name):
        raise UserConfigError(f"EXP={name}: not a config name", "letters, digits, '.', '-' and '_': e.g. EXP=qwen3-8b")
    files = [conf_dir / "model" / f"{name}.yaml", conf_dir / "experiment" / f"{name}.yaml"]
    for path in files:
        if path.exists():
            raise UserConfigError(f"{path} exists: init never overwrites a config",
                                  "pick another name with EXP=<name>, or edit that file")
    facts, tokenizer = read_model(Path(model), name)
    check_data(data, tokenizer)
    from draftline.tokenize.generated import thinking_template

    thinking = thinking_template(tokenizer)
    if on_gpu is None:
        from draftline.engine import cuda_available

        on_gpu = cuda_available()
    for path, text in zip(files, (model_yaml(facts, thinking), experiment_yaml(facts, on_gpu, thinking))):
        path.write_text(text)
    repo = conf_dir.parent
    said, overrides = local_paths(local_of(name, conf_dir), {"model.path": machine_path(model, repo),
                                                     "data.path": machine_path(data, repo)})
    tail = f' OVERRIDES="{" ".join(f"{k}={v}" for k, v in overrides.items())}"' if overrides else ""
    lines = [f"wrote {files[0]}: {facts.shape.architecture}, {facts.shape.num_layers} layers, hidden "
             f"{facts.shape.hidden_size}, aux_layer_ids {facts.aux_layer_ids}, dtype {facts.dtype}, "
             f"tensor_parallel_size {facts.tensor_parallel_size}, trust_remote_code {str(bool(facts.remote_code)).lower()}",
             f"wrote {files[1]}" + (": a thinking target, tokenize.reasoning=as_generated" if thinking else ""),
             said, "next:", f"  make status EXP={name}{tail}"]
    if facts.weight_bytes > _min_target_gb(conf_dir) * 1e9:
        lines.append(f"  make rehearse EXP={name}{tail}   # {_gb(facts.weight_bytes)}: the run's engine code on a miniature first")
    lines += [f"  make {stage} EXP={name}{tail}" for stage in ("tokenize", "extract")]
    lines.append(f"  make train EXP={name}{tail}   # the draft lands in runs/{name}/draft")
    return lines


def _min_target_gb(conf_dir: Path) -> float:
    """rehearse.min_target_gb: above it the stages that load the target wait for the rehearsal."""
    from omegaconf import OmegaConf

    return float(OmegaConf.load(conf_dir / "rehearse" / "default.yaml").min_target_gb)


def build_cli():
    import typer

    app = typer.Typer(add_completion=False)

    @app.command()
    def main(model: str = typer.Argument(..., help="the target's Hugging Face directory (config.json, tokenizer)"),
             data: str = typer.Argument(..., help="your conversations: JSON, JSONL, parquet, a datasets directory"),
             name: str = typer.Option(None, help="the experiment and model config's name; default: MODEL's directory name"),
             conf_dir: Path = typer.Option(CONF_DIR, help="where conf/ is (tests point it at a copy)")) -> None:
        """Write conf/model/NAME.yaml and conf/experiment/NAME.yaml for your own target, and its
        paths into the untracked conf/local.<name>.yaml."""
        for line in init(model, data, name, conf_dir):
            typer.echo(line)

    return app


def main() -> None:
    from draftline.errors import refuse

    try:
        build_cli()()
    except UserConfigError as error:
        refuse(error)


if __name__ == "__main__":
    main()
