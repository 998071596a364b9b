"""A two-node Slurm on this host for tests: munged, slurmctld and two slurmd (n1, n2), each
started here and stopped by the pid it wrote, in a scratch folder (../shared/REFERENCE.md
section 12). Fake GPUs (gres over character devices) let jobs ask for --gpus-per-node on a
CPU box; Slurm then sets CUDA_VISIBLE_DEVICES, which the CPU stack ignores.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
FAKE_GPUS = 8  # per node
NODES = ("n1", "n2")
START_TIMEOUT = 60  # seconds until both nodes are idle


def installed() -> bool:
    return all(shutil.which(name) for name in (*DAEMONS, "mungekey", "sbatch"))


def free_ports(count: int) -> list[int]:
    """Ports free now on this host (bound, then released together so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Cluster:
    """Start with ``start()``, always end with ``stop()`` (it stops whatever started)."""

    def __init__(self, root: Path):
        self.root = root
        self.pidfiles: list[Path] = []
        self.socket_dir: Path | None = None
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *command: str, check: bool = True) -> str:
        """A Slurm client command against this cluster; its stdout."""
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr}")
        return done.stdout

    def _daemon(self, pidfile: Path, *command: str) -> None:
        """Start a daemon that forks and writes ``pidfile``; wait until it has."""
        self.pidfiles.append(pidfile)
        subprocess.run(command, env=self.env, check=True, timeout=60)
        deadline = time.monotonic() + START_TIMEOUT
        while not (pidfile.exists() and pidfile.read_text().strip()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{command[0]} wrote no {pidfile}; see its log in {self.root}")
            time.sleep(0.1)

    def start(self) -> None:
        root = self.root
        for name in ("state", "spool", "log", "run", "gpu"):
            (root / name).mkdir(parents=True, exist_ok=True)
        # munged refuses a socket whose every folder up from / others cannot enter, and
        # pytest's temporary folders are private: the socket gets a folder of its own in /tmp.
        self.socket_dir = Path(tempfile.mkdtemp(prefix="draftline-munge-"))
        self.socket_dir.chmod(0o755)
        for index in range(FAKE_GPUS):
            os.mknod(root / "gpu" / f"gpu{index}", 0o666 | 0o020000, os.makedev(1, 3))
        key, socket_path = root / "munge.key", self.socket_dir / "munge.socket"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, timeout=60)
        self._daemon(root / "run" / "munged.pid", "munged", f"--key-file={key}",
                     f"--socket={socket_path}", f"--pid-file={root / 'run' / 'munged.pid'}",
                     f"--log-file={root / 'log' / 'munged.log'}", f"--seed-file={root / 'munge.seed'}")
        controller, *node_ports = free_ports(1 + len(NODES))
        host = socket.gethostname().split(".")[0]
        lines = [
            "ClusterName=draftline-test", f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={controller}", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={socket_path}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none", "SelectType=select/cons_tres",
            # Without DefMemPerCPU each job takes a node's whole memory.
            "SelectTypeParameters=CR_Core_Memory", "DefMemPerCPU=1000", "ReturnToService=2",
            "GresTypes=gpu", "MinJobAge=3600", "KillWait=10",
            f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool'}/%n",
            f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log'}/slurmd-%n.log",
            *(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=2 "
              f"Sockets=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=8000 Gres=gpu:{FAKE_GPUS}"
              for node, port in zip(NODES, node_ports)),
            f"PartitionName=test Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        (root / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={','.join(NODES)} Name=gpu File={root / 'gpu'}/gpu[0-{FAKE_GPUS - 1}]\n")
        self._daemon(root / "run" / "slurmctld.pid", "slurmctld", "-f", str(self.conf))
        for node in NODES:
            self._daemon(root / "run" / f"slurmd-{node}.pid", "slurmd", "-f", str(self.conf), "-N", node)
        deadline = time.monotonic() + START_TIMEOUT
        while self.run("sinfo", "-h", "-o", "%t", check=False).split() != ["idle"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the nodes never became idle:\n{self.run('sinfo', check=False)}")
            time.sleep(0.5)

    def job_processes(self) -> list[int]:
        """Processes Slurm started for this cluster's jobs (their environment names its conf)."""
        found, marker = [], f"SLURM_CONF={self.conf}".encode()
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                variables = environ.read_bytes().split(b"\0")
            except (FileNotFoundError, ProcessLookupError):  # ended meanwhile
                continue
            except PermissionError:  # not ours: this cluster's jobs run as root, like us
                continue
            if marker in variables and any(v.startswith(b"SLURM_JOB_ID=") for v in variables):
                found.append(int(environ.parent.name))
        return found

    def stop(self) -> None:
        """Cancel every job, end what they left behind, then each daemon by its pid (last
        started first), the daemons even when the first part raised. Raises if a daemon does
        not end on SIGTERM."""
        try:
            if self.conf.exists():
                queued = re.findall(r"\d+", self.run("squeue", "-h", "-o", "%A", check=False))
                if queued:
                    self.run("scancel", "--full", *queued)
            for pid in self.job_processes():
                _signal(pid, signal.SIGKILL)
        finally:
            self._stop_daemons()

    def _stop_daemons(self) -> None:
        stuck = []
        for pidfile in reversed(self.pidfiles):
            if not pidfile.exists():
                continue
            pid = int(pidfile.read_text())
            _signal(pid, signal.SIGTERM)
            if not _ended(pid, 30):
                _signal(pid, signal.SIGKILL)
                stuck.append(f"{pidfile.stem} ({pid})")
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir)
        if stuck:
            raise RuntimeError(f"needed SIGKILL: {', '.join(stuck)}")


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _ended(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{pid}/stat")
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.1)
    return False
