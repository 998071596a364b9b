"""AdamW for the draft, fused where torch has a kernel for the device; torch only.

speculators' Trainer builds ``torch.optim.AdamW(params, lr=...)``, whose default on CUDA is the
``foreach`` implementation (a few kernels per parameter group and op) and on CPU a Python loop
over parameters.  torch's ``fused=True`` does a parameter's whole update in one kernel: on an
H200 at Kimi-K2.5 draft dims the unfused optimizer step took ~21 ms of a ~250 ms step.  Both
compute AdamW's float32 update; they differ only in rounding order (see
tests/test_train_optimizer.py for how far).

Kept free of speculators and vLLM so that its GPU test runs where only torch is installed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["FUSED_ADAMW_DEVICES", "adamw", "optimizer_implementation"]

# Device types with a fused AdamW kernel: CUDA, and CPU since torch 2.4 (the stacks pin 2.9.1
# for CUDA and 2.10.0 for CPU).
FUSED_ADAMW_DEVICES = ("cuda", "cpu")
IMPLEMENTATIONS = ("fused", "foreach", "for-loop")


def optimizer_implementation(device: str | torch.device, fused: bool | None = None) -> str:
    """Which AdamW kernel runs on ``device``: ``fused``, or torch's default where not fused
    (``foreach`` on CUDA, ``for-loop`` elsewhere).  ``fused=None``: fused where torch has it."""
    kind = torch.device(device).type
    if fused is None:
        fused = kind in FUSED_ADAMW_DEVICES
    if fused and kind not in FUSED_ADAMW_DEVICES:
        raise ValueError(f"fused AdamW runs on {FUSED_ADAMW_DEVICES}, not on {device}")
    if fused:
        return "fused"
    return "foreach" if kind == "cuda" else "for-loop"


def adamw(params: Iterable[torch.nn.Parameter], lr: float,
          implementation: str) -> torch.optim.AdamW:
    """AdamW (torch's defaults otherwise, as speculators' Trainer) with the kernel set
    explicitly, so the implementation a run records is the one that ran."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"AdamW implementation {implementation!r}, expected one of "
                         f"{IMPLEMENTATIONS}")
    return torch.optim.AdamW(params, lr=lr, fused=implementation == "fused",
                             foreach=implementation == "foreach")
