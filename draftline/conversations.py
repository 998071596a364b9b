"""Load chat conversations from JSON / JSONL files and write a default set.

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

import importlib
import inspect
import json
import os
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from draftline.artifacts import atomic_path

__all__ = [
    "Conversation",
    "DataError",
    "Skipped",
    "load_conversations",
    "normalize_record",
    "default_conversations",
    "write_default_conversations",
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


# --------------------------------------------------------------------------- default set

# Pure-Python or core C modules whose docstrings do not depend on the platform
# or on optional libraries, so the default set is the same on every machine
# running the same Python version.
_DEFAULT_MODULES = (
    "abc", "argparse", "base64", "bisect", "calendar", "collections", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "difflib", "enum", "fnmatch", "fractions", "functools",
    "graphlib", "heapq", "html", "ipaddress", "itertools", "json", "math", "numbers", "operator",
    "pprint", "queue", "random", "re", "shlex", "statistics", "string", "textwrap", "types",
    "typing", "uuid", "weakref",
)  # fmt: skip
_SYSTEM_PROMPTS = (
    "You are a helpful assistant who knows the Python standard library well.",
    "Answer questions about Python precisely, quoting the official documentation.",
)
_QUESTIONS = (
    "What does `{name}` do?",
    "Explain `{name}`.",
    "Can you describe `{name}` from the Python standard library?",
    "I'm reading code that uses `{name}`. What is it for?",
    "Summarise the documentation of `{name}`.",
    "How does `{name}` work?",
)
_FOLLOW_UPS = ("And `{name}`?", "What about `{name}`?", "Now explain `{name}`, please.")
_ANSWER_PREFIXES = ("", "Here is what the documentation says about `{name}`:\n\n", "`{name}`: ")
_MIN_DOC_CHARS = 40  # one-liners like "Return self==value." teach little
_MAX_DOC_CHARS = 6000  # keeps single samples well under typical max_length budgets


def _own_member(obj: Any, module: str) -> bool:
    """True for a function/class defined by ``module`` (or its C accelerator), not re-exported."""
    if not (inspect.isroutine(obj) or inspect.isclass(obj)):
        return False  # constants would yield their *type's* docstring, e.g. str's
    owner = getattr(obj, "__module__", None) or ""
    return owner in (module, "_" + module) or owner.startswith(module + ".")


def _members(module: str) -> Iterator[tuple[str, Any]]:
    """Yield ``(qualified_name, object)`` for a module, its members and their methods, sorted."""
    mod = importlib.import_module(module)
    yield module, mod
    for name in sorted(dir(mod)):
        obj = getattr(mod, name, None)
        if name.startswith("_") or not _own_member(obj, module):
            continue
        yield f"{module}.{name}", obj
        if inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                value = getattr(obj, attr, None)
                if not attr.startswith("_") and inspect.isroutine(value):
                    yield f"{module}.{name}.{attr}", value


def _doc_entries() -> list[tuple[str, str]]:
    """``(qualified_name, docstring)`` pairs; duplicate docstrings keep the first name."""
    entries: list[tuple[str, str]] = []
    seen: set[str] = set()
    # Deprecated aliases (e.g. typing.io) warn when touched; only their text is read here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for module in _DEFAULT_MODULES:
            for name, obj in _members(module):
                raw = obj.__doc__  # not inspect.getdoc: inherited docs would describe the base
                doc = inspect.cleandoc(raw) if isinstance(raw, str) else ""
                if _MIN_DOC_CHARS <= len(doc) <= _MAX_DOC_CHARS and doc not in seen:
                    seen.add(doc)
                    entries.append((name, doc))
    return entries


def _pick(options: tuple[str, ...], name: str, salt: str) -> str:
    """Choose a phrasing from the name; crc32 is stable across runs, unlike ``hash``."""
    return options[zlib.crc32(f"{salt}:{name}".encode()) % len(options)]


def _answer(name: str, doc: str) -> dict[str, str]:
    return {"role": "assistant", "content": _pick(_ANSWER_PREFIXES, name, "a").format(name=name) + doc}


def _conversation(group: list[tuple[str, str]], index: int) -> Conversation:
    """One conversation about 1..3 entries: a question, then follow-ups for the rest."""
    messages: Conversation = []
    if index % 5 == 0:
        messages.append({"role": "system", "content": _SYSTEM_PROMPTS[index // 5 % 2]})
    for turn, (name, doc) in enumerate(group):
        options = _QUESTIONS if turn == 0 else _FOLLOW_UPS
        messages.append({"role": "user", "content": _pick(options, name, "q").format(name=name)})
        messages.append(_answer(name, doc))
    return messages


def default_conversations() -> Iterator[Conversation]:
    """Deterministic conversations built from stdlib docstrings (sorted iteration).

    Every fourth conversation is multi-turn (two or three entries of the
    stream, asked as follow-ups); every fifth has a system prompt.
    """
    entries = _doc_entries()
    position, index = 0, 0
    while position < len(entries):
        size = 1 if index % 4 else 2 + index // 4 % 2
        yield _conversation(entries[position : position + size], index)
        position += size
        index += 1


def write_default_conversations(out_path: str | os.PathLike[str], max_bytes: int = 1_000_000) -> int:
    """Write :func:`default_conversations` as OpenAI-style JSONL, at most ``max_bytes``.

    Conversations are written in order until the next one would exceed the
    cap, so a smaller cap gives a prefix of the larger set.  The file is
    byte-identical across runs on the same Python version and is replaced
    atomically.  Returns the number of conversations written.
    """
    lines: list[bytes] = []
    total = 0
    for messages in default_conversations():
        line = (json.dumps({"messages": messages}, ensure_ascii=False, sort_keys=True) + "\n").encode()
        if total + len(line) > max_bytes:
            break
        lines.append(line)
        total += len(line)
    if not lines:
        raise ValueError(f"max_bytes={max_bytes} is too small for even one conversation")
    with atomic_path(out_path) as tmp:
        tmp.write_bytes(b"".join(lines))
    return len(lines)
