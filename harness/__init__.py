"""Harnesses the tests and benchmarks share, not the product: the engine's other branches on
vLLM's CPU engine (``python -m harness.branches``), a hook that reads the aux hidden states a
served target hands its draft, and a tiny EAGLE-3 draft overfit to a target's own replies."""

# As in stages/ and benchmarks/: torch's CUDA checks ask NVML, so an engine started here may
# fork its workers (stages/__init__.py says why).
from draftline.pipeline.cuda import fork_safe_cuda_checks

fork_safe_cuda_checks()
