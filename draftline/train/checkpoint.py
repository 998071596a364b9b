"""Resumable draft-training checkpoints: ``out_dir/checkpoints/step-NNNNNNNN/``.

Each holds the trainable weights (safetensors) and the optimizer in float32 -- speculators'
checkpointer stores bfloat16, which would make a resumed run drift from an uninterrupted
one -- plus the LR scheduler and ``state.json`` (step, epoch, run spec, last metrics).  A
checkpoint is written into a dot-prefixed temporary sibling and renamed into place
(``draftline.pipeline.artifacts.atomic_dir``), so a process killed mid-save never leaves a directory
that ``latest_checkpoint`` accepts.  (The rename is atomic, not fsync-durable: a power loss
right after a save is outside what this guards.)
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftline.pipeline.artifacts import atomic_dir

__all__ = ["trainable_state", "latest_checkpoint", "save_checkpoint", "resume_checkpoint"]

log = logging.getLogger(__name__)
CHECKPOINTS = "checkpoints"
STEP_DIR = re.compile(r"step-(\d{8})")
STATE = "state.json"


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters training changes (frozen verifier embeddings/head are rebuilt)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """Newest complete ``step-*`` checkpoint; temporary (dot-prefixed) dirs never match."""
    root = Path(out_dir) / CHECKPOINTS
    found = [(int(m.group(1)), p) for p in root.glob("step-*")
             if (m := STEP_DIR.fullmatch(p.name)) and (p / STATE).exists()]
    return max(found)[1] if found else None


def save_checkpoint(out_dir: Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, state: dict,
                    keep: int | None) -> Path:
    """Write ``step``'s checkpoint atomically, then drop all but the newest ``keep``."""
    path = out_dir / CHECKPOINTS / f"step-{step:08d}"
    with atomic_dir(path) as tmp:
        weights = {n: t.to("cpu", copy=True) for n, t in trainable_state(model).items()}
        save_file(weights, str(tmp / "draft.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / STATE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    _prune_checkpoints(out_dir, keep)
    return path


def _prune_checkpoints(out_dir: Path, keep: int | None) -> None:
    """Keep the newest ``keep`` (at least one, to resume from); Kimi-sized ones are GiBs."""
    if keep is None:
        return
    steps = sorted(p for p in (out_dir / CHECKPOINTS).glob("step-*") if STEP_DIR.fullmatch(p.name))
    for path in steps[: -max(keep, 1)]:
        shutil.rmtree(path)


def _remove_stale_temporaries(out_dir: Path) -> None:
    """A run killed mid-save leaves a dot-prefixed temporary; it can never be resumed from."""
    for tmp in (out_dir / CHECKPOINTS).glob(".step-*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def _load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     scheduler: torch.optim.lr_scheduler.LRScheduler, device: str) -> dict:
    weights = load_file(str(path / "draft.safetensors"), device=device)
    expected = set(trainable_state(model))
    if set(weights) != expected:
        mismatch = sorted(set(weights) ^ expected)
        raise ValueError(f"{path}: weights {mismatch} differ from the draft's parameters")
    model.load_state_dict(weights, strict=False)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device,
                                         weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    return json.loads((path / STATE).read_text())


def resume_checkpoint(out_dir: Path, spec: dict, model: torch.nn.Module,
                      optimizer: torch.optim.Optimizer,
                      scheduler: torch.optim.lr_scheduler.LRScheduler,
                      device: str) -> tuple[int, dict]:
    """Load the latest checkpoint into model/optimizer/scheduler; return (step, metrics).

    ``(0, {})`` when there is none.  A checkpoint of another run spec (other data, steps,
    lr, ...) is refused: continuing it would silently mix two schedules.
    """
    _remove_stale_temporaries(out_dir)
    path = latest_checkpoint(out_dir)
    if path is None:
        return 0, {}
    saved = json.loads((path / STATE).read_text())["spec"]
    if saved != spec:
        changed = sorted(k for k in spec.keys() | saved.keys() if spec.get(k) != saved.get(k))
        raise ValueError(f"{path} belongs to a different run (changed: {changed}); "
                         "use a fresh out_dir")
    state = _load_checkpoint(path, model, optimizer, scheduler, device)
    log.info("resumed from %s", path)
    return int(state["step"]), state["metrics"]
