"""Train the same draft twice on the same prepared data and compare the two checkpoints.

    make prepare EXP=tiny-trained                 # once: the prepared data both runs read
    python -m benchmarks.train_twice EXP=tiny-trained train.device=cuda train.precision=bf16
    python -m benchmarks.train_twice EXP=tiny-trained train.device=cuda train.precision=bf16 \\
        numerics.deterministic=false              # the same without deterministic algorithms

Arguments after the experiment are Hydra overrides, exactly as `make train OVERRIDES=...`
takes them. Each run is its own process (``--one``: a fresh CUDA context, no shared caches)
that calls ``draftline.train.loop.train`` with the stage's arguments into its own directory
under ``runs/<exp>/train-twice/``, with ``numerics`` applied as every stage applies it; then
every tensor of the two saved drafts (model.safetensors, in the save dtype) and of the two
last checkpoints (the float32 master weights) is compared. Printed: the numerics in
force, each run's seconds and final loss, the ops that warned they have no deterministic
kernel (``torch.use_deterministic_algorithms(warn_only=True)``: the run goes on with the
nondeterministic one), the first step whose loss differs and the largest loss difference, and
per tensor the max abs difference (0.0 means bit-identical), then the largest over the
checkpoint.  Each run's stderr (its log and tracebacks) passes through.

Measured on one H200 (torch 2.11.0+cu130, CUDA 13.0, driver 580.159.04; EXP=tiny-trained,
1200 steps, bf16 autocast, compiled flex attention, numerics.deterministic=true): identical
loss curves at every step, and the saved draft and the last checkpoint's float32 master
weights identical byte for byte; no op on the path warned of a nondeterministic kernel.  The
first run took 120 s (compiling), the second 57 s (inductor's cache).  The
``numerics.deterministic=false`` run was not made yet.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path


def one(exp: str, overrides: list[str], out: Path) -> dict:
    from draftline.pipeline import config, numerics

    cfg = config.compose(config.experiment_overrides(exp, overrides))
    applied = numerics.apply(cfg.numerics.torch_threads, bool(cfg.numerics.deterministic))
    from draftline.train import loop

    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _train(loop, cfg, out)
    for warning in caught:  # shown as usual, after the run
        warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    nondeterministic = sorted({str(w.message).split("\n")[0] for w in caught
                               if "deterministic" in str(w.message)})
    return {"seconds": round(time.monotonic() - start, 1), "draft": result["draft_dir"],
            "precision": result["precision"], "final_loss": result["loss_history"][-1],
            "loss_history": result["loss_history"], "nondeterministic_ops": nondeterministic,
            "numerics": numerics.describe(applied)}


def _train(loop, cfg, out: Path) -> dict:
    from draftline.pipeline import launch
    from draftline.train.run import train_data
    from draftline.train.settings import TrainSettings

    settings = TrainSettings.from_config(cfg.train, device=launch.rank_device(str(cfg.train.device)),
                                         check_vllm=False)
    return loop.train(train_data(cfg), settings, out)


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--one":
        print(json.dumps(one(argv[1], argv[3:], Path(argv[2]))))
        return
    if not argv or not argv[0].startswith("EXP="):
        raise SystemExit("usage: python -m benchmarks.train_twice EXP=<exp> [hydra overrides]")
    exp, overrides = argv[0].removeprefix("EXP="), argv[1:]
    root = Path("runs") / exp / "train-twice"
    shutil.rmtree(root, ignore_errors=True)
    runs = []
    for name in ("a", "b"):
        done = subprocess.run([sys.executable, "-m", "benchmarks.train_twice", "--one", exp,
                               str(root / name), *overrides],
                              check=True, stdout=subprocess.PIPE, text=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"run {name}: {runs[-1]['seconds']} s, precision {runs[-1]['precision']}, "
              f"final loss {runs[-1]['final_loss']}", flush=True)
    print("numerics:", json.dumps(runs[0]["numerics"]))
    print("ops without a deterministic kernel (warned):",
          json.dumps(runs[0]["nondeterministic_ops"]))
    losses = list(zip(runs[0]["loss_history"], runs[1]["loss_history"]))
    differ = [step for step, (x, y) in enumerate(losses, start=1) if x != y]
    print(f"loss curves: {len(losses)} steps, first differing step "
          f"{differ[0] if differ else 'none'}, max abs difference "
          f"{max(abs(x - y) for x, y in losses):.3g}")
    drafts = [Path(r["draft"]) / "model.safetensors" for r in runs]
    compare("saved draft (model.safetensors, save dtype)", *drafts)
    from draftline.train.checkpoint import latest_checkpoint

    masters = [latest_checkpoint(Path(r["draft"]).parent) / "draft.safetensors" for r in runs]
    compare("last checkpoint (float32 master weights)", *masters)


def compare(label: str, first: Path, second: Path) -> None:
    """Per tensor max abs difference (and the tensor's largest magnitude), then a verdict."""
    from safetensors.torch import load_file

    from draftline.cli import reproduce

    print(f"{label}:")
    a, b = load_file(str(first)), load_file(str(second))
    for key in sorted(a):
        x, y = a[key].double(), b[key].double()
        diff = float((x - y).abs().max()) if x.numel() else 0.0
        scale = float(x.abs().max()) if x.numel() else 0.0
        print(f"  {key:<40} {str(a[key].dtype):<15} max abs diff {diff:.3g} (max |w| "
              f"{scale:.3g})")
    verdict, detail = reproduce.compare_file(first, second, atol=0.0, tau_tol=0.0)
    print(f"  {label.split(' (')[0]}: {verdict} ({detail or 'same bytes'})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
