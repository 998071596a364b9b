"""Stage entry points, one per Make target (`python -m stages.<stage>`).

Importing the package (which every `python -m stages.<stage>` does before the stage's own code)
makes torch's CUDA checks ask NVML: ``torch.cuda.is_available()`` and ``device_count()`` then
create no CUDA context in this process. vLLM 0.16 forks its GPU workers unless CUDA is already
initialized here (``_maybe_force_spawn`` reads ``torch.cuda.is_initialized()``, which a plain
query leaves False), and a child forked after a query that did create a context cannot use CUDA
("Cannot re-initialize CUDA in forked subprocess"). ``import vllm`` sets the same variable
(vllm/env_override.py), but extract's preflight asks torch about GPUs before speculators imports
vLLM. Keep it for as long as any stage queries CUDA before a vLLM engine starts its workers.
"""

from draftline.pipeline.cuda import fork_safe_cuda_checks

fork_safe_cuda_checks()
