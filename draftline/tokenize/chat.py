"""Tokenize a rendered conversation and mask what the target generated.

Why not offsets or ``return_assistant_tokens_mask``: Kimi-K2.5 ships a slow,
TikToken-based ``PreTrainedTokenizer`` (no offset mapping) and most chat
templates have no ``{% generation %}`` blocks.  Everything here uses only
``apply_chat_template(..., tokenize=False)``, plain encoding and ``decode``,
which every tokenizer class has.

Masking works in two stages.

1. **Characters** (:mod:`draftline.tokenize.spans`): the whole render and, per
   assistant turn, the span the target generated (after its generation prompt,
   through its end-of-turn marker, tool calls and kept reasoning included).

2. **Tokens.**  ``prefix`` strategy: encode ``full`` once and each span
   boundary prefix ``full[:b]``; if every boundary encoding is a prefix of
   ``full``'s ids (true whenever boundaries sit next to special tokens), the
   spans map to token ranges exactly.  If a BPE merge crosses a boundary,
   ``segments`` strategy: encode the pieces between boundaries separately and
   concatenate; accepted only if the ids decode to ``full`` (or to what
   ``full``'s own ids decode to, for tokenizers whose decode is not lossless).
   Otherwise :class:`ChatTemplateError` names the sample.

Templates render the BOS token themselves, so encoding never adds special
tokens (the same convention as ``apply_chat_template(tokenize=True)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from bisect import bisect_left
from itertools import pairwise
from typing import Any, Sequence

from draftline.errors import DataError
from draftline.tokenize.spans import (
    ChatTemplateError,
    SampleLabel,
    Span,
    Template,
    _common_prefix_len,
    Rendered,
    _label,
    assistant_char_spans,
    render_conversation,
)

__all__ = [
    "ChatTemplateError",
    "DroppedExchange",
    "EmptyLossMaskError",
    "EncodedConversation",
    "Windows",
    "assistant_char_spans",
    "encode_conversation",
    "template_windows",
    "tokenize_conversation",
]

# The offsets shortcut of the prefix strategy (fast tokenizers); off only to compare the two.
USE_OFFSETS = True


class EmptyLossMaskError(DataError):
    """No assistant token survives (after truncation); callers may skip it under a budget."""


@dataclass(frozen=True)
class EncodedConversation:
    """Token ids and loss mask of one conversation, plus how they were obtained.

    ``num_truncated`` counts tokens dropped by ``max_length`` so callers can
    report truncation; ``strategy`` is ``"prefix"`` or ``"segments"``.  ``tool_results``
    is 1 on the unmasked tokens after a reply up to the next one when tool results are among
    them (what regenerate must not continue past with a new reply), and empty when the
    conversation has none.
    """

    input_ids: list[int]
    loss_mask: list[int]
    num_truncated: int
    strategy: str
    tool_results: list[int] = field(default_factory=list)


# --------------------------------------------------------------------------- tokenizing


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Ids of ``text`` without added BOS/EOS (the template already rendered them)."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _token_boundary(tokenizer: Any, full: str, ids: list[int], char_pos: int) -> int | None:
    """Token index of ``char_pos`` if ``full[:char_pos]`` encodes to a prefix of ``ids``."""
    if char_pos == len(full):
        return len(ids)
    head = _encode(tokenizer, full[:char_pos])
    return len(head) if ids[: len(head)] == head else None


def _mask_by_prefix(tokenizer: Any, full: str, spans: list[Span]) -> tuple[list[int], list[int]] | None:
    """Encode ``full`` once; map spans to tokens via prefix encodings, or None if one is not a prefix."""
    ids = _encode(tokenizer, full)
    mask = [0] * len(ids)
    for start, end in spans:
        first = _token_boundary(tokenizer, full, ids, start)
        last = _token_boundary(tokenizer, full, ids, end)
        if first is None or last is None:
            return None
        mask[first:last] = [1] * (last - first)
    return ids, mask


def _offset_boundary(starts: list[int], ends: list[int], char_pos: int, length: int) -> int | None:
    """Token index at ``char_pos`` if one token ends and the next starts exactly there."""
    if char_pos in (0, length):
        return 0 if char_pos == 0 else len(starts)
    t = bisect_left(starts, char_pos)  # first token starting at or after char_pos
    if 0 < t < len(starts) and starts[t] == char_pos and ends[t - 1] == char_pos:
        return t
    return None


def _mask_by_offsets(tokenizer: Any, full: str, spans: list[Span]) -> tuple[list[int], list[int]] | None:
    """One encode with offsets (fast tokenizers only); None unless every boundary is clean.

    A shortcut for the prefix strategy: where a token ends and the next starts exactly at
    each span boundary, the boundary encodings are prefixes of ``full``'s ids in practice
    (boundaries sit next to special tokens).  Anything less clean (offsets trimmed around
    spaces, a token across the boundary) falls back to the prefix strategy, so this only
    saves the per-boundary encodes.  tests/test_chat.py checks both give the same masks.
    """
    if not getattr(tokenizer, "is_fast", False):
        return None
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    starts, ends = [s for s, _ in offsets], [e for _, e in offsets]
    if starts != sorted(starts):
        return None
    mask = [0] * len(ids)
    for start, end in spans:
        first = _offset_boundary(starts, ends, start, len(full))
        last = _offset_boundary(starts, ends, end, len(full))
        if first is None or last is None:
            return None
        mask[first:last] = [1] * (last - first)
    return ids, mask


def _mask_by_segments(
    tokenizer: Any, full: str, spans: list[Span], sample: SampleLabel
) -> tuple[list[int], list[int]]:
    """Encode the text between span boundaries separately; verify the concatenation decodes back."""
    cuts = sorted({0, len(full), *(pos for span in spans for pos in span)})
    ids: list[int] = []
    mask: list[int] = []
    for a, b in pairwise(cuts):
        piece = _encode(tokenizer, full[a:b])
        inside = any(start <= a and b <= end for start, end in spans)
        ids += piece
        mask += [int(inside)] * len(piece)
    decoded = _decode(tokenizer, ids)
    if decoded != full and decoded != _decode(tokenizer, _encode(tokenizer, full)):
        at = _common_prefix_len(decoded, full)
        raise ChatTemplateError(
            f"{_label(sample)}: token ids are not a prefix across message boundaries and the "
            f"segment-wise encoding does not decode back either; first difference at character {at}: "
            f"expected {full[at:at + 30]!r}, got {decoded[at:at + 30]!r}"
        )
    return ids, mask


def _tool_marks(mask: list[int], tool_after: list[bool]) -> list[int]:
    """Mark the tokens from the end of each mask run that tool results follow to the next run."""
    if not any(tool_after):
        return []
    starts = [i for i, bit in enumerate(mask) if bit and (i == 0 or not mask[i - 1])]
    ends = [i for i, bit in enumerate(mask) if bit and (i + 1 == len(mask) or not mask[i + 1])]
    marks = [0] * len(mask)
    for end, following, tool in zip(ends, starts[1:] + [len(mask)], tool_after, strict=True):
        if tool:
            marks[end + 1 : following] = [1] * (following - end - 1)
    return marks


def _encode_rendered(tokenizer: Any, rendered: Rendered, sample: SampleLabel) -> EncodedConversation:
    """Ids, mask and tool marks of a rendered conversation, before any truncation."""
    full, spans = rendered.text, rendered.spans
    result = _mask_by_offsets(tokenizer, full, spans) if USE_OFFSETS else None
    if result is None:
        result = _mask_by_prefix(tokenizer, full, spans)
    strategy = "prefix" if result is not None else "segments"
    ids, mask = result if result is not None else _mask_by_segments(tokenizer, full, spans, sample)
    return EncodedConversation(ids, mask, 0, strategy, _tool_marks(mask, rendered.tool_after))


def _encode_whole(tokenizer: Any, messages: Sequence[dict], sample: SampleLabel,
                  tools: Sequence[dict] | None, template: Template) -> EncodedConversation:
    rendered = render_conversation(tokenizer, messages, sample, tools, template)
    return _encode_rendered(tokenizer, rendered, sample)


def _truncated(whole: EncodedConversation, max_length: int, sample: SampleLabel) -> EncodedConversation:
    ids, mask = whole.input_ids[:max_length], whole.loss_mask[:max_length]
    dropped = len(whole.input_ids) - len(ids)
    if not any(mask):
        why = f" after truncating {dropped} of {len(ids) + dropped} tokens" if dropped else ""
        raise EmptyLossMaskError(f"{_label(sample)}: no assistant tokens{why} (max_length={max_length})")
    return EncodedConversation(ids, mask, dropped, whole.strategy, whole.tool_results[:max_length])


def encode_conversation(
    tokenizer: Any, messages: Sequence[dict], max_length: int, sample: SampleLabel = None, *,
    tools: Sequence[dict] | None = None, template: Template = None,
) -> EncodedConversation:
    """Render, tokenize and mask one conversation; truncate to ``max_length`` tokens.

    ``loss_mask[i] == 1`` exactly for tokens the target generated: each assistant turn after
    its generation prompt, through the template's end-of-turn marker.  ``tools`` are the
    declared tools and ``template`` further ``apply_chat_template`` keywords (e.g.
    ``{"thinking": True}``).  ``sample`` only labels error messages.  Raises
    :class:`EmptyLossMaskError` if no assistant token is left, and :class:`ChatTemplateError`
    if the template cannot be masked reliably or leaves out part of the record.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    return _truncated(_encode_whole(tokenizer, messages, sample, tools, template), max_length, sample)


def tokenize_conversation(
    tokenizer: Any, messages: Sequence[dict], max_length: int, sample: SampleLabel = None, *,
    tools: Sequence[dict] | None = None, template: Template = None,
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of :func:`encode_conversation`, for callers that need no stats."""
    encoded = encode_conversation(tokenizer, messages, max_length, sample, tools=tools, template=template)
    return encoded.input_ids, encoded.loss_mask


# --------------------------------------------------------------------------- long conversations


@dataclass(frozen=True)
class DroppedExchange:
    """Messages ``[start, end)`` of one exchange whose render (``num_tokens`` long, with the
    leading system turns) leaves no reply token within ``max_length``."""

    start: int
    end: int
    num_tokens: int


@dataclass(frozen=True)
class Windows:
    """The samples one conversation became, and how much of its assistant text they keep.

    ``num_assistant_tokens`` counts the loss-mask tokens of the whole conversation rendered
    at once; ``num_kept_tokens`` those of all windows together.  ``dropped_exchanges`` names
    each exchange that gave no sample because its prompt alone fills ``max_length``.
    ``num_reasoning`` counts replies with reasoning, ``num_reasoning_dropped`` those whose
    reasoning no sample trains (the template leaves it out: earlier turns of Qwen3 and Kimi in
    a whole render), ``num_reasoning_tokens`` the tokens of the reasoning trained, counted on
    the conversation as one window like ``num_assistant_tokens``.

    With ``reasoning="as_generated"`` (draftline.tokenize.generated): ``num_extra_samples``
    samples of one reply each, after ``num_extra_prefix_tokens`` prompt tokens in all;
    ``num_reused`` replies the whole render already shows as generated; ``as_template`` the
    message indices of replies that could not be established as generated and are trained as
    the whole render shows them; ``num_left_out`` whole-render windows that train no reply.
    """

    samples: list[EncodedConversation]
    num_assistant_tokens: int
    num_kept_tokens: int
    dropped_exchanges: list[DroppedExchange] = field(default_factory=list)
    num_reasoning: int = 0
    num_reasoning_dropped: int = 0
    num_reasoning_tokens: int = 0
    num_extra_samples: int = 0
    num_extra_prefix_tokens: int = 0
    num_reused: int = 0
    as_template: list[int] = field(default_factory=list)
    num_left_out: int = 0


def _exchanges(messages: Sequence[dict]) -> tuple[int, list[tuple[int, int]]]:
    """``(head, [(start, end), ...])``: leading system turns, then each exchange's turns.

    An exchange is the non-assistant turns up to and including the assistant replies after
    them, tool calls and their results included (a window never separates a call from its
    result); trailing turns with no reply after them belong to no exchange.
    """
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    exchanges, start, last_reply = [], head, None
    for k in range(head, len(messages)):
        if messages[k]["role"] != "assistant":
            continue
        last_reply = k
        if k + 1 == len(messages) or messages[k + 1]["role"] not in ("assistant", "tool"):
            exchanges.append((start, k + 1))
            start = k + 1
    if last_reply is not None and last_reply >= start:  # tool results end the conversation
        exchanges.append((start, last_reply + 1))
    return head, exchanges


@dataclass(frozen=True)
class Window:
    """Messages of one window: the leading system turns, then ``messages[start:end]``
    (whole exchanges); ``encoded`` is their whole render, ``fits`` whether it fits."""

    messages: list[dict]
    start: int
    end: int
    encoded: EncodedConversation
    fits: bool

    def index(self, k: int) -> int:
        """Message ``k`` of this window as an index of the whole conversation."""
        head = len(self.messages) - (self.end - self.start)
        return k if k < head else self.start + k - head


def plan_windows(tokenizer: Any, messages: Sequence[dict], max_length: int, sample: SampleLabel,
                 tools: Sequence[dict] | None, template: Template) -> list[Window]:
    """The windows of a conversation longer than ``max_length`` (see :func:`template_windows`):
    the longest runs of whole exchanges that fit, and each exchange too long alone (``fits``
    False: its caller cuts it or drops it)."""
    head, exchanges = _exchanges(messages)
    system = list(messages[:head])

    def window(i: int, j: int) -> list[dict]:  # exchanges i..j-1 with the system prompt
        return system + list(messages[exchanges[i][0] : exchanges[j - 1][1]])

    windows: list[Window] = []
    i = 0
    while i < len(exchanges):
        # Binary search for the largest j whose window fits: lengths grow with j.
        lo, hi, best = i + 1, len(exchanges), None
        while lo <= hi:
            mid = (lo + hi) // 2
            encoded = _encode_whole(tokenizer, window(i, mid), sample, tools, template)
            if len(encoded.input_ids) <= max_length:
                best, lo = (mid, encoded), mid + 1
            else:
                hi = mid - 1
        if best is None:  # one exchange alone is too long
            alone = _encode_whole(tokenizer, window(i, i + 1), sample, tools, template)
            windows.append(Window(window(i, i + 1), exchanges[i][0], exchanges[i][1], alone, False))
            i += 1
            continue
        j, encoded = best
        windows.append(Window(window(i, j), exchanges[i][0], exchanges[j - 1][1], encoded, True))
        i = j
    return windows


def _reasoning_trained(tokenizer: Any, messages: Sequence[dict], trained: Sequence[tuple[int, bool]]
                       ) -> dict[str, int]:
    """Counts of ``(message index, reasoning in a sample's mask)`` per reply, as Windows keeps
    them.  The reasoning's tokens are those of its text encoded on its own: a token or so off
    where a merge crosses its ends, the same way in every setting, so settings compare."""
    reasoning = {k: (messages[k].get("reasoning_content") or "").strip() for k, _ in trained}
    return {"num_reasoning": sum(bool(r) for r in reasoning.values()),
            "num_reasoning_dropped": sum(bool(reasoning[k]) and not shown for k, shown in trained),
            "num_reasoning_tokens": sum(len(_encode(tokenizer, reasoning[k])) for k, shown in trained
                                        if shown and reasoning[k])}


def template_windows(
    tokenizer: Any, messages: Sequence[dict], max_length: int, sample: SampleLabel = None, *,
    tools: Sequence[dict] | None = None, template: Template = None,
) -> Windows:
    """Encode a conversation as one sample, or, when it is longer than ``max_length``, as
    several samples split at exchange boundaries (a user turn and the reply to it).

    Each window is the conversation's leading system turns plus as many consecutive exchanges
    as fit, rendered on their own by the template, so every sample starts where a chat can
    start and ends after an assistant turn.  The first window is therefore the longest prefix
    of whole exchanges that fits; the next starts where it stopped, with the system prompt as
    context again.  An exchange that alone is too long is cut at ``max_length`` tokens and kept
    if some of its reply survives (``num_truncated`` says so); otherwise it is dropped and
    listed in ``dropped_exchanges``.  :class:`EmptyLossMaskError` if nothing at all survives.
    ``tools`` and ``template`` as for :func:`encode_conversation`; every window declares the tools.
    What the template renders is trained (``tokenize.reasoning: template``, or ``preserve`` with
    the template's switch in ``template``); :func:`draftline.tokenize.windows.encode_windows`
    picks between this and each reply as generated.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    rendered = render_conversation(tokenizer, messages, sample, tools, template)
    whole = _encode_rendered(tokenizer, rendered, sample)
    total = sum(whole.loss_mask)
    replies = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    counts = _reasoning_trained(tokenizer, messages, [
        (k, (messages[k].get("reasoning_content") or "").strip() in rendered.text[a:b])
        for k, (a, b) in zip(replies, rendered.spans, strict=True)])
    if len(whole.input_ids) <= max_length:
        return Windows([whole], total, total, **counts)
    samples: list[EncodedConversation] = []
    dropped: list[DroppedExchange] = []
    for window in plan_windows(tokenizer, messages, max_length, sample, tools, template):
        if window.fits:
            samples.append(window.encoded)
        elif any(window.encoded.loss_mask[:max_length]):  # keep the head of a reply that survives
            samples.append(_truncated(window.encoded, max_length, sample))
        else:  # the caller counts it; the conversation may still yield other samples
            dropped.append(DroppedExchange(window.start, window.end, len(window.encoded.input_ids)))
    if not samples:
        raise EmptyLossMaskError(
            f"{_label(sample)}: no assistant tokens within max_length={max_length}: every exchange's "
            f"prompt alone is longer ({len(whole.input_ids)} tokens in all)")
    return Windows(samples, total, sum(sum(s.loss_mask) for s in samples), dropped, **counts)
