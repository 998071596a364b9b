"""No CUDA driver initialization before a vLLM engine forks its workers (stages/__init__.py).

On a CPU torch ``is_available()`` starts nothing, so a plain test cannot fail: the default-tier
test spies on every torch.cuda call an entry point makes and checks the NVML-based check was on
by then. The gpu test reproduces the fork failure on a CUDA host, with the old order and the fix.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

ENTRY_POINTS = sorted(f"{p.parent.name}.{p.stem}" for folder in ("stages", "benchmarks", "harness")
                      for p in (REPO / folder).glob("*.py") if p.stem != "__init__")
SPY = """
import json, os, sys
os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
import torch
seen = []
def spy(name, real):
    def call(*args, **kwargs):
        seen.append([name, os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")])
        return real(*args, **kwargs)
    return call
for name in ("is_available", "device_count", "get_device_name", "get_device_properties",
             "current_device", "set_device", "init", "mem_get_info"):
    setattr(torch.cuda, name, spy(name, getattr(torch.cuda, name)))
import importlib
module = importlib.import_module(sys.argv[1])
seen.append(["imported", os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")])
if sys.argv[1] == "stages.extract":  # the preflight that asks before speculators imports vLLM
    from draftline.extract import preflight, run
    preflight.check_devices(1)
    run.replica_environments(1, 1)
print(json.dumps(seen))
"""


def test_every_entry_point_is_one_of_the_known():
    assert {"stages.extract", "stages.regenerate", "stages.evaluate", "stages.serve",
            "benchmarks.extract", "benchmarks.serve", "benchmarks.train"} <= set(ENTRY_POINTS)


# The stages in the default tier, the benchmarks and harnesses (5-20 s each) in the long one.
@pytest.mark.parametrize("entry", [e if e.startswith("stages.") else pytest.param(e, marks=pytest.mark.long)
                                   for e in ENTRY_POINTS])
def test_cuda_is_asked_only_through_nvml_from_every_entry_point(entry):
    result = subprocess.run([sys.executable, "-c", SPY, entry], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    if entry == "stages.extract":
        assert {"is_available", "device_count"} & {name for name, _ in seen}, seen  # the spy saw them
    assert all(value == "1" for _, value in seen), seen


def test_the_extract_preflight_asks_cuda_only_through_nvml_whoever_imports_it():
    """draftline issue 44, item 8: the gpu tier's `extract` probe imports the preflight
    without the stage boundary (stages/__init__.py), so its own CUDA questions must be
    fork-safe; they once asked torch directly, which poisons the fork of vLLM's workers."""
    probe = SPY.replace("module = importlib.import_module(sys.argv[1])", "module = None").replace(
        'if sys.argv[1] == "stages.extract":', "if True:")
    probe = probe.replace("    run.replica_environments(1, 1)\n", "    preflight.check_host_memory("
                          "__import__('draftline.pipeline.config', fromlist=['compose']).compose([]), 64, 1)\n")
    result = subprocess.run([sys.executable, "-c", probe, "-"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"is_available", "device_count"} & {name for name, _ in seen}, seen
    assert all(value == "1" for name, value in seen if name != "imported"), seen


GPU_PROBE = """
import os, sys
if sys.argv[1] == "fixed":
    import stages  # the stage boundary: what every `python -m stages.<stage>` imports first
import torch
if sys.argv[1] == "extract":
    from draftline.extract.preflight import check_devices
    check_devices(1)  # extract's own preflight, before speculators imports vLLM
else:
    assert torch.cuda.is_available() and torch.cuda.device_count() >= 1
pid = os.fork()
if pid == 0:
    try:
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        print("child: CUDA works", flush=True)
        os._exit(0)
    except Exception as error:
        print(f"child: {type(error).__name__}: {error}", flush=True)
        os._exit(3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("order, code", [("old", 3), ("fixed", 0), ("extract", 0)])
def test_a_child_forked_after_the_device_check_can_use_cuda(order, code):
    if order == "extract":
        pytest.importorskip("hydra")
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    result = subprocess.run([sys.executable, "-c", GPU_PROBE, order], cwd=REPO, capture_output=True,
                            text=True, env=env, timeout=120)
    print(f"{order}: exit {result.returncode}: {result.stdout.strip()}")
    assert result.returncode == code, result.stdout + result.stderr
    if order == "old":
        assert "Cannot re-initialize CUDA in forked subprocess" in result.stdout
