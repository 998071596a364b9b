"""The target with its draft in vLLM: acceptance as vLLM counts it, and `vllm serve`.

vLLM is the component that serves the draft, so its own speculative decoding is the live
measurement: ``measure_replies`` decodes each held-out prompt greedily with the draft and
reads vLLM's spec-decode counters after every engine step, which gives the accepted draft
tokens of each verification step (one request at a time, so each step is one draft).
``generate_timed`` times a batch with or without the draft (benchmarks.serve), and
``serve_command`` is the `vllm serve` command line `make serve` runs.

vLLM sets up process-global state, so measurements run in a child process
(``python -m draftline.speculative.jobs <job> REQUEST OUT``) and hand back JSON.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from draftline.engine import EngineOptions, llm_kwargs, serve_args

log = logging.getLogger(__name__)

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def serve_command(options: EngineOptions, draft: str | Path, k: int, *, host: str, port: int,
                  extra: Sequence[str] = ()) -> list[str]:
    """`vllm serve` of the target with its draft: the command `make serve` runs (the engine
    evaluate measured, with ``engine.serving_differences`` applied)."""
    return ["vllm", "serve", *serve_args(options, draft, k, host=host, port=port), *extra]


# --------------------------------------------------------------------------- counters


@dataclasses.dataclass
class SpecCounters:
    """vLLM's cumulative spec-decode counters at one moment."""

    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: list[int]  # [k]: steps whose draft position j was accepted

    @classmethod
    def read(cls, engine, k: int) -> "SpecCounters":
        """From ``LLMEngine.get_metrics()`` (needs ``disable_log_stats=False``)."""
        counters, vectors = {}, {}
        for metric in engine.get_metrics():
            if hasattr(metric, "values"):
                vectors[metric.name] = list(metric.values)
            elif hasattr(metric, "value"):
                counters[metric.name] = counters.get(metric.name, 0) + metric.value
        per_pos = vectors.get(ACCEPTED_PER_POS, [0] * k)
        if len(per_pos) != k:
            raise RuntimeError(f"vLLM reports {len(per_pos)} draft positions, expected k={k}")
        return cls(int(counters.get(DRAFTS, 0)), int(counters.get(DRAFT_TOKENS, 0)),
                   int(counters.get(ACCEPTED, 0)), [int(v) for v in per_pos])

    def minus(self, other: "SpecCounters") -> "SpecCounters":
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted,
                            [a - b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos,
                                                   strict=True)])

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- jobs (child side)


def _sampling(max_tokens: int, stop_ids: Sequence[int]):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=int(max_tokens),
                          stop_token_ids=[int(s) for s in stop_ids], detokenize=False)


def _measure_replies(request: dict) -> dict:
    """Each prompt alone, greedy, with the draft: its tokens and accepted count per step."""
    from vllm import LLM

    options, k = EngineOptions(**request["options"]), int(request["k"])
    llm = LLM(**llm_kwargs(options, request["draft"], k))
    result = measure_on(llm, request)
    _shutdown(llm)
    return result


def measure_on(llm, request: dict) -> dict:
    """``_measure_replies`` on an engine already started with the draft (a job that also
    reads something else from the same engine)."""
    from vllm import TokensPrompt

    k = int(request["k"])
    engine = llm.llm_engine
    replies = []
    for index, (prompt, max_tokens) in enumerate(zip(request["prompts"], request["max_tokens"],
                                                     strict=True)):
        engine.add_request(f"reply-{index}", TokensPrompt(prompt_token_ids=list(prompt)),
                           _sampling(max_tokens, request["stop_ids"]))
        before, steps, tokens = SpecCounters.read(engine, k), [], []
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    tokens = list(output.outputs[0].token_ids)
            now = SpecCounters.read(engine, k)
            delta = now.minus(before)
            before = now
            if delta.drafts > 1:
                raise RuntimeError(f"one engine step of one request verified {delta.drafts} "
                                   "drafts: per-step acceptance cannot be attributed")
            if delta.drafts == 1:
                accepted = delta.accepted_per_pos
                if accepted != sorted(accepted, reverse=True) or sum(accepted) != delta.accepted:
                    raise RuntimeError(f"vLLM's per-position counts {accepted} are not one "
                                       f"accepted prefix of {delta.accepted} tokens")
                steps.append(delta.accepted)
        replies.append({"tokens": tokens, "accepted": steps})
    totals = SpecCounters.read(engine, k)
    return {"replies": replies, "counters": totals.as_dict()}


def _generate_timed(request: dict) -> dict:
    """All prompts in one batch, with or without the draft: tokens out and wall seconds."""
    from vllm import LLM, TokensPrompt

    options = EngineOptions(**request["options"])
    k = request.get("k")
    llm = LLM(**llm_kwargs(options, request.get("draft"), k))
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in request["prompts"]]
    params = [_sampling(m, request["stop_ids"]) for m in request["max_tokens"]]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up, not timed
    before = SpecCounters.read(llm.llm_engine, k) if request.get("draft") else None
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    if before is not None:
        result["counters"] = SpecCounters.read(llm.llm_engine, k).minus(before).as_dict()
    _shutdown(llm)
    return result


def _shutdown(llm) -> None:
    """End the engine's processes now: a second engine in the same job must not share the
    cores with the first one's workers."""
    llm.llm_engine.engine_core.shutdown()


def _speculative_and_plain(request: dict) -> dict:
    """The rehearsal's pair in one process, vLLM imported once: each prompt decoded with the
    draft (``_measure_replies``), then all of them by the plain engine (``_generate_timed``)."""
    speculative = _measure_replies(request)
    return {"speculative": speculative,
            "plain": _generate_timed({**request, "draft": None, "k": None})}


def decode_batch(llm, prompts: Sequence[Sequence[int]], max_tokens: int, stop_ids: Sequence[int],
                 k: int | None) -> dict:
    """All prompts at once, greedy, stepping the engine by hand: each prompt's tokens and, with
    a draft, the accepted draft tokens of each of its verification steps, plus wall seconds.

    A request's first output comes from its prefill (one token, no draft verified); every
    later step that gives it tokens verified one draft of k and gave 1 + accepted tokens. Its
    last step is not counted: a stop token or the token cap cuts the tokens it gave, not what
    vLLM accepted. vLLM's own counters over the batch (``counters``) are kept beside them.
    """
    from vllm import TokensPrompt

    engine = llm.llm_engine
    before = SpecCounters.read(engine, k) if k else None
    params = _sampling(max_tokens, stop_ids)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"b-{index}", TokensPrompt(prompt_token_ids=list(prompt)), params)
    given = [0] * len(prompts)
    steps: list[list[int]] = [[] for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished_requests():
        for output in engine.step():
            index = int(output.request_id.split("-")[1])
            now = list(output.outputs[0].token_ids)
            new = len(now) - given[index]
            if new > 0 and given[index] > 0 and not output.finished:
                steps[index].append(new - 1)
            given[index] = len(now)
            if output.finished:
                tokens[index] = now
    seconds = time.perf_counter() - start
    result = {"tokens": tokens, "seconds": seconds, "output_tokens": sum(map(len, tokens))}
    if k:
        result["accepted"] = steps
        result["counters"] = SpecCounters.read(engine, k).minus(before).as_dict()
    return result


def _render(tokenizer, messages: list[dict], tools: list[dict], template_kwargs: dict) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                        tokenize=True, **template_kwargs)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def _benchmark(request: dict) -> dict:
    """Benchmarks' prompts decoded greedily with the draft, one engine for all of them, turn by
    turn (a later turn is asked after the target's own earlier answers); then, when ``plain``
    is set, the same rendered prompts by the plain engine for the speed-up. ``benchmarks``:
    name -> items (``turns``, ``tools``, ``system``, ``tools_in_system``: the tools as that
    system text, for a template that renders none)."""
    from vllm import LLM

    options, k = EngineOptions(**request["options"]), int(request["k"])
    kwargs = dict(request.get("chat_template_kwargs") or {})
    llm = LLM(**llm_kwargs(options, request["draft"], k))
    tokenizer = llm.get_tokenizer()
    out, rendered = {}, {}
    for name, items in request["benchmarks"].items():
        histories = []
        for item in items:
            system = "\n\n".join(filter(None, [item.get("system"), item.get("tools_in_system")]))
            histories.append([{"role": "system", "content": system}] if system else [])
        turns, rendered[name] = [], []
        for turn in range(max(len(item["turns"]) for item in items)):
            asked = [i for i, item in enumerate(items) if turn < len(item["turns"])]
            prompts = []
            for i in asked:
                histories[i].append({"role": "user", "content": items[i]["turns"][turn]})
                tools = [] if items[i].get("tools_in_system") else items[i].get("tools", [])
                prompts.append(_render(tokenizer, histories[i], tools, kwargs))
            decoded = decode_batch(llm, prompts, int(request["max_tokens"]), request["stop_ids"], k)
            for j, i in enumerate(asked):
                histories[i].append({"role": "assistant", "content": tokenizer.decode(
                    decoded["tokens"][j], skip_special_tokens=True)})
            turns.append({"items": asked, "prompts": prompts, **decoded})
            rendered[name].append(prompts)
        out[name] = {"turns": turns}
    _shutdown(llm)
    if request.get("plain"):
        llm = LLM(**llm_kwargs(options, None, None))
        for name, turns in rendered.items():
            out[name]["plain"] = [decode_batch(llm, prompts, int(request["max_tokens"]),
                                               request["stop_ids"], None) for prompts in turns]
        _shutdown(llm)
    return out


def _decode_batch(request: dict) -> dict:
    """``decode_batch`` of token prompts on an engine with the draft (``draft``/``k``) or without."""
    from vllm import LLM

    options, k = EngineOptions(**request["options"]), request.get("k")
    llm = LLM(**llm_kwargs(options, request.get("draft"), k))
    result = decode_batch(llm, request["prompts"], int(request["max_tokens"]), request["stop_ids"], k)
    _shutdown(llm)
    return result


JOBS = {"measure-replies": _measure_replies, "generate-timed": _generate_timed,
        "speculative-and-plain": _speculative_and_plain, "benchmark": _benchmark,
        "decode-batch": _decode_batch}


# --------------------------------------------------------------------------- jobs (parent side)


def run_job(job: str, request: dict, options: EngineOptions, timeout: float = 3600,
            module: str = __name__, jobs: dict | None = None) -> dict:
    """Run one job in a child process (``python -m <module> job REQUEST OUT``: this module's
    JOBS, or another module's ``jobs`` served by its own ``main``); its full output is raised
    on failure."""
    if job not in (JOBS if jobs is None else jobs):
        raise ValueError(f"unknown job {job!r}; jobs: {sorted(JOBS if jobs is None else jobs)}")
    with tempfile.TemporaryDirectory() as tmp:
        request_path, out_path = Path(tmp) / "request.json", Path(tmp) / "out.json"
        request_path.write_text(json.dumps({**request, "options": dataclasses.asdict(options)}))
        command = [sys.executable, "-m", module, job, str(request_path), str(out_path)]
        env = {**os.environ, **options.environment()}
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        if result.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"vLLM job {job} failed (exit {result.returncode}):\n"
                               f"{result.stdout[-20000:]}\n{result.stderr[-20000:]}")
        return json.loads(out_path.read_text())


def measure_replies(options: EngineOptions, draft: str | Path, k: int,
                    prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                    stop_ids: Sequence[int]) -> dict:
    """vLLM's greedy speculative decoding of each prompt: tokens and per-step acceptance."""
    return run_job("measure-replies", {
        "draft": str(draft), "k": int(k), "prompts": [list(map(int, p)) for p in prompts],
        "max_tokens": [int(m) for m in max_tokens], "stop_ids": [int(s) for s in stop_ids]}, options)


def generate_timed(options: EngineOptions, draft: str | Path | None, k: int | None,
                   prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                   stop_ids: Sequence[int]) -> dict:
    """One timed batch, with the draft or (``draft=None``) without it."""
    return run_job("generate-timed", {
        "draft": None if draft is None else str(draft), "k": k,
        "prompts": [list(map(int, p)) for p in prompts],
        "max_tokens": [int(m) for m in max_tokens], "stop_ids": [int(s) for s in stop_ids]}, options)


def speculative_and_plain(options: EngineOptions, draft: str | Path, k: int,
                          prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                          stop_ids: Sequence[int]) -> dict:
    """``measure_replies`` and the plain engine's ``generate_timed`` of the same prompts, in
    one child process: {"speculative": ..., "plain": ...}."""
    return run_job("speculative-and-plain", {
        "draft": str(draft), "k": int(k), "prompts": [list(map(int, p)) for p in prompts],
        "max_tokens": [int(m) for m in max_tokens], "stop_ids": [int(s) for s in stop_ids]}, options)


def main(argv: list[str], jobs: dict | None = None, module: str = __name__) -> None:
    """``python -m draftline.speculative.jobs JOB REQUEST OUT``: the child side of ``run_job``
    (another module's ``main`` passes its own ``jobs``)."""
    jobs = JOBS if jobs is None else jobs
    if len(argv) != 3 or argv[0] not in jobs:
        raise SystemExit(f"usage: python -m {module} {{{','.join(jobs)}}} REQUEST OUT")
    logging.basicConfig(level=logging.INFO)
    result = jobs[argv[0]](json.loads(Path(argv[1]).read_text()))
    Path(argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
