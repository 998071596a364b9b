"""Training's knobs as one typed object, built once from ``cfg.train`` and passed down.

Adding a knob touches ``conf/train/*.yaml`` and :class:`TrainSettings` (its field and, where
the yaml spells it otherwise, :meth:`TrainSettings.from_config`); the loop, the session and the
benchmarks read the same object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["TrainData", "TrainSettings", "auto_or"]


def auto_or(value: Any, kind: type) -> Any:
    """``auto`` (or null) -> None, which lets training size it; else the value as ``kind``."""
    return None if value is None or str(value) == "auto" else kind(value)


@dataclasses.dataclass(frozen=True)
class TrainData:
    """What a run trains on: prepare's shards and split index, tokenize's vocabulary mapping,
    the verifier (the target) and the aux layers its hidden states were taken from."""

    shards: Sequence[str | Path]
    split_index: str | Path
    vocab_mapping: str | Path
    verifier_dir: str | Path
    aux_layer_ids: Sequence[int]


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """How to train: ``conf/train/default.yaml`` says what each knob is; ``None`` lets training
    size or pick it (``auto`` in the yaml)."""

    steps: int | None = None  # optimizer steps (give steps or epochs)
    epochs: int | None = None
    lr: float = 3e-4  # AdamW peak learning rate
    warmup_steps: int | None = None  # None: speculators' default, 1% of the steps
    ttt_steps: int = 3  # test-time-training rollout depth
    ttt_step_loss_decay: float = 1.0
    max_tokens_per_step: int = 512  # packed tokens per optimizer step, all ranks together
    seed: int = 0  # draft init and batch order
    device: str = "cpu"  # this rank's device
    num_layers: int = 1  # draft decoder layers
    method: str = "eagle3"  # eagle3 | parallel (draftline.train.parallel)
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp32
    compile: bool | None = None  # None: on CUDA only
    attention: str = "auto"  # auto: flex when compiled, dense SDPA otherwise
    fused_optimizer: bool | None = None  # None: fused AdamW where the device has it
    loader_threads: int | None = None  # PackedLoader's packing threads; None: from the CPUs
    prefetch_batches: int | None = None  # batches packed ahead; None: threads + 1
    checkpoint_every: int = 100  # steps between resumable checkpoints
    keep_checkpoints: int | None = 2  # None keeps all
    save_dtype: str = "bfloat16"  # the saved draft's dtype
    check_vllm: bool | None = None  # None: vLLM's parse of the save where vLLM is installed

    @classmethod
    def from_config(cls, train: Mapping, *, device: str, **overrides: Any) -> TrainSettings:
        """From ``cfg.train`` (the stage's resolved config), on this rank's ``device``."""
        return cls(
            steps=int(train["steps"]), lr=float(train["lr"]), ttt_steps=int(train["ttt_steps"]),
            max_tokens_per_step=int(train["max_tokens_per_step"]), seed=int(train["seed"]),
            device=device, num_layers=int(train["num_layers"]), method=str(train["method"]),
            checkpoint_every=int(train["checkpoint_every"]),
            precision=str(train.get("precision", "auto")),
            compile=auto_or(train.get("compile", "auto"), bool),
            loader_threads=auto_or(train.get("loader_threads", "auto"), int),
            prefetch_batches=auto_or(train.get("prefetch_batches", "auto"), int),
            fused_optimizer=auto_or(train.get("fused_optimizer", "auto"), bool),
            **overrides,
        )
