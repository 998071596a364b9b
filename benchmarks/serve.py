"""Serving speed with and without the trained draft, on a run's held-out prompts, in vLLM.

    .venv/bin/python -m benchmarks.serve --exp tiny-trained            # after `make evaluate`
    .venv/bin/python -m benchmarks.serve --exp kimi-k2.5 --repeats 3   # on the GPU host

The held-out split's replies (the target's own when the run regenerated them) give the
prompts and each reply's length.  Both engines decode every prompt greedily in one batch, the
target alone and the target with its EAGLE-3 draft (k from the draft config), with the same
engine settings; one warm-up request each is not timed.  Prints output tokens/s both ways, the
speed-up, whether the greedy outputs are identical (speculative decoding is lossless), vLLM's
spec-decode counters (tau = 1 + accepted / drafts, acceptance per position) and, when
`make evaluate` has run, the offline tau on the same replies.  Repeats alternate the two
engines and report medians.  On CPU the numbers check the path, not the speed: a tiny
target's forward costs about what the draft's does, so expect no speed-up there.

The result is kept in <run_dir>/benchmarks/serve.json under the draft's hash
(draftline.evaluate.speedup), where `make report` shows it for that draft.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exp", default="tiny-trained", help="experiment (conf/experiment/<exp>.yaml)")
    parser.add_argument("--max-prompts", type=int, default=None, help="held-out replies to decode")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per engine, alternating")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="sequences per batch")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model.path=/models/x")
    return parser.parse_args()


def heldout_prompts(run_dir: Path, limit: int | None) -> tuple[list[list[int]], list[int]]:
    """Every held-out reply's prompt (the tokens before it) and its length."""
    from draftline import formats
    from draftline.pipeline import artifacts
    from draftline.regenerate.greedy import reply_spans

    prepared = artifacts.read_manifest(run_dir / "prepare")
    rows = formats.load_split(run_dir / "prepare" / prepared["index"], formats.VALIDATION)
    prompts, lengths = [], []
    for shard_index in rows[:, 0].unique().tolist():
        mine = rows[rows[:, 0] == shard_index]
        for data in formats.read_shard_rows(Path(prepared["shards"][shard_index]),
                                            mine[:, 1].tolist(),
                                            (formats.INPUT_IDS, formats.LOSS_MASK)):
            ids = data[formats.INPUT_IDS].tolist()
            for a, b in reply_spans(data[formats.LOSS_MASK].bool().tolist()):
                prompts.append(ids[:a])
                lengths.append(b - a)
    return prompts[:limit], lengths[:limit]


def main() -> None:
    args = parse_args()
    from dataclasses import replace

    from draftline import engine
    from draftline.regenerate import greedy
    from draftline.speculative import jobs
    from draftline.evaluate import speedup
    from draftline.evaluate.rollout import num_speculative_tokens
    from draftline.pipeline import artifacts, config

    cfg = config.compose(config.experiment_overrides(args.exp, args.overrides))
    run_dir = Path(cfg.run_dir)
    train = artifacts.read_manifest(run_dir / "train")
    draft = Path(train["draft"]).absolute()
    k = num_speculative_tokens(draft)
    prompts, lengths = heldout_prompts(run_dir, args.max_prompts)
    options = replace(engine.engine_options(cfg, cfg.evaluate.vllm), max_num_seqs=args.max_num_seqs)
    stops = greedy.stop_token_ids(cfg.model.path)
    print(f"{len(prompts)} held-out prompts, {sum(lengths)} reply tokens at most; draft {draft}, k={k}")

    runs: dict[str, list[dict]] = {"target alone": [], "with draft": []}
    for repeat in range(args.repeats):
        for name, with_draft in (("target alone", False), ("with draft", True)):
            result = jobs.generate_timed(options, draft if with_draft else None,
                                            k if with_draft else None, prompts, lengths, stops)
            result["tokens_out"] = sum(len(t) for t in result["tokens"])
            runs[name].append(result)
            print(f"  run {repeat + 1} {name}: {result['tokens_out']} tokens in "
                  f"{result['seconds']:.2f} s = {result['tokens_out'] / result['seconds']:.1f} tok/s")

    rate = {name: statistics.median(r["tokens_out"] / r["seconds"] for r in rs) for name, rs in runs.items()}
    identical = sum(a == b for a, b in zip(runs["target alone"][0]["tokens"],
                                           runs["with draft"][0]["tokens"], strict=True))
    counters = runs["with draft"][0]["counters"]
    drafts = max(counters["drafts"], 1)
    tau = 1 + counters["accepted"] / drafts
    per_pos = [a / drafts for a in counters["accepted_per_pos"]]
    print(f"output tokens/s (median of {args.repeats}): target alone {rate['target alone']:.1f}, "
          f"with draft {rate['with draft']:.1f}, speed-up {rate['with draft'] / rate['target alone']:.2f}x")
    print(f"greedy outputs identical with and without the draft: {identical} of {len(prompts)}")
    print(f"vLLM counters: {counters['drafts']} drafts, {counters['draft_tokens']} draft tokens, "
          f"{counters['accepted']} accepted: tau {tau:.3f}, accepted per position "
          f"{' / '.join(f'{p:.3f}' for p in per_pos)}")
    results = run_dir / "evaluate" / "results.json"
    if results.exists():
        evaluated = json.loads(results.read_text())
        offline = evaluated["offline"]["eagle3"]
        print(f"offline tau (make evaluate, held-out split): {offline['tau']:.3f} "
              f"[{offline['tau_ci'][0]:.3f}, {offline['tau_ci'][1]:.3f}]")
    kept = speedup.record(run_dir, draft, {
        "speedup": rate["with draft"] / rate["target alone"], "tokens_per_second": rate,
        "repeats": args.repeats, "prompts": len(prompts), "max_num_seqs": args.max_num_seqs,
        "identical_outputs": [identical, len(prompts)], "vllm_tau": tau, "k": k,
        "device": device_name(options), "measured": datetime.datetime.now(datetime.UTC).isoformat(
            timespec="seconds"), "command": " ".join(["python -m benchmarks.serve", *sys.argv[1:]])})
    print(f"kept in {kept} under the draft's hash (make report EXP={args.exp} shows it)")


def device_name(options) -> str:
    """What the engines ran on, as the report labels the speed-up: a CPU figure says so."""
    from draftline.engine import cuda_available
    from draftline.pipeline import numerics

    if not cuda_available():
        return f"CPU ({numerics.cpu()['usable_cpus']} cores)"
    name, gpus = numerics.gpu()["names"][0], int(options.tensor_parallel_size)
    return f"{name} x{gpus}" if gpus > 1 else name


if __name__ == "__main__":
    main()
