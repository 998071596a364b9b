"""What draftline knows about a target model directory before loading it.

* Its shape (layer count, width, architecture) and which aux layer ids it has.
* Its digest: the content of its files, which stands for the target in shard fingerprints.
* Remote code only where asked: a model directory may ship Python that transformers or vLLM
  would import (``auto_map`` in its config files). draftline runs it only when the model
  config says ``trust_remote_code: true``; otherwise a stage refuses before loading anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from draftline.pipeline.artifacts import read_json, sha256_file, write_json
from draftline.errors import UserConfigError, UserError

# The files through which transformers and vLLM find a directory's own classes.
CODE_FILES = ("config.json", "tokenizer_config.json", "processor_config.json",
              "preprocessor_config.json")


class RemoteCodeRefused(UserError, ValueError):
    """The model directory asks to run its own Python and the config did not allow it."""

    hint_text = ("read the files it names; if you trust them, set model.trust_remote_code=true "
                 "in the model's conf/model/<name>.yaml (or OVERRIDES)")


# config.json's auto_map entries that transformers replaces with its own classes when it knows
# the model_type: DeepSeek-V3's checkpoint still names its configuration_deepseek.py, and with
# trust_remote_code off transformers and vLLM read it with their DeepseekV3Config.
NATIVE_AUTO_CLASSES = ("AutoConfig", "AutoModel")


def _transformers_knows(model_type: object) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


def remote_code_references(model_dir: str | Path) -> list[str]:
    """``file: Auto* -> module.Class`` for every auto_map entry in the directory's configs that
    would run its Python: config.json's config and model classes of a model_type transformers
    4.57 has are left out (trust_remote_code off uses transformers' own)."""
    found = []
    for name in CODE_FILES:
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        content = json.loads(path.read_text())
        auto_map = content.get("auto_map") or {}
        native = name == "config.json" and auto_map and _transformers_knows(content.get("model_type"))
        for auto_class, target in sorted(auto_map.items()):
            if not (native and auto_class.startswith(NATIVE_AUTO_CLASSES)):
                found.append(f"{name}: {auto_class} -> {target}")
    return found


def check(model_dir: str | Path, trust_remote_code: bool) -> bool:
    """Return ``trust_remote_code`` once the directory agrees with it; raise when the directory
    ships code the config did not allow, naming the files and classes."""
    references = remote_code_references(model_dir)
    if references and not trust_remote_code:
        raise RemoteCodeRefused(
            f"{model_dir} asks to run its own Python ({'; '.join(references)}); draftline runs "
            "it only when the model config allows it: set model.trust_remote_code=true if you "
            "trust this directory")
    return bool(trust_remote_code)


# --------------------------------------------------------------------------- families

FAMILY_TABLE = "docs/families.md"  # the table below with what the rehearsal keeps and drops, and the proofs


@dataclasses.dataclass(frozen=True)
class Family:
    """A model_type vLLM 0.16 (with patches/vllm/) serves as an EAGLE-3 target and transformers
    4.57 knows (docs/families.md says how each was read and what is proven)."""

    model_type: str     # config.json's (the wrapper's, for a multimodal model)
    architecture: str   # vLLM's class (SupportsEagle3)
    public_model: str   # one public checkpoint of the family
    miniature: bool     # the rehearsal builds its miniature (draftline.rehearse.miniature)


FAMILIES = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", "meta-llama/Llama-3.1-8B-Instruct", True),
    Family("qwen2", "Qwen2ForCausalLM", "Qwen/Qwen2.5-7B-Instruct", True),
    Family("qwen3", "Qwen3ForCausalLM", "Qwen/Qwen3-8B", True),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen/Qwen3-30B-A3B", True),
    Family("gpt_oss", "GptOssForCausalLM", "openai/gpt-oss-20b", True),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek-ai/DeepSeek-V3", True),
    Family("kimi_k2", "DeepseekV3ForCausalLM", "moonshotai/Kimi-K2-Instruct", True),
    Family("kimi_k25", "KimiK25ForConditionalGeneration", "moonshotai/Kimi-K2.5", True),
    Family("llama4", "Llama4ForConditionalGeneration", "meta-llama/Llama-4-Scout-17B-16E-Instruct", True),
    Family("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM", "tencent/Hy-MT2-7B", True),
    Family("llava", "LlavaForConditionalGeneration", "llava-hf/llava-1.5-7b-hf", True),
    Family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen/Qwen2.5-VL-7B-Instruct", True),
    Family("qwen3_vl", "Qwen3VLForConditionalGeneration", "Qwen/Qwen3-VL-8B-Instruct", True),
    Family("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "Qwen/Qwen3-VL-30B-A3B-Instruct", True),
)}


class UnsupportedFamily(UserConfigError):
    """The target's model_type is not one vLLM 0.16 serves with an EAGLE-3 draft here."""

    hint_text = f"the families draftline serves with EAGLE-3, and why others are left out: {FAMILY_TABLE}"


def family_of(config: dict) -> Family:
    """The Family of a parsed config.json, or UnsupportedFamily naming its model_type."""
    model_type = str(config.get("model_type"))
    if model_type not in FAMILIES:
        raise UnsupportedFamily(f"model_type {model_type!r} ({(config.get('architectures') or ['?'])[0]}): "
                                f"not a family vLLM 0.16 serves with an EAGLE-3 draft (see {FAMILY_TABLE})")
    return FAMILIES[model_type]


@dataclasses.dataclass(frozen=True)
class TargetShape:
    """What the extraction needs to know about the target before loading it."""

    num_layers: int
    hidden_size: int
    architecture: str


def read_target_shape(model_dir: str | Path) -> TargetShape:
    """Layer count, width and architecture from config.json (text_config for wrappers)."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"target model config not found: {path}")
    return shape_of(json.loads(path.read_text()))


def text_config(config: dict) -> dict:
    """The text model's keys of a parsed config.json: ``text_config`` for a wrapper, else the
    config itself. A ``text_config`` that names only what differs from its model_type's defaults
    (LLaVA-1.5's: no layer count, no width) gets those defaults, as transformers reads it."""
    text = config.get("text_config")
    if text is None:
        return config
    if "num_hidden_layers" in text and "hidden_size" in text:
        return text
    from transformers import AutoConfig

    return {**AutoConfig.for_model(str(text.get("model_type"))).to_dict(), **text}


def shape_of(config: dict) -> TargetShape:
    """The TargetShape of a parsed config.json (text_config for wrappers)."""
    text = text_config(config)
    return TargetShape(
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        architecture=(config.get("architectures") or ["unknown"])[0],
    )


# Weight files of a model directory (their total size decides whether a run rehearses first).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def weight_bytes(model_dir: str | Path) -> int:
    """Total size of the directory's weight files (top level, as HF checkpoints lay them out):
    its safetensors files when it has any (vLLM loads those; a checkpoint that ships the same
    weights as .bin too is counted once), else its other weight files; 0 for a directory that
    does not exist yet (a tiny target not built yet)."""
    root = Path(model_dir)
    if not root.is_dir():
        return 0
    files = [p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]
    safetensors = [p for p in files if p.suffix == ".safetensors"]
    return sum(p.stat().st_size for p in safetensors or files)


# Files of a model directory that record how the project built it (with timings), not what the
# target computes: left out of its digest.
BUILD_RECORDS = ("build.json",)


def target_digest(model_dir: str | Path, cache_path: Path) -> str:
    """sha256 over the target's files: relative names and content, hidden files (download
    caches, with their timestamps) and build records left out. Where the directory is, and when
    its files were written, do not enter it. ``cache_path`` keeps each file's sha256 under its
    path, size and mtime, so an unchanged target is hashed once, not on every run."""
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"target model directory not found: {root}")
    cache = read_json(cache_path) if cache_path.exists() else {}
    seen, digest = {}, hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or rel.name in BUILD_RECORDS:
            continue
        stat = path.stat()
        key = str(path.resolve())
        size_mtime = [stat.st_size, stat.st_mtime_ns]
        entry = cache.get(key)
        file_sha = entry[1] if entry and entry[0] == size_mtime else sha256_file(path)
        seen[key] = [size_mtime, file_sha]
        digest.update(rel.as_posix().encode() + b"\0" + file_sha.encode())
    if seen != cache:
        write_json(cache_path, seen)
    return digest.hexdigest()


def check_layer_ids(aux_layer_ids: list[int], shape: TargetShape) -> None:
    """Aux id i captures the input of layer i: valid ids are 1 .. num_layers - 1."""
    bad = [i for i in aux_layer_ids if not 0 < i < shape.num_layers]
    if bad or len(set(aux_layer_ids)) != len(aux_layer_ids):
        raise ValueError(
            f"aux_layer_ids {list(aux_layer_ids)} invalid for a {shape.num_layers}-layer "
            f"target: need distinct ids in [1, {shape.num_layers - 1}]"
        )


def check_model_config(model, exp: str) -> None:
    """conf/model's num_layers x hidden_size against model.path's config.json, before any stage
    trusts the path: a path filled from conf/local.yaml for another target would otherwise
    rehearse, or extract, that other target under this experiment's name."""
    path = Path(model.path) / "config.json"
    if not path.exists():
        return  # target.check refuses it where a stage loads the target, with its own words
    shape = read_target_shape(model.path)
    said = (int(model.num_layers), int(model.hidden_size))
    if (shape.num_layers, shape.hidden_size) != said:
        raise UserConfigError(
            f"model.path={model.path} is a {shape.num_layers}-layer x {shape.hidden_size} target "
            f"({shape.architecture}, its config.json); conf/model/{model.name}.yaml says {said[0]} x {said[1]}",
            f"one of the two is another target's. conf/local.yaml fills model.path for every experiment "
            f"that leaves it unset: put EXP={exp}'s own in conf/local.{exp}.yaml (`make init` writes it) "
            f'or pass OVERRIDES="model.path=<its directory>"')
