"""Render a conversation with the tokenizer's chat template and mask assistant tokens.

Why not offsets or ``return_assistant_tokens_mask``: Kimi-K2.5 ships a slow,
TikToken-based ``PreTrainedTokenizer`` (no offset mapping) and most chat
templates have no ``{% generation %}`` blocks.  Everything here uses only
``apply_chat_template(..., tokenize=False)``, plain encoding and ``decode``,
which every tokenizer class has.

Masking works in two stages.

1. **Characters.**  ``full`` is the render of the whole conversation.  For
   assistant message ``k``, its span starts where the render of
   ``messages[:k]`` *with* the generation prompt stops agreeing with the
   render of ``messages[:k+1]`` (so the role header is excluded even when the
   prompt adds e.g. ``<think>`` that history renders differently), and ends at
   the end of the render of ``messages[:k+1]`` (so the end-of-turn marker is
   included: the draft must learn to stop).  That needs ``messages[:k+1]`` to
   render as a prefix of ``full``; templates that rewrite history depending on
   what follows (e.g. dropping reasoning from earlier turns) break that, and
   then the content itself is searched for in ``full`` after the previous
   message and extended by the end-of-turn text the template put after it.

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

from jinja2.exceptions import TemplateError

from draftline.tokenize.conversations import DataError

__all__ = [
    "ChatTemplateError",
    "DroppedExchange",
    "EmptyLossMaskError",
    "EncodedConversation",
    "Windows",
    "assistant_char_spans",
    "encode_conversation",
    "encode_windows",
    "tokenize_conversation",
]

# The offsets shortcut of the prefix strategy (fast tokenizers); off only to compare the two.
USE_OFFSETS = True
Span = tuple[int, int]  # [start, end) character offsets into the full render
SampleLabel = int | str | None  # only used to name the sample in error messages


class ChatTemplateError(DataError):
    """The template/tokenizer pair cannot be rendered or masked for this sample."""


class EmptyLossMaskError(DataError):
    """No assistant token survives (after truncation); callers may skip it under a budget."""


@dataclass(frozen=True)
class EncodedConversation:
    """Token ids and loss mask of one conversation, plus how they were obtained.

    ``num_truncated`` counts tokens dropped by ``max_length`` so callers can
    report truncation; ``strategy`` is ``"prefix"`` or ``"segments"``.
    """

    input_ids: list[int]
    loss_mask: list[int]
    num_truncated: int
    strategy: str


def _label(sample: SampleLabel) -> str:
    return "conversation" if sample is None else f"sample {sample}"


# --------------------------------------------------------------------------- rendering


def _render(
    tokenizer: Any, messages: Sequence[dict], generation_prompt: bool, sample: SampleLabel
) -> str:
    """Render ``messages`` to text; template failures name the sample and prefix length."""
    try:
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt
        )
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


def _span_by_prefix(
    tokenizer: Any, messages: Sequence[dict], k: int, full: str, sample: SampleLabel
) -> Span | None:
    """Span of assistant message ``k`` from prefix renders, or None if the template rewrites history."""
    through = _render(tokenizer, messages[: k + 1], False, sample)
    if not full.startswith(through):
        return None
    before = _render(tokenizer, messages[:k], True, sample)
    start = _common_prefix_len(before, through)
    if messages[k]["content"].strip() not in through[start:]:
        return None  # the generation prompt overlaps the content: boundary is unreliable
    return start, len(through)


def _span_by_search(
    tokenizer: Any, messages: Sequence[dict], k: int, full: str, cursor: int, sample: SampleLabel
) -> Span:
    """Locate assistant message ``k``'s content in ``full`` at or after ``cursor``.

    The span is extended over the end-of-turn text that the template puts after
    the content (taken from the render of ``messages[:k+1]``) as far as ``full``
    agrees with it.
    """
    content = messages[k]["content"].strip()
    begin = full.find(content, cursor)
    if begin < 0:
        raise ChatTemplateError(
            f"{_label(sample)}: assistant message {k} does not occur in the rendered text after "
            f"offset {cursor}; content starts {content[:60]!r}"
        )
    end = begin + len(content)
    through = _render(tokenizer, messages[: k + 1], False, sample)
    found = through.rfind(content)
    suffix = through[found + len(content) :] if found >= 0 else ""
    return begin, end + _common_prefix_len(suffix, full[end:])


def assistant_char_spans(
    tokenizer: Any, messages: Sequence[dict], sample: SampleLabel = None
) -> tuple[str, list[Span]]:
    """Render ``messages`` and return ``(full_text, spans)`` of assistant turns (see module doc)."""
    if not messages:
        raise ChatTemplateError(f"{_label(sample)}: no messages")
    first = next((m for m in messages if m["role"] != "system"), None)
    if first is not None and first["role"] == "assistant":
        raise ChatTemplateError(
            f"{_label(sample)}: the conversation starts with an assistant turn; chat templates "
            "need a user turn before the first reply (the loader drops leading assistant turns)"
        )
    full = _render(tokenizer, messages, False, sample)
    spans: list[Span] = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        previous_end = spans[-1][1] if spans else 0
        span = _span_by_prefix(tokenizer, messages, k, full, sample)
        if span is None or span[0] < previous_end:
            history = _render(tokenizer, messages[:k], False, sample)
            cursor = max(previous_end, _common_prefix_len(history, full))
            span = _span_by_search(tokenizer, messages, k, full, cursor, sample)
        spans.append(span)
    return full, spans


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


def _encode_whole(tokenizer: Any, messages: Sequence[dict], sample: SampleLabel):
    """``(ids, mask, strategy)`` of the whole conversation, before any truncation."""
    full, spans = assistant_char_spans(tokenizer, messages, sample)
    result = _mask_by_offsets(tokenizer, full, spans) if USE_OFFSETS else None
    if result is None:
        result = _mask_by_prefix(tokenizer, full, spans)
    if result is not None:
        return *result, "prefix"
    return *_mask_by_segments(tokenizer, full, spans, sample), "segments"


def _truncated(ids: list[int], mask: list[int], strategy: str, max_length: int,
               sample: SampleLabel) -> EncodedConversation:
    dropped = max(0, len(ids) - max_length)
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        why = f" after truncating {dropped} of {len(ids) + dropped} tokens" if dropped else ""
        raise EmptyLossMaskError(f"{_label(sample)}: no assistant tokens{why} (max_length={max_length})")
    return EncodedConversation(ids, mask, dropped, strategy)


def encode_conversation(
    tokenizer: Any, messages: Sequence[dict], max_length: int, sample: SampleLabel = None
) -> EncodedConversation:
    """Render, tokenize and mask one conversation; truncate to ``max_length`` tokens.

    ``loss_mask[i] == 1`` exactly for tokens of assistant turns (content plus the
    template's end-of-turn marker).  ``sample`` only labels error messages.
    Raises :class:`EmptyLossMaskError` if no assistant token is left, and
    :class:`ChatTemplateError` if the template cannot be masked reliably.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    return _truncated(*_encode_whole(tokenizer, messages, sample), max_length, sample)


def tokenize_conversation(
    tokenizer: Any, messages: Sequence[dict], max_length: int, sample: SampleLabel = None
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of :func:`encode_conversation`, for callers that need no stats."""
    encoded = encode_conversation(tokenizer, messages, max_length, sample)
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
    """

    samples: list[EncodedConversation]
    num_assistant_tokens: int
    num_kept_tokens: int
    dropped_exchanges: list[DroppedExchange] = field(default_factory=list)


def _exchanges(messages: Sequence[dict]) -> tuple[int, list[tuple[int, int]]]:
    """``(head, [(start, end), ...])``: leading system turns, then each exchange's turns.

    An exchange is the non-assistant turns up to and including the assistant reply after
    them; trailing turns with no reply after them belong to no exchange.
    """
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    exchanges, start = [], head
    for k in range(head, len(messages)):
        last_of_reply = messages[k]["role"] == "assistant" and (
            k + 1 == len(messages) or messages[k + 1]["role"] != "assistant")
        if last_of_reply:
            exchanges.append((start, k + 1))
            start = k + 1
    return head, exchanges


def encode_windows(
    tokenizer: Any, messages: Sequence[dict], max_length: int, sample: SampleLabel = None
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
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    ids, mask, strategy = _encode_whole(tokenizer, messages, sample)
    total = sum(mask)
    if len(ids) <= max_length:
        return Windows([EncodedConversation(ids, mask, 0, strategy)], total, total)
    head, exchanges = _exchanges(messages)
    system = list(messages[:head])

    def window(i: int, j: int) -> list[dict]:  # exchanges i..j-1 with the system prompt
        return system + list(messages[exchanges[i][0] : exchanges[j - 1][1]])

    samples: list[EncodedConversation] = []
    dropped: list[DroppedExchange] = []
    i = 0
    while i < len(exchanges):
        # Binary search for the largest j whose window fits: lengths grow with j.
        lo, hi, best = i + 1, len(exchanges), None
        while lo <= hi:
            mid = (lo + hi) // 2
            encoded = _encode_whole(tokenizer, window(i, mid), sample)
            if len(encoded[0]) <= max_length:
                best, lo = (mid, encoded), mid + 1
            else:
                hi = mid - 1
        if best is None:  # one exchange alone is too long: keep its head if a reply survives
            w_ids, w_mask, w_strategy = _encode_whole(tokenizer, window(i, i + 1), sample)
            if any(w_mask[:max_length]):
                samples.append(_truncated(w_ids, w_mask, w_strategy, max_length, sample))
            else:  # the caller counts it; the conversation may still yield other samples
                dropped.append(DroppedExchange(*exchanges[i], len(w_ids)))
            i += 1
            continue
        j, (w_ids, w_mask, w_strategy) = best
        samples.append(EncodedConversation(w_ids, w_mask, 0, w_strategy))
        i = j
    if not samples:
        raise EmptyLossMaskError(
            f"{_label(sample)}: no assistant tokens within max_length={max_length}: every exchange's "
            f"prompt alone is longer ({len(ids)} tokens in all)")
    return Windows(samples, total, sum(sum(s.loss_mask) for s in samples), dropped)
