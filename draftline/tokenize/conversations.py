"""Load chat conversations and normalise them (the embedded set: draftline.tiny.embedded).

Two record styles are accepted and normalised to the messages chat templates take
(``[{"role", "content", ...}]``, roles ``system`` / ``user`` / ``assistant`` / ``tool``):

* ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|..., "value": str}]}``
* OpenAI:   ``{"messages": [{"role": "user"|"assistant"|..., "content": str}]}``

The turn keys follow the first turn (``from``/``value`` or ``role``/``content``),
so ``conversations`` lists in OpenAI spelling load too; another column can be
named with ``field``.  Role names are mapped through ``roles`` (``data.roles``;
:data:`DEFAULT_ROLES` covers the ShareGPT and OpenAI spellings), then through
:data:`~draftline.tokenize.traces.TRACE_ROLES` (tool results and ShareGPT calls).

Tool traces and reasoning keep their structure (:mod:`draftline.tokenize.traces` says how
each spelling maps): an assistant turn keeps ``tool_calls`` (OpenAI ``tool_calls``, the legacy
``function_call`` field, or a ShareGPT ``function_call`` turn, which joins the assistant turn
right before it when that one has no calls) and ``reasoning_content`` (or ``reasoning``, or a
leading inline ``<think>`` block); a tool turn keeps ``tool_call_id`` and ``name``; the
record's ``tools`` column (a list or its JSON text) is returned beside the messages.

Where records come from (JSON, JSONL, parquet, ``datasets`` directories, hub
names from the local cache) is :mod:`draftline.tokenize.sources`' business; the
locations in messages are its ``file:line`` / ``file[row]`` strings.

What real data gets wrong, and what happens (every skip is a :class:`RecordSkip`
with a short ``reason`` that callers count):

* leading assistant or tool turns (ShareGPT's "split" files cut long chats into chunks
  that start with the assistant): **dropped**, the rest of the conversation kept;
* a role not in ``roles`` nor a trace role: ``unknown_role`` (the name is kept for counting);
* empty or blank text of a system or user turn: ``empty_text``; an assistant turn with
  neither text nor tool calls: ``empty_reply``; no turns at all: ``no_turns``;
* two turns of the same role in a row (tool results excepted): ``same_role_run`` (merging
  them would be a guess about what the speaker meant, and many templates refuse them);
* no assistant turn (after dropping the leading ones): ``no_assistant_turn``;
* a tool call or ``tools`` column that is not what the shapes above allow: ``bad_tool_call``
  / ``bad_tools``; think tags other than one leading block: ``inline_think``;
* wrong types or missing keys: ``bad_record``; unreadable lines:
  ``malformed_json`` / ``not_utf8``.

:func:`load_conversations` is the small in-memory front end used by tests and
the tiny target's training; the tokenize stage streams records itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from collections import Counter
from typing import Any, Mapping

from draftline.errors import DataError
from draftline.tokenize import traces

__all__ = [
    "Conversation",
    "DataError",
    "Skipped",
    "load_conversations",
    "normalize_record",
]

Conversation = list[dict[str, Any]]

# Source role name -> normalised role.  ShareGPT uses human/gpt (and, in the
# widely used V3 dump, chatgpt/bing/bard for replies of other assistants);
# OpenAI uses user/assistant; Gemini-style data uses model.  Tool-trace roles are
# traces.TRACE_ROLES; anything else is skipped rather than guessed: a wrong role
# silently corrupts loss masks.  conf/data/*.yaml repeat this table as data.roles.
DEFAULT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}
_TARGET_ROLES = ("system", "user", "assistant", "tool", "function_call")
# How many skip reasons a budget-exceeded error quotes; the rest are counted.
_REASONS_SHOWN = 5


class RecordSkip(ValueError):
    """One conversation cannot be used; ``reason`` is a short key for counting.

    ``role`` is the offending source role for ``unknown_role``.
    """

    def __init__(self, reason: str, detail: str, role: str | None = None):
        super().__init__(detail)
        self.reason = reason
        self.role = role


@dataclass(frozen=True)
class Skipped:
    """One record dropped under the skip budget: where, why (key) and the details."""

    where: str
    reason: str
    detail: str

    def __str__(self) -> str:
        return f"{self.where}: {self.detail}"


@dataclass(frozen=True)
class Normalized:
    """A usable conversation, its declared tools, the number of leading assistant (and tool)
    turns dropped from it, and the normalisations made (``inline_think``: count of replies)."""

    messages: Conversation
    dropped_leading: int
    tools: list[dict] | None = None
    fixes: Counter | None = None


# --------------------------------------------------------------------------- normalising


def check_roles(roles: Mapping[str, str]) -> dict[str, str]:
    """``data.roles`` as a plain dict; every alias must map to a role :func:`normalize` knows."""
    bad = {k: v for k, v in roles.items() if v not in _TARGET_ROLES}
    if bad:
        raise ValueError(f"data.roles maps to roles other than {_TARGET_ROLES}: {bad}")
    return {str(k): str(v) for k, v in roles.items()}


def _turn_keys(turns: list, style: str) -> tuple[str, str]:
    """``(role_key, text_key)``: those of the first turn, else the style's own."""
    first = turns[0] if isinstance(turns[0], dict) else {}
    if "role" in first:
        return "role", "content"
    if "from" in first:
        return "from", "value"
    return ("from", "value") if style == "conversations" else ("role", "content")


def _normalize_turn(turn: Any, index: int, keys: tuple[str, str], roles: Mapping[str, str],
                    fixes: Counter) -> dict:
    """Map one source turn to a template message; raise RecordSkip naming the turn.

    A ShareGPT ``function_call`` turn comes back as ``{"role": "function_call", "tool_calls"}``
    for :func:`_join_calls` to attach.
    """
    role_key, text_key = keys
    if not isinstance(turn, dict):
        raise RecordSkip("bad_record", f"turn {index} is a {type(turn).__name__}, not an object")
    if turn.get(role_key) is None or text_key not in turn:
        present = sorted(k for k, v in turn.items() if v is not None)
        raise RecordSkip("bad_record", f"turn {index} lacks {role_key!r} or {text_key!r} (keys: {present})")
    source_role = turn[role_key]
    role = None
    if isinstance(source_role, str):
        role = roles.get(source_role, traces.TRACE_ROLES.get(source_role))
    if role is None:
        raise RecordSkip("unknown_role", f"turn {index} has unknown role {source_role!r} "
                         "(map it in data.roles)", role=str(source_role))
    text = turn[text_key]
    calls_given = role == "assistant" and (turn.get("tool_calls") or turn.get("function_call"))
    if text is None and (calls_given or role == "function_call"):
        text = ""  # OpenAI: a reply that only calls tools has null content
    if not isinstance(text, str):
        raise RecordSkip("bad_record", f"turn {index} ({role}) {text_key} is a "
                         f"{type(text).__name__}, not a string")
    if role == "function_call":
        return {"role": role, "tool_calls": _calls(text, index)}
    if role == "assistant":
        return _reply(turn, index, text, fixes)
    if role == "tool":
        return {"role": role, "content": text,
                **{key: turn[key] for key in ("tool_call_id", "name") if isinstance(turn.get(key), str)}}
    if not text.strip():
        raise RecordSkip("empty_text", f"turn {index} ({role}) has empty text")
    return {"role": role, "content": text}


def _calls(raw: Any, index: int) -> list[dict]:
    try:
        return traces.tool_calls(raw, f"turn {index} tool call")
    except ValueError as exc:
        raise RecordSkip("bad_tool_call", str(exc)) from exc


def _reply(turn: dict, index: int, text: str, fixes: Counter) -> dict:
    """An assistant message with its calls and reasoning; ``fixes`` counts inline think moved."""
    reasoning = turn.get("reasoning_content", turn.get("reasoning"))
    reasoning = reasoning if isinstance(reasoning, str) and reasoning.strip() else None
    try:
        content, reasoning, moved = traces.split_inline_think(text, reasoning)
    except ValueError as exc:
        raise RecordSkip("inline_think", f"turn {index} (assistant): {exc}") from exc
    fixes["inline_think"] += moved
    message: dict[str, Any] = {"role": "assistant", "content": content}
    raw_calls = turn.get("tool_calls") or turn.get("function_call")
    if raw_calls:
        message["tool_calls"] = _calls(raw_calls, index)
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if not content.strip() and not raw_calls:
        raise RecordSkip("empty_reply", f"turn {index} (assistant) has neither text nor tool calls")
    return message


def _join_calls(messages: list[dict]) -> list[dict]:
    """ShareGPT ``function_call`` turns as assistant turns: joined to the reply right before
    them when it has no calls (OpenAI keeps text and calls in one message), else on their own."""
    out: list[dict] = []
    for message in messages:
        if message["role"] != "function_call":
            out.append(message)
        elif out and out[-1]["role"] == "assistant" and "tool_calls" not in out[-1]:
            out[-1] = {**out[-1], "tool_calls": message["tool_calls"]}
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": message["tool_calls"]})
    return out


def _turns(record: Any, field: str | None) -> tuple[list, str]:
    """The record's list of turns and the name of the field it came from."""
    if not isinstance(record, dict):
        raise RecordSkip("bad_record", f"record is a {type(record).__name__}, not an object")
    if field is not None:
        styles = [field] if record.get(field) is not None else []
        wanted = f"field {field!r} (data.field)"
    else:
        # Columnar formats hold both columns when a file mixes styles; the unused one is null.
        styles = [key for key in ("conversations", "messages") if record.get(key) is not None]
        wanted = "exactly one of 'conversations' (ShareGPT) or 'messages' (OpenAI)"
    if len(styles) != 1:
        raise RecordSkip("bad_record", f"record needs {wanted}; keys: {sorted(record)}")
    turns = record[styles[0]]
    if not isinstance(turns, list):
        raise RecordSkip("bad_record", f"{styles[0]!r} is a {type(turns).__name__}, not a list")
    if not turns:
        raise RecordSkip("no_turns", f"{styles[0]!r} has no turns")
    return turns, styles[0]


def normalize(record: Any, roles: Mapping[str, str] | None = None, field: str | None = None) -> Normalized:
    """Normalise one record (see the module doc); raise :class:`RecordSkip` with the reason.

    The caller adds the location (file and line), which this function does not know.
    """
    roles = DEFAULT_ROLES if roles is None else roles
    turns, style = _turns(record, field)
    keys = _turn_keys(turns, style)
    fixes: Counter = Counter()
    messages = _join_calls([_normalize_turn(t, i, keys, roles, fixes) for i, t in enumerate(turns)])
    try:
        tools = traces.declared_tools(record.get("tools"))
    except ValueError as exc:
        raise RecordSkip("bad_tools", str(exc)) from exc
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    first_user = head  # a tool result before any user turn answers a call that was cut away
    while first_user < len(messages) and messages[first_user]["role"] in ("assistant", "tool"):
        first_user += 1
    messages = messages[:head] + messages[first_user:]
    if not any(m["role"] == "assistant" for m in messages):
        dropped = f", {first_user - head} leading assistant turn(s) dropped" if first_user > head else ""
        raise RecordSkip("no_assistant_turn",
                         f"conversation has no assistant turn ({len(turns)} turns{dropped})")
    for k in range(1, len(messages)):
        if messages[k]["role"] == messages[k - 1]["role"] != "tool":
            raise RecordSkip("same_role_run", f"turns {k - 1} and {k} (after dropping leading "
                             f"assistant turns) are both {messages[k]['role']!r}")
    return Normalized(messages, first_user - head, tools, +fixes)


def normalize_record(record: Any, roles: Mapping[str, str] | None = None,
                     field: str | None = None) -> Conversation:
    """The messages of :func:`normalize`, for callers that need no counts."""
    return normalize(record, roles, field).messages


# --------------------------------------------------------------------------- loading


def _budget_error(label: str, skipped: list[Skipped], max_skipped: int) -> DataError:
    """Build the error for too many bad records, quoting the first few reasons."""
    shown = "\n  ".join(str(s) for s in skipped[:_REASONS_SHOWN])
    more = len(skipped) - _REASONS_SHOWN
    tail = f"\n  ... and {more} more" if more > 0 else ""
    return DataError(
        f"{label}: {len(skipped)} bad record(s), more than max_skipped={max_skipped}:\n  {shown}{tail}"
    )


def load_conversations(
    path: str | os.PathLike[str], max_skipped: int = 0, roles: Mapping[str, str] | None = None,
    field: str | None = None,
) -> tuple[list[Conversation], list[Skipped]]:
    """Load and normalise every conversation of a source into memory.

    ``path`` is anything :func:`draftline.tokenize.sources.open_source` reads.  Bad
    records are collected as :class:`Skipped`; if there are more than
    ``max_skipped`` a :class:`DataError` quotes the count and the first few.  The
    whole source is scanned first so the count is the real total.  A source that
    yields no conversation at all is an error too, because an empty dataset
    would only fail later, far from its cause.
    """
    from draftline.tokenize.sources import open_source  # it imports DataError from here

    if max_skipped < 0:
        raise ValueError(f"max_skipped must be >= 0, got {max_skipped}")
    source = open_source(path)
    conversations: list[Conversation] = []
    skipped: list[Skipped] = []
    for where, record, error in source.stream():
        if error is not None:
            key = "not_utf8" if error.startswith("not UTF-8") else "malformed_json"
            skipped.append(Skipped(where, key, error))
            continue
        try:
            conversations.append(normalize_record(record, roles, field))
        except RecordSkip as exc:
            skipped.append(Skipped(where, exc.reason, str(exc)))
    if len(skipped) > max_skipped:
        raise _budget_error(source.label, skipped, max_skipped)
    if not conversations:
        raise DataError(f"{source.label}: no conversations loaded ({len(skipped)} record(s) skipped)")
    return conversations, skipped
