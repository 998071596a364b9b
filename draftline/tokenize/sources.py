"""Where conversation records come from: JSON, JSONL, parquet, ``datasets``, hub names.

:func:`open_source` turns ``data.path`` into a :class:`Source` that streams raw records as
``(where, record, parse_error)``, where ``where`` is a location an editor or a debugger can
find again:

==========================  ==========================  =======================================
``data.path``               read as                     ``where``
==========================  ==========================  =======================================
file starting with ``[``    one JSON list (in memory)   ``file[item]`` (0-based)
other file, ``.parquet``    parquet, in row batches     ``file[row]`` (0-based)
other file                  JSONL, line by line         ``file:line`` (1-based, blank lines too)
directory                   ``datasets.load_from_disk`` ``dir[row]`` (memory-mapped arrow)
``owner/name`` (no such     hub dataset from the local  ``owner/name:split[row]``
path)                       HF cache only, never online
==========================  ==========================  =======================================

Only a JSON list is read whole (a JSON array cannot be streamed with the standard library);
everything else is streamed, so memory does not grow with the file.  A hub name is resolved
with ``huggingface_hub.snapshot_download(local_files_only=True)`` and its parquet or JSON(L)
files of the requested split are read like local files; nothing is ever downloaded, so a
name that is not cached is a :class:`~draftline.errors.DataError` that says how to
get it.

Record selection (``max_samples``, a seeded shuffle) is by record number, so it picks the
same records whatever the format: JSONL numbers its non-blank lines, the others their rows.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from draftline.pipeline import artifacts
from draftline.pipeline.config import is_hub_name
from draftline.errors import DataError

__all__ = ["RawRecord", "Source", "open_source", "select_records"]

RawRecord = tuple[str, Any, str | None]  # (where, record or None, parse error or None)
_PARQUET_BATCH = 1024  # rows decoded at a time (bounded memory)
_HUB_SUFFIXES = (".parquet", ".jsonl", ".json")


@dataclass(frozen=True)
class Source:
    """A resolved data source: what it is, how many records, how to stream them."""

    kind: str  # json | jsonl | parquet | datasets | hub
    label: str  # data.path as given, for messages
    files: tuple[Path, ...]  # the files read (one for local files; a hub split may have several)
    count: Callable[[], int]  # number of records (one cheap pass or metadata)
    stream: Callable[[], Iterator[RawRecord]]  # every record in order

    def fingerprint(self) -> dict:
        """Input hashes for the manifest: a file's sha256, or a directory tree's."""
        if self.kind == "datasets":
            return {"kind": self.kind, "sha256_tree": artifacts.sha256_tree(self.files[0])}
        return {"kind": self.kind, "sha256": {str(f): artifacts.sha256_file(f) for f in self.files}}


# --------------------------------------------------------------------------- JSON and JSONL


def _is_json_list(path: Path) -> bool:
    """True when the first non-whitespace character of ``path`` is ``[``."""
    with path.open("rb") as fh:
        while chunk := fh.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1] == b"["
    return False


def _jsonl_records(path: Path) -> Iterator[RawRecord]:
    """One record per non-blank line; a bad line costs that record, not the file."""
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, json.loads(raw.decode("utf-8")), None
            except UnicodeDecodeError as exc:
                yield where, None, f"not UTF-8: {exc.reason} at byte {exc.start}"
            except json.JSONDecodeError as exc:
                yield where, None, f"malformed JSON: {exc.msg} (column {exc.colno})"


def _jsonl_count(path: Path) -> int:
    with path.open("rb") as fh:
        return sum(1 for raw in fh if raw.strip())


def _json_list(path: Path) -> list:
    """Parse a whole-file JSON list; a parse error is fatal since nothing is recoverable."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8: {exc.reason} at byte {exc.start}") from exc
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}") from exc
    return data  # a list: the caller sniffed "[" and the parse consumed the whole file


def _json_list_records(path: Path) -> Iterator[RawRecord]:
    for index, record in enumerate(_json_list(path)):
        yield f"{path}[{index}]", record, None


# --------------------------------------------------------------------------- parquet and arrow


def _parquet_records(paths: tuple[Path, ...], label: Callable[[Path, int], str]) -> Iterator[RawRecord]:
    import pyarrow.parquet as pq

    for path in paths:
        row = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH):
            for record in batch.to_pylist():
                yield label(path, row), record, None
                row += 1


def _parquet_count(paths: tuple[Path, ...]) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(path).metadata.num_rows for path in paths)


def _load_from_disk(path: Path, split: str):
    """A ``datasets`` directory (Dataset, or DatasetDict and its ``split``)."""
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{path}: no split {split!r} (data.split); splits: {sorted(loaded)}")
        loaded = loaded[split]
    return loaded


def _datasets_records(path: Path, split: str) -> Iterator[RawRecord]:
    dataset = _load_from_disk(path, split)
    row = 0
    for batch in dataset.iter(batch_size=_PARQUET_BATCH):  # column dict per batch
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns)):
            yield f"{path}[{row}]", dict(zip(columns, values)), None
            row += 1


# --------------------------------------------------------------------------- hub cache


def _hub_files(name: str, split: str) -> tuple[Path, ...]:
    """The cached files of ``split`` of hub dataset ``name``, sorted; never goes online."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(name, repo_type="dataset", local_files_only=True))
    except LocalEntryNotFoundError as exc:
        raise DataError(
            f"data.path={name!r} is neither a local file or directory nor a dataset in the local "
            f"Hugging Face cache ({os.environ.get('HF_HUB_CACHE') or os.environ.get('HF_HOME') or '~/.cache/huggingface'}). "
            "draftline never downloads: fetch it once where the hub is reachable "
            f"(`huggingface-cli download --repo-type dataset {name}`) or save it with "
            "`datasets.Dataset.save_to_disk` and point data.path at that directory"
        ) from exc
    files = sorted(p for p in snapshot.rglob("*") if p.is_file() and p.name.endswith(_HUB_SUFFIXES))
    # Hub layouts name the split in the file (data/train-00000-of-00003.parquet,
    # data/train_sft-*.parquet) or in a folder (train/*.jsonl).
    chosen = tuple(p for p in files if split in p.relative_to(snapshot).parts[:-1]
                   or p.name.split("-")[0].split(".")[0] == split)
    if not chosen:
        shown = [str(p.relative_to(snapshot)) for p in files[:10]]
        raise DataError(f"hub dataset {name!r}: no parquet/JSON file of split {split!r} "
                        f"(data.split) in {snapshot}; files: {shown}")
    kinds = {p.suffix for p in chosen}
    if len(kinds) != 1:
        raise DataError(f"hub dataset {name!r} split {split!r} mixes file kinds {sorted(kinds)}")
    return chosen


def _hub_source(name: str, split: str) -> Source:
    files = _hub_files(name, split)

    def label(path: Path, row: int) -> str:
        return f"{name}:{split}/{path.name}[{row}]"

    if files[0].suffix == ".parquet":
        return Source("hub", name, files, lambda: _parquet_count(files),
                      lambda: _parquet_records(files, label))

    def stream() -> Iterator[RawRecord]:
        for path in files:
            yield from (_json_list_records(path) if _is_json_list(path) else _jsonl_records(path))

    def count() -> int:
        return sum(len(_json_list(p)) if _is_json_list(p) else _jsonl_count(p) for p in files)

    return Source("hub", name, files, count, stream)


# --------------------------------------------------------------------------- choosing


def open_source(path: str | os.PathLike[str], split: str = "train") -> Source:
    """Resolve ``data.path`` (see the module doc for what each kind of path means)."""
    label = str(path)
    local = Path(path)
    if local.is_dir():
        return Source("datasets", label, (local,), lambda: len(_load_from_disk(local, split)),
                      lambda: _datasets_records(local, split))
    if local.is_file():
        if local.suffix == ".parquet":
            files = (local,)
            return Source("parquet", label, files, lambda: _parquet_count(files),
                          lambda: _parquet_records(files, lambda p, row: f"{p}[{row}]"))
        if _is_json_list(local):
            return Source("json", label, (local,), lambda: len(_json_list(local)),
                          lambda: _json_list_records(local))
        return Source("jsonl", label, (local,), lambda: _jsonl_count(local),
                      lambda: _jsonl_records(local))
    if is_hub_name(label):
        return _hub_source(label, split)
    raise DataError(f"data.path={label!r}: no such file or directory (and not an owner/name hub id)")


def select_records(source: Source, max_samples: int | None, shuffle: bool,
                   seed: int) -> Iterator[tuple[int, RawRecord]]:
    """Yield ``(rank, raw_record)``: the records to use and their position in the output.

    Without shuffling the ranks are the record numbers and reading stops after
    ``max_samples``.  With shuffling, a seeded permutation of all record numbers decides
    which ``max_samples`` records are used and in what order; the source is still read once,
    front to back, and the caller orders its results by rank.
    """
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"data.max_samples must be >= 1 or null, got {max_samples}")
    if not shuffle:
        for number, raw in enumerate(source.stream()):
            if max_samples is not None and number >= max_samples:
                return
            yield number, raw
        return
    order = list(range(source.count()))
    random.Random(seed).shuffle(order)
    ranks = {number: rank for rank, number in enumerate(order[:max_samples])}
    for number, raw in enumerate(source.stream()):
        if number in ranks:
            yield ranks[number], raw
