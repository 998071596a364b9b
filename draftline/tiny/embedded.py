"""The embedded inputs: committed files, checked against pinned sha256 on every use.

    python -m draftline.tiny.embedded check     # both files match their pinned hashes
    python -m draftline.tiny.embedded build     # rebuild them from this interpreter (maintainers)

The conversation set (``data.build: embedded``) and the corpus the tiny targets' tokenizer is
trained on are made from Python standard-library docstrings, which differ between Python patch
releases (3.11.7 and Debian bookworm's 3.11.2 gave different files, so host and image trained on
different data). They are therefore built once, committed under ``embedded_data/`` and read from
there: the bytes are the same on every interpreter, OS and machine. Together about 400 kB of
text (git stores them compressed, a little over 100 kB); text rather than an archive so a
rebuild shows up as a readable diff.

``build`` regenerates both files from the running interpreter; the pinned hashes below (and in
tests/test_embedded.py) then have to be updated by hand, which is the point: the embedded data
changes only in a reviewed commit.
"""

from __future__ import annotations

import importlib
import inspect
import json
import platform
import re
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any, Iterator

from draftline.pipeline.artifacts import atomic_path, sha256_file

DATA_DIR = Path(__file__).resolve().parent / "embedded_data"
CONVERSATIONS = "conversations.jsonl"
TOKENIZER_CORPUS = "tokenizer_corpus.jsonl"
PINNED_SHA256 = {
    CONVERSATIONS: "4877a1fcd7dc62a65b134175ccb2983f3e8497ca985de2e54b3ace6b8bfdfecb",
    TOKENIZER_CORPUS: "5315f55f28e6a21110b18c6d3c6fdbf362a1e080e6ef1a8b5cd1b136ca2e2155",
}
BUILT_WITH_PYTHON = "3.11.7"  # the interpreter whose stdlib docstrings the committed files hold
BUILD_MAX_BYTES = 1_000_000  # size cap of the committed conversation set (bytes)

Conversation = list[dict[str, str]]


class EmbeddedDataError(ValueError):
    """A committed embedded file is missing or does not match its pinned sha256."""


def verified(name: str) -> Path:
    """The committed file ``name``, after checking its sha256 against the pinned one."""
    if name not in PINNED_SHA256:
        raise ValueError(f"unknown embedded file {name!r}; known: {sorted(PINNED_SHA256)}")
    path = DATA_DIR / name
    if not path.exists():
        raise EmbeddedDataError(f"{path} is missing: the checkout or image is incomplete")
    actual = sha256_file(path)
    if actual != PINNED_SHA256[name]:
        raise EmbeddedDataError(
            f"{path} has sha256 {actual}, pinned {PINNED_SHA256[name]} in draftline/tiny/embedded.py: "
            "the embedded data was edited without updating the pin (a rebuild belongs in its own "
            "reviewed commit: python -m draftline.tiny.embedded build)")
    return path


def write_conversations(out_path: str | Path, max_bytes: int = BUILD_MAX_BYTES) -> int:
    """Copy the committed conversation set to ``out_path``: whole lines, at most ``max_bytes``.

    A smaller cap gives a prefix of the full set. Returns the number of conversations.
    """
    data = _capped(max_bytes)
    with atomic_path(out_path) as tmp:
        tmp.write_bytes(data)
    return data.count(b"\n")


def _capped(max_bytes: int) -> bytes:
    lines = verified(CONVERSATIONS).read_bytes().splitlines(keepends=True)
    kept, total = [], 0
    for line in lines:
        if total + len(line) > max_bytes:
            break
        kept.append(line)
        total += len(line)
    if not kept:
        raise ValueError(f"max_bytes={max_bytes} is too small for even one conversation")
    return b"".join(kept)


class NotTheEmbeddedPath(ValueError):
    """``data.path`` names a file of the user's while ``data`` is the embedded set: the project
    would write its set there, so the config is refused instead."""


# data.build names of the embedded set: as committed, and with reasoning added to every reply
# (:func:`with_reasoning`, for the thinking tiny target), each at its own place under the assets.
BUILDS = {"stdlib_docstrings": CONVERSATIONS, "stdlib_docstrings_reasoning": "conversations-reasoning.jsonl"}


def conversations_path(assets_dir: str | Path, build: str = "stdlib_docstrings") -> Path:
    """Where the embedded set is written: the project's assets, never a path a user chose."""
    if build not in BUILDS:
        raise ValueError(f"data.build={build!r}: the embedded set's builds are {', '.join(BUILDS)}")
    return Path(assets_dir) / BUILDS[build]


def check_data_path(data_path: str | Path, assets_dir: str | Path, build: str = "stdlib_docstrings") -> Path:
    """The embedded set's path, after refusing a ``data.path`` that names anything else."""
    expected = conversations_path(assets_dir, build)
    if Path(data_path).resolve() != expected.resolve():
        raise NotTheEmbeddedPath(
            f"data.path={data_path} is set, but data is the embedded set, which lives only at "
            f"{expected}: did you mean data=file? (OVERRIDES=\"data=file data.path={data_path}\")")
    return expected


def ensure_conversations(data_path: str | Path, assets_dir: str | Path,
                         max_bytes: int = BUILD_MAX_BYTES, build: str = "stdlib_docstrings") -> Path:
    """The embedded set (capped at ``max_bytes``) at its place under ``assets_dir``, rewritten
    when it is missing or differs (a copy made by an older builder, or edited by hand).
    ``data_path`` is the configured one: it must be that place (``check_data_path``)."""
    out_path = check_data_path(data_path, assets_dir, build)
    data = _capped(max_bytes)
    if build == "stdlib_docstrings_reasoning":
        data = b"".join(json.dumps(with_reasoning(json.loads(line)), ensure_ascii=False).encode() + b"\n"
                        for line in data.splitlines())
    if not out_path.exists() or out_path.read_bytes() != data:
        with atomic_path(out_path) as tmp:
            tmp.write_bytes(data)
    return out_path


_NAME = re.compile(r"`([^`]+)`")


def with_reasoning(record: dict) -> dict:
    """``record`` with ``reasoning_content`` on every assistant reply: a short plan written from
    the question before it and the reply's own form, so a target trained on the set learns to
    think before it answers, and what it thinks follows from the context (a draft can learn it)."""
    messages, question = [], ""
    for message in record["messages"]:
        if message["role"] == "user":
            question = message["content"]
        elif message["role"] == "assistant":
            found = _NAME.search(question)
            name = found.group(1) if found else "it"
            content = message["content"]
            form = ("quote its documentation after a lead-in" if content.startswith("Here is")
                    else "name it, then give its documentation" if content.startswith("`")
                    else "give its documentation as it is")
            message = {**message, "reasoning_content":
                       f"The user asks about `{name}`. I know its docstring; I will {form}."}
        messages.append(message)
    return {**record, "messages": messages}


def tokenizer_corpus() -> list[str]:
    """The documents the tiny targets' byte-level BPE is trained on (one JSON string a line)."""
    text = verified(TOKENIZER_CORPUS).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines()]


# --------------------------------------------------------------------------- builders
# Used only by `build`: they read the running interpreter's docstrings.

# Pure-Python or core C modules whose docstrings do not depend on the platform or on optional
# libraries (they still differ between Python patch releases, hence the committed files).
_CONVERSATION_MODULES = (
    "abc", "argparse", "base64", "bisect", "calendar", "collections", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "difflib", "enum", "fnmatch", "fractions", "functools",
    "graphlib", "heapq", "html", "ipaddress", "itertools", "json", "math", "numbers", "operator",
    "pprint", "queue", "random", "re", "shlex", "statistics", "string", "textwrap", "types",
    "typing", "uuid", "weakref",
)  # fmt: skip
_CORPUS_MODULES = ("argparse", "collections", "functools", "itertools", "json", "os", "pathlib",
                   "re", "string", "textwrap")
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
        for module in _CONVERSATION_MODULES:
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


def build_conversations() -> Iterator[Conversation]:
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


def conversations_bytes(max_bytes: int = BUILD_MAX_BYTES) -> bytes:
    """:func:`build_conversations` as OpenAI-style JSONL, whole conversations up to ``max_bytes``."""
    lines: list[bytes] = []
    total = 0
    for messages in build_conversations():
        line = (json.dumps({"messages": messages}, ensure_ascii=False, sort_keys=True) + "\n").encode()
        if total + len(line) > max_bytes:
            break
        lines.append(line)
        total += len(line)
    return b"".join(lines)


def build_tokenizer_corpus() -> list[str]:
    """Docstrings of a fixed set of stdlib modules, public members in sorted order; duplicate
    docstrings are dropped (first occurrence kept)."""
    docs: list[str] = []
    seen: set[str] = set()

    def add(doc: str | None) -> None:
        if doc and doc not in seen:
            seen.add(doc)
            docs.append(doc)

    for name in sorted(_CORPUS_MODULES):
        mod = importlib.import_module(name)
        add(inspect.getdoc(mod))
        for member in sorted(dir(mod)):
            obj = getattr(mod, member, None)
            if member.startswith("_") or obj is None or inspect.ismodule(obj):
                continue
            add(inspect.getdoc(obj))
            if inspect.isclass(obj) and obj.__module__ == mod.__name__:
                for attr in sorted(vars(obj)):
                    if not attr.startswith("_"):
                        add(inspect.getdoc(getattr(obj, attr, None)))
    return docs


def corpus_bytes() -> bytes:
    return "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in build_tokenizer_corpus()).encode()


def build(out_dir: Path = DATA_DIR) -> dict[str, str]:
    """Rebuild both files from this interpreter's stdlib; return their sha256 (to pin)."""
    built = {CONVERSATIONS: conversations_bytes(), TOKENIZER_CORPUS: corpus_bytes()}
    for name, data in built.items():
        with atomic_path(Path(out_dir) / name) as tmp:
            tmp.write_bytes(data)
    return {name: sha256_file(Path(out_dir) / name) for name in built}


def main(argv: list[str]) -> None:
    if argv == ["check"]:
        for name in PINNED_SHA256:
            print(f"{name}: sha256 {sha256_file(verified(name))} (pinned)")
    elif argv == ["build"]:
        for name, digest in build().items():
            print(f"{name}: sha256 {digest} (built with Python {platform.python_version()}; "
                  f"pin it in PINNED_SHA256)")
    else:
        raise SystemExit("usage: python -m draftline.tiny.embedded check|build")


if __name__ == "__main__":
    main(sys.argv[1:])
