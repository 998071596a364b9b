"""Several processes for one stage: torchrun for training, replica children for extraction.

    make train GPUS=2                      # -> torchrun --standalone --nproc-per-node 2 -m stages.train ...
    python -m stages.train train.gpus=2    # the same: the stage re-launches itself under torchrun

``make train`` starts one Python process; with ``train.gpus > 1`` (or ``train.nodes > 1``)
and no torchrun around it, that process starts ``torch.distributed.run`` on the same module
and overrides and waits for it.  torchrun starts one process per GPU, watches them, and ends
all of them when one fails; each process prints its own traceback, which ``--tee`` passes to
the terminal prefixed with its local rank (``[default1]:``).  Nothing here schedules hosts:
across hosts, Slurm or Kubernetes starts one ``make train`` per host and torchrun's c10d
rendezvous (``train.rendezvous=HOST:PORT``) joins them.

Extraction replicas (``extract.replicas=N``) are plain child processes of the stage, one vLLM
engine each on its own devices (``split_devices``, ``split_cores``); ``supervise`` forwards
their output prefixed ``[replica r]``, and when one fails it ends the others and raises with
that child's traceback.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

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


def rank_device(requested: str, current: World = World(), setting: str = "train.device") -> str:
    """This process's device for ``requested`` (``setting`` names it in errors).

    ``auto`` is CUDA when a GPU is visible, else the CPU; ``cuda`` is this rank's own GPU,
    ``cuda:<local rank>``.  With several ranks only ``auto``, ``cuda`` or ``cpu`` are taken:
    a named GPU (``cuda:1``) would put every rank on the same one.
    """
    import torch

    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"{setting}={requested} but no CUDA GPU")
    if current.distributed and requested not in ("cuda", "cpu"):
        raise ValueError(f"{setting}={requested} with {current.world_size} ranks: each rank "
                         "uses cuda:<local rank>, so give auto, cuda or cpu")
    return f"cuda:{current.local_rank}" if requested == "cuda" else requested


def rank_tokens(tokens_per_step: int, current: World, setting: str = "max_tokens_per_step") -> int:
    """Each rank's share of a step's global token budget (``setting`` names it in errors):
    ranks pack equal shares, so the budget must divide evenly."""
    if tokens_per_step % current.world_size:
        raise ValueError(f"{setting}={tokens_per_step} must divide evenly "
                         f"among {current.world_size} processes")
    return tokens_per_step // current.world_size


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


# --------------------------------------------------------------------------- replicas

TAIL_LINES = 400  # output lines kept per child for the message that reports its failure


def split_devices(visible: Sequence[str], replicas: int, per_replica: int) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` per replica: disjoint runs of ``per_replica`` visible GPUs."""
    need = replicas * per_replica
    if replicas < 1 or per_replica < 1 or need > len(visible):
        raise ValueError(f"{replicas} replicas x {per_replica} GPUs need {need} GPUs; "
                         f"{len(visible)} visible ({','.join(visible) or 'none'})")
    return [",".join(visible[r * per_replica:(r + 1) * per_replica]) for r in range(replicas)]


def split_cores(cores: Sequence[int], replicas: int, ranks: int) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` per replica on the CPU platform: the usable cores split
    evenly over replicas x TP ranks, one replica's ranks joined by ``|`` (vLLM's format)."""
    per_rank = len(cores) // max(replicas * ranks, 1)
    if replicas < 1 or ranks < 1 or per_rank < 1:
        raise ValueError(f"{replicas} replicas x TP {ranks} need {replicas * ranks} CPU cores; "
                         f"{len(cores)} usable")
    binds = []
    for replica in range(replicas):
        groups = []
        for rank in range(ranks):
            start = (replica * ranks + rank) * per_rank
            groups.append(",".join(str(core) for core in cores[start:start + per_rank]))
        binds.append("|".join(groups))
    return binds


class ChildFailed(RuntimeError):
    """A supervised child exited non-zero; the message carries its traceback (or last lines)."""


def _failure_text(lines: Sequence[str]) -> str:
    """From the last traceback in a child's output (with the log line before it) to the end;
    the last 40 lines where there is none (a child killed by a signal prints nothing)."""
    starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    first = max(starts[-1] - 1, 0) if starts else max(len(lines) - 40, 0)
    return "".join(lines[first:])


def _exit_text(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"


def _forward(name: str, stream, tail: collections.deque) -> None:
    for line in stream:
        tail.append(line)
        sys.stderr.write(f"[{name}] {line}")
    sys.stderr.flush()


def _end(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the child's process group (its engine's workers too), SIGKILL after grace_s."""
    if process.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def supervise(command: Sequence[str], envs: Mapping[str, Mapping[str, str]],
              poll: Callable[[], None] = lambda: None, poll_s: float = 2.0) -> None:
    """Run ``command`` once per name in ``envs`` (that child's extra environment) and wait.

    Each child leads its own process group, so ending it ends whatever it started (vLLM's
    workers). Output is forwarded prefixed ``[name]``; ``poll`` runs every ``poll_s`` seconds
    (progress). When a child fails the others are ended and ``ChildFailed`` carries its
    traceback; an exception or SIGTERM in this process ends every child too.
    """
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    children: dict[str, tuple[subprocess.Popen, collections.deque, threading.Thread]] = {}
    try:
        for name, env in envs.items():
            process = subprocess.Popen(list(command), env={**os.environ, **env}, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       start_new_session=True, errors="replace")
            tail = collections.deque(maxlen=TAIL_LINES)
            reader = threading.Thread(target=_forward, args=(name, process.stdout, tail), daemon=True)
            reader.start()
            children[name] = (process, tail, reader)
        while True:
            codes = {name: child[0].poll() for name, child in children.items()}
            failed = [name for name, code in codes.items() if code not in (None, 0)]
            if failed:
                name = failed[0]
                process, tail, reader = children[name]
                reader.join(timeout=10)
                env = " ".join(f"{k}={v}" for k, v in envs[name].items())
                raise ChildFailed(f"{name} ({env}) {_exit_text(process.returncode)}; its output "
                                  f"ends:\n{_failure_text(list(tail))}")
            poll()
            if all(code == 0 for code in codes.values()):
                return
            time.sleep(poll_s)
    finally:
        for process, _, reader in children.values():
            _end(process)
            reader.join(timeout=10)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
