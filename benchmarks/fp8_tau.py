"""Acceptance held? bf16 vs fp8 hidden-state shards on the embedded run, several training seeds.

    .venv/bin/python -m benchmarks.fp8_tau                # all of it (about 1-2 h on 2 busy cores)
    .venv/bin/python -m benchmarks.fp8_tau --analyse      # only the tables, from what is on disk
    .venv/bin/python -m benchmarks.fp8_tau --seeds 0 1 2 3 --root runs/fp8-tau
    .venv/bin/python -m benchmarks.fp8_tau --bytes        # bytes/token, formula and on disk

What runs, in this order, each stage as `python -m stages.<stage> experiment=tiny-trained
run_dir=<root>/<dtype> extract.save_dtype=<dtype> train.seed=<s> evaluate.gate=null
evaluate.vllm.require_agreement=false numerics.torch_threads=1` (a stage whose manifest is
already there is skipped, so an interrupted run picks up where it stopped):

1. the trained tiny target (`make target`'s builder) if runs/_assets/ lacks it, and the
   embedded conversations (`make`'s assets step);
2. bf16: tokenize, regenerate, extract, prepare in <root>/bfloat16;
3. fp8: tokenize and regenerate copied from the bf16 run dir (neither reads an extract key, so
   they are the same replies, byte for byte), then extract and prepare in <root>/float8_e4m3fn;
4. per seed, bf16 then fp8: train, evaluate (its results.json kept as
   <root>/<dtype>/seed-<s>.results.json). The gate and the offline-vs-vLLM agreement check
   are off, for both dtypes, so that a run below the floor or in disagreement reports
   instead of stopping the sequence: on fp8 shards the offline walk's truth (argmax of the
   verifier head on the dequantized final slot) differs from the target's own greedy token
   at about 1% of reply positions (``greedy_from_final_slot`` below), so the offline walk
   need not reproduce vLLM's verdicts step for step. The table shows each run's agreement.

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
# One intra-op thread: on a shared 2-core box two OpenMP threads stall at every parallel region
# (tiny-trained's draft: 13 steps/s alone, 0.5 under load); the same count for every run.
THREADS = 1
BAR = 0.03  # |mean tau difference| that counts as acceptance held
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="runs/fp8-tau", help="one run dir per dtype below it")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="train.seed values")
    parser.add_argument("--analyse", action="store_true", help="only the tables")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--bytes", action="store_true",
                        help="only the bytes/token table at Llama-8B, Kimi and embedded widths")
    return parser.parse_args()


def stage(name: str, run_dir: Path, dtype: str, seed: int) -> None:
    """One stage in the run dir of ``dtype``; skipped if its manifest is there."""
    if (run_dir / name / "manifest.json").exists():
        return
    overrides = [f"experiment={EXP}", f"run_dir={run_dir}", f"extract.save_dtype={dtype}",
                 f"train.seed={seed}", "evaluate.gate=null",
                 "evaluate.vllm.require_agreement=false", f"numerics.torch_threads={THREADS}"]
    print(f"--- {name} {dtype} seed {seed}", flush=True)
    subprocess.run([sys.executable, "-m", f"stages.{name}", *overrides], check=True)


def run_all(root: Path, seeds: list[int]) -> None:
    if not TARGET.exists():
        subprocess.run([sys.executable, "-m", "draftline.cli.trained_target", f"experiment={EXP}"],
                       check=True)
    # The embedded conversations, as `make` builds them before any stage.
    subprocess.run([sys.executable, "-m", "draftline.cli.status", "assets", EXP, "--"],
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


def greedy_agreement(root: Path) -> dict:
    """On the held-out samples: how often the target's greedy token from the fp8 final slot
    (what offline evaluation and training targets see) is the one from the bf16 slot, and
    how often each is the reply's next token (the target's own greedy reply)."""
    from draftline.evaluate.offline import load_heldout
    from draftline.formats import VALIDATION, load_split
    from draftline.train.draft import load_verifier_head, read_verifier

    _, head = load_verifier_head(read_verifier(TARGET.parent))
    held = {}
    for dtype in DTYPES:
        prepared = json.loads((root / dtype / "prepare" / "manifest.json").read_text())
        index = root / dtype / "prepare" / prepared["index"]
        held[dtype] = load_heldout(prepared["shards"], load_split(index, VALIDATION), head)
    same = total = 0
    follows = {d: 0 for d in DTYPES}
    for bf16, fp8 in zip(held[DTYPES[0]], held[DTYPES[1]], strict=True):
        if not torch.equal(bf16.input_ids, fp8.input_ids):
            raise ValueError("the two runs hold other held-out samples")
        reply = bf16.loss_mask[1:]  # positions t whose next token x_{t+1} is a reply token
        same += int((bf16.target_next[:-1] == fp8.target_next[:-1])[reply].sum())
        for dtype, sample in (("bfloat16", bf16), ("float8_e4m3fn", fp8)):
            follows[dtype] += int((sample.target_next[:-1] == sample.input_ids[1:])[reply].sum())
        total += int(reply.sum())
    return {"reply_positions": total, "fp8_greedy_equals_bf16": same / total,
            "greedy_is_next_reply_token": {d: n / total for d, n in follows.items()}}


def quantization_error(root: Path) -> dict:
    """Per slot over every shard: relative RMS error of the dequantized fp8 states against
    the bf16 shards' (the same tokens), and the largest |state| / RMS of a row (how far a row's
    outliers stretch its scale)."""
    from draftline import formats

    manifest = json.loads((root / DTYPES[0] / "extract" / "manifest.json").read_text())
    error = reference = peak = None
    for shard in manifest["shards"]:
        exact = formats.read_shard(root / DTYPES[0] / "extract" / shard["file"])
        stored = formats.read_shard(root / DTYPES[1] / "extract" / shard["file"])
        want = exact[formats.HIDDEN_STATES].float()  # [tokens, slots, H]
        got = formats.dequantize(stored[formats.HIDDEN_STATES], stored[formats.HIDDEN_SCALES])
        e, r = ((got - want) ** 2).sum((0, 2)), (want ** 2).sum((0, 2))  # [slots]
        p = (want.abs().amax(-1) / want.pow(2).mean(-1).sqrt().clamp(min=1e-30)).amax(0)
        error, reference = (e, r) if error is None else (error + e, reference + r)
        peak = p if peak is None else torch.maximum(peak, p)
    return {"relative_rms_error_per_slot": (error / reference).sqrt().tolist(),
            "max_row_peak_to_rms_per_slot": peak.tolist()}


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
               "fp8_minus_bf16": differences, "greedy_from_final_slot": greedy_agreement(root),
               "quantization": quantization_error(root),
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
    g = summary["greedy_from_final_slot"]
    print(f"greedy token from the final slot on {g['reply_positions']} held-out reply positions: "
          f"fp8 = bf16 at {g['fp8_greedy_equals_bf16']:.4f}; equals the reply's next token: "
          + ", ".join(f"{d} {v:.4f}" for d, v in g["greedy_is_next_reply_token"].items()))
    q = summary["quantization"]
    print("fp8 vs bf16 states, per slot (aux..., final): relative RMS error "
          f"{[round(x, 4) for x in q['relative_rms_error_per_slot']]}, largest row peak/RMS "
          f"{[round(x, 1) for x in q['max_row_peak_to_rms_per_slot']]}")
    for dtype, b in summary["bytes_per_token_on_disk"].items():
        print(f"bytes/token {dtype}: on disk {b['on_disk']:.1f}, formula {b['raw_minimum']}")


# (name, hidden) with 3 aux slots + the final one; the embedded run's on-disk number is its own.
WIDTHS = (("Llama-3.1-8B", 4096), ("Kimi-K2.5", 7168), ("embedded (tiny-trained)", 128))


def bytes_table(tokens: int = 8192, sample_len: int = 1024) -> list[dict]:
    """bytes/token by the formula (shards.bytes_per_token) and of one shard written by
    formats.pack_shard + write_shard (random states, ``tokens`` in samples of ``sample_len``)."""
    import tempfile

    from draftline import formats
    from draftline.extract import shards

    rows = []
    generator = torch.Generator().manual_seed(0)
    for name, hidden in WIDTHS:
        row = {"dims": name, "hidden": hidden}
        lengths = [sample_len] * (tokens // sample_len)
        states = torch.randn(tokens, 4, hidden, generator=generator).to(torch.bfloat16)
        for dtype in DTYPES:
            results, start = {}, 0
            for i, n in enumerate(lengths):
                results[i] = {"hidden_states": list(states[start:start + n].unbind(1)),
                              "input_ids": torch.arange(n)}
                start += n
            ids = tuple(range(len(lengths)))
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "shard.safetensors"
                formats.write_shard(path, formats.pack_shard(ids, results, {i: [1] * n for i, n in
                                                                          enumerate(lengths)}, dtype),
                                    {formats.FINGERPRINT: "bytes"})
                row[dtype] = {"formula": shards.bytes_per_token(4, hidden, dtype),
                              "on_disk": path.stat().st_size / tokens}
        row["ratio_formula"] = row[DTYPES[1]]["formula"] / row[DTYPES[0]]["formula"]
        row["ratio_on_disk"] = row[DTYPES[1]]["on_disk"] / row[DTYPES[0]]["on_disk"]
        rows.append(row)
        print(f"{name:<24} H {hidden:>5}: bf16 {row[DTYPES[0]]['formula']:>6} B ({row[DTYPES[0]]['on_disk']:,.1f} "
              f"on disk), fp8 {row[DTYPES[1]]['formula']:>6} B ({row[DTYPES[1]]['on_disk']:,.1f}); "
              f"fp8/bf16 {row['ratio_formula']:.4f} formula, {row['ratio_on_disk']:.4f} on disk")
    return rows


def main() -> None:
    args = parse_args()
    root = Path(args.root)
    if args.bytes:
        bytes_table()
        return
    if not args.analyse:
        run_all(root, args.seeds)
    analyse(root, args.seeds, args.resamples)


if __name__ == "__main__":
    main()
