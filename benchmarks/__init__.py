"""Benchmarks that print numbers (`python -m benchmarks.<name>`).

Like stages/, importing the package makes torch's CUDA checks ask NVML, so a benchmark that asks
about GPUs and then starts a vLLM engine leaves it free to fork its workers (stages/__init__.py).
"""

from draftline.pipeline.cuda import fork_safe_cuda_checks

fork_safe_cuda_checks()
