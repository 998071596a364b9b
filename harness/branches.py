"""The engine's other branches, rehearsed on vLLM's CPU engine: TP=2, bf16, compiled.

Every other test runs vLLM at TP=1, float32, eager; the flagship run takes the other branch at
each of those forks. This runs, for the tiny Llama, DeepseekV3 and Kimi-K2.5 targets
(``draftline.tiny.builders`` and ``draftline.tiny.kimi_k25``, float32 weights), with the engine options of ``draftline.engine``
(the project's thread binding split over the TP ranks):

* extraction (speculators' patched generator, as extract starts it): TP=1 float32 (the
  reference), TP=2 float32, TP=1 bf16, each slot of each prompt against transformers
  (float32) and against TP=1's rows. Extraction always runs eager (speculators' generator
  sets it), so there is no compiled extraction.
* speculative decoding (evaluate's measurement, ``draftline.speculative.jobs.measure_on``:
  greedy, one prompt at a time, vLLM's counters read after every step) with a draft trained on the
  target's own greedy replies (``harness.drafts.overfit_draft``: it gets several
  tokens accepted per step, so tau can move): eager TP=1 (the reference), compiled TP=1,
  eager TP=2, compiled TP=2. The plain engine of eager TP=1 decodes the same prompts; with
  ``--own-plain`` every branch's own plain engine does too. Per branch: replies equal to
  eager TP=1's plain decode (and to its own, where run), tau and its paired difference to
  eager TP=1 over the replies with a bootstrap CI. The compiled branch also captures the aux
  hidden states the target hands the draft and compares them with the stored TP=1 rows of the
  same prompt.

    .venv/bin/python -m harness.branches --own-plain           # the whole table
    .venv/bin/python -m harness.branches --models llama --root runs/_branches

The long test tier (CI) runs ``CI_SPECULATIVE``: eager TP=1, compiled (it carries the served
capture) and compiled TP=2 (the flagship's own combination), without own plain engines: 7
engine starts a target instead of 11 (eager TP=2 alone and the own plains are in the table
this module prints, not in CI's time budget).

Writes <root>/<model>/results.json and prints the table. tests/test_branches.py (marker
`long`, run by .ci/run) holds the results to the tolerances below.

Tolerances (relative: max |a - b| over a slot / max |reference| of that slot):
* TP=2 float32 vs TP=1 and vs HF: ``TP2_TOLERANCE`` = 1e-5. A row-parallel layer's output is
  the all-reduce of two partial sums over K/2 terms each instead of one sum over K: the same
  products summed in another order, a rounding difference of a few float32 ulps (2^-24 ~ 6e-8)
  per reduction, growing through the layers (6 at most here) to some 1e-7..1e-6 of the
  state's scale; 1e-5 leaves room for that and is still 1000x below a wrong layer or a wrong
  rank's rows (distinct layers differ by O(1) here).
* bf16 vs HF float32, per token (|row - HF| / |HF| over the hidden width), the rehearsal's
  rule (draftline.rehearse.checks.judge): the median token within ``BF16_TOLERANCE`` = 0.05
  and at most 5% of the tokens beyond it. bf16 keeps 8 significant bits: every weight,
  activation and residual add is rounded to 2^-8 ~ 0.4% of its size; after a few layers the
  typical token is off by a few 2^-8 (about 0.01 measured), 10x below the distance between
  neighbouring layers' states. Through MoE layers a few tokens go much further (0.2-0.4):
  their router scores for two experts are within bf16's rounding, and the rounded run picks
  the other expert. transformers' own bf16 run of the same weights flips about as many
  tokens against its float32 run (``hf_bf16_vs_hf``, reported beside it). Each slot's median
  token must also be nearest the layer it names.
* served aux (compiled) vs stored rows (eager): ``SERVED_TOLERANCE`` = 1e-5, inductor's fused
  kernels reorder float32 arithmetic as above.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from draftline import engine
from draftline.speculative import jobs
from draftline.engine import EngineOptions
from harness import capture

TP2_TOLERANCE = 1e-5
BF16_TOLERANCE = 0.05
SERVED_TOLERANCE = 1e-5
K = 3  # draft tokens per step
# Extraction prompts (random tokens): queueing and chunked prefill with three slots and a
# 64-token budget, as tests/test_extraction.py.
EXTRACT_LENGTHS = (191, 7, 40, 130, 64, 1)
TOKEN_BUDGET = 64
# Speculative decoding: prompts of the target's own text, the draft trained on its replies.
SPEC_PROMPTS = 12
SPEC_PROMPT_LENGTH = 12
SPEC_TOKENS = 32
KIMI_TEXT_ONLY = {"vision_chunk": 0}


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    build: str            # its draftline.tiny builder, as module.function
    num_layers: int
    aux_ids: tuple[int, ...]
    mm_limits: dict | None = None


MODELS = {
    "llama": Model("llama", "builders.build_tiny_llama", 6, (2, 3, 4)),
    "deepseek-v3": Model("deepseek-v3", "builders.build_tiny_deepseek_v3", 4, (1, 2, 3)),
    "kimi-k2.5": Model("kimi-k2.5", "kimi_k25.build_tiny_kimi_k25", 4, (1, 2, 3), KIMI_TEXT_ONLY),
}
EXTRACTIONS = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "bf16": {"dtype": "bfloat16"}}
SPECULATIVE = {"eager-tp1": {}, "compiled": {"enforce_eager": False},
               "tp2": {"tensor_parallel_size": 2},
               "compiled-tp2": {"enforce_eager": False, "tensor_parallel_size": 2}}
CI_SPECULATIVE = {name: SPECULATIVE[name] for name in ("eager-tp1", "compiled", "compiled-tp2")}


def options_for(target: Path, model: Model, **change) -> EngineOptions:
    """The engine options a stage would build for this target on the CPU engine (float32,
    eager, MLA off), with one branch's changes; the thread binding split over its TP ranks."""
    tp = int(change.get("tensor_parallel_size", 1))
    base = EngineOptions(target=str(target), dtype="float32", max_model_len=512, max_num_seqs=3,
                         limit_mm_per_prompt=model.mm_limits, mla_disable=True,
                         enforce_eager=True, cpu_threads_bind=engine.cpu_threads_bind(tp))
    return dataclasses.replace(base, **change)


# --------------------------------------------------------------------------- child jobs


def _extract(request: dict) -> dict:
    """speculators' generator with the project's options; every prompt's rows saved."""
    from safetensors.torch import save_file
    from speculators.data_generation import VllmHiddenStatesGenerator

    options = EngineOptions(**request["options"])
    generator = VllmHiddenStatesGenerator(
        options.target, layer_ids=list(request["aux_ids"]),
        **engine.generator_kwargs(options, max_num_batched_tokens=TOKEN_BUDGET))
    try:
        outputs = generator.generate([list(p) for p in request["prompts"]])
    finally:
        generator.shutdown()
    save_file({f"{i}.{slot}": h.float().contiguous() for i, out in enumerate(outputs)
               for slot, h in enumerate(out["hidden_states"])}, request["out"])
    return {"prompts": len(outputs)}


def _speculative(request: dict) -> dict:
    """One branch: the draft's engine (the aux capture of one prompt when asked, then
    evaluate's measurement), then, when asked, the plain engine on the same prompts."""
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams, TokensPrompt

    options = EngineOptions(**request["options"])
    if request.get("capture"):
        # apply_model sends a function to the engine core: pickled, which vLLM allows only
        # when asked (a test harness's own function, never a user's input).
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    started = time.monotonic()
    llm = LLM(**engine.llm_kwargs(options, request["draft"], int(request["k"])))
    result = {"engine_start_seconds": time.monotonic() - started}
    if request.get("capture"):
        llm.apply_model(capture.install)
        prompt = list(request["capture"]["prompt"])
        llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                     SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        prefill = llm.apply_model(capture.take)[0][0]  # rank 0, the prompt's forward
        save_file({str(slot): h[: len(prompt)].float().contiguous() for slot, h in enumerate(prefill)},
                  request["capture"]["out"])
    result["speculative"] = jobs.measure_on(llm, request)
    jobs._shutdown(llm)
    if request.get("plain", True):
        result["plain"] = jobs._generate_timed({**request, "draft": None, "k": None})
    return result


JOBS = {"extract": _extract, "speculative": _speculative}


def _job(name: str, request: dict, options: EngineOptions) -> dict:
    return jobs.run_job(name, request, options, module="harness.branches", jobs=JOBS)


# --------------------------------------------------------------------------- comparisons


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def slot_errors(rows: dict, reference, prompts, slots: int) -> list[float]:
    """Per slot, the worst relative error over prompts of ``rows`` against ``reference``
    (rows of the same layout, or a callable prompt index -> list of per-slot tensors)."""
    worst = [0.0] * slots
    for i in range(len(prompts)):
        ref = reference(i) if callable(reference) else [reference[f"{i}.{s}"] for s in range(slots)]
        for slot in range(slots):
            worst[slot] = max(worst[slot], relative(rows[f"{i}.{slot}"], ref[slot]))
    return worst


def nearest_layers(rows: dict, hf: list, prompts, wanted: list[int]) -> bool:
    """Whether every slot of every prompt (its median token) is nearest the transformers
    entry it names."""
    from draftline.rehearse.checks import nearest_layer

    return all(nearest_layer(rows[f"{i}.{slot}"], hf[i])[0] == layer
               for i in range(len(prompts)) for slot, layer in enumerate(wanted))


def token_summary(rows: dict, reference, prompts, slots: int, tol: float = BF16_TOLERANCE) -> list[dict]:
    """Per slot, over every prompt's tokens: the median and worst token's relative error and
    the share of tokens beyond ``tol`` (``reference`` as in ``slot_errors``)."""
    from draftline.rehearse.checks import summarize, token_errors

    summary = []
    for slot in range(slots):
        e = torch.cat([token_errors(rows[f"{i}.{slot}"],
                                    (reference(i) if callable(reference) else
                                     [reference[f"{i}.{s}"] for s in range(slots)])[slot])
                       for i in range(len(prompts))])
        summary.append({**summarize(e, tol), "tokens": len(e)})
    return summary


def tau_counts(replies: list[dict]):
    from draftline.evaluate.stats import Counts

    return Counts.from_lengths([torch.tensor(r["accepted"], dtype=torch.long) for r in replies], K)


def compare_speculative(branch: dict, reference: dict, resamples: int = 2000) -> dict:
    """A branch's replies and tau against eager TP=1's on the same prompts (its own plain
    decode's counts are None where the branch ran none)."""
    from draftline.evaluate import stats
    from draftline.evaluate.in_vllm import first_difference

    spec = [r["tokens"] for r in branch["speculative"]["replies"]]
    ref_plain = reference["plain"]["tokens"]
    own_plain = branch["plain"]["tokens"] if "plain" in branch else None
    a, b = tau_counts(branch["speculative"]["replies"]), tau_counts(reference["speculative"]["replies"])
    counters = branch["speculative"]["counters"]
    return {
        "replies": len(spec),
        "equal_to_own_plain": (sum(s == p for s, p in zip(spec, own_plain, strict=True))
                               if own_plain is not None else None),
        "equal_to_eager_tp1_plain": sum(s == p for s, p in zip(spec, ref_plain, strict=True)),
        "plain_equal_to_eager_tp1_plain": (sum(p == q for p, q in zip(own_plain, ref_plain, strict=True))
                                           if own_plain is not None else None),
        "first_differences": [{"reply": i, **first_difference(p, s)}
                              for i, (s, p) in enumerate(zip(spec, ref_plain, strict=True)) if s != p],
        "drafts": counters["drafts"], "tau": 1 + counters["accepted"] / max(counters["drafts"], 1),
        "tau_minus_eager_tp1": stats.paired_difference(a, b, "tau", resamples, 0.95, 0),
        "engine_start_seconds": branch["engine_start_seconds"],
    }


# --------------------------------------------------------------------------- one target


def run_model(model: Model, root: Path, branches: dict | None = None, reuse: bool = False,
              own_plain: bool = False) -> dict:
    """Every branch on one tiny target (the speculative ones in ``branches``, default all);
    results.json in ``root``. ``own_plain``: every branch runs its own plain engine, not only
    eager TP=1. ``reuse``: keep the extraction rows and the speculative branches' records an
    earlier run left in ``root`` (the target is rebuilt byte for byte; the comparisons are
    made again)."""
    from safetensors.torch import load_file
    from transformers import GenerationConfig

    from draftline.tiny import reference
    from harness import drafts

    root.mkdir(parents=True, exist_ok=True)
    module, _, builder = model.build.rpartition(".")
    build = getattr(importlib.import_module(f"draftline.tiny.{module}"), builder)
    target = build(root / "target", num_layers=model.num_layers)
    hf_model = reference.load_hf_model(target)
    vocab = int(hf_model.config.vocab_size)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(7, vocab, (n,), generator=g).tolist() for n in EXTRACT_LENGTHS]
    hf = [reference.hf_hidden_states(hf_model, p) for p in prompts]
    hf_bf16_model = copy.deepcopy(hf_model).to(torch.bfloat16)
    hf_bf16 = [reference.hf_hidden_states(hf_bf16_model, p) for p in prompts]
    del hf_bf16_model
    wanted = [*model.aux_ids, model.num_layers]  # aux slots, then the final (normed) state
    slots = len(wanted)
    results: dict = {"model": model.name, "aux_ids": list(model.aux_ids), "extraction": {},
                     "speculative": {}, "tolerances": {"tp2": TP2_TOLERANCE, "bf16": BF16_TOLERANCE,
                                                       "served": SERVED_TOLERANCE}}
    rows = {}
    for name, change in EXTRACTIONS.items():
        options = options_for(target, model, **change)
        out = root / f"extract-{name}.safetensors"
        started = time.monotonic()
        if not (reuse and out.exists()):
            _job("extract", {"aux_ids": list(model.aux_ids), "prompts": prompts, "out": str(out)}, options)
        rows[name] = load_file(str(out))
        record = {"seconds": time.monotonic() - started,
                  "vs_hf": slot_errors(rows[name], lambda i: [hf[i][layer] for layer in wanted],
                                       prompts, slots),
                  "nearest_layer_is_named_layer": nearest_layers(rows[name], hf, prompts, wanted)}
        if name != "tp1":
            record["vs_tp1"] = slot_errors(rows[name], rows["tp1"], prompts, slots)
        if name == "bf16":
            record["vs_hf_tokens"] = token_summary(rows[name], lambda i: [hf[i][layer] for layer in wanted],
                                                   prompts, slots)
            hf_rows = {f"{i}.{slot}": hf_bf16[i][layer].float() for i in range(len(prompts))
                       for slot, layer in enumerate(wanted)}
            record["hf_bf16_vs_hf_tokens"] = token_summary(
                hf_rows, lambda i: [hf[i][layer] for layer in wanted], prompts, slots)
        results["extraction"][name] = record
        print(f"{model.name} extraction {name}: {json.dumps(record)}", flush=True)

    # The target's own greedy text (transformers), and a draft trained on it.
    spec_prompts = [torch.randint(7, vocab, (SPEC_PROMPT_LENGTH,), generator=g) for _ in range(SPEC_PROMPTS)]
    greedy = GenerationConfig(do_sample=False, max_new_tokens=SPEC_TOKENS, min_new_tokens=SPEC_TOKENS,
                              pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        sequences = [hf_model.generate(p[None], generation_config=greedy)[0] for p in spec_prompts]
    earlier = root / "results.json"
    earlier = json.loads(earlier.read_text())["speculative"] if reuse and earlier.exists() else {}
    started = time.monotonic()
    if set(branches or SPECULATIVE) - set(earlier):
        draft = drafts.overfit_draft(target, hf_model, sequences, list(model.aux_ids), root / "draft")
    results["draft_seconds"] = time.monotonic() - started
    capture_prompt = prompts[2]
    measured = {}
    branches = branches or SPECULATIVE
    if "eager-tp1" not in branches:
        raise ValueError("the speculative branches are compared with eager-tp1: include it")
    branches = {"eager-tp1": branches["eager-tp1"], **branches}  # the reference first
    for name, change in branches.items():
        if name in earlier:
            results["speculative"][name] = earlier[name]
            continue
        options = options_for(target, model, **change)
        request = {"draft": str(draft), "k": K, "prompts": [p.tolist() for p in spec_prompts],
                   "max_tokens": [SPEC_TOKENS] * SPEC_PROMPTS, "stop_ids": [],
                   "plain": own_plain or name == "eager-tp1"}
        served_path = root / f"served-{name}.safetensors"
        if name == "compiled":
            request["capture"] = {"prompt": capture_prompt, "out": str(served_path)}
        started = time.monotonic()
        measured[name] = _job("speculative", request, options)
        (root / f"replies-{name}.json").write_text(json.dumps(measured[name]))
        reference = measured.get("eager-tp1")
        if reference is None:  # kept by --reuse: its replies, as that run wrote them
            reference = json.loads((root / "replies-eager-tp1.json").read_text())
        record = compare_speculative(measured[name], reference)
        record["seconds"] = time.monotonic() - started
        if name == "compiled":
            served = load_file(str(served_path))
            record["served_aux_vs_stored_rows"] = [
                relative(served[str(slot)], rows["tp1"][f"2.{slot}"]) for slot in range(len(model.aux_ids))]
        results["speculative"][name] = record
        print(f"{model.name} speculative {name}: {json.dumps(record)}", flush=True)
    (root / "results.json").write_text(json.dumps(results, indent=2))
    return results


# --------------------------------------------------------------------------- table


def table(all_results: list[dict]) -> str:
    """The branch matrix as markdown: per branch and target, extraction's worst slot error
    against HF and TP=1, replies equal to the plain decode, tau and its difference to eager TP=1."""
    def worst(values):
        return f"{max(values):.2g}" if values else "-"

    lines = ["| branch | target | extract max rel. vs HF (per slot) | vs TP=1 | spec = eager TP=1 plain | "
             "tau | tau - eager TP=1 [95% CI] | other |",
             "|---|---|---|---|---|---|---|---|"]
    for branch, extraction, speculative in (("TP=2", "tp2", "tp2"), ("bf16", "bf16", None),
                                            ("compiled", None, "compiled"),
                                            ("compiled + TP=2", None, "compiled-tp2"),
                                            ("eager TP=1 (reference)", "tp1", "eager-tp1")):
        for r in all_results:
            e = r["extraction"].get(extraction) if extraction else None
            s = r["speculative"].get(speculative) if speculative else None
            vs_hf = "/".join(f"{v:.1g}" for v in e["vs_hf"]) if e else "eager only"
            if e and "vs_hf_tokens" in e:
                tokens, hf16 = e["vs_hf_tokens"], e["hf_bf16_vs_hf_tokens"]
                vs_hf = ("median token " + "/".join(f"{t['median']:.2g}" for t in tokens)
                         + f"; tokens > {BF16_TOLERANCE:g}: "
                         + "/".join(f"{t['share_beyond']:.1%}" for t in tokens)
                         + " (HF's own bf16: " + "/".join(f"{t['share_beyond']:.1%}" for t in hf16) + ")"
                         + "; worst token " + f"{max(t['max'] for t in tokens):.2g}")
            vs_tp1 = worst(e.get("vs_tp1", [])) if e else "-"
            if speculative and not s:
                spec, tau, diff = "not run (see --branches)", "-", "-"
            elif s:
                d = s["tau_minus_eager_tp1"]
                own = ("own plain not run" if s["equal_to_own_plain"] is None
                       else f"{s['equal_to_own_plain']}/{s['replies']}")
                spec = f"{s['equal_to_eager_tp1_plain']}/{s['replies']} (= own plain: {own})"
                tau = f"{s['tau']:.3f}"
                diff = f"{d['difference']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"
            else:
                spec, tau, diff = "not run (bf16: extraction only)", "-", "-"
            other = (f"served aux vs stored rows {worst(s['served_aux_vs_stored_rows'])}"
                     if s and "served_aux_vs_stored_rows" in s else "")
            lines.append(f"| {branch} | {r['model']} | {vs_hf} | {vs_tp1} | {spec} | {tau} | {diff} | {other} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in JOBS:  # the child side of run_job
        jobs.main(argv, jobs=JOBS, module="harness.branches")
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--root", default="runs/_branches", type=Path)
    parser.add_argument("--reuse", action="store_true", help="keep extraction rows already in --root")
    parser.add_argument("--branches", nargs="+", choices=list(SPECULATIVE), default=list(SPECULATIVE),
                        help="speculative branches (eager-tp1, the reference, always runs)")
    parser.add_argument("--own-plain", action="store_true",
                        help="every speculative branch also runs its own plain engine")
    args = parser.parse_args(argv)
    engine.fork_safe_cuda_checks()
    results = []
    for name in args.models:
        started = time.monotonic()
        results.append(run_model(MODELS[name], args.root / name, reuse=args.reuse, own_plain=args.own_plain,
                                 branches={"eager-tp1": {}, **{b: SPECULATIVE[b] for b in args.branches}}))
        print(f"{name}: {time.monotonic() - started:.0f} s", flush=True)
    print(table(results))
    (args.root / "table.md").write_text(table(results) + "\n")


if __name__ == "__main__":
    main()
