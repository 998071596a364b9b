"""Each assistant reply as the target generates it (``tokenize.reasoning: as_generated``, issue 43).

Serving, the target gets the history as its template shows history (thinking templates drop
the reasoning of finished turns) plus the generation prompt, and then writes its reply:
reasoning, end of thinking, text, tool calls, end-of-turn marker.  A render of the whole record
shows every reply the way *later* prompts show it, so for a thinking target it trains each
finished reply without the reasoning the target wrote.

For reply ``k`` of ``messages``, :func:`reply_as_generated` finds, as text, the prompt
``apply_chat_template(messages[:k], add_generation_prompt=True)`` and the reply as the template
renders it right after that prompt.  The reply is the rest of a template render that has the
prompt's history rendered as an exact prefix; three renders are tried, and the first that shows
the reply's reasoning (or any, for a reply without reasoning) is taken:

1. ``messages[:k+1]``: the usual case (Qwen3 shows the last reply's reasoning).
2. the same with the reasoning of the earlier replies removed: templates that re-render history
   once a later reply exists (Kimi drops an unfinished tool loop's reasoning as soon as a reply
   without calls follows) keep the prompt as a prefix then.
3. the same with the template's own switch to keep reasoning (:data:`PRESERVE`): templates that
   never show the reasoning of a final reply (Kimi: reasoning only after the last reply without
   calls, so never on that reply itself).

Renders 2 and 3 are taken only where their generation prompt is the real one and the reply's
turn they show, less the reasoning, is the turn render 1 ends with: the changed history or the
switch changed nothing else.  Where no render qualifies (a generation prompt that opens a think
block the history never shows, as DeepSeek-R1's own template does), the reply cannot be
established exactly and the function returns None: the caller trains it as the whole render
shows it and counts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from draftline.tokenize import chat
from draftline.tokenize.spans import (ChatTemplateError, Rendered, SampleLabel, Template, _render,
                                      _render_template, _tool_after, render_conversation)
from draftline.tokenize.traces import THINK_OPEN

__all__ = ["PRESERVE", "SETTINGS", "Generated", "check_setting", "describe", "generated_windows",
           "reply_as_generated", "thinking_template"]

# tokenize.reasoning: the reply as the target generates it, the whole record as the template
# renders it, or the whole record with the template's own switch to keep every reply's reasoning.
SETTINGS = ("as_generated", "template", "preserve")
# The switch the thinking templates draftline knows take (Kimi-K2.5's name for it).  Templates
# that take no such argument ignore it: the render is the same with it.
PRESERVE = {"preserve_thinking": True}


def check_setting(value: Any) -> str:
    """``tokenize.reasoning`` as given, or ValueError naming the choices."""
    if value not in SETTINGS:
        raise ValueError(f"tokenize.reasoning must be one of {', '.join(SETTINGS)}, got {value!r}")
    return value


def describe(tokenize: dict, regenerate: dict | None = None) -> list[tuple[str, str]]:
    """``(what, value)`` rows of the reasoning a run trained, from the tokenize and regenerate
    manifests (``make status`` and the report show them)."""
    trained = tokenize.get("reasoning_trained")
    if not trained:
        return []
    chosen = trained.get("chosen", "configured")
    rows = [("tokenize.reasoning", f"{trained['setting']} ({chosen})"),
            ("reasoning trained (data)", f"{trained['replies']} of {tokenize['reasoning']['replies']} replies "
                                         f"with reasoning, {trained['tokens']} tokens")]
    extra = tokenize.get("as_generated")
    if extra:
        rows.append(("as_generated prompts (data)", f"{extra['extra_samples']} extra samples, "
                     f"{extra['extra_prefix_tokens']} prompt tokens ({extra['overhead_fraction']:.1%} of "
                     f"{extra['tokens']})"))
    if regenerate and regenerate.get("form") == "turns":
        g = regenerate["generation"]
        rows.append(("target replies", f"turn by turn after the server's prompt; split by "
                     f"{regenerate.get('reasoning_parser') or 'no reasoning parser'}: {g['with_reasoning']} of "
                     f"{g['stopped']} finished replies with reasoning; {g['rerendered']} render back as "
                     f"generated, {g['rerender_differs']} otherwise"))
    return rows


@dataclass(frozen=True)
class Generated:
    """Reply ``k``'s prompt (the server's render of ``messages[:k]`` with the generation prompt)
    and the reply's text as the target writes it after that prompt; ``shows_reasoning`` says
    whether the reply's reasoning is in it (False also for a reply without reasoning)."""

    prompt: str
    reply: str
    shows_reasoning: bool


def _reasoning(message: dict) -> str:
    return (message.get("reasoning_content") or "").strip()


def _without_reasoning(messages: Sequence[dict]) -> list[dict]:
    return [{key: value for key, value in m.items() if key != "reasoning_content"} for m in messages]


def _shows_turn(message: dict, text: str) -> bool:
    """The reply's text and every call it makes are in ``text`` (the checks of the whole render)."""
    return message["content"].strip() in text and all(
        call["function"]["name"] in text for call in message.get("tool_calls", ()))


def _candidates(messages: Sequence[dict], k: int, template: Template) -> list[tuple[list[dict], dict]]:
    """Histories and template arguments of the renders 2 and 3 (see the module doc)."""
    history, arguments = list(messages[:k]), dict(template or {})
    out = []
    if any(_reasoning(m) for m in history):
        out.append((_without_reasoning(history), arguments))
    if not all(arguments.get(key) == value for key, value in PRESERVE.items()):
        out.append((history, {**arguments, **PRESERVE}))
    return out


def reply_as_generated(tokenizer: Any, messages: Sequence[dict], k: int, sample: SampleLabel = None,
                       template: Template = None) -> Generated | None:
    """Assistant message ``k`` as the target generates it after its prompt (see the module
    doc); None where no render establishes it exactly.  ``template``: keyword arguments of
    ``apply_chat_template``, the declared tools included."""
    reply = messages[k]
    if reply["role"] != "assistant":
        raise ValueError(f"messages[{k}] is a {reply['role']!r} turn, not an assistant reply")
    prompt = _render(tokenizer, messages[:k], True, sample, template)
    plain = _render(tokenizer, messages[: k + 1], False, sample, template)
    reasoning = _reasoning(reply)
    fallback = None
    if plain.startswith(prompt) and _shows_turn(reply, plain[len(prompt) :]):
        text = plain[len(prompt) :]
        if not reasoning or reasoning in text:
            return Generated(prompt, text, bool(reasoning))
        fallback = Generated(prompt, text, False)
    history = _render(tokenizer, messages[:k], False, sample, template)
    if not prompt.startswith(history):
        return fallback  # no generation prompt to compare the other renders' with
    generation_prompt = prompt[len(history) :]
    for other_history, arguments in _candidates(messages, k, template):
        head = _render(tokenizer, other_history, True, sample, arguments)
        through = _render(tokenizer, [*other_history, reply], False, sample, arguments)
        if not (through.startswith(head) and head.endswith(generation_prompt)):
            continue
        text = through[len(head) :]
        bare = text.replace(reasoning, "", 1) if reasoning else text
        if not (plain.endswith(text) or plain.endswith(bare)) or not _shows_turn(reply, text):
            continue  # it changed more of the reply's turn than its reasoning
        if not reasoning or reasoning in text:
            return Generated(prompt, text, bool(reasoning))
        fallback = fallback or Generated(prompt, text, False)
    return fallback


# --------------------------------------------------------------------------- thinking targets

_PROBE = "Probe reasoning 7f3a."  # text no template writes of its own accord


def thinking_template(tokenizer: Any) -> bool:
    """Whether the target's chat template is a thinking model's: it takes ``reasoning_content``
    (shows it in a render, with or without :data:`PRESERVE`, or names it) or writes a think
    block.  ``make init`` writes ``tokenize.reasoning: as_generated`` for these."""
    source = str(tokenizer.chat_template)  # a dict of named templates reads as its text too
    if "reasoning_content" in source:
        return True
    user = {"role": "user", "content": "Hi."}
    reply = {"role": "assistant", "content": "Hello.", "reasoning_content": _PROBE}
    renders = []
    for messages, prompt, arguments in (([user], True, None), ([user, reply], False, None),
                                        ([user, reply], False, PRESERVE)):
        try:
            renders.append(_render(tokenizer, messages, prompt, None, arguments))
        except ChatTemplateError:
            continue  # a template that refuses the probe shows nothing by it
    return any(_PROBE in text or THINK_OPEN in text for text in renders)


# --------------------------------------------------------------------------- samples


@dataclass(frozen=True)
class _Samples:
    """One window's samples as generated, each with the index of its last reply (-1 for the
    whole render), and per reply ``(index, its reasoning in a mask)``."""

    samples: list[tuple[Any, int]]
    trained: list[tuple[int, bool]]
    reused: int
    as_template: list[int]
    left_out: int


def _encode_sample(tokenizer: Any, messages: Sequence[dict], text: str, spans: dict[int, tuple[int, int]],
                   last: int, sample: SampleLabel):
    """``text`` (a render of ``messages[:last+1]``, whole or up to reply ``last``) masked on
    ``spans`` (reply index -> characters); tool marks as for a whole render."""
    replies = [k for k, m in enumerate(messages[: last + 1]) if m["role"] == "assistant"]
    every = [spans.get(k, (0, 0)) for k in replies]  # empty: not trained here
    rendered = Rendered(text, [s for s in every if s[0] < s[1]], _tool_after(messages[: last + 1], every))
    return chat._encode_rendered(tokenizer, rendered, sample)


def _as_generated(tokenizer: Any, messages: Sequence[dict], sample: SampleLabel,
                  tools: Sequence[dict] | None, template: Template) -> _Samples:
    """The whole render, masked on the replies it shows after their own prompts (and on those
    not established as generated: trained as it shows them); then, latest reply first, each
    other reply after its prompt, masked exactly on the reply, inside a later reply's sample
    where that one starts with it (a call's prompt and reply head the prompt of the reply after
    its results), else in a sample of its own."""
    rendered = render_conversation(tokenizer, messages, sample, tools, template)
    arguments = _render_template(tools, template)
    replies = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    whole: dict[int, tuple[int, int]] = {}
    pending, trained, as_template = [], [], []
    for k, (a, b) in zip(replies, rendered.spans, strict=True):
        found = reply_as_generated(tokenizer, messages, k, sample, arguments)
        if found is None or not found.reply:
            whole[k] = (a, b)
            as_template.append(k)
            trained.append((k, _reasoning(messages[k]) in rendered.text[a:b]))
            continue
        trained.append((k, found.shows_reasoning))
        text = found.prompt + found.reply
        if (a, b) == (len(found.prompt), len(text)) and rendered.text.startswith(text):
            whole[k] = (a, b)  # the whole render already shows it after its own prompt
        else:  # never trained in a form the target did not write
            pending.append((k, found))
    reused = len(whole) - len(as_template)
    hosts: list[tuple[str, dict[int, tuple[int, int]], int]] = []  # (text, spans, last reply)
    for k, found in reversed(pending):
        text = found.prompt + found.reply
        span = (len(found.prompt), len(text))
        host = next((h for h in hosts if h[0].startswith(text)), None)
        if host is None:
            hosts.append((text, {k: span}, k))
        else:
            host[1][k] = span
    samples = []
    if whole:
        samples.append((_encode_sample(tokenizer, messages, rendered.text, whole, len(messages) - 1, sample),
                        -1))
    for text, spans, last in reversed(hosts):  # in reply order
        samples.append((_encode_sample(tokenizer, messages, text, spans, last, sample), last))
    return _Samples(samples, trained, reused, as_template, int(not whole))


def generated_windows(tokenizer: Any, messages: Sequence[dict], max_length: int, sample: SampleLabel,
                      tools: Sequence[dict] | None, template: Template) -> chat.Windows:
    """A conversation's samples with ``tokenize.reasoning: as_generated`` (the windows of
    :func:`draftline.tokenize.chat.template_windows`).

    A conversation that fits gives the samples of :func:`_as_generated`.  A longer one is cut
    into the same windows as the whole render's (a call and its results stay together), and each
    window gives its own: the window is the conversation its replies' prompts start with.  A
    sample longer than ``max_length`` is cut there if some of its reply survives, else dropped
    (``dropped_exchanges``: the window's exchange, or the one reply).
    """
    conversation = _as_generated(tokenizer, messages, sample, tools, template)
    total = sum(sum(s.loss_mask) for s, _ in conversation.samples)
    counts = chat._reasoning_trained(tokenizer, messages, conversation.trained)
    if all(len(s.input_ids) <= max_length for s, _ in conversation.samples):
        parts, windows = [conversation], [None]
    else:
        windows = chat.plan_windows(tokenizer, messages, max_length, sample, tools, template)
        parts = [_as_generated(tokenizer, w.messages, sample, tools, template) for w in windows]
    kept, dropped, extra, prefix = [], [], 0, 0
    as_template, reused, left_out = [], 0, 0
    for window, part in zip(windows, parts, strict=True):
        where = (lambda k: k) if window is None else window.index
        for encoded, k in part.samples:
            if len(encoded.input_ids) > max_length:
                if not any(encoded.loss_mask[:max_length]):  # its prompt alone fills max_length
                    first, last = (window.start, window.end) if k < 0 else (where(k), where(k) + 1)
                    dropped.append(chat.DroppedExchange(first, last, len(encoded.input_ids)))
                    continue
                encoded = chat._truncated(encoded, max_length, sample)
            kept.append(encoded)
            if k >= 0:  # a sample built for replies: its unmasked tokens are their prompts
                extra += 1
                prefix += len(encoded.input_ids) - sum(encoded.loss_mask)
        as_template += [where(k) for k in part.as_template]
        reused += part.reused
        left_out += part.left_out
    if not kept:
        raise chat.EmptyLossMaskError(
            f"{chat._label(sample)}: no assistant tokens within max_length={max_length} "
            f"({sum(len(s.input_ids) for s, _ in conversation.samples)} tokens in all as generated)")
    return chat.Windows(kept, total, sum(sum(s.loss_mask) for s in kept), dropped, **counts,
                        num_extra_samples=extra, num_extra_prefix_tokens=prefix, num_reused=reused,
                        as_template=as_template, num_left_out=left_out)
