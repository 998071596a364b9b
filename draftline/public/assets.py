"""The project-built inputs of experiments on public data: the prompt set (``data.build:
public_prompts``) and the SmolLM2 directory (``model.build: smollm2``), built by Make's assets
step (draftline.cli.status) like the tiny targets, only under ``assets_dir``.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftline.pipeline.artifacts import atomic_path, write_json

PROMPTS_BUILD = "public_prompts"


class NotAnAssetPath(ValueError):
    """A project-built input configured at a path outside the project's assets."""


def check_under_assets(path: str | Path, assets_dir: str | Path, build: str) -> Path:
    path = Path(path)
    if Path(assets_dir).resolve() not in path.resolve().parents:
        raise NotAnAssetPath(f"{path} is built by the project ({build}) and lives only under "
                             f"{assets_dir}/: for your own file use data=file data.path={path}")
    return path


def sources_path(data_path: str | Path) -> Path:
    """The sidecar that says where every prompt of the built set came from."""
    data_path = Path(data_path)
    return data_path.with_name(data_path.name + ".sources.json")


def ensure_prompts(data, assets_dir: str | Path, seed: int, model_dir: str | Path,
                   template_kwargs: dict) -> Path:
    """The public training prompts at ``data.path`` (rewritten when the recipe changed).

    Declared tools reach the target as evaluate's benchmarks give them: through the chat
    template where it renders tools, else as a system turn (``prompts.tools_in_system``).
    """
    from draftline.public import prompts

    path = check_under_assets(data.path, assets_dir, PROMPTS_BUILD)
    tools_rendered = prompts.template_renders_tools(model_dir, template_kwargs)
    recipe = {"bfcl_per_category": data.get("bfcl_per_category"), "embedded": data.get("embedded"),
              "seed": int(seed), "train_bfcl": list(prompts.TRAIN_BFCL),
              "tools": "template" if tools_rendered else "system turn"}
    sidecar = sources_path(path)
    if path.exists() and sidecar.exists() and json.loads(sidecar.read_text()).get("recipe") == recipe:
        return path
    records, info = prompts.training_records(assets_dir, bfcl_per_category=recipe["bfcl_per_category"],
                                             embedded=recipe["embedded"], seed=int(seed),
                                             tools_as_system=not tools_rendered)
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records), encoding="utf-8")
    write_json(sidecar, {"recipe": recipe, **info,
                         "held_out": "every user turn of " + ", ".join(prompts.BENCHMARKS)
                                     + " (by content_key: sha256 of the whitespace-normalised text)"})
    return path
