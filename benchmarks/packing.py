"""Fill of the training plan (real tokens / token budget), before and after, without training.

    python -m benchmarks.packing                       # the benchmark dims and the kimi-k2.5 shape
    python -m benchmarks.packing --embedded runs/tiny-trained   # plus the embedded run's index

"before" is speculators 0.3.0's ``MultipackDistributedBatchSamplerV2``, the planner main used
(same arguments as ``make_sampler``, now ``draftline.train.packing``'s, gave it); "after" is
``draftline.train.packing.StepPlanner``.  Both go through ``draftline.train.packing.plan_steps``.
Cases:

1. ``benchmarks/train.py`` at Llama-3.1-8B and Kimi-K2.5 dims: its sample lengths for
   ``--seed/--warmup/--steps/--tokens-per-step`` as it draws them on a CUDA machine (the same
   generator calls in the same order: one draw for the verifier's seed, the vocabulary's
   permutation, then the lengths, uniform in [mean/2, 3 mean/2]), so the fill printed for its
   timed steps is the one that benchmark prints for its disk run;
2. the embedded run (``--embedded RUN_DIR``): the train split of prepare's index, with the
   experiment's ``train.max_tokens_per_step`` and ``train.steps``;
3. the ``kimi-k2.5`` experiment's shape: samples of at most 4,096 tokens (tokenize.seq_length)
   in 8,192-token steps, 20,000 steps of them; lengths synthesized (no Kimi data here):
   log-normal with median 1,000 and sigma 0.8, cut to [16, 4096], and uniform in [16, 4096].
   With ``--world-size N`` the 8,192 are the global budget, N ranks of 8192/N each.

Printed per case: fill over the plan's steps (and over the benchmark's timed steps), the worst
step and the 1st percentile of steps, steps planned per epoch, and the share of tokens cut
because a sample exceeds the budget.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

from benchmarks import train as bench
from draftline.train.packing import StepPlanner, fill_of, plan_steps, step_fills

KIMI_STEPS, KIMI_BUDGET, KIMI_MAX_LEN = 20_000, 8192, 4096


class SpeculatorsPlanner:
    """main's planner behind the ``batches(epoch)`` that ``plan_steps`` asks for."""

    def __init__(self, lengths: Sequence[int], max_tokens: int, seed: int, rank: int = 0,
                 world_size: int = 1):
        self.sampler = MultipackDistributedBatchSamplerV2(
            batch_max_length=max_tokens, lengths=list(lengths), num_replicas=world_size,
            rank=rank, seed=seed)

    def batches(self, epoch: int) -> list[np.ndarray]:
        self.sampler.set_epoch(epoch)
        return list(self.sampler)


PLANNERS: dict[str, Callable] = {"before": SpeculatorsPlanner, "after": StepPlanner}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="benchmarks/train.py's --seed")
    parser.add_argument("--warmup", type=int, default=3, help="its --warmup (issue 24: 3)")
    parser.add_argument("--steps", type=int, default=10, help="its --steps (issue 24: 10)")
    parser.add_argument("--tokens-per-step", type=int, default=8192, help="its budget")
    parser.add_argument("--embedded", default=None, help="a run dir of EXP=tiny-trained")
    parser.add_argument("--world-size", type=int, nargs="+", default=[1],
                        help="ranks for the kimi-k2.5 shape (global budget divided)")
    return parser.parse_args(argv)


def benchmark_lengths(args: argparse.Namespace, hidden: int, vocab: int) -> list[int]:
    """``benchmarks/train.py``'s stored sample lengths on a CUDA machine (its prepare_inputs)."""
    dims = bench.Dims(hidden=hidden, intermediate=0, heads=1, kv_heads=1, head_dim=1,
                      vocab=vocab, draft_vocab=32000, layers=1, ttt=3)
    generator = torch.Generator().manual_seed(args.seed)
    torch.randint(0, 2**62, (1,), generator=generator)  # random_bf16's seed for the verifier
    bench.vocab_mapping(dims, generator)
    tokens = (args.warmup + args.steps) * args.tokens_per_step
    return bench.sample_lengths(tokens, max(2, args.tokens_per_step // 8), generator)


def chat_lengths(tokens: int, seed: int = 0) -> list[int]:
    """Log-normal, median 1000, sigma 0.8, cut to [16, 4096]: ``tokens`` worth of samples."""
    rng = np.random.default_rng(seed)
    raw = np.clip(rng.lognormal(np.log(1000), 0.8, tokens // 500).astype(np.int64), 16,
                  KIMI_MAX_LEN)
    return raw[: int(np.searchsorted(np.cumsum(raw), tokens)) + 1].tolist()


def uniform_lengths(tokens: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    raw = rng.integers(16, KIMI_MAX_LEN + 1, tokens // 1000)
    return raw[: int(np.searchsorted(np.cumsum(raw), tokens)) + 1].tolist()


def report(case: str, stored: Sequence[int], budget: int, steps: int, seed: int,
           timed: slice | None = None, world_size: int = 1) -> None:
    """Both planners' fill for one case; ``stored`` lengths lose one token to the shift."""
    lengths = np.asarray(stored, dtype=np.int64) - 1
    cut = np.maximum(lengths - budget, 0).sum() / lengths.sum()
    print(f"\n{case}: {len(lengths):,} samples, {lengths.sum():,} tokens, budget {budget:,} "
          f"x {world_size} rank(s), {steps:,} steps, tokens cut at the budget {cut:.2%}")
    for name, planner in PLANNERS.items():
        start = time.perf_counter()
        ranks = [planner(lengths, budget, seed, rank, world_size) for rank in range(world_size)]
        plans = [[batch for _, batch in plan_steps(r, 0, steps)] for r in ranks]
        seconds = time.perf_counter() - start
        fills = step_fills([b for plan in plans for b in plan], lengths, budget)
        per_epoch = len(ranks[0].batches(0))
        line = (f"  {name:<6} fill {fills.mean():.4f}  steps: worst {fills.min():.3f}, 1st "
                f"percentile {np.percentile(fills, 1):.3f}  {per_epoch:,} steps/epoch  "
                f"planned in {seconds:.1f} s")
        if timed is not None:
            timed_batches = [b for plan in plans for b in plan[timed]]
            line += f"  timed steps {timed.start}-{timed.stop - 1}: " \
                    f"{fill_of(timed_batches, lengths, budget):.4f}"
        print(line, flush=True)


def embedded(run_dir: str) -> None:
    from draftline import formats
    from draftline.pipeline import artifacts, config

    cfg = config.compose(config.experiment_overrides("tiny-trained", [f"run_dir={run_dir}"]))
    prepare_dir = config.stage_dir(cfg, "prepare")
    index = prepare_dir / artifacts.read_manifest(prepare_dir)["index"]
    rows = formats.load_split(index, formats.TRAIN)
    report(f"embedded run ({index})", rows[:, 2].tolist(), int(cfg.train.max_tokens_per_step),
           int(cfg.train.steps), int(cfg.train.seed))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    timed = slice(args.warmup, args.warmup + args.steps)
    for name, hidden, vocab in (("Llama-3.1-8B", 4096, 128256), ("Kimi-K2.5", 7168, 163840)):
        report(f"benchmarks/train.py at {name} dims (seed {args.seed}, warmup {args.warmup}, "
               f"steps {args.steps})", benchmark_lengths(args, hidden, vocab),
               args.tokens_per_step, args.warmup + args.steps, args.seed, timed)
    if args.embedded:
        embedded(args.embedded)
    tokens = KIMI_STEPS * KIMI_BUDGET
    for world_size in args.world_size:
        for shape, lengths in (("log-normal", chat_lengths(tokens)),
                               ("uniform", uniform_lengths(tokens))):
            report(f"kimi-k2.5 shape, {shape} lengths", lengths, KIMI_BUDGET // world_size,
                   KIMI_STEPS, 0, world_size=world_size)


if __name__ == "__main__":
    main()
