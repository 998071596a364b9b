"""`make help`: every target, every variable with its default, the experiments; plain text
into a pipe."""

import os
import re

from conftest import REPO
from helpers import run_make


def test_help_lists_every_variable_with_its_default_and_every_experiment_without_colour():
    out = run_make("help", expect=0).stdout
    assert "\033" not in out  # a pipe gets no colour codes
    variables = re.findall(r"^([A-Z_]+) \?= ?([^#\n]*)", (REPO / "Makefile").read_text(), flags=re.M)
    assert {"EXP", "OVERRIDES", "GPUS", "SHARD", "STACK", "FROM", "FORCE"} <= {n for n, _ in variables}
    for name, default in variables:
        # A default that is a Make expression shows its value here instead (STACK, PYTHON).
        shown = default.strip() if "$(" not in default else r"\S+ here"
        assert re.search(rf"^  {name} +.*\[{shown if '$(' in default else re.escape(shown)}\]$", out,
                         flags=re.M), name
    assert re.search(r"^  STACK +.*\[(cpu|gpu) here\]$", out, flags=re.M)
    assert re.search(r"^  PYTHON +.*\[python3\.1[12] here\]$", out, flags=re.M)
    experiments = sorted(p.stem for p in (REPO / "conf/experiment").glob("*.yaml"))
    line = next(line for line in out.splitlines() if line.startswith("Experiments"))
    assert sorted(line.split(": ", 1)[1].split()) == experiments
    for target in ("tokenize", "extract", "train", "rehearse", "smoke", "status"):
        assert re.search(rf"^  {target} +\S", out, flags=re.M), target


def test_a_venv_set_up_for_gpu_stays_gpu_and_asking_for_cpu_is_refused(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".setup-gpu").touch()
    os.utime(venv / ".setup-gpu", (0, 0))  # older than the locks: setup would sync one
    kept = run_make("-n", "setup", f"VENV={venv}", expect=0)
    assert "requirements/gpu.lock" in kept.stdout and "requirements/cpu.lock" not in kept.stdout
    refused = run_make("-n", "setup", f"VENV={venv}", "STACK=cpu")
    assert refused.returncode == 2 and "requirements/cpu.lock" not in refused.stdout
    assert f"{venv} is set up for the gpu stack" in refused.stderr
    assert "`make clean` then `make setup STACK=cpu`" in refused.stderr
    (venv / ".setup-gpu").unlink()  # a fresh or CPU venv: the CPU lock, as before
    assert "requirements/cpu.lock" in run_make("-n", "setup", f"VENV={venv}").stdout
