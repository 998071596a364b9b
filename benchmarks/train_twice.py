"""Train the same draft twice on the same prepared data and compare the two checkpoints.

    make prepare EXP=tiny-trained                 # once: the prepared data both runs read
    python -m benchmarks.train_twice EXP=tiny-trained train.device=cuda train.precision=bf16
    python -m benchmarks.train_twice EXP=tiny-trained train.device=cuda train.precision=bf16 \\
        numerics.deterministic=false              # the same without deterministic algorithms

Arguments after the experiment are Hydra overrides, exactly as `make train OVERRIDES=...`
takes them. Each run is its own process (``--one``: a fresh CUDA context, no shared caches)
that calls ``draftline.training.train`` with the stage's arguments into its own directory
under ``runs/<exp>/train-twice/``, with ``numerics`` applied as every stage applies it; then
every tensor of the two saved drafts (model.safetensors) is compared. Printed: the numerics in
force, each run's seconds and final loss, and per tensor the max abs difference (0.0 means
bit-identical), then the largest over the checkpoint.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


def one(exp: str, overrides: list[str], out: Path) -> dict:
    from draftline import artifacts, config, numerics
    from stages.train import auto_or, pick_device, vocab_path

    cfg = config.compose(config.experiment_overrides(exp, overrides))
    applied = numerics.apply(cfg.numerics.torch_threads, bool(cfg.numerics.deterministic))
    from draftline import training

    prepare_dir = config.stage_dir(cfg, "prepare")
    prepared = artifacts.read_manifest(prepare_dir)
    extract = artifacts.read_manifest(config.stage_dir(cfg, "extract"))
    start = time.monotonic()
    result = training.train(
        prepared["shards"], prepare_dir / prepared["index"], vocab_path(cfg), str(cfg.model.path),
        out, list(extract["aux_layer_ids"]), steps=int(cfg.train.steps), lr=float(cfg.train.lr),
        ttt_steps=int(cfg.train.ttt_steps), max_tokens_per_step=int(cfg.train.max_tokens_per_step),
        seed=int(cfg.train.seed), device=pick_device(str(cfg.train.device)),
        num_layers=int(cfg.train.num_layers), checkpoint_every=int(cfg.train.checkpoint_every),
        precision=str(cfg.train.precision), compile=auto_or(cfg.train.compile, bool),
        loader_threads=auto_or(cfg.train.loader_threads, int),
        prefetch_batches=auto_or(cfg.train.prefetch_batches, int), check_vllm=False)
    return {"seconds": round(time.monotonic() - start, 1), "draft": result["draft_dir"],
            "precision": result["precision"], "final_loss": result["loss_history"][-1],
            "numerics": numerics.describe(applied)}


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--one":
        print(json.dumps(one(argv[1], argv[3:], Path(argv[2]))))
        return
    if not argv or not argv[0].startswith("EXP="):
        raise SystemExit("usage: python -m benchmarks.train_twice EXP=<exp> [hydra overrides]")
    exp, overrides = argv[0].removeprefix("EXP="), argv[1:]
    from draftline import reproduce

    root = Path("runs") / exp / "train-twice"
    shutil.rmtree(root, ignore_errors=True)
    runs = []
    for name in ("a", "b"):
        done = subprocess.run([sys.executable, "-m", "benchmarks.train_twice", "--one", exp,
                               str(root / name), *overrides],
                              check=True, capture_output=True, text=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"run {name}: {runs[-1]['seconds']} s, precision {runs[-1]['precision']}, "
              f"final loss {runs[-1]['final_loss']}")
    print("numerics:", json.dumps(runs[0]["numerics"]))
    first, second = (Path(r["draft"]) / "model.safetensors" for r in runs)
    from safetensors.torch import load_file

    a, b = load_file(str(first)), load_file(str(second))
    for key in sorted(a):
        diff = float((a[key].double() - b[key].double()).abs().max()) if a[key].numel() else 0.0
        print(f"  {key:<40} {str(a[key].dtype):<15} max abs diff {diff:.3g}")
    verdict, detail = reproduce.compare_file(first, second, atol=0.0, tau_tol=0.0)
    print(f"checkpoints: {verdict} ({detail or 'same bytes'})")


if __name__ == "__main__":
    main(sys.argv[1:])
