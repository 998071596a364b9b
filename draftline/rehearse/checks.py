"""The rehearsal's checks: each one the real run's code on the miniature, timed and logged.

* extraction: a few of tokenize's samples through extract's own path (speculators' patched
  generator started by extract's ``make_generator``, draftline.extract.shards writing real
  shards); every slot of every sample compared with transformers on the same miniature: the
  row must be nearest to the layer input it names, within the dtype's tolerance.
* speculative decoding: evaluate's measurement (draftline.serve.measure_replies, the draft in
  vLLM, greedy, one prompt at a time) against the plain engine's greedy decode of the same
  prompts; replies may differ in at most ``max_text_mismatches`` (evaluate's allowance for
  floating-point near-ties).
* `vllm serve`: make serve's command line (draftline.serve.serve_command) of miniature and
  draft, until it answers one completion request.

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

# max |row - transformers'| / max |transformers'| per slot: float32 end to end agrees to
# rounding; bf16 activations (or bf16 shards) leave about 1% (measured on the tiny targets),
# while the neighbouring layer's input differs by tens of percent.
TOLERANCE = {"float32": 1e-4, "other": 5e-2}


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


def tolerance(dtype: str, save_dtype: str) -> float:
    return TOLERANCE["float32"] if dtype == save_dtype == "float32" else TOLERANCE["other"]


def compare_rows(rows, reference: list, aux_layer_ids: Sequence[int], tol: float) -> list[float]:
    """Each slot's relative error against the transformers entry it names (aux id i: the input
    of layer i; the last slot: the final normed state); raises when a slot is off tolerance or
    nearer another layer's entry than its own."""
    import torch

    wanted = [*aux_layer_ids, len(reference) - 1]
    errors = []
    for slot, layer in enumerate(wanted):
        row = rows[:, slot].float()  # [T, H]
        distance = [float((row - ref).abs().max() / ref.abs().max().clamp(min=1e-12)) for ref in reference]
        nearest = int(torch.tensor(distance).argmin())
        if nearest != layer or distance[layer] > tol:
            raise AssertionError(
                f"slot {slot} should be transformers' hidden_states[{layer}] (relative error "
                f"{distance[layer]:.3g}, tolerance {tol:g}) but is nearest hidden_states[{nearest}] "
                f"({distance[nearest]:.3g}): the captured rows are not the layer inputs training uses")
        errors.append(distance[layer])
    return errors


def extraction(cfg_mini, make_generator: Callable, samples: list[list[int]],
               masks: list[list[int]], out_dir: Path, reference_model) -> tuple[dict, str]:
    """Extract's path on the miniature into ``out_dir``, then every slot against transformers."""
    from draftline import formats
    from draftline.extract import shards
    from draftline.pipeline.progress import TOKENS, Progress
    from draftline.rehearse import cost
    from draftline.tiny import miniature

    lengths = [len(s) for s in samples]
    plans = shards.plan_shards(lengths, int(cfg_mini.extract.shard_tokens))
    aux_ids = [int(i) for i in cfg_mini.model.aux_layer_ids]
    metadata = formats.shard_metadata("rehearsal", aux_ids, int(cfg_mini.model.hidden_size))
    started = time.monotonic()
    environment = dict(os.environ)  # make_generator sets vLLM's variables here, for this engine only
    generator = make_generator(cfg_mini)
    engine_ready = time.monotonic()
    log.info("extraction engine started in %.1f s", engine_ready - started)
    try:
        shards.extract_shards(generator, plans, samples, masks, out_dir, int(cfg_mini.extract.token_budget),
                              str(cfg_mini.extract.save_dtype), metadata,
                              Progress("rehearse extract", sum(lengths), unit=TOKENS, quiet=True))
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
              "engine_start_seconds": engine_ready - started}
    model, why = reference_model
    if model is None:
        record["compared_with_transformers"] = why
        return record, f"{len(samples)} samples, {sum(lengths)} tokens; not compared: {why}"
    tol = tolerance(str(cfg_mini.model.dtype), str(cfg_mini.extract.save_dtype))
    worst = [0.0] * (len(aux_ids) + 1)
    for plan in plans:
        rows = formats.read_shard_rows(out_dir / plan.name, range(len(plan.sample_ids)),
                                       (formats.HIDDEN_STATES, formats.INPUT_IDS))
        for row in rows:
            reference = miniature.reference_hidden_states(model, row[formats.INPUT_IDS].tolist())
            errors = compare_rows(row[formats.HIDDEN_STATES], reference, aux_ids, tol)
            worst = [max(a, b) for a, b in zip(worst, errors)]
    record.update(compared_with_transformers=True, max_relative_error=worst, tolerance=tol)
    return record, (f"{len(samples)} samples, {sum(lengths)} tokens, {len(aux_ids) + 1} slots = "
                    f"transformers' layer inputs {aux_ids} + final (max rel. error "
                    f"{max(worst):.2g} <= {tol:g})")


# --------------------------------------------------------------------------- speculative decoding


def prompts_of(samples: list[list[int]], masks: list[list[int]], max_prompt: int) -> list[list[int]]:
    """Each sample's tokens before its first reply (the whole sample when it has none)."""
    from draftline.regenerate import reply_spans

    prompts = []
    for ids, mask in zip(samples, masks, strict=True):
        spans = reply_spans(mask)
        prompts.append(ids[:spans[0][0]][-max_prompt:] if spans and spans[0][0] > 0 else ids[-max_prompt:])
    return prompts


def speculative(options, draft: Path, k: int, prompts: list[list[int]], max_tokens: int,
                stop_ids: list[int], max_mismatches: int) -> tuple[dict, str]:
    """The draft in vLLM, greedy, against the plain engine's greedy decode."""
    from draftline import serve
    from draftline.evaluate.in_vllm import first_difference

    caps = [max_tokens] * len(prompts)
    both = serve.speculative_and_plain(options, draft, k, prompts, caps, stop_ids)
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


def serving(options, draft: Path, k: int, prompt: list[int], max_tokens: int, log_path: Path,
            timeout: float) -> tuple[dict, str]:
    """`vllm serve` of miniature + draft (make serve's command line) answers one completion."""
    from draftline import serve

    port = _free_port()
    command = serve.serve_command(options, draft, k, host="127.0.0.1", port=port)
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
