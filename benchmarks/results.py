"""A run's figures as docs/results.md shows them: the benchmark table and the seconds per stage.

    python -m benchmarks.results --exp smollm2 [--run-dir runs/smollm2]

Reads only the run's manifests and ``evaluate/results.json`` and prints Markdown: per standard
benchmark the run's draft, every compared draft (``evaluate.compare``) and the baselines, with
tau, its CI, acceptance by position and the speed-up; then each stage's wall seconds and the
machine it ran on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

STAGES = ("tokenize", "regenerate", "extract", "prepare", "train", "evaluate", "report")


def _ci(values: list[float]) -> str:
    return f"[{values[0]:.3f}, {values[1]:.3f}]"


def _row(benchmark: str, label: str, found: dict, speedup: str) -> str:
    return (f"| {benchmark} | {label} | {found['tau']:.3f} | {_ci(found['tau_ci'])} | "
            f"{' / '.join(f'{a:.3f}' for a in found['acceptance'])} | {speedup} |")


def benchmark_table(results: dict) -> list[str]:
    standard = results.get("benchmarks")
    if not standard:
        return ["(no standard benchmarks in this run: evaluate.benchmarks.names is empty)"]
    lines = ["| benchmark | draft | τ (vLLM) | 95% CI | acceptance p1 / p2 / p3 | speed-up (tok/s with / without) |",
             "|---|---|---|---|---|---|"]
    compared = results.get("compared") or {}
    for name, found in standard["per_benchmark"].items():
        drafts = [("draftline", found)] + [
            (label, other["benchmarks"]["per_benchmark"][name]) for label, other in compared.items()
            if other.get("benchmarks")]
        for label, r in drafts:
            s = r.get("speedup")
            lines.append(_row(name, label, r["vllm"], f"{s['ratio']:.2f}x ({s['with_draft_tokens_per_s']:.0f} / "
                              f"{s['plain_tokens_per_s']:.0f})" if s else "-"))
        for baseline, b in found["baselines"].items():
            lines.append(_row(name, f"{baseline} (offline, same replies)", b, "-"))
    return lines


def heldout_table(results: dict) -> list[str]:
    lines = ["| draft | held-out τ (offline) | 95% CI | in vLLM (same replies) | agrees |", "|---|---|---|---|---|"]
    measured = results.get("in_vllm") or {}
    for name, r in results["offline"].items():
        live = (f"{measured['vllm']['tau']:.3f} {_ci(measured['vllm']['tau_ci'])}"
                if name == "eagle3" and measured else "-")
        agrees = str(measured.get("agrees")) if name == "eagle3" and measured else "-"
        lines.append(f"| {name} | {r['tau']:.3f} | {_ci(r['tau_ci'])} | {live} | {agrees} |")
    for label, other in (results.get("compared") or {}).items():
        r = other["offline"]
        lines.append(f"| {label} | {r['tau']:.3f} | {_ci(r['tau_ci'])} | - | - |")
    return lines


def seconds_table(run_dir: Path) -> list[str]:
    lines = ["| stage | wall s | cores | git |", "|---|---|---|---|"]
    for stage in STAGES:
        path = run_dir / stage / "manifest.json"
        if not path.exists():
            continue
        manifest = json.loads(path.read_text())
        provenance = manifest.get("provenance", {})
        cpus = provenance.get("numerics", {}).get("cpu", {}).get("usable_cpus", "?")
        lines.append(f"| {stage} | {manifest.get('wall_seconds', '?')} | {cpus} | {provenance.get('git', '?')[:7]} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exp", required=True)
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()
    run_dir = Path(args.run_dir or f"runs/{args.exp}")
    results = json.loads((run_dir / "evaluate/results.json").read_text())
    print("\n".join(benchmark_table(results) + [""] + heldout_table(results) + [""] + seconds_table(run_dir)))


if __name__ == "__main__":
    main()
