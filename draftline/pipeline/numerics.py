"""What decides a run's numbers on this machine: set it from config, and record it.

``apply`` runs before a stage's work (stage.run_stage, cli.trained_target): torch's intra-op
thread count from ``numerics.torch_threads`` (a CPU reduction splits by thread, so another count
sums in another order), and deterministic algorithms. ``describe`` is what every manifest records:
the interpreter, the thread counts, the CPU model and its vector ISA flags (oneDNN and MKL pick
kernels by ISA), the GPU, its driver and the CUDA and cuDNN versions.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

# ISA flags that change which CPU kernels oneDNN/MKL/torch dispatch to (from /proc/cpuinfo).
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
             "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")
# cuBLAS is deterministic only with a fixed workspace; must be set before CUDA starts.
CUBLAS_WORKSPACE = ":4096:8"


def apply(torch_threads: int | None, deterministic: bool) -> dict:
    """Set torch's threads and determinism for this process; return what is in force."""
    import torch

    if torch_threads is not None:
        if int(torch_threads) < 1:
            raise ValueError(f"numerics.torch_threads must be >= 1 or null, got {torch_threads}")
        torch.set_num_threads(int(torch_threads))
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        # warn_only: an op without a deterministic kernel warns (in the log) instead of
        # stopping a GPU run; CPU stages have none on their path.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    return {"torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "requested_torch_threads": torch_threads}


def cpu() -> dict:
    """CPU model, logical CPUs this process may use, and the ISA flags above that it has."""
    model, flags = platform.processor() or "unknown", set()
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("unknown", platform.processor()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return {"model": model, "machine": platform.machine(), "usable_cpus": len(os.sched_getaffinity(0)),
            "isa": [flag for flag in ISA_FLAGS if flag in flags]}


def gpu() -> dict | None:
    """GPU names, driver, CUDA (torch's build) and cuDNN versions; None without a CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    driver = None
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True)
        driver = query.stdout.split("\n")[0].strip() if query.returncode == 0 else None
    return {"names": names, "driver": driver, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version()}


def describe(applied: dict | None = None) -> dict:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__,
            **(applied or {"torch_threads": torch.get_num_threads(),
                           "deterministic": torch.are_deterministic_algorithms_enabled()}),
            "cpu": cpu(), "gpu": gpu()}
