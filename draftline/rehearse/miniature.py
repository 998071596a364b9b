"""A miniature of a target model, built from its config.json and tokenizer alone.

`make rehearse` (draftline.rehearse) runs the real run's engine code on it: the same
``architectures``, ``model_type`` and config classes (a multimodal wrapper with its vision
config included), the target's tokenizer and chat template, random weights, a few layers.
No weight file of the target is opened, so a directory holding only config.json and the
tokenizer files is enough.

How (by concern): draftline.rehearse.layers picks the kept layers and their kinds,
draftline.rehearse.shrink makes the config small (widths, quantization, vision tower),
draftline.rehearse.weights draws the random weights in the target's names and dtype, and
draftline.rehearse.reference loads the result in transformers.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from draftline import target
from draftline.pipeline.artifacts import atomic_dir
from draftline.rehearse import wrappers
from draftline.rehearse.layers import LayerPlan, plan_layers
from draftline.rehearse.shrink import VISION_SHRINKERS, quantization_plan, shrink_text, shrink_vision
from draftline.rehearse.weights import (WRAPPER_PREFIX, checkpoint_state, hf_config, kimi_vision, llama4_vision,
                                        text_model)
from draftline.tiny.kimi_k25 import KIMI_K25_PREPROCESSOR_CONFIG

# Files that hold weights (or their index): never opened, never copied.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt",
                   ".safetensors.index.json", ".bin.index.json")


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
            state = checkpoint_state(wrappers.build(mini, seed), "", dtype, quant)
        else:
            state = checkpoint_state(text_model(mini_text, seed), WRAPPER_PREFIX.get(model_type, ""),
                                     dtype, quant)
        if model_type == "kimi_k25":
            state.update(kimi_vision(mini, seed, dtype))
            if not (tmp / "preprocessor_config.json").exists():
                (tmp / "preprocessor_config.json").write_text(
                    json.dumps(KIMI_K25_PREPROCESSOR_CONFIG, indent=2, sort_keys=True) + "\n")
        if model_type == "llama4":
            state.update(llama4_vision(mini, seed, dtype))
        save_file(dict(sorted(state.items())), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return Miniature(Path(out_dir).absolute(), (config.get("architectures") or ["unknown"])[0],
                     model_type, plan, shrunk, dropped, quant)
