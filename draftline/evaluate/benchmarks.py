"""tau on standard benchmarks, measured by vLLM's own greedy speculative decoding.

Published drafts are judged this way: the serving engine decodes each benchmark prompt
greedily with the draft (k speculative tokens) and counts tokens per verification step. For
the benchmarks in ``evaluate.benchmarks.names`` (prompts: draftline.public.prompts) one child
process (draftline.speculative.jobs, job ``benchmark``) renders the prompts with the target's chat
template and decodes each benchmark's prompts in one batch with the draft, turn by turn
(MT-Bench's second turn follows the target's own first answer), then, for the speed-up,
decodes the same rendered prompts with the plain engine (one engine start each).

What each benchmark reports:

* ``vllm``: tau and acceptance at each position with percentile-bootstrap CIs over prompts
  (an MT-Bench question's two turns are one unit). Each verification step's accepted count is
  read from the tokens the step gave its request (``jobs.decode_batch``); a request's last
  step is left out (a stop or the cap cuts its tokens, not vLLM's verdict).
* ``vllm_counters``: tau from vLLM's own counters over the same batches (every step,
  the last ones too), beside the per-prompt figure.
* ``baselines``: the frequency drafts of the offline evaluation (training-split counts)
  walked over the same replies: greedy replies are the target's own, so every offline verdict
  is the one vLLM would give them.
* ``speedup``: output tokens/s with the draft / without it, same prompts, same batch, same
  engine settings, on this machine.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger("draftline.evaluate")


def items_for(name: str, assets_dir: str | Path, max_prompts: int | None, tools_rendered: bool) -> list[dict]:
    """The benchmark's first ``max_prompts`` items, tools moved to the system turn where the
    template renders none."""
    from draftline.public import prompts

    items = prompts.load(name, assets_dir)[: max_prompts or None]
    for item in items:
        if item["tools"] and not tools_rendered:
            item["tools_in_system"] = prompts.tools_in_system(item["tools"])
    return items


def _token_sample(prompt: list[int], reply: list[int]):
    """An offline Sample of a greedy reply: no features (the frequency drafts need none); the
    target's next token at each reply position is the reply's own next token."""
    from draftline.evaluate.offline import Sample

    ids = torch.tensor(list(prompt) + list(reply), dtype=torch.long)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[len(prompt):] = True
    following = torch.cat([ids[1:], torch.tensor([-1])])
    return Sample(input_ids=ids, loss_mask=mask, aux=torch.zeros(len(ids), 0), target_next=following)


def summarize(name: str, items: list[dict], measured: dict, k: int, baselines: list, stats: dict) -> dict:
    """The benchmark's figures from the job's output (see the module docstring)."""
    from draftline.evaluate.offline import simulate
    from draftline.evaluate.stats import Counts, bootstrap

    per_item: list[list[int]] = [[] for _ in items]
    replies: list[list[tuple[list[int], list[int]]]] = [[] for _ in items]
    drafts = accepted = 0
    for turn in measured["turns"]:
        for j, i in enumerate(turn["items"]):
            per_item[i].extend(turn["accepted"][j])
        counters = turn["counters"]
        drafts, accepted = drafts + counters["drafts"], accepted + counters["accepted"]
    for turn, prompts in zip(measured["turns"], measured["prompts"], strict=True):
        for j, i in enumerate(turn["items"]):
            replies[i].append((prompts[j], turn["tokens"][j]))
    counts = Counts.from_lengths([torch.tensor(steps, dtype=torch.long) for steps in per_item], k)
    result = {"benchmark": name, "prompts": len(items),
              "turns": sum(len(item["turns"]) for item in items),
              "vllm": bootstrap(counts, **stats),
              "vllm_counters": {"tau": 1 + accepted / max(drafts, 1), "drafts": drafts, "accepted": accepted},
              "output_tokens": sum(t["output_tokens"] for t in measured["turns"]),
              "tools_in_system": any("tools_in_system" in item for item in items)}
    result["counts_per_prompt"] = counts.at_least.tolist()
    result["baselines"] = {}
    for proposer in baselines:
        lengths = []
        for item_replies in replies:
            sims = simulate(proposer, [_token_sample(p, r) for p, r in item_replies], k)
            lengths.append(torch.cat([s.accepted[s.steps] for s in sims]) if sims
                           else torch.zeros(0, dtype=torch.long))
        result["baselines"][proposer.name] = bootstrap(Counts.from_lengths(lengths, k), **stats)
    if measured.get("plain"):
        spec_s = sum(t["seconds"] for t in measured["turns"])
        plain_s = sum(p["seconds"] for p in measured["plain"])
        plain_tokens = sum(p["output_tokens"] for p in measured["plain"])
        result["speedup"] = {
            "with_draft_tokens_per_s": result["output_tokens"] / spec_s,
            "plain_tokens_per_s": plain_tokens / plain_s,
            "ratio": (result["output_tokens"] / spec_s) / (plain_tokens / plain_s),
            "with_draft_seconds": spec_s, "plain_seconds": plain_s,
            "same_text": sum(a == b for t, p in zip(measured["turns"], measured["plain"], strict=True)
                             for a, b in zip(t["tokens"], p["tokens"], strict=True)),
        }
    return result


def run(cfg, draft: Path, k: int, baselines: list, stats: dict,
        plain_from: dict | None = None) -> dict | None:
    """Every configured benchmark, or None when none is.

    ``plain_from``: another draft's results on the same benchmarks, whose plain decode (the
    same target, prompts and settings: greedy replies do not depend on the draft) gives this
    draft's speed-up instead of decoding without a draft once more."""
    from omegaconf import OmegaConf

    from draftline import engine
    from draftline.public import prompts
    from draftline.regenerate import greedy
    from draftline.speculative import jobs

    settings = cfg.evaluate.benchmarks
    if not settings.names:  # not asked for: nothing was skipped
        return None
    template_kwargs = OmegaConf.to_container(cfg.tokenize.chat_template_kwargs)
    tools_rendered = prompts.template_renders_tools(cfg.model.path, template_kwargs)
    options = engine.engine_options(cfg, settings)
    stop_ids = greedy.stop_token_ids(cfg.model.path)
    every = {name: items_for(name, cfg.assets_dir, settings.max_prompts, tools_rendered)
             for name in settings.names}
    log.info("benchmarks %s: %s prompts, up to %d new tokens each, k=%d (vLLM, greedy, a batch per turn)",
             list(every), [len(items) for items in every.values()], int(settings.max_new_tokens), k)
    decoded = jobs.run_job("benchmark", {
        "draft": str(Path(draft).absolute()), "k": int(k), "benchmarks": every,
        "max_tokens": int(settings.max_new_tokens), "stop_ids": [int(s) for s in stop_ids],
        "chat_template_kwargs": template_kwargs,
        "plain": bool(settings.speedup) and plain_from is None}, options,
        timeout=float(settings.timeout_s))
    results = {}
    for name, items in every.items():
        measured = decoded[name]
        measured["prompts"] = [turn.pop("prompts") for turn in measured["turns"]]
        results[name] = summarize(name, items, measured, k, baselines, stats)
        reference = ((plain_from or {}).get("per_benchmark", {}).get(name) or {}).get("speedup")
        if reference:
            seconds = sum(t["seconds"] for t in measured["turns"])
            rate = results[name]["output_tokens"] / seconds
            results[name]["speedup"] = {
                "with_draft_tokens_per_s": rate, "with_draft_seconds": seconds,
                "plain_tokens_per_s": reference["plain_tokens_per_s"],
                "plain_seconds": reference["plain_seconds"],
                "ratio": rate / reference["plain_tokens_per_s"],
                "plain_from": "the run's own draft's plain decode of the same prompts"}
        found = results[name]
        log.info("benchmark %s: tau %.3f [%.3f, %.3f] (vLLM counters %.3f), acceptance %s; "
                 "baselines %s; speed-up %s", name, found["vllm"]["tau"], *found["vllm"]["tau_ci"],
                 found["vllm_counters"]["tau"], [round(a, 3) for a in found["vllm"]["acceptance"]],
                 {b: round(v["tau"], 3) for b, v in found["baselines"].items()},
                 round(found["speedup"]["ratio"], 3) if "speedup" in found else "not measured")
    return {"k": int(k), "max_new_tokens": int(settings.max_new_tokens), "max_prompts": settings.max_prompts,
            "tools_rendered_by_template": tools_rendered, "per_benchmark": results}
