"""AdamW step time on the draft's parameters: fused vs torch's default kernel; torch only.

    python -m benchmarks.optimizer                          # tiny-trained, hidden 256, 1024 (CPU)
    python -m benchmarks.optimizer --device cuda --dims llama-8b kimi-k2.5

The draft's trainable parameters (``draft_parameter_shapes``: speculators' one-layer Eagle3
draft, float32 master weights as training keeps them) get fresh random gradients, then
``--steps`` optimizer steps of each implementation are timed, interleaved (fused, default,
fused, ...) so that a busy machine slows both alike; the median per implementation is printed.
The default is what ``torch.optim.AdamW(params, lr)`` runs, as speculators' Trainer does:
``foreach`` on CUDA, a Python loop over the parameters on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from draftline.train.optimizer import adamw, optimizer_implementation

DIMS = {  # hidden, intermediate, heads, kv heads, head dim, draft vocab
    "tiny-trained": (128, 256, 2, 1, 64, 256),
    "hidden-256": (256, 896, 2, 1, 128, 512),  # benchmarks/train.py's CPU smoke dims
    "hidden-1024": (1024, 3584, 8, 2, 128, 32000),
    "llama-8b": (4096, 14336, 32, 8, 128, 32000),
    "kimi-k2.5": (7168, 18432, 56, 8, 128, 32000),
}


def draft_parameter_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int,
                           head_dim: int, draft_vocab: int) -> list[tuple[int, ...]]:
    """The trainable parameters of speculators' one-layer Eagle3 draft, in its order (tests/
    test_train_optimizer.py checks this against the built draft): fc over the 3 aux states,
    q/k/v reading [embedding, hidden] (2H), o, the MLP, the layer's three norms and the final
    norm, and the draft-vocabulary head."""
    h, q, kv = hidden, heads * head_dim, kv_heads * head_dim
    return [(h, 3 * h), (q, 2 * h), (kv, 2 * h), (kv, 2 * h), (h, q),
            (intermediate, h), (intermediate, h), (h, intermediate),
            (h,), (h,), (h,), (h,), (draft_vocab, h)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dims", nargs="+", default=["tiny-trained", "hidden-256",
                                                       "hidden-1024"], choices=sorted(DIMS))
    parser.add_argument("--steps", type=int, default=20, help="timed steps per implementation")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return parser.parse_args(argv)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def time_steps(shapes: list[tuple[int, ...]], device: str, steps: int) -> dict[str, float]:
    """Median ms per optimizer step, per implementation (two warm-up steps each)."""
    implementations = ["fused", optimizer_implementation(device, fused=False)]
    generator = torch.Generator(device).manual_seed(0)
    runs = {}
    for name in implementations:
        params = [torch.nn.Parameter(torch.randn(s, generator=generator, device=device) * 0.02)
                  for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator, device=device) * 1e-3
        runs[name] = (adamw(params, 3e-4, name), [])
    for _ in range(2):
        for optimizer, _times in runs.values():
            optimizer.step()
    for _ in range(steps):
        for optimizer, times in runs.values():
            synchronize(device)
            start = time.perf_counter()
            optimizer.step()
            synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(times) for name, (_opt, times) in runs.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"device {args.device}  torch {torch.__version__}  threads {torch.get_num_threads()}  "
          f"steps {args.steps}", flush=True)
    for name in args.dims:
        shapes = draft_parameter_shapes(*DIMS[name])
        count = sum(torch.Size(s).numel() for s in shapes)
        ms = time_steps(shapes, args.device, args.steps)
        (fused, f_ms), (other, o_ms) = ms.items()
        print(f"{name:<13} {count / 1e6:8.2f}M params  {fused} {f_ms:9.3f} ms  {other} "
              f"{o_ms:9.3f} ms  {other}/fused {o_ms / f_ms:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
