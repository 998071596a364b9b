"""Drafting cost per speculative step: sequential EAGLE-3 (k passes) against parallel drafting (one).

    python -m benchmarks.draft_passes                       # CUDA, Kimi-K2.5's draft widths
    python -m benchmarks.draft_passes --preset llama-8b     # a Llama-3.1-8B draft's widths
    python -m benchmarks.draft_passes --device cpu --preset tiny --repeats 1   # a CPU smoke run

What vLLM 0.16's proposer computes for one request per step, on a one-layer EAGLE-3 draft with
a KV cache of ``--context`` tokens, as CUDA graphs (vLLM captures the draft's passes too):

- **sequential** (``parallel_drafting: false``): a first pass over the tokens the target just
  verified (``--accepted`` per request, their 3H target features through ``fc``), then k-1
  passes of one token each, every pass appending to the cache and sampling its argmax;
- **parallel** (``parallel_drafting: true``): one pass over the verified tokens and k-1 mask
  slots, the k drafts sampled from its last k positions.

Each pass is the draft's whole forward at the given widths: the token embedding beside fc of
the hidden features, one decoder layer (attention over the cache with grouped KV heads, SwiGLU
MLP, RMS norms) and the head over the draft vocabulary with its argmax.  The weights are random
(cost, not acceptance) and this is the draft alone: the target's verification forward, which
parallel drafting leaves unchanged, is not here.  The step's speed-up from parallel drafting is
``(T_verify + T_seq) / (T_verify + T_par)`` at equal τ, so the ratio printed here bounds it.

Printed per batch size and k: microseconds per step for each mode (median of ``--repeats``
timings of ``--iters`` graph replays) and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

PRESETS = {
    # hidden, heads, kv heads, head dim, intermediate, vocab, draft vocab
    "kimi-k2.5": (7168, 64, 8, 128, 18432, 163840, 32000),
    "llama-8b": (4096, 32, 8, 128, 14336, 128256, 32000),
    "tiny": (256, 4, 2, 64, 512, 2048, 512),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="kimi-k2.5", choices=sorted(PRESETS), help="draft widths")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64], help="requests per step")
    parser.add_argument("--k", type=int, nargs="+", default=[3, 5, 7], help="speculative tokens")
    parser.add_argument("--accepted", type=int, default=3,
                        help="tokens the target verified per request last step (the first pass's length)")
    parser.add_argument("--context", type=int, default=2048, help="tokens already in the draft's cache")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if any)")
    parser.add_argument("--iters", type=int, default=50, help="steps per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings per cell (median kept)")
    parser.add_argument("--no-graphs", action="store_true", help="eager passes (CPU always is)")
    return parser.parse_args()


class Draft:
    """A one-layer EAGLE-3 draft's weights and its forward over n new tokens per request."""

    def __init__(self, preset: str, device: torch.device, dtype: torch.dtype, max_batch: int,
                 max_len: int) -> None:
        hidden, heads, kv_heads, head_dim, inter, vocab, draft_vocab = PRESETS[preset]
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, dtype=dtype) * shape[-1] ** -0.5

        self.embed = w(vocab, hidden)
        self.fc = w(hidden, 3 * hidden)
        self.qkv = w((heads + 2 * kv_heads) * head_dim, 2 * hidden)  # EAGLE-3: [embed, hidden]
        self.o = w(hidden, heads * head_dim)
        self.gate_up = w(2 * inter, hidden)
        self.down = w(hidden, inter)
        self.head = w(draft_vocab, hidden)
        self.norms = [torch.ones(hidden, device=device, dtype=dtype) for _ in range(4)]
        shape = (max_batch, kv_heads, max_len, head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor, start: int) -> torch.Tensor:
        """tokens [B, n], feats [B, n, 3H] (the target's) or [B, n, H] (the draft's own), cache
        positions start..start+n; returns the argmax draft tokens [B, n]."""
        b, n = tokens.shape
        h = feats if feats.shape[-1] == self.fc.shape[0] else F.linear(feats, self.fc)
        x = torch.cat([F.rms_norm(F.embedding(tokens, self.embed), (h.shape[-1],), self.norms[0]),
                       F.rms_norm(h, (h.shape[-1],), self.norms[1])], dim=-1)
        q, k, v = F.linear(x, self.qkv).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], -1)
        q = q.view(b, n, self.heads, self.head_dim).transpose(1, 2)
        self.k_cache[:b, :, start:start + n] = k.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        self.v_cache[:b, :, start:start + n] = v.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        end = start + n
        mask = torch.ones(n, end, dtype=torch.bool, device=tokens.device).tril(start)
        attn = F.scaled_dot_product_attention(q, self.k_cache[:b, :, :end], self.v_cache[:b, :, :end],
                                              attn_mask=mask, enable_gqa=True)
        h = h + F.linear(attn.transpose(1, 2).reshape(b, n, -1), self.o)
        gate, up = F.linear(F.rms_norm(h, (h.shape[-1],), self.norms[2]), self.gate_up).chunk(2, -1)
        h = h + F.linear(F.silu(gate) * up, self.down)
        return F.linear(F.rms_norm(h, (h.shape[-1],), self.norms[3]), self.head).argmax(-1)


def step_fn(draft: Draft, mode: str, batch: int, k: int, accepted: int, context: int,
            device: torch.device, dtype: torch.dtype):
    """One speculative step's drafting for ``batch`` requests, on static inputs (graph-safe)."""
    hidden = draft.fc.shape[0]
    vocab = draft.embed.shape[0]
    verified = torch.randint(vocab, (batch, accepted), device=device)
    target_feats = torch.randn(batch, accepted, 3 * hidden, device=device, dtype=dtype)
    if mode == "parallel":
        tokens = torch.cat([verified, torch.zeros(batch, k - 1, dtype=torch.long, device=device)], 1)
        mask_feat = torch.randn(3 * hidden, device=device, dtype=dtype)
        feats = torch.cat([target_feats, mask_feat.expand(batch, k - 1, -1)], 1)

        def run() -> torch.Tensor:
            return draft.forward(tokens, feats, context)[:, -k:]
        return run

    own = torch.randn(batch, 1, hidden, device=device, dtype=dtype)

    def run() -> torch.Tensor:
        out = [draft.forward(verified, target_feats, context)[:, -1:]]
        for j in range(1, k):  # each later pass: the previous draft token and the draft's own hidden
            out.append(draft.forward(out[-1], own, context + accepted + j - 1))
        return torch.cat(out, 1)
    return run


def timed(run, device: torch.device, iters: int, repeats: int, graphs: bool) -> float:
    """Median microseconds per call over ``repeats`` timings of ``iters`` calls."""
    if graphs:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        call = graph.replay
    else:
        call = run
        run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(iters):
            call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - begin) / iters * 1e6)
    return statistics.median(times)


def main() -> None:
    args = parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16
    graphs = device.type == "cuda" and not args.no_graphs
    max_len = args.context + args.accepted + max(args.k)
    draft = Draft(args.preset, device, dtype, max(args.batch), max_len)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {args.preset} draft widths {PRESETS[args.preset]}, bf16, {name}, "
          f"context {args.context}, {args.accepted} verified tokens a request, "
          f"{'CUDA graphs' if graphs else 'eager'}, median of {args.repeats} x {args.iters} steps")
    print("| batch | k | sequential (us/step) | parallel (us/step) | sequential / parallel |")
    print("| --- | --- | --- | --- | --- |")
    with torch.inference_mode():
        for batch in args.batch:
            for k in args.k:
                seq = timed(step_fn(draft, "sequential", batch, k, args.accepted, args.context, device, dtype),
                            device, args.iters, args.repeats, graphs)
                par = timed(step_fn(draft, "parallel", batch, k, args.accepted, args.context, device, dtype),
                            device, args.iters, args.repeats, graphs)
                print(f"| {batch} | {k} | {seq:.0f} | {par:.0f} | {seq / par:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
