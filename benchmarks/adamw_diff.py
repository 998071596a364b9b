"""Where fused and unfused AdamW differ: one step and several on identical gradients; torch only.

    python -m benchmarks.adamw_diff --device cuda --dims llama-8b

Same start, same gradients (regenerated from one seed, no model forward), fused against
torch's default kernel.  For each, the moments and parameters are compared with each other and
with a float64 evaluation of AdamW's formula on the same inputs, so that the kernel that
strays (if one does) is named.  Also prints what a wrong beta2 / eps / weight decay in the
reference does to the same numbers, the scale a real difference has.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.optimizer import DIMS, draft_parameter_shapes
from draftline.train.optimizer import optimizer_implementation

EPS32 = torch.finfo(torch.float32).eps
LR = 3e-3


def grads(shapes, device, generator):
    out = []
    for s in shapes:
        scale = 10.0 ** (-6 * torch.rand((), generator=generator, device=device))
        out.append(torch.randn(s, generator=generator, device=device) * scale)
    return out


def run(shapes, device, implementation, steps, **kwargs):
    generator = torch.Generator(device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator, device=device) * 0.02)
              for s in shapes]
    optimizer = torch.optim.AdamW(params, lr=LR, fused=implementation == "fused",
                                  foreach=implementation == "foreach", **kwargs)
    generator.manual_seed(1)
    history = []
    for _ in range(steps):
        g = grads(shapes, device, generator)
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        optimizer.step()
        history.append(g)
    return params, optimizer, history


def float64_moments(history, beta1=0.9, beta2=0.999):
    m = [torch.zeros_like(g, dtype=torch.float64) for g in history[0]]
    v = [torch.zeros_like(g, dtype=torch.float64) for g in history[0]]
    for g in history:
        for i, gi in enumerate(g):
            gd = gi.double()
            m[i] = beta1 * m[i] + (1 - beta1) * gd
            v[i] = beta2 * v[i] + (1 - beta2) * gd * gd
    return m, v


def report(shapes, device, steps, reference, label, **kwargs):
    fp, fo, fh = run(shapes, device, "fused", steps)
    rp, ro, rh = run(shapes, device, reference, steps, **kwargs)
    same_grads = all(torch.equal(a, b) for ga, gb in zip(fh, rh) for a, b in zip(ga, gb))
    m64, v64 = float64_moments(fh)
    print(f"[{label}] steps {steps}  identical grads {same_grads}", flush=True)
    worst_param = 0.0
    for i, (a, b) in enumerate(zip(fp, rp)):
        unit = EPS32 * torch.clamp(b.detach().abs(), min=LR)
        worst_param = max(worst_param, float(((a - b).detach().abs() / unit).max()))
        for key, truth in (("exp_avg", m64[i]), ("exp_avg_sq", v64[i])):
            x, y = fo.state[a][key], ro.state[b][key]
            diff = (x - y).abs()
            scale = float(y.abs().max())
            rel = diff / y.abs().clamp_min(1e-45)
            bad = rel > 4 * steps * EPS32
            fx = float(((x.double() - truth).abs() / truth.abs().clamp_min(1e-300)).max())
            fy = float(((y.double() - truth).abs() / truth.abs().clamp_min(1e-300)).max())
            ex = float((x.double() - truth).abs().max()) / max(scale, 1e-300)
            ey = float((y.double() - truth).abs().max()) / max(scale, 1e-300)
            if i < 2 or int(bad.sum()):
                line = (f"  p{i} {tuple(a.shape)} {key}: max|x|={scale:.3e} "
                        f"max abs diff={float(diff.max()):.3e} "
                        f"(= {float(diff.max()) / max(scale, 1e-300) / EPS32:.2f} eps*max|v|) "
                        f"n rel>{4 * steps}eps={int(bad.sum())}  max rel={float(rel.max()):.3e}"
                        f"  vs float64: fused max rel {fx:.3e} ({ex / EPS32:.2f} eps*max), "
                        f"{reference} max rel {fy:.3e} ({ey / EPS32:.2f} eps*max)")
                if int(bad.sum()):
                    line += (f"  at the bad ones: |v| median {float(y[bad].abs().median()):.3e}"
                             f" max {float(y[bad].abs().max()):.3e}")
                print(line, flush=True)
    print(f"  params: max |fused - {reference}| = {worst_param:.2f} x eps*max(|p|,lr)",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dims", nargs="+", default=["hidden-256"], choices=sorted(DIMS))
    args = parser.parse_args()
    reference = optimizer_implementation(args.device, fused=False)
    print(f"torch {torch.__version__} device {args.device}", flush=True)
    for dims in args.dims:
        shapes = draft_parameter_shapes(*DIMS[dims])
        print(f"== {dims}", flush=True)
        for steps in (1, 5):
            report(shapes, args.device, steps, reference, f"{dims} fused vs {reference}")
        report(shapes, args.device, 5, reference, "mutant beta2=0.998", betas=(0.9, 0.998))
        report(shapes, args.device, 5, reference, "mutant eps=1e-6", eps=1e-6)
        report(shapes, args.device, 5, reference, "mutant wd=0.02", weight_decay=0.02)


if __name__ == "__main__":
    main()
