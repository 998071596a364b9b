"""Remote code only where asked: a model directory may ship Python that transformers or vLLM
would import (``auto_map`` in its config files). draftline runs it only when the model config
says ``trust_remote_code: true``; otherwise a stage refuses before loading anything.
"""

from __future__ import annotations

import json
from pathlib import Path

# The files through which transformers and vLLM find a directory's own classes.
CODE_FILES = ("config.json", "tokenizer_config.json", "processor_config.json",
              "preprocessor_config.json")


class RemoteCodeRefused(ValueError):
    """The model directory asks to run its own Python and the config did not allow it."""


def remote_code_references(model_dir: str | Path) -> list[str]:
    """``file: Auto* -> module.Class`` for every auto_map entry in the directory's configs."""
    found = []
    for name in CODE_FILES:
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        auto_map = json.loads(path.read_text()).get("auto_map") or {}
        for auto_class, target in sorted(auto_map.items()):
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
