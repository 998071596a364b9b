"""`make help`: every target, every variable with its default, the experiments; plain text
into a pipe."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_help_lists_every_variable_with_its_default_and_every_experiment_without_colour():
    out = subprocess.run(["make", "--no-print-directory", "help"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert "\033" not in out  # a pipe gets no colour codes
    variables = re.findall(r"^([A-Z_]+) \?= ?([^#\n]*)", (REPO / "Makefile").read_text(), flags=re.M)
    assert {"EXP", "OVERRIDES", "GPUS", "SHARD", "STACK", "FROM", "FORCE"} <= {n for n, _ in variables}
    for name, default in variables:
        assert re.search(rf"^  {name} +.*\[{re.escape(default.strip())}\]$", out, flags=re.M), name
    experiments = sorted(p.stem for p in (REPO / "conf/experiment").glob("*.yaml"))
    line = next(line for line in out.splitlines() if line.startswith("Experiments"))
    assert sorted(line.split(": ", 1)[1].split()) == experiments
    for target in ("tokenize", "extract", "train", "rehearse", "smoke", "status"):
        assert re.search(rf"^  {target} +\S", out, flags=re.M), target
