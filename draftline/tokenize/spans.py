"""Render a conversation with the target's chat template; find what the target generated.

For assistant message ``k`` the span is every character of its turn after the generation
prompt: the reasoning the template keeps, the text, the tool-call section and the end-of-turn
marker.  Never a role header, a tool result, the declared tools, a system or user turn.

* **Prefix renders** (the usual case).  The span starts where the render of ``messages[:k]``
  *with* the generation prompt stops agreeing with the render of ``messages[:k+1]`` (so the
  header is excluded even when the prompt adds e.g. ``<think>`` that history renders
  differently) and ends at the end of the render of ``messages[:k+1]`` (so the end-of-turn
  marker is included: the draft must learn to stop).  Tool turns and calls need no code of
  their own: they are messages like the others, rendered by the template.
* **Search**, when ``messages[:k+1]`` does not render as a prefix of the whole conversation
  because the template rewrites history depending on what follows (Qwen3 and Kimi drop the
  reasoning of earlier turns).  The turn is found in the whole render after the previous
  turn: its role header (the text the generation prompt shares with the turn rendered last),
  then its anchor (its text, or for a reply with no text its first call's name), and it ends
  where the turn rendered last and the whole render stop agreeing after the anchor.

:func:`render_conversation` then checks that the render kept what the record says the
target did (:class:`UnfaithfulRender` names the reason, callers count it as a skip):
every reply's text (``reply_not_rendered``) and calls (``tool_call_not_rendered``), every
tool result (``tool_result_not_rendered``) and declared tool (``tools_not_rendered``).
Reasoning the template drops from earlier turns is counted, not refused: that is how the
target sees its own history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from jinja2.exceptions import TemplateError

from draftline.errors import DataError

__all__ = ["ChatTemplateError", "Rendered", "UnfaithfulRender", "assistant_char_spans",
           "render_conversation"]

Span = tuple[int, int]  # [start, end) character offsets into the full render
SampleLabel = int | str | None  # only used to name the sample in error messages
Template = Mapping[str, Any] | None  # keyword arguments of apply_chat_template: tools, thinking, ...


class ChatTemplateError(DataError):
    """The template/tokenizer pair cannot be rendered or masked for this sample."""

    reason = "template_error"  # the skip reason callers count it under


class UnfaithfulRender(ChatTemplateError):
    """The render leaves out part of what the record says happened; ``reason`` names what."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def _label(sample: SampleLabel) -> str:
    return "conversation" if sample is None else f"sample {sample}"


def _render(tokenizer: Any, messages: Sequence[dict], generation_prompt: bool, sample: SampleLabel,
            template: Template = None) -> str:
    """Render ``messages`` to text; template failures name the sample and prefix length."""
    try:
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt, **(template or {}))
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise ChatTemplateError(
            f"{_label(sample)}: chat template failed on messages[:{len(messages)}] "
            f"(add_generation_prompt={generation_prompt}): {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(text, str):
        raise ChatTemplateError(f"{_label(sample)}: apply_chat_template returned {type(text).__name__}")
    return text


def _common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):  # the usual case, decided in C rather than a Python loop
        return len(a)
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _span_by_prefix(tokenizer: Any, messages: Sequence[dict], k: int, full: str, sample: SampleLabel,
                    template: Template) -> Span | None:
    """Span of assistant message ``k`` from prefix renders, or None if the template rewrites history."""
    through = _render(tokenizer, messages[: k + 1], False, sample, template)
    if not full.startswith(through):
        return None
    before = _render(tokenizer, messages[:k], True, sample, template)
    start = _common_prefix_len(before, through)
    if messages[k]["content"].strip() not in through[start:]:
        return None  # the generation prompt overlaps the content: boundary is unreliable
    return start, len(through)


def _anchor(message: dict, k: int, sample: SampleLabel) -> str:
    """Text every render of the reply shows: its content, else its first call's name."""
    anchor = message["content"].strip() or next(
        (call["function"]["name"] for call in message.get("tool_calls", ())), "")
    if not anchor:
        raise ChatTemplateError(f"{_label(sample)}: assistant message {k} has neither text nor "
                                "tool calls to find it by")
    return anchor


def _find_after_reasoning(text: str, anchor: str, message: dict, lo: int) -> int:
    """First ``anchor`` at or after ``lo``, past the reply's reasoning if that comes first
    (reasoning may quote the reply's text or the tool it is about to call)."""
    found = text.find(anchor, lo)
    reasoning = (message.get("reasoning_content") or "").strip()
    at = text.find(reasoning, lo) if reasoning else -1
    if 0 <= at <= found:
        found = text.find(anchor, at + len(reasoning))
    return found


def _locate(full: str, headers: list[str], anchor: str, message: dict, cursor: int) -> tuple[int, int]:
    """``(turn start, anchor position)`` in ``full`` after ``cursor``: after the first header
    followed by the anchor before that header occurs again, else at the anchor (-1: none)."""
    for header in filter(None, headers):
        at = full.find(header, cursor)
        if at < 0:
            continue
        head_end = at + len(header)
        again = full.find(header, head_end)
        begin = _find_after_reasoning(full, anchor, message, head_end)
        if begin < 0:  # the reply starts with what the prompt ends with (e.g. <think>)
            begin = _find_after_reasoning(full, anchor, message, at)
        if begin >= 0 and (again < 0 or begin < again):
            return min(begin, head_end), begin
    begin = _find_after_reasoning(full, anchor, message, cursor)
    return begin, begin


def _span_by_search(tokenizer: Any, messages: Sequence[dict], k: int, full: str, cursor: int,
                    sample: SampleLabel, template: Template) -> Span:
    """Locate assistant message ``k`` in ``full`` at or after ``cursor`` (see the module doc).

    The header is the generation prompt, or failing that the part of it the turn rendered last
    shares (history may render without the ``<think>`` a prompt opens).
    """
    message = messages[k]
    through = _render(tokenizer, messages[: k + 1], False, sample, template)
    before = _render(tokenizer, messages[:k], True, sample, template)
    history = _render(tokenizer, messages[:k], False, sample, template)
    start = _common_prefix_len(before, through)
    turn = min(start, _common_prefix_len(history, through))
    prompt = before[len(history) :] if before.startswith(history) else ""
    anchor = _anchor(message, k, sample)
    first, begin = _locate(full, [prompt, through[turn:start]], anchor, message, cursor)
    if begin < 0:
        raise UnfaithfulRender("reply_not_rendered", (
            f"{_label(sample)}: assistant message {k} does not occur in the rendered text after "
            f"offset {cursor}; content starts {message['content'].strip()[:60]!r}"))
    found = _find_after_reasoning(through, anchor, message, start)
    if found < 0:
        found = _find_after_reasoning(through, anchor, message, turn)
    end = begin + len(anchor)
    if found >= 0:  # the rest of the turn (calls, end marker) as far as both renders agree
        end += _common_prefix_len(through[found + len(anchor) :], full[end:])
    return first, end


def _render_template(tools: Sequence[dict] | None, template: Template) -> Template:
    return {**(template or {}), **({"tools": list(tools)} if tools else {})}


def assistant_char_spans(tokenizer: Any, messages: Sequence[dict], sample: SampleLabel = None,
                         template: Template = None) -> tuple[str, list[Span]]:
    """Render ``messages`` and return ``(full_text, spans)`` of assistant turns (see the module
    doc).  ``template``: keyword arguments of ``apply_chat_template`` (``tools``, ``thinking``...)."""
    if not messages:
        raise ChatTemplateError(f"{_label(sample)}: no messages")
    first = next((m for m in messages if m["role"] != "system"), None)
    if first is not None and first["role"] == "assistant":
        raise ChatTemplateError(
            f"{_label(sample)}: the conversation starts with an assistant turn; chat templates "
            "need a user turn before the first reply (the loader drops leading assistant turns)"
        )
    full = _render(tokenizer, messages, False, sample, template)
    spans: list[Span] = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        previous_end = spans[-1][1] if spans else 0
        span = _span_by_prefix(tokenizer, messages, k, full, sample, template)
        if span is None or span[0] < previous_end:
            history = _render(tokenizer, messages[:k], False, sample, template)
            cursor = max(previous_end, _common_prefix_len(history, full))
            span = _span_by_search(tokenizer, messages, k, full, cursor, sample, template)
        spans.append(span)
    return full, spans


# --------------------------------------------------------------------------- faithfulness


@dataclass(frozen=True)
class Rendered:
    """The whole render, the reply spans, and what the template did with tool traces.

    ``tool_after[i]`` says whether tool results come between reply span ``i`` (after merging
    spans that touch, as token masks do) and the next one: the reply's prompt for what follows
    needs the tool's execution.  ``num_reasoning`` counts replies with reasoning,
    ``num_reasoning_dropped`` those whose reasoning the template left out of this render.
    """

    text: str
    spans: list[Span]
    tool_after: list[bool]
    num_reasoning: int = 0
    num_reasoning_dropped: int = 0


def _check_replies(full: str, messages: Sequence[dict], spans: list[Span], sample: SampleLabel) -> int:
    """Raise UnfaithfulRender for a reply whose text or calls are missing from its span;
    return how many replies' reasoning is missing (counted, not refused)."""
    replies = [(k, m) for k, m in enumerate(messages) if m["role"] == "assistant"]
    dropped = 0
    for (k, message), (a, b) in zip(replies, spans, strict=True):
        turn = full[a:b]
        if message["content"].strip() not in turn:
            raise UnfaithfulRender("reply_not_rendered", f"{_label(sample)}: the template leaves the "
                                   f"text of assistant message {k} out of its turn")
        for call in message.get("tool_calls", ()):
            if call["function"]["name"] not in turn:
                raise UnfaithfulRender("tool_call_not_rendered", (
                    f"{_label(sample)}: the template leaves the call to {call['function']['name']!r} "
                    f"of assistant message {k} out of its turn"))
        reasoning = (message.get("reasoning_content") or "").strip()
        dropped += bool(reasoning) and reasoning not in turn
    return dropped


def _check_context(tokenizer: Any, full: str, spans: list[Span], messages: Sequence[dict],
                   sample: SampleLabel, template: Template) -> None:
    """Raise UnfaithfulRender for a tool result the prompt text leaves out (the replies' spans
    may quote it), or declared tools the template ignores (it renders the same without them)."""
    cuts = [0, *(pos for span in spans for pos in span), len(full)]
    prompt = "\x00".join(full[a:b] for a, b in zip(cuts[::2], cuts[1::2]))
    for k, message in enumerate(messages):
        if message["role"] == "tool" and message["content"].strip() not in prompt:
            raise UnfaithfulRender("tool_result_not_rendered",
                                   f"{_label(sample)}: the template leaves tool result {k} out")
    if template and template.get("tools"):
        bare = {key: value for key, value in template.items() if key != "tools"}
        if _render(tokenizer, messages, False, sample, bare) == full:
            raise UnfaithfulRender("tools_not_rendered", (
                f"{_label(sample)}: the template ignores the record's declared tools "
                f"({', '.join(t['function']['name'] for t in template['tools'])})"))


def _tool_after(messages: Sequence[dict], spans: list[Span]) -> list[bool]:
    """Per group of touching spans (one token-mask run): tool results before the next group."""
    replies = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    groups: list[list[int]] = []  # first and last reply index of each run
    last_end = None
    for k, (a, b) in zip(replies, spans, strict=True):
        if a == b:
            continue  # renders to nothing: no tokens, no run
        if groups and a == last_end:
            groups[-1][1] = k
        else:
            groups.append([k, k])
        last_end = b
    bounds = [g[0] for g in groups[1:]] + [len(messages)]
    return [any(messages[j]["role"] == "tool" for j in range(g[1] + 1, nxt))
            for g, nxt in zip(groups, bounds)]


def render_conversation(tokenizer: Any, messages: Sequence[dict], sample: SampleLabel = None,
                        tools: Sequence[dict] | None = None, template: Template = None) -> Rendered:
    """:func:`assistant_char_spans` with the record's ``tools``, checked for faithfulness."""
    template = _render_template(tools, template)
    full, spans = assistant_char_spans(tokenizer, messages, sample, template)
    dropped = _check_replies(full, messages, spans, sample)
    _check_context(tokenizer, full, spans, messages, sample, template)
    num_reasoning = sum(bool((m.get("reasoning_content") or "").strip()) for m in messages)
    return Rendered(full, spans, _tool_after(messages, spans), num_reasoning, dropped)
