"""The rehearsal's checks: each one the real run's code on the miniature, timed and logged.

* extraction: a few of tokenize's samples through extract's own path (speculators' patched
  generator started by extract's ``make_generator``, extract's own writer writing real
  shards); every slot of every sample compared with transformers on the same miniature: the
  row must be nearest to the layer input it names, within the dtype's tolerance.
* speculative decoding: evaluate's measurement (draftline.speculative.jobs.measure_replies, the
  draft in vLLM, greedy, one prompt at a time) against the plain engine's greedy decode of the same
  prompts; replies may differ in at most ``max_text_mismatches`` (evaluate's allowance for
  floating-point near-ties).
* `vllm serve`: make serve's command line (draftline.speculative.jobs.serve_command) of
  miniature and draft, until it answers one completion request.

A failing check raises: the rehearsal stops there, its traceback ends the stage non-zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger("draftline.rehearse")

# Per token, |row - transformers'| / |transformers'| (norms over the hidden width). float32 end
# to end agrees to rounding on every token. bf16 activations leave about 1% on a typical token
# (a few roundings of 2^-8; the Qwen3-MoE miniature at TP 2: median 0.8-0.9% per slot), while
# the neighbouring layer's input differs by tens of percent (48-133% there); so the median
# token must be within 5%. Through MoE layers a few tokens go further: where two experts'
# router scores are within bf16's rounding of each other, the rounded run picks the other
# expert and that token's state moves by an expert's output (20-40% measured in the tiny
# DeepseekV3; 5-28% in the Qwen3-MoE miniature, 5-8% of its final normed state).
# transformers' own bf16 run flips as many tokens of the tiny DeepseekV3 against its float32
# run (1-3% of tokens past 5%, harness/branches.py), the Qwen3-MoE miniature's bf16 engine
# 2.0-4.3% per slot, so up to FLIPPED_SHARE of the tokens may.
TOLERANCE = {"float32": 1e-4, "other": 5e-2}
FLIPPED_SHARE = {"float32": 0.0, "other": 0.05}
# Storing in another dtype than the engine computed in (fp8 shards of a bf16 run) rounds every
# value once more, by at most half a step of the stored dtype at that value (e4m3: 2^-4 of the
# value; 2^-10 of the row's scale for values under 2^-6 of it). storage_rounding() sums those
# half steps over the row, from the stored values themselves, and a token counts against the
# rule only by what its error exceeds that bound: by the triangle inequality a row within the
# tolerance before storage is within the tolerance plus the bound after it, so whatever passes
# unrounded passes stored, and a token past both was past the tolerance before storage. The
# price is a looser token test where storage rounds: 5% plus 4.5-5.0% for fp8, still a fifth
# of the way to the nearest neighbouring layer (48% in the Qwen3-MoE miniature; the slot's
# layer is checked apart, compare_rows). Measured there (TP 2, hidden 512, 832 tokens per
# slot): fp8-rounding transformers' own float32 rows moves them 2.2-3.0% (median 2.6%: e4m3's
# steps do not average out over the width), the bound says 4.5-5.0% (uniform rounding errors
# give 1/sqrt(3) of it: 0.48-0.63 measured); the bf16 engine's rows leave 2.0/3.5/4.3/3.1% of
# the slots' tokens past 5% as bf16 shards, 2.2/3.5/4.7/5.9% as fp8 shards judged without the
# bound (the reported failure), 2.0/1.0/0.4/0.0% with it. No allowance where the stored dtype
# is the engine's (nothing was rounded): float32 end to end stays at 1e-4 and no flips.


@dataclasses.dataclass
class Result:
    name: str
    passed: bool
    seconds: float
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name:<22} {self.seconds:7.1f} s  {self.detail}"


class Rehearsal:
    """Runs checks in order, logs one line per check, keeps the results for the manifest."""

    def __init__(self) -> None:
        self.results: list[Result] = []

    def check(self, name: str, work: Callable[[], tuple[object, str]]):
        """``work()`` returns (value, one-line detail); its exception fails the check."""
        start = time.monotonic()
        try:
            value, detail = work()
        except BaseException as error:
            result = Result(name, False, time.monotonic() - start, f"{type(error).__name__}: "
                            + (str(error).strip().splitlines() or [""])[0][:200])
            self.results.append(result)
            log.error("%s", result.line())
            raise
        result = Result(name, True, time.monotonic() - start, detail)
        self.results.append(result)
        log.info("%s", result.line())
        return value

    def record(self) -> list[dict]:
        return [dataclasses.asdict(r) for r in self.results]


# --------------------------------------------------------------------------- extraction


def precision(dtype: str, save_dtype: str) -> str:
    return "float32" if dtype == save_dtype == "float32" else "other"


def tolerance(dtype: str, save_dtype: str) -> float:
    return TOLERANCE[precision(dtype, save_dtype)]


def token_errors(row, reference):
    """Per token, the relative error of ``row`` [T, H] against ``reference`` [T, H]."""
    row, reference = row.float(), reference.float()
    return (row - reference).norm(dim=-1) / reference.norm(dim=-1).clamp(min=1e-12)


def nearest_layer(row, reference: list) -> tuple[int, list[float]]:
    """The transformers entry ``row`` [T, H] is nearest by its median token, and the median
    token's distance to each entry."""
    distance = [float(token_errors(row, ref).median()) for ref in reference]
    return min(range(len(distance)), key=distance.__getitem__), distance


def summarize(errors, tol: float, allowance=None) -> dict:
    """One slot's token errors: the median and worst token, the share of tokens past ``tol``
    (past ``tol`` plus their ``allowance`` where given: see storage_rounding)."""
    excess = errors if allowance is None else errors - allowance
    record = {"median": float(errors.median()), "max": float(errors.max()),
              "share_beyond": float((excess > tol).float().mean())}
    if allowance is not None:
        record.update(median_beyond_rounding=float(excess.median()), median_allowance=float(allowance.median()))
    return record


def storage_rounding(values, scales=None):
    """Per row of stored hidden states [..., H] (fp8: with their scales [...]), a bound on
    |stored - what the engine computed| (the norm over H): each value within half a step of the
    stored dtype at it (fp8: in its scale's units). float32's roundings around the fp8 cast
    (dividing by the scale, multiplying back: 2^-24 of a value each) stay far inside what the
    bound charges the row's largest value, which fp8 stores exactly (448) but counts a half
    step (16 of its scale's 448)."""
    import torch

    stored = values.float()  # exact: every stored dtype here fits in float32
    info = torch.finfo(values.dtype)
    _, exponent = torch.frexp(stored)  # |v| in [2^(exponent-1), 2^exponent)
    binade = torch.ldexp(torch.ones_like(stored), exponent - 1).masked_fill(stored == 0, 0)
    half_step = binade.clamp(min=info.tiny) * (info.eps / 2)  # below tiny: subnormal steps
    if scales is not None:
        half_step = half_step * scales.float()[..., None]
    return half_step.norm(dim=-1)


def compare_rows(rows, reference: list, aux_layer_ids: Sequence[int]) -> list:
    """Per slot, each token's relative error against the transformers entry the slot names
    (aux id i: the input of layer i; the last slot: the final normed state). Raises when a
    slot's median token is nearer another layer's entry than its own."""
    wanted = [*aux_layer_ids, len(reference) - 1]
    errors = []
    for slot, layer in enumerate(wanted):
        row = rows[:, slot]  # [T, H]
        nearest, distance = nearest_layer(row, reference)
        if nearest != layer:
            raise AssertionError(
                f"slot {slot} should be transformers' hidden_states[{layer}] (median relative "
                f"error {distance[layer]:.3g}) but is nearest hidden_states[{nearest}] "
                f"({distance[nearest]:.3g}): the captured rows are not the layer inputs training uses")
        errors.append(token_errors(row, reference[layer]))
    return errors


def judge(errors: list, tol: float, flipped_share: float, allowances: list | None = None) -> list[dict]:
    """Each slot's token errors (one tensor per slot, every sample's tokens) against the
    rule: the median token within ``tol``, at most ``flipped_share`` of the tokens past it.
    ``allowances`` (per slot, per token, relative like the errors): the storage's rounding
    bound, added to ``tol`` token by token. Returns per slot median, worst and that share;
    raises naming the first slot off it."""
    summary = []
    for slot, e in enumerate(errors):
        allowance = None if allowances is None else allowances[slot]
        record = summarize(e, tol, allowance)
        share, median = record["share_beyond"], record.get("median_beyond_rounding", record["median"])
        if median > tol or share > flipped_share:
            beyond = f"{tol:g}" if allowance is None else (
                f"{tol:g} + the shards' rounding bound (median {record['median_allowance']:.3g})")
            raise AssertionError(
                f"slot {slot}: median token relative error {record['median']:.3g} and "
                f"{share:.1%} of {len(e)} tokens beyond {beyond} (allowed: median <= {tol:g}"
                f"{'' if allowance is None else ' + rounding'}, share <= {flipped_share:.0%}; "
                f"worst token {record['max']:.3g})")
        summary.append(record)
    return summary


def extraction(cfg_mini, samples: list[list[int]], masks: list[list[int]], out_dir: Path,
               reference_model) -> tuple[dict, str]:
    """Extract's path on the miniature into ``out_dir`` (its generator, its writer: the
    engine's rank 0 unless the run says otherwise), then every slot against transformers."""
    from draftline import formats
    from draftline.extract import shards, writer
    from draftline.extract.generator import make_generator
    from draftline.extract.run import write_shards
    from draftline.extract.settings import ExtractSettings
    from draftline.pipeline.progress import TOKENS, Progress
    from draftline.rehearse import cost

    lengths = [len(s) for s in samples]
    plans = shards.plan_shards(lengths, int(cfg_mini.extract.shard_tokens))
    aux_ids = [int(i) for i in cfg_mini.model.aux_layer_ids]
    metadata = formats.shard_metadata("rehearsal", aux_ids, int(cfg_mini.model.hidden_size))
    started = time.monotonic()
    environment = dict(os.environ)  # make_generator sets vLLM's variables here, for this engine only
    generator = make_generator(cfg_mini)
    engine_ready = time.monotonic()
    log.info("extraction engine started in %.1f s", engine_ready - started)
    split = writer.TimeSplit()
    try:
        settings = ExtractSettings.from_config(cfg_mini.extract)
        write_shards(settings, generator, plans, settings.job(samples, masks, out_dir, metadata),
                     Progress("rehearse extract", sum(lengths), unit=TOKENS, quiet=True), split)
    except BaseException as error:
        raise RuntimeError(f"extraction failed {time.monotonic() - engine_ready:.1f} s after its engine "
                           f"started ({engine_ready - started:.1f} s to start)") from error
    finally:
        generator.shutdown()
        os.environ.clear()
        os.environ.update(environment)
    written = sum((out_dir / p.name).stat().st_size for p in plans)
    # The cost line's formula on the shards extract's own code just wrote.
    estimated = cost.shard_bytes(sum(lengths), len(aux_ids) + 1, int(cfg_mini.model.hidden_size),
                                 str(cfg_mini.extract.save_dtype))
    record = {"samples": len(samples), "tokens": sum(lengths), "shards": len(plans),
              "shard_bytes": written, "estimated_bytes": estimated,
              "engine_start_seconds": engine_ready - started,
              "time_split": split.record(str(cfg_mini.extract.writer))}
    model, why = reference_model
    if model is None:
        record["compared_with_transformers"] = why
        return record, f"{len(samples)} samples, {sum(lengths)} tokens; not compared: {why}"
    from draftline.rehearse.reference import reference_hidden_states

    dtype, save_dtype = str(cfg_mini.model.dtype), str(cfg_mini.extract.save_dtype)
    kind = precision(dtype, save_dtype)
    tol = TOLERANCE[kind]
    errors, allowances = compare_shards([out_dir / p.name for p in plans], aux_ids, dtype,
                                        lambda ids: reference_hidden_states(model, ids))
    summary = judge(errors, tol, FLIPPED_SHARE[kind], allowances)
    record.update(compared_with_transformers=True,
                  max_relative_error=[r["max"] for r in summary],
                  median_relative_error=[r["median"] for r in summary],
                  share_beyond_tolerance=[r["share_beyond"] for r in summary],
                  tolerance=tol, flipped_share_allowed=FLIPPED_SHARE[kind],
                  rounding_allowance_median=[r.get("median_allowance") for r in summary])
    plus = "" if allowances is None else (
        f" + {save_dtype} rounding, median {max(r['median_allowance'] for r in summary):.2g}")
    return record, (f"{len(samples)} samples, {sum(lengths)} tokens, {len(aux_ids) + 1} slots = "
                    f"transformers' layer inputs {aux_ids} + final (median token rel. error "
                    f"{max(r['median'] for r in summary):.2g} <= {tol:g}{plus}; tokens beyond it "
                    f"{max(r['share_beyond'] for r in summary):.1%} <= "
                    f"{FLIPPED_SHARE[kind]:.0%}; worst token {max(r['max'] for r in summary):.2g})")


def compare_shards(paths: Sequence[Path], aux_ids: Sequence[int], engine_dtype: str,
                   reference_of: Callable[[list[int]], list]) -> tuple[list, list | None]:
    """Every sample of the shards at ``paths`` against ``reference_of(its ids)`` (transformers'
    layer inputs and final state, compare_rows): per slot, each token's relative error and,
    where the shards hold a dtype other than ``engine_dtype`` (the engine's rows were rounded
    to store them), that rounding's bound relative to transformers' row (storage_rounding);
    None where nothing was rounded."""
    import torch

    from draftline import formats

    errors, allowances, rounded = [[] for _ in aux_ids] + [[]], [[] for _ in aux_ids] + [[]], False
    for path in paths:
        stored = formats.read_shard(path)
        values, scales = stored[formats.HIDDEN_STATES], stored.get(formats.HIDDEN_SCALES)
        rounded = values.dtype != getattr(torch, engine_dtype)
        offsets = stored[formats.SAMPLE_OFFSETS].tolist()
        for span in (slice(a, b) for a, b in zip(offsets[:-1], offsets[1:])):
            sample = values[span], None if scales is None else scales[span]
            reference = reference_of(stored[formats.INPUT_IDS][span].tolist())
            bound = storage_rounding(*sample)  # [T, slots]
            for slot, e in enumerate(compare_rows(formats.dequantize(*sample), reference, aux_ids)):
                layer = [*aux_ids, len(reference) - 1][slot]
                errors[slot].append(e)
                allowances[slot].append(bound[:, slot] / reference[layer].norm(dim=-1).clamp(min=1e-12))
    return [torch.cat(e) for e in errors], [torch.cat(a) for a in allowances] if rounded else None


# --------------------------------------------------------------------------- speculative decoding


def prompts_of(samples: list[list[int]], masks: list[list[int]], max_prompt: int) -> list[list[int]]:
    """Each sample's tokens before its first reply (the whole sample when it has none)."""
    from draftline.regenerate.greedy import reply_spans

    prompts = []
    for ids, mask in zip(samples, masks, strict=True):
        spans = reply_spans(mask)
        prompts.append(ids[:spans[0][0]][-max_prompt:] if spans and spans[0][0] > 0 else ids[-max_prompt:])
    return prompts


def speculative(options, draft: Path, k: int, prompts: list[list[int]], max_tokens: int,
                stop_ids: list[int], max_mismatches: int) -> tuple[dict, str]:
    """The draft in vLLM, greedy, against the plain engine's greedy decode."""
    from draftline.speculative import jobs
    from draftline.evaluate.in_vllm import first_difference

    caps = [max_tokens] * len(prompts)
    both = jobs.speculative_and_plain(options, draft, k, prompts, caps, stop_ids)
    measured, plain = both["speculative"], both["plain"]
    mismatched = [{"prompt": i, **first_difference(p, m["tokens"])}
                  for i, (m, p) in enumerate(zip(measured["replies"], plain["tokens"], strict=True))
                  if m["tokens"] != p]
    counters = measured["counters"]
    tau = 1 + counters["accepted"] / max(counters["drafts"], 1)
    record = {"prompts": len(prompts), "max_tokens": max_tokens, "k": k, "mismatched": mismatched,
              "counters": counters, "tau": tau}
    if counters["drafts"] == 0:
        raise AssertionError(f"vLLM verified no drafts on {len(prompts)} prompts: the draft never ran")
    if len(mismatched) > max_mismatches:
        raise AssertionError(f"greedy speculative decoding differs from the plain engine on "
                             f"{len(mismatched)} of {len(prompts)} prompts (evaluate.vllm."
                             f"max_text_mismatches={max_mismatches}): {mismatched[:3]}")
    return record, (f"greedy equal to the plain engine on {len(prompts) - len(mismatched)}/"
                    f"{len(prompts)} prompts ({len(mismatched)} near-ties allowed up to "
                    f"{max_mismatches}), {counters['drafts']} drafts of k={k}, tau {tau:.2f}")


# --------------------------------------------------------------------------- vllm serve


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, timeout: float = 5) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _stop(process: subprocess.Popen) -> None:
    """End the server this check started (its own process group), then wait for it."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _tail(path: Path, chars: int = 12000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def harmony_vocab_loads(model_type: str) -> None:
    """vLLM 0.16's OpenAI server renders and stops gpt-oss replies with openai_harmony, whose
    encoding needs the o200k_base vocab file (downloaded, or read from the folder named by
    TIKTOKEN_ENCODINGS_BASE, checked against its sha256); without it `vllm serve` exits at
    start. Raises one line saying so, in a second, before a server is started."""
    if model_type != "gpt_oss":
        return
    from openai_harmony import HarmonyEncodingName, HarmonyError, load_harmony_encoding

    try:
        load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except HarmonyError as error:
        raise RuntimeError(  # the remedy first: the FAIL line keeps the first 200 characters
            f"gpt-oss: `vllm serve` needs openai_harmony's o200k_base vocab: set TIKTOKEN_ENCODINGS_BASE "
            f"to a folder holding o200k_base.tiktoken, or rehearse.skip=[serve] ({error})") from error


def serving(options, draft: Path, k: int, prompt: list[int], max_tokens: int, log_path: Path,
            timeout: float) -> tuple[dict, str]:
    """`vllm serve` of miniature + draft (make serve's command line) answers one completion."""
    from draftline.speculative import jobs

    harmony_vocab_loads(json.loads((Path(options.target) / "config.json").read_text()).get("model_type", ""))
    port = _free_port()
    command = jobs.serve_command(options, draft, k, host="127.0.0.1", port=port)
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", *command[1:]]
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with open(log_path, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **options.environment()})
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"`vllm serve` exited with {process.returncode} before answering; "
                                   f"its log ({log_path}) ends:\n{_tail(log_path)}")
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"`vllm serve` not healthy after {timeout:.0f} s; its log "
                                   f"({log_path}) ends:\n{_tail(log_path)}")
            with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
                if _get(f"{base}/health") == 200:
                    break
            time.sleep(1)
        ready = time.monotonic() - started
        reply = _post(f"{base}/v1/completions", {"model": options.target, "prompt": list(prompt),
                                                 "max_tokens": max_tokens, "temperature": 0}, timeout)
    finally:
        _stop(process)
    choices = reply.get("choices") or []
    completion = int((reply.get("usage") or {}).get("completion_tokens") or 0)
    if not choices or completion < 1:
        raise AssertionError(f"`vllm serve` answered without a completion: {reply}")
    record = {"command": command, "ready_seconds": ready, "completion_tokens": completion,
              "finish_reason": choices[0].get("finish_reason"), "log": str(log_path)}
    return record, (f"healthy after {ready:.0f} s, one completion of {completion} tokens "
                    f"({choices[0].get('finish_reason')})")
