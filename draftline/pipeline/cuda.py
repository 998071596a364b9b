"""CUDA queries that leave a process safe to fork (see stages/__init__.py for why).

Standard library only: it must run before torch is asked anything, and costs nothing on CPU.
"""

from __future__ import annotations

import os

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"  # torch reads it at each is_available() call


def fork_safe_cuda_checks() -> None:
    """Make ``torch.cuda.is_available()``/``device_count()`` ask NVML, creating no CUDA
    context, so a vLLM engine started later may fork its workers."""
    os.environ[NVML_CHECK] = "1"
