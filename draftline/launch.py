"""Several processes for one stage: torchrun for training, one process group per run.

    make train GPUS=2                      # -> torchrun --standalone --nproc-per-node 2 -m stages.train ...
    python -m stages.train train.gpus=2    # the same: the stage re-launches itself under torchrun

``make train`` starts one Python process; with ``train.gpus > 1`` (or ``train.nodes > 1``)
and no torchrun around it, that process starts ``torch.distributed.run`` on the same module
and overrides and waits for it.  torchrun starts one process per GPU, watches them, and ends
all of them when one fails; each process prints its own traceback, which ``--tee`` passes to
the terminal prefixed with its local rank (``[default1]:``).  Nothing here schedules hosts:
across hosts, Slurm or Kubernetes starts one ``make train`` per host and torchrun's c10d
rendezvous (``train.rendezvous=HOST:PORT``) joins them.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import subprocess
import sys
from collections.abc import Sequence

log = logging.getLogger(__name__)

# NVLink multicast (NVLS) off in NCCL, PyTorch's symmetric memory and NVSHMEM: on shared
# multi-GPU hosts a program that uses it can take the host's GPUs out of service.  Forced,
# not defaulted, in every process this launcher starts.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


@dataclasses.dataclass(frozen=True)
class World:
    """This process's place among the training processes (torchrun's environment)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world() -> World:
    """From torchrun's RANK / WORLD_SIZE / LOCAL_RANK; a plain process is rank 0 of 1."""
    env = os.environ
    return World(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)),
                 int(env.get("LOCAL_RANK", 0)))


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def torchrun_command(module: str, args: Sequence[str], procs_per_node: int, nodes: int = 1,
                     rendezvous: str | None = None, run_id: str = "draftline") -> list[str]:
    """``python -m torch.distributed.run ... -m module args``: one host or a c10d rendezvous."""
    if procs_per_node < 1 or nodes < 1:
        raise ValueError(f"need at least one process and one node, got {procs_per_node} "
                         f"per node on {nodes} nodes")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(procs_per_node), "--tee", "3"]
    if nodes == 1 and rendezvous is None:
        command.append("--standalone")
    else:
        if rendezvous is None:
            raise ValueError(f"train.nodes={nodes} needs train.rendezvous=HOST:PORT "
                             "(the first node's address, reachable from every node)")
        command += ["--nnodes", str(nodes), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", rendezvous, "--rdzv-id", run_id]
    return [*command, "-m", module, *args]


def relaunch(module: str, args: Sequence[str], procs_per_node: int, nodes: int = 1,
             rendezvous: str | None = None, run_id: str = "draftline") -> int:
    """Run ``module`` under torchrun with NVLink multicast off; return torchrun's exit code."""
    command = torchrun_command(module, args, procs_per_node, nodes, rendezvous, run_id)
    log.info("launching %d processes per node on %d node(s): %s", procs_per_node, nodes,
             " ".join(command))
    return subprocess.run(command, env={**os.environ, **NO_MULTICAST}, check=False).returncode


def init_process_group(device: str, timeout_s: float) -> None:
    """NCCL on CUDA, gloo on CPU; collectives fail after ``timeout_s`` instead of hanging."""
    import torch
    import torch.distributed as dist

    os.environ.update(NO_MULTICAST)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=torch.device(device) if backend == "nccl" else None)


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def quiet_other_ranks(current: World) -> None:
    """Progress from rank 0 only; other ranks still log warnings and their tracebacks."""
    if not current.is_main:
        logging.getLogger("draftline").setLevel(logging.WARNING)
