"""Load chat conversations from JSON / JSONL files (the embedded set: draftline.embedded).

Two record styles are accepted and normalised to ``[{"role", "content"}, ...]``
with roles ``system`` / ``user`` / ``assistant``:

* ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system"|"user"|"assistant", "value": str}]}``
* OpenAI:   ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}]}``

A file is either a JSON list of such records or JSONL (one record per line);
the first non-blank character decides (``[`` means a JSON list), so the file
extension does not matter.  Locations in errors are ``file:line`` (1-based)
for JSONL and ``file[item]`` (0-based list index) for a JSON list, so a
message always points at something an editor can jump to.

Bad records are errors by default.  Real datasets contain a few broken
samples, so ``max_skipped`` lets a caller tolerate up to that many; every
skipped record is returned as a :class:`Skipped` so the count can be reported.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

__all__ = [
    "Conversation",
    "DataError",
    "Skipped",
    "load_conversations",
    "normalize_record",
]

Conversation = list[dict[str, str]]

# Source role name -> normalised role.  ShareGPT uses human/gpt, OpenAI uses
# user/assistant; both use system.  Anything else (tool, function, bing, ...)
# is rejected rather than guessed: a wrong role silently corrupts loss masks.
_ROLE_MAP = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
# How many skip reasons a budget-exceeded error quotes; the rest are counted.
_REASONS_SHOWN = 5


class DataError(ValueError):
    """Input data is unusable; the message names the file and line / item / sample."""


@dataclass(frozen=True)
class Skipped:
    """One record dropped under the skip budget.

    ``line`` is the 1-based line for JSONL, the 0-based item index for a JSON
    list (``in_list`` tells which), so :attr:`where` renders it unambiguously.
    """

    file: str
    line: int
    reason: str
    in_list: bool = False

    @property
    def where(self) -> str:
        return f"{self.file}[{self.line}]" if self.in_list else f"{self.file}:{self.line}"

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


# --------------------------------------------------------------------------- normalising


def _normalize_turn(turn: Any, index: int, role_key: str, text_key: str) -> dict[str, str]:
    """Map one source turn to ``{"role", "content"}``; raise ValueError naming the turn."""
    if not isinstance(turn, dict):
        raise ValueError(f"turn {index} is a {type(turn).__name__}, not an object")
    if role_key not in turn or text_key not in turn:
        raise ValueError(f"turn {index} lacks {role_key!r} or {text_key!r} (keys: {sorted(turn)})")
    source_role = turn[role_key]
    role = _ROLE_MAP.get(source_role) if isinstance(source_role, str) else None
    if role is None:
        raise ValueError(f"turn {index} has unknown role {source_role!r}")
    text = turn[text_key]
    if not isinstance(text, str):
        raise ValueError(f"turn {index} ({role}) {text_key} is a {type(text).__name__}, not a string")
    if not text.strip():
        raise ValueError(f"turn {index} ({role}) has empty text")
    return {"role": role, "content": text}


def normalize_record(record: Any) -> Conversation:
    """Normalise one ShareGPT or OpenAI record; raise ValueError with the reason.

    The caller adds the location (file and line), which this function does not
    know.
    """
    if not isinstance(record, dict):
        raise ValueError(f"record is a {type(record).__name__}, not an object")
    styles = [key for key in ("conversations", "messages") if key in record]
    if len(styles) != 1:
        raise ValueError(
            "record needs exactly one of 'conversations' (ShareGPT) or 'messages' (OpenAI); "
            f"keys: {sorted(record)}"
        )
    turns = record[styles[0]]
    if not isinstance(turns, list):
        raise ValueError(f"{styles[0]!r} is a {type(turns).__name__}, not a list")
    role_key, text_key = ("from", "value") if styles[0] == "conversations" else ("role", "content")
    messages = [_normalize_turn(t, i, role_key, text_key) for i, t in enumerate(turns)]
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"conversation has no assistant turn ({len(messages)} turns)")
    return messages


# --------------------------------------------------------------------------- reading


def _is_json_list(path: Path) -> bool:
    """True when the first non-whitespace character of ``path`` is ``[``."""
    with path.open("rb") as fh:
        while chunk := fh.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1] == b"["
    return False


def _jsonl_records(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """Yield ``(line_number, record, error)`` for each non-blank JSONL line.

    Lines are decoded one by one so a single bad byte sequence costs one
    record, not the file.
    """
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                yield number, json.loads(raw.decode("utf-8")), None
            except UnicodeDecodeError as exc:
                yield number, None, f"not UTF-8: {exc.reason} at byte {exc.start}"
            except json.JSONDecodeError as exc:
                yield number, None, f"malformed JSON: {exc.msg} (column {exc.colno})"


def _json_list_records(path: Path) -> list[Any]:
    """Parse a whole-file JSON list; a parse error is fatal since nothing is recoverable."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8: {exc.reason} at byte {exc.start}") from exc
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}") from exc
    return data  # a list: the caller sniffed "[" and the parse consumed the whole file


def _located_records(path: Path) -> Iterator[tuple[int, bool, Any, str | None]]:
    """Yield ``(line_or_index, in_list, record, parse_error)`` for either file layout."""
    if _is_json_list(path):
        for index, record in enumerate(_json_list_records(path)):
            yield index, True, record, None
    else:
        for number, record, error in _jsonl_records(path):
            yield number, False, record, error


def _budget_error(path: Path, skipped: list[Skipped], max_skipped: int) -> DataError:
    """Build the error for too many bad records, quoting the first few reasons."""
    shown = "\n  ".join(str(s) for s in skipped[:_REASONS_SHOWN])
    more = len(skipped) - _REASONS_SHOWN
    tail = f"\n  ... and {more} more" if more > 0 else ""
    return DataError(
        f"{path}: {len(skipped)} bad record(s), more than max_skipped={max_skipped}:\n  {shown}{tail}"
    )


def load_conversations(
    path: str | os.PathLike[str], max_skipped: int = 0
) -> tuple[list[Conversation], list[Skipped]]:
    """Load and normalise every conversation in a JSON-list or JSONL file.

    Bad records (malformed JSON line, unknown role, no assistant turn, empty
    text, wrong types) are collected as :class:`Skipped`; if there are more
    than ``max_skipped`` a :class:`DataError` quotes the count and the first
    few.  The whole file is scanned first so the count is the real total.  A
    file that yields no conversation at all is an error too, because an empty
    dataset would only fail later, far from its cause.
    """
    if max_skipped < 0:
        raise ValueError(f"max_skipped must be >= 0, got {max_skipped}")
    path = Path(path)
    conversations: list[Conversation] = []
    skipped: list[Skipped] = []
    for where, in_list, record, error in _located_records(path):
        if error is None:
            try:
                conversations.append(normalize_record(record))
                continue
            except ValueError as exc:
                error = str(exc)
        skipped.append(Skipped(str(path), where, error, in_list))
    if len(skipped) > max_skipped:
        raise _budget_error(path, skipped, max_skipped)
    if not conversations:
        raise DataError(f"{path}: no conversations loaded ({len(skipped)} record(s) skipped)")
    return conversations, skipped
