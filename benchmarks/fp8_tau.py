"""Acceptance held? bf16 vs fp8 hidden-state shards on the embedded run, several training seeds.

    .venv/bin/python -m benchmarks.fp8_tau                # all of it (about 1-2 h on 2 busy cores)
    .venv/bin/python -m benchmarks.fp8_tau --analyse      # only the tables, from what is on disk
    .venv/bin/python -m benchmarks.fp8_tau --seeds 0 1 2 3 --root runs/fp8-tau

What runs, in this order, each stage as `python -m stages.<stage> experiment=tiny-trained
run_dir=<root>/<dtype> extract.save_dtype=<dtype> train.seed=<s> evaluate.gate=null` (a stage
whose manifest is already there is skipped, so an interrupted run picks up where it stopped):

1. the trained tiny target (`make target`'s builder) if runs/_assets/ lacks it, and the
   embedded conversations (`make`'s assets step);
2. bf16: tokenize, regenerate, extract, prepare in <root>/bfloat16;
3. fp8: tokenize and regenerate copied from the bf16 run dir (neither reads an extract key, so
   they are the same replies, byte for byte), then extract and prepare in <root>/float8_e4m3fn;
4. per seed, bf16 then fp8: train, evaluate (its results.json kept as
   <root>/<dtype>/seed-<s>.results.json). The gate is off so that a seed below the floor
   still reports; the floor is compared here.

Then the tables: offline tau and vLLM's tau per seed and dtype, and fp8 - bf16 averaged over
the seeds with a paired percentile-bootstrap CI (``stats.mean_paired_difference``: the
held-out samples, or for vLLM the held-out replies, resampled with the same picks in every
seed and dtype), plus a t interval over the seeds' differences (it includes the seed-to-seed
spread the bootstrap does not). The bar (issue 24): |mean dtau| <= 0.03. Written to
<root>/summary.json.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from draftline.evaluate.stats import Counts, mean_paired_difference

DTYPES = ("bfloat16", "float8_e4m3fn")
EXP = "tiny-trained"
TARGET = Path("runs/_assets/tiny-trained/build.json")
BASE_STAGES = ("tokenize", "regenerate", "extract", "prepare")
SHARED_STAGES = ("tokenize", "regenerate")  # read no extract key: copied into the fp8 run
BAR = 0.03  # |mean tau difference| that counts as acceptance held
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="runs/fp8-tau", help="one run dir per dtype below it")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="train.seed values")
    parser.add_argument("--analyse", action="store_true", help="only the tables")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    return parser.parse_args()


def stage(name: str, run_dir: Path, dtype: str, seed: int) -> None:
    """One stage in the run dir of ``dtype``; skipped if its manifest is there."""
    if (run_dir / name / "manifest.json").exists():
        return
    overrides = [f"experiment={EXP}", f"run_dir={run_dir}", f"extract.save_dtype={dtype}",
                 f"train.seed={seed}", "evaluate.gate=null"]
    print(f"--- {name} {dtype} seed {seed}", flush=True)
    subprocess.run([sys.executable, "-m", f"stages.{name}", *overrides], check=True)


def run_all(root: Path, seeds: list[int]) -> None:
    if not TARGET.exists():
        subprocess.run([sys.executable, "-m", "draftline.tiny.trained", f"experiment={EXP}"],
                       check=True)
    # The embedded conversations, as `make` builds them before any stage.
    subprocess.run([sys.executable, "-m", "draftline.pipeline.status", "assets", EXP, "--"],
                   check=True)
    bf16, fp8 = (root / d for d in DTYPES)
    for name in BASE_STAGES:
        stage(name, bf16, DTYPES[0], seeds[0])
    for name in SHARED_STAGES:
        if not (fp8 / name / "manifest.json").exists():
            shutil.rmtree(fp8 / name, ignore_errors=True)
            shutil.copytree(bf16 / name, fp8 / name, symlinks=True)
    for name in BASE_STAGES[len(SHARED_STAGES):]:
        stage(name, fp8, DTYPES[1], seeds[0])
    for seed in seeds:
        for dtype in DTYPES:
            kept = root / dtype / f"seed-{seed}.results.json"
            if kept.exists():
                continue
            for name in ("train", "evaluate"):
                (root / dtype / name / "manifest.json").unlink(missing_ok=True)
                stage(name, root / dtype, dtype, seed)
            shutil.copyfile(root / dtype / "evaluate" / "results.json", kept)


def counts(rows: list[list[int]]) -> Counts:
    return Counts(torch.tensor(rows, dtype=torch.long))


def t_interval(values: list[float]) -> list[float] | None:
    """95% t interval of the mean (None for one value)."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = T_975.get(n - 1, 1.96) * sd / math.sqrt(n)
    return [mean - half, mean + half]


def analyse(root: Path, seeds: list[int], resamples: int) -> dict:
    results = {(d, s): json.loads((root / d / f"seed-{s}.results.json").read_text())
               for d in DTYPES for s in seeds if (root / d / f"seed-{s}.results.json").exists()}
    seeds = [s for s in seeds if all((d, s) in results for d in DTYPES)]
    if not seeds:
        raise SystemExit(f"no seed has results for both dtypes under {root}")
    rows, pairs = [], {"offline": [], "vllm": []}
    for seed in seeds:
        for dtype in DTYPES:
            r = results[(dtype, seed)]
            off, live = r["offline"]["eagle3"], r["in_vllm"]["vllm"]
            rows.append({"seed": seed, "dtype": dtype, "offline_tau": off["tau"],
                         "offline_ci": off["tau_ci"], "vllm_tau": live["tau"],
                         "vllm_ci": live["tau_ci"], "vllm_agrees": r["in_vllm"]["agrees"],
                         "text_mismatches": r["in_vllm"]["text_mismatches"]})
        bf16, fp8 = results[(DTYPES[0], seed)], results[(DTYPES[1], seed)]
        pairs["offline"].append((counts(fp8["offline"]["eagle3"]["counts_per_sample"]),
                                 counts(bf16["offline"]["eagle3"]["counts_per_sample"])))
        pairs["vllm"].append((counts(fp8["in_vllm"]["counts_per_reply"]),
                              counts(bf16["in_vllm"]["counts_per_reply"])))
    differences = {}
    for what, paired in pairs.items():
        d = mean_paired_difference(paired, "tau", resamples, 0.95, seed=0)
        d["t_interval_over_seeds"] = t_interval(d["per_run"])
        d["held"] = abs(d["difference"]) <= BAR
        differences[what] = d
    gate = json.loads(Path("tests/assets/tau_gate.json").read_text())[EXP]["tau_min"]
    summary = {"seeds": seeds, "bar": BAR, "gate_tau_min": gate, "runs": rows,
               "fp8_minus_bf16": differences,
               "bytes_per_token_on_disk": {d: json.loads((root / d / "extract" / "manifest.json")
                                                         .read_text())["bytes_per_token"]
                                           for d in DTYPES}}
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    print_tables(summary)
    return summary


def print_tables(summary: dict) -> None:
    print("\nseed  dtype           offline tau [95% CI]        vLLM tau [95% CI]           agrees")
    for r in summary["runs"]:
        print(f"{r['seed']:>4}  {r['dtype']:<14}  {r['offline_tau']:.3f} [{r['offline_ci'][0]:.3f}, "
              f"{r['offline_ci'][1]:.3f}]      {r['vllm_tau']:.3f} [{r['vllm_ci'][0]:.3f}, "
              f"{r['vllm_ci'][1]:.3f}]      {r['vllm_agrees']}")
    for what, d in summary["fp8_minus_bf16"].items():
        t = d["t_interval_over_seeds"]
        print(f"fp8 - bf16, {what}: mean {d['difference']:+.4f}, paired bootstrap CI "
              f"[{d['ci'][0]:+.4f}, {d['ci'][1]:+.4f}] (width {d['ci_width']:.4f}), t over "
              f"seeds {'n/a' if t is None else f'[{t[0]:+.4f}, {t[1]:+.4f}]'}; per seed "
              f"{[round(x, 4) for x in d['per_run']]}; |mean| <= {summary['bar']}: {d['held']}")
    for dtype, b in summary["bytes_per_token_on_disk"].items():
        print(f"bytes/token {dtype}: on disk {b['on_disk']:.1f}, formula {b['raw_minimum']}")


def main() -> None:
    args = parse_args()
    root = Path(args.root)
    if not args.analyse:
        run_all(root, args.seeds)
    analyse(root, args.seeds, args.resamples)


if __name__ == "__main__":
    main()
