"""deploy/slurm on a real two-node Slurm (tests/slurm_cluster.py: munged, slurmctld and two
slurmd on this host, fake GPUs), submitted as a user would: `deploy/slurm/submit.sh` for the
embedded tiny experiment on the CPU stack, with the host's .venv (DRAFTLINE_RUNTIME=none).

The chain regenerates, extracts as a 2-task array and trains on two nodes (one `make train`
per node, joined by torchrun's c10d rendezvous, gloo). Against one plain checkout on one host
(`make extract`, `make train GPUS=2`): the shards are byte-identical and the two-node draft
matches. A cancelled slice resubmitted alone resumes; a failing job shows its traceback in its
output file and cancels the jobs after it.

Skips without Slurm; .ci/run installs it and sets DRAFTLINE_REQUIRE_SLURM=1, which turns the
skip into a failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftline.pipeline import artifacts
import slurm_cluster
from conftest import REPO, copy_repo
from helpers import run_make
from test_scale import DRAFT_ATOL, max_draft_difference

pytestmark = [pytest.mark.long, pytest.mark.vllm]

# Small enough for a few minutes on 2 cores; shards of 512 tokens give each slice several, so
# a slice cancelled after its first shard still has some to resume. One torch thread per
# process: the two "nodes" share this host's two cores.
OVERRIDES = ("data.max_bytes=20000 extract.shard_tokens=512 extract.token_budget=512 "
             "train.steps=20 numerics.torch_threads=1")
SLICES = 2
JOB_TIMEOUT = 900  # seconds for a chain on a busy 2-core box (each slice starts an engine)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not slurm_cluster.installed():
        if os.environ.get("DRAFTLINE_REQUIRE_SLURM") == "1":
            raise RuntimeError("DRAFTLINE_REQUIRE_SLURM=1 but Slurm is not installed "
                               "(apt-get install slurm-wlm munge)")
        pytest.skip("Slurm is not installed (apt-get install slurm-wlm munge)")
    running = slurm_cluster.Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        running.start()
        print("\n$ sinfo\n" + running.run("sinfo"))
        yield running
    finally:
        running.stop()


def checkout(tmp_path: Path) -> Path:
    """A copy of the repository with what `make setup` made here (.venv, .tools where uv is
    not on PATH), as a user's checkout after `make setup`."""
    repo = copy_repo(tmp_path)
    (repo / ".venv").symlink_to(Path(sys.prefix))
    if (REPO / ".tools").exists():
        (repo / ".tools").symlink_to(REPO / ".tools")
    # Else the first `make` in the copy (two jobs at once) would re-sync the project's .venv.
    stale = subprocess.run(["make", "-q", "setup"], cwd=repo, capture_output=True, text=True)
    if stale.returncode:
        raise RuntimeError(f"{sys.prefix} is not set up from this checkout's lock: run `make setup`")
    return repo


def submit(cluster: slurm_cluster.Cluster, repo: Path, *args: str, overrides: str = OVERRIDES) -> dict[str, str]:
    """deploy/slurm/submit.sh from the checkout; the job id of each step it submitted."""
    env = {**cluster.env, "EXP": "tiny", "DRAFTLINE_RUNTIME": "none", "DRAFTLINE_STACK": "cpu",
           "SLICES": str(SLICES), "NODES": "2", "OVERRIDES": overrides,
           "RENDEZVOUS_PORT": str(slurm_cluster.free_ports(1)[0])}
    done = subprocess.run(["deploy/slurm/submit.sh", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"$ deploy/slurm/submit.sh {' '.join(args)}\n{done.stdout}", end="")
    jobs = dict(re.findall(r"^(\w+): job (\d+)", done.stdout, flags=re.M))
    print(cluster.run("squeue", "-h", "-o", "  %i %j %E", "-j", ",".join(jobs.values())), end="")
    return jobs


def job_records(cluster: slurm_cluster.Cluster, job: str) -> dict[str, dict[str, str]]:
    """`scontrol show job` of a job (each array task apart), keyed by job name and task."""
    records = {}
    for line in cluster.run("scontrol", "show", "job", "-o", job).splitlines():
        fields = dict(re.findall(r"(\S+?)=(\S*)", line))
        task = fields.get("ArrayTaskId")
        job_id = f"{fields['ArrayJobId']}_{task}" if task else fields["JobId"]
        records[f"{fields['JobName']}{'_' + task if task else ''} {job_id}"] = fields
    return records


def seconds(run_time: str) -> int:
    days, _, clock = run_time.rpartition("-")
    h, m, s = map(int, clock.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def submission_order(record: tuple[str, dict]) -> tuple[int, str]:
    """Jobs in the order submitted; an array's tasks (or its pending range, "0-1") in turn."""
    fields = record[1]
    return int(fields.get("ArrayJobId", fields["JobId"])), fields.get("ArrayTaskId", "")


def settle(cluster: slurm_cluster.Cluster, jobs: dict[str, str], timeout_s: float = JOB_TIMEOUT) -> dict[str, dict]:
    """Wait until no job of ``jobs`` is pending or running; print and return their records."""
    ids = ",".join(jobs.values())
    deadline = time.monotonic() + timeout_s
    while cluster.run("squeue", "-h", "-j", ids, check=False).strip():
        if time.monotonic() > deadline:
            raise AssertionError("jobs still queued:\n" + cluster.run("squeue", "-j", ids, "-o", "%i %j %T %M %r"))
        time.sleep(2)
    records = {}
    for job in jobs.values():
        records |= job_records(cluster, job)
    for name, fields in sorted(records.items(), key=submission_order):
        print(f"  {name}: {fields['JobState']} ({fields['Reason']}), exit {fields['ExitCode']}, "
              f"{seconds(fields['RunTime'])} s")
    return records


def state_of(records: dict[str, dict], name: str) -> str:
    (state,) = [f["JobState"] for n, f in records.items() if n.split()[0] == name]
    return state


def shard_files(repo: Path) -> dict[str, str]:
    return {p.name: artifacts.sha256_file(p) for p in sorted((repo / "runs/tiny/extract").glob("shard-*.safetensors"))}


def test_a_failing_job_shows_its_traceback_and_cancels_the_jobs_after_it(cluster, tmp_path):
    """A config no tokenizer takes (tokenize.seq_length=0): the regenerate job fails with the
    stage's traceback in its output file; extract and train are cancelled, not left pending."""
    repo = checkout(tmp_path)
    jobs = submit(cluster, repo, overrides=f"{OVERRIDES} tokenize.seq_length=0")
    records = settle(cluster, jobs, timeout_s=240)  # regenerate fails within a minute
    assert state_of(records, "draftline-regenerate") == "FAILED"
    for name in ("draftline-extract", "draftline-train"):
        (fields,) = [f for n, f in records.items() if n.startswith(name)]
        assert fields["JobState"] == "CANCELLED" and fields["Reason"] == "DependencyNeverSatisfied", fields
    output = (repo / f"draftline-regenerate-{jobs['regenerate']}.out").read_text()
    assert "Traceback (most recent call last)" in output, output[-3000:]
    assert "ValueError: tokenize.seq_length must be >= 1, got 0" in output, output[-3000:]
    assert cluster.job_processes() == []


def test_submit_runs_the_tiny_pipeline_on_two_nodes_like_one_host(cluster, tmp_path):
    """regenerate -> extract (2 tasks; task 1 cancelled after its first shard, so train is
    cancelled too) -> `submit.sh extract 1` (resumes: its first shard untouched) -> train on
    two nodes. Then one host: `make extract`, `make train GPUS=2`. Shards byte-identical,
    drafts within DRAFT_ATOL."""
    repo = checkout(tmp_path / "slurm")
    started = time.monotonic()
    jobs = submit(cluster, repo)
    extract_dir = repo / "runs/tiny/extract"
    first = extract_dir / "shard-00001.safetensors"  # slice 1's first shard
    deadline = time.monotonic() + JOB_TIMEOUT
    while not first.exists():
        assert time.monotonic() < deadline, "slice 1 wrote no shard"
        time.sleep(0.05)
    cluster.run("scancel", f"{jobs['extract']}_1")
    records = settle(cluster, jobs)
    # scancel returns before the task dies, and a tiny slice writes its shards within
    # milliseconds: the task may finish any number of them first (CI: 2 seen at the cancel, 4
    # at the resume; here once all 6). So once Slurm reports it cancelled, all but the first
    # are removed, standing for what a cancel that lands early loses.
    written = sorted(p for p in extract_dir.glob("shard-*.safetensors") if int(p.name[6:11]) % SLICES == 1)
    for lost in written[1:]:
        lost.unlink()
    kept = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in written[:1]}
    print(f"cancelled {jobs['extract']}_1 after it wrote {len(written)} shard(s) of slice 1; "
          f"kept {sorted(kept)}")
    assert state_of(records, "draftline-regenerate") == "COMPLETED"
    assert state_of(records, "draftline-extract_0") == "COMPLETED"
    assert state_of(records, "draftline-extract_1") == "CANCELLED"
    assert state_of(records, "draftline-train") == "CANCELLED"  # DependencyNeverSatisfied

    again = submit(cluster, repo, "extract", "1")
    records = settle(cluster, again)
    assert {f["JobState"] for f in records.values()} == {"COMPLETED"}, records
    assert {f["ExitCode"] for f in records.values()} == {"0:0"}, records
    resumed = (repo / f"draftline-extract-{again['extract']}-1.out").read_text()
    planned = re.search(r"(\d+) shards planned here, (\d+) to extract", resumed)
    print(f"resubmitted slice 1: {planned[0]}; chain {time.monotonic() - started:.0f} s")
    assert int(planned[2]) == int(planned[1]) - len(kept) > 0, planned[0]
    assert kept == {
        n: ((extract_dir / n).stat().st_ino, (extract_dir / n).stat().st_mtime_ns) for n in kept}
    train_output = (repo / f"draftline-train-{again['train']}.out").read_text()
    assert "--nnodes 2 --rdzv-backend c10d" in train_output and "Rank 1 is connected to 1 peer" in train_output
    assert cluster.job_processes() == []

    reference = checkout(tmp_path / "one-host")
    started = time.monotonic()
    for goal in (["extract"], ["train", "GPUS=2"]):
        run_make(*goal, "EXP=tiny", f"OVERRIDES={OVERRIDES}", cwd=reference, timeout=JOB_TIMEOUT, expect=0)
    print(f"one host: make extract, make train GPUS=2: {time.monotonic() - started:.0f} s")

    ours, theirs = shard_files(repo), shard_files(reference)
    print("shards, two slices on Slurm | one `make extract`:")
    for name in sorted(ours | theirs):
        print(f"  {name} {ours.get(name, '-')[:16]} | {theirs.get(name, '-')[:16]}")
    assert ours == theirs and len(ours) >= 2 * SLICES

    difference = max_draft_difference(repo / "runs/tiny", reference / "runs/tiny")
    print(f"draft, 2 nodes x 1 process against 1 node x 2 processes: max |difference| "
          f"{difference:.3g} (tolerance {DRAFT_ATOL:g})")
    assert difference <= DRAFT_ATOL
