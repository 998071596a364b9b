"""Mutation score of the modules that carry the project's claims (mutmut, configured in
pyproject.toml's [tool.mutmut]).

    make mutation                         # fresh run over every listed module, then the table
    python -m benchmarks.mutation report  # the table of the last run (mutants/ kept)

mutmut copies the package to mutants/, changes one operator, constant or call at a time and
runs the fast tests that reach the changed function. A mutant is *killed* when a test fails,
*survived* when every test passed, *no tests* when no selected test calls the function (the
engine paths, covered by the vLLM tier instead). Survivors are either killed by a new test or
listed in tests/assets/mutation_equivalent.json with why no test can tell them apart; the report
names every survivor that is neither.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import typer

REPO = Path(__file__).resolve().parents[1]
MUTANTS = REPO / "mutants"
EQUIVALENT = REPO / "tests/assets/mutation_equivalent.json"
OUT = REPO / "runs/_mutation"
STATUSES = ("killed", "survived", "no tests", "timeout", "suspicious", "segfault", "not checked")

app = typer.Typer(add_completion=False, help=__doc__)


def statuses() -> dict[str, str]:
    """mutant name -> status, read from mutmut's per-file records under mutants/."""
    from mutmut.stats import status_by_exit_code

    found = {}
    for meta in sorted(MUTANTS.rglob("*.py.meta")):
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            found[name] = status_by_exit_code[code]
    if not found:
        raise RuntimeError(f"no mutmut results under {MUTANTS}: run `make mutation` first")
    return found


def module_of(mutant: str) -> str:
    """draftline.tokenize.vocab.x_coverage__mutmut_3 -> draftline/tokenize/vocab.py"""
    return mutant.rsplit(".", 1)[0].replace(".", "/") + ".py"


def show(mutant: str) -> str:
    """The mutant's diff against the original function (what `mutmut show` prints)."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    os.chdir(REPO)  # mutmut resolves mutants/ and its config from the working directory
    return get_diff_for_mutant(mutant)


def summarize(found: dict[str, str]) -> dict:
    equivalent = json.loads(EQUIVALENT.read_text()) if EQUIVALENT.exists() else {}
    modules: dict[str, Counter] = {}
    for name, status in found.items():
        modules.setdefault(module_of(name), Counter())[status] += 1
    survivors = sorted(n for n, s in found.items() if s == "survived")
    table = {}
    for module, counts in sorted(modules.items()):
        tested = counts["killed"] + counts["survived"] + counts["timeout"]
        table[module] = {**{s: counts[s] for s in STATUSES if counts[s]}, "total": sum(counts.values()),
                         "score": round((counts["killed"] + counts["timeout"]) / tested, 4) if tested else None}
    return {"modules": table, "survivors": survivors,
            "explained": {n: equivalent[n] for n in survivors if n in equivalent},
            "unexplained": [n for n in survivors if n not in equivalent],
            "stale_explanations": sorted(set(equivalent) - set(survivors))}


def print_table(summary: dict) -> None:
    print(f"{'module':32} {'killed':>7} {'survived':>9} {'no tests':>9} {'timeout':>8} {'total':>6} {'score':>6}")
    for module, row in summary["modules"].items():
        score = "-" if row["score"] is None else f"{row['score']:.3f}"
        print(f"{module:32} {row.get('killed', 0):7d} {row.get('survived', 0):9d} {row.get('no tests', 0):9d} "
              f"{row.get('timeout', 0):8d} {row['total']:6d} {score:>6}")
    print("score = (killed + timeout) / (killed + survived + timeout); 'no tests': no fast test calls it")
    print(f"survivors: {len(summary['survivors'])}, explained as equivalent: {len(summary['explained'])}, "
          f"unexplained: {len(summary['unexplained'])}")
    for name in summary["unexplained"]:
        print(f"  unexplained survivor: {name}")
    for name in summary["stale_explanations"]:
        print(f"  {EQUIVALENT.name} lists {name}, which no longer survives (remove it)")


def write(summary: dict, seconds: float | None) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "summary.json").write_text(json.dumps({**summary, "seconds": seconds}, indent=2) + "\n")
    with open(OUT / "survivors.diff", "w") as handle:
        for name in summary["survivors"]:
            handle.write(f"# {name}: {summary['explained'].get(name, 'UNEXPLAINED')}\n{show(name)}\n")
    print(f"written: {OUT / 'summary.json'}, {OUT / 'survivors.diff'}")


@app.command()
def run(names: list[str] = typer.Argument(None, help="mutant name globs, e.g. 'draftline.tokenize.vocab.*'"),
        workers: int = typer.Option(os.cpu_count() or 1, help="mutants tested at once"),
        fresh: bool = typer.Option(True, help="start over (remove mutants/)")) -> None:
    """Run mutmut over the configured modules, then print and write the per-module table."""
    names = names or []
    if fresh and MUTANTS.exists():
        shutil.rmtree(MUTANTS)
    start = time.monotonic()
    # mutmut forks each mutant's test run from a warm process; a fork of a process whose
    # OpenMP pool is running can hang in its first parallel region, which would count as a
    # "timeout" (a detection) without any test having failed. One thread per worker.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(workers), *names],
                   cwd=REPO, check=True, env=env)
    seconds = time.monotonic() - start
    summary = summarize(statuses())
    print(f"mutmut run: {seconds:.0f} s with {workers} workers")
    print_table(summary)
    write(summary, round(seconds, 1))


@app.command()
def report() -> None:
    """The per-module table of the last run."""
    summary = summarize(statuses())
    print_table(summary)
    write(summary, None)


if __name__ == "__main__":
    app()
