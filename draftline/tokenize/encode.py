"""Conversations -> training samples, in parallel, with every skip counted by reason.

The main process streams records from a :class:`~draftline.tokenize.sources.Source`,
normalises them (cheap) and hands batches of conversations to ``workers`` spawned
processes, each with its own tokenizer, which render, mask and window them (the slow
part).  Results come back in submission order and are placed by rank, so the samples, their
order, the vocabulary counts and the skip table are the same for any number of workers.

The skip budget (``tokenize.max_skipped``) is a count (an int) or a fraction of the records
read (a float in [0, 1]); every reason is counted, with the first few locations, and a run
over budget fails with the table.  An exchange lost from a conversation that still gives
samples (its prompt alone fills ``seq_length``) is not a record skip and does not count
against the budget; the manifest's ``dropped_exchanges`` counts those, with locations.
Normalisations (inline reasoning moved to ``reasoning_content``) and reasoning no sample
trains are counted too (``normalized``, ``reasoning``): nothing changes without a number in the
manifest.  ``reasoning_trained`` says which ``tokenize.reasoning`` setting made the samples and
how many reasoning tokens they train; ``as_generated`` what that setting cost (its extra
samples and their prompt tokens) and which replies it could not establish.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from draftline import target
from draftline.pipeline.progress import Progress
from draftline.errors import UserError
from draftline.tokenize.chat import ChatTemplateError, DroppedExchange, EmptyLossMaskError
from draftline.tokenize.windows import encode_windows
from draftline.tokenize.generated import check_setting
from draftline.tokenize.spans import Template
from draftline.errors import DataError
from draftline.tokenize.conversations import DEFAULT_ROLES, RecordSkip, normalize
from draftline.tokenize.sources import Source, select_records

__all__ = ["Budget", "Tally", "TokenizedSet", "load_tokenizer", "tokenize_source", "default_workers"]

log = logging.getLogger("draftline.tokenize")

EXAMPLES_PER_REASON = 3  # locations kept per skip reason in the manifest
BATCH = 32  # conversations per worker task: large enough to amortise pickling, small for balance
TASKS_PER_WORKER = 4  # tasks in flight per worker: bounds memory while keeping workers busy


class NoChatTemplate(UserError, ValueError):
    """The target's tokenizer has no chat template: tokenize renders every conversation with it."""

    hint_text = ("tokenize renders every conversation with the target's chat template: use the "
                 "chat (instruct) model's directory, or a copy of this one whose "
                 "tokenizer_config.json has a chat_template")


def load_tokenizer(model_dir: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    trust = target.check(model_dir, trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust)
    if not tokenizer.chat_template:
        raise NoChatTemplate(f"{model_dir}: tokenizer has no chat_template")
    return tokenizer


def default_workers() -> int:
    """All cores this process may run on."""
    return len(os.sched_getaffinity(0))


# --------------------------------------------------------------------------- budget and tally


@dataclass(frozen=True)
class Budget:
    """``tokenize.max_skipped``: an int is a count, a float a fraction of the records read."""

    value: int | float

    def __post_init__(self):
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)):
            raise ValueError(f"tokenize.max_skipped must be an int (count) or a float (fraction), "
                             f"got {self.value!r}")
        if isinstance(self.value, float) and not 0.0 <= self.value <= 1.0:
            raise ValueError(f"tokenize.max_skipped as a fraction must be in [0, 1], got {self.value}")
        if isinstance(self.value, int) and self.value < 0:
            raise ValueError(f"tokenize.max_skipped must be >= 0, got {self.value}")

    def allows(self, skipped: int, records: int) -> bool:
        if isinstance(self.value, int):
            return skipped <= self.value
        return skipped <= self.value * records

    def __str__(self) -> str:
        kind = "count" if isinstance(self.value, int) else "fraction of records"
        return f"tokenize.max_skipped={self.value} ({kind})"


@dataclass
class Tally:
    """What happened to each record: skips by reason (with first locations) and fixes."""

    num_records: int = 0
    skips: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    unknown_roles: Counter = field(default_factory=Counter)
    leading_dropped_conversations: int = 0
    leading_dropped_turns: int = 0
    num_conversations: int = 0  # records that gave at least one sample
    num_split: int = 0  # conversations that became more than one sample
    num_truncated: int = 0  # samples cut inside an exchange
    dropped_exchanges: int = 0  # exchanges of kept conversations whose prompt alone fills seq_length
    dropped_exchange_conversations: int = 0
    dropped_exchange_examples: list[str] = field(default_factory=list)
    assistant_tokens: int = 0
    kept_tokens: int = 0
    normalized: Counter = field(default_factory=Counter)  # records' fixes by kind (replies)
    reasoning_replies: int = 0  # replies of kept conversations with reasoning
    reasoning_dropped: int = 0  # ... whose reasoning no sample trains (the template leaves it out)
    reasoning_tokens: int = 0  # tokens of the reasoning the samples train
    tool_result_samples: int = 0  # samples with tool results after a reply
    reasoning_setting: str = "template"  # tokenize.reasoning
    num_samples: int = 0
    num_tokens: int = 0
    extra_samples: int = 0  # as_generated: samples of one reply after its own prompt
    extra_prefix_tokens: int = 0  # ... their prompt tokens
    replies_reused: int = 0  # ... replies the whole render already shows as generated
    whole_left_out: int = 0  # ... whole-render windows that train no reply
    as_template: int = 0  # ... replies not established as generated, trained as the template shows them
    as_template_examples: list[str] = field(default_factory=list)

    def skip(self, where: str, reason: str, detail: str, role: str | None = None) -> None:
        self.skips[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < EXAMPLES_PER_REASON:
            shown.append(f"{where}: {detail}")
        if role is not None:
            self.unknown_roles[role] += 1

    def drop_exchanges(self, where: str, details: list[str]) -> None:
        """Exchanges lost from a conversation that still gave samples (not a record skip)."""
        if not details:
            return
        self.dropped_exchanges += len(details)
        self.dropped_exchange_conversations += 1
        for detail in details[: EXAMPLES_PER_REASON - len(self.dropped_exchange_examples)]:
            self.dropped_exchange_examples.append(f"{where}: {detail}")

    @property
    def num_skipped(self) -> int:
        return sum(self.skips.values())

    def table(self) -> str:
        """Reason -> count lines with the first location of each, for errors and logs."""
        rows = [f"  {reason:<20} {count:>8}   e.g. {self.examples[reason][0]}"
                for reason, count in sorted(self.skips.items(), key=lambda kv: (-kv[1], kv[0]))]
        return "\n".join(rows) or "  (none)"

    def manifest(self) -> dict:
        kept = self.kept_tokens / self.assistant_tokens if self.assistant_tokens else 0.0
        return {
            "num_records": self.num_records,
            "num_conversations": self.num_conversations,
            "num_skipped": self.num_skipped,
            "skipped": {reason: {"count": count, "examples": self.examples[reason]}
                        for reason, count in sorted(self.skips.items())},
            "unknown_roles": dict(sorted(self.unknown_roles.items())),
            "leading_assistant_turns_dropped": {"conversations": self.leading_dropped_conversations,
                                                "turns": self.leading_dropped_turns},
            "num_split_conversations": self.num_split,
            "num_truncated_samples": self.num_truncated,
            "dropped_exchanges": {"count": self.dropped_exchanges,
                                  "conversations": self.dropped_exchange_conversations,
                                  "examples": self.dropped_exchange_examples},
            "num_assistant_tokens": self.assistant_tokens,
            "num_kept_assistant_tokens": self.kept_tokens,
            "assistant_tokens_kept_fraction": round(kept, 6),
            "normalized": dict(sorted(self.normalized.items())),
            "reasoning": {"replies": self.reasoning_replies,
                          "dropped_by_template": self.reasoning_dropped},
            "reasoning_trained": {"setting": self.reasoning_setting,
                                  "replies": self.reasoning_replies - self.reasoning_dropped,
                                  "tokens": self.reasoning_tokens},
            "as_generated": self._as_generated(),
            "num_samples_with_tool_results": self.tool_result_samples,
        }

    def _as_generated(self) -> dict | None:
        """What tokenize.reasoning=as_generated cost and could not do; None for the others."""
        if self.reasoning_setting != "as_generated":
            return None
        overhead = self.extra_prefix_tokens / self.num_tokens if self.num_tokens else 0.0
        return {"samples": self.num_samples, "tokens": self.num_tokens,
                "extra_samples": self.extra_samples, "extra_prefix_tokens": self.extra_prefix_tokens,
                "overhead_fraction": round(overhead, 6), "replies_reused": self.replies_reused,
                "whole_samples_left_out": self.whole_left_out,
                "replies_as_template": {"count": self.as_template, "examples": self.as_template_examples}}

    def add_as_generated(self, where: str, stats: dict) -> None:
        """One conversation's as_generated counts (the ``stats`` of :func:`_encode_batch`)."""
        self.extra_samples += stats["extra_samples"]
        self.extra_prefix_tokens += stats["extra_prefix_tokens"]
        self.replies_reused += stats["reused"]
        self.whole_left_out += stats["left_out"]
        self.as_template += len(stats["as_template"])
        for k in stats["as_template"][: EXAMPLES_PER_REASON - len(self.as_template_examples)]:
            self.as_template_examples.append(
                f"{where}: turn {k}: no render shows it right after its generation prompt")


# --------------------------------------------------------------------------- workers

_WORKER: dict[str, Any] = {}  # the tokenizer and seq_length of this process


def _init_worker(model_dir: str, trust_remote_code: bool, seq_length: int, template: Template,
                 reasoning: str) -> None:
    _WORKER["tokenizer"] = load_tokenizer(model_dir, trust_remote_code)
    _WORKER["seq_length"] = seq_length
    _WORKER["template"] = template
    _WORKER["reasoning"] = reasoning


def _dropped_detail(exchange: DroppedExchange, leading: int, seq_length: int) -> str:
    """Where a dropped exchange was, in the record's own turn numbers (before dropping
    ``leading`` assistant turns; exchanges never include the leading system turns)."""
    first, last = exchange.start + leading, exchange.end - 1 + leading
    return (f"exchange of turns {first}-{last} dropped: its prompt fills seq_length={seq_length} "
            f"({exchange.num_tokens} tokens rendered alone), no reply token left")


def _sample_arrays(sample) -> tuple:
    """``(ids int32, mask uint8, truncated, tool marks uint8)``: compact to send back."""
    marks = sample.tool_results or [0] * len(sample.input_ids)
    return (np.asarray(sample.input_ids, dtype=np.int32), np.asarray(sample.loss_mask, dtype=np.uint8),
            sample.num_truncated > 0, np.asarray(marks, dtype=np.uint8))


def _encode_batch(batch: list[tuple[int, str, list[dict], int, list | None]]) -> list[tuple]:
    """``(rank, where, outcome)`` per conversation; outcome is a skip or the windows.

    Input: ``(rank, where, messages, leading assistant turns dropped, declared tools)``.  Skips:
    ``("skip", reason, detail)``.  Samples: ``("ok", [sample arrays], total, kept, dropped,
    stats)`` with one detail string per dropped exchange, and ``stats`` the reasoning and
    as_generated counts (turn numbers in the record's own numbering).
    """
    tokenizer, seq_length = _WORKER["tokenizer"], _WORKER["seq_length"]
    out = []
    for rank, where, messages, leading, tools in batch:
        try:  # the tally adds where
            windows = encode_windows(tokenizer, messages, seq_length, tools=tools,
                                     template=_WORKER["template"], reasoning=_WORKER["reasoning"])
        except EmptyLossMaskError as exc:
            out.append((rank, where, ("skip", "no_assistant_tokens", str(exc))))
            continue
        except ChatTemplateError as exc:
            out.append((rank, where, ("skip", exc.reason, str(exc))))
            continue
        samples = [_sample_arrays(s) for s in windows.samples]
        dropped = [_dropped_detail(e, leading, seq_length) for e in windows.dropped_exchanges]
        stats = {"reasoning": windows.num_reasoning, "reasoning_dropped": windows.num_reasoning_dropped,
                 "reasoning_tokens": windows.num_reasoning_tokens,
                 "extra_samples": windows.num_extra_samples,
                 "extra_prefix_tokens": windows.num_extra_prefix_tokens, "reused": windows.num_reused,
                 "left_out": windows.num_left_out, "as_template": [k + leading for k in windows.as_template]}
        out.append((rank, where, ("ok", samples, windows.num_assistant_tokens, windows.num_kept_tokens,
                                  dropped, stats)))
    return out


def _ordered_map(fn: Callable, tasks: Iterable, workers: int, init: Callable, initargs: tuple) -> Iterator:
    """``map(fn, tasks)`` in order over ``workers`` spawned processes, a bounded window ahead.

    One worker runs in this process (no pool), which is the reference the parallel path
    must reproduce.  Spawned, not forked: the parent may already hold tokenizer threads.
    """
    if workers == 1:
        init(*initargs)
        yield from map(fn, tasks)
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=init, initargs=initargs) as pool:
        pending: deque = deque()
        for task in tasks:
            pending.append(pool.submit(fn, task))
            if len(pending) >= TASKS_PER_WORKER * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


# --------------------------------------------------------------------------- the run


@dataclass
class TokenizedSet:
    """Flat samples in output order, and the tally of how they were made."""

    input_ids: np.ndarray  # int64 [total_tokens]
    loss_mask: np.ndarray  # uint8 [total_tokens]
    offsets: np.ndarray  # int64 [num_samples + 1]
    tally: Tally
    tool_results: np.ndarray | None = None  # uint8 [total_tokens]; None when no sample has any
    # as_generated: each kept conversation as a record (where, messages, tools), in sample order:
    # what regenerate's target replies are generated from, turn by turn (draftline/regenerate/turns.py)
    conversations: list[dict] | None = None


def _read_error_reason(error: str) -> str:
    return "not_utf8" if error.startswith("not UTF-8") else "malformed_json"


@dataclass(frozen=True)
class TokenizeSettings:
    """How :func:`tokenize_source` reads and encodes: the target's tokenizer (``model``), the
    ``tokenize`` knobs and the ``data`` selection, as the stage resolved them."""

    model_dir: str  # the target's directory (its tokenizer and chat template)
    seq_length: int  # tokens per sample
    budget: Budget = Budget(0)  # tokenize.max_skipped
    trust_remote_code: bool = False
    roles: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_ROLES))  # data.roles
    max_samples: int | None = None  # data.max_samples
    shuffle: bool = False  # data.shuffle
    seed: int = 0  # the selection's order when shuffled
    workers: int = 1  # tokenizer processes
    template: Template = None  # tokenize.chat_template_kwargs
    reasoning: str = "template"  # tokenize.reasoning, resolved (draftline.tokenize.windows)
    text_field: str | None = None  # data.field: the record's key holding the conversation


def tokenize_source(source: Source, settings: TokenizeSettings) -> TokenizedSet:
    """Tokenize every selected record of ``source`` (see the module doc) as ``settings`` say."""
    model_dir, trust_remote_code, seq_length = settings.model_dir, settings.trust_remote_code, settings.seq_length
    roles, field, max_samples, shuffle = settings.roles, settings.text_field, settings.max_samples, settings.shuffle
    seed, workers, budget = settings.seed, settings.workers, settings.budget
    template, reasoning = settings.template, settings.reasoning
    check_setting(reasoning)
    if workers < 1:
        raise ValueError(f"tokenize.workers must be >= 1, got {workers}")
    if seq_length < 1:
        raise ValueError(f"tokenize.seq_length must be >= 1, got {seq_length}")
    tally = Tally(reasoning_setting=reasoning)

    def over_budget() -> DataError:
        return DataError(f"{source.label}: {tally.num_skipped} of {tally.num_records} records "
                         f"skipped, over {budget}:\n{tally.table()}")

    def batches() -> Iterator[list]:
        batch = []
        for rank, (where, record, error) in select_records(source, max_samples, shuffle, seed):
            tally.num_records += 1
            try:
                if error is not None:
                    raise RecordSkip(_read_error_reason(error), error)
                normalized = normalize(record, roles, field)
            except RecordSkip as exc:
                tally.skip(where, exc.reason, str(exc), exc.role)
                if isinstance(budget.value, int) and not budget.allows(tally.num_skipped, 0):
                    raise over_budget() from exc  # a count budget can fail early
                continue
            if normalized.dropped_leading:
                tally.leading_dropped_conversations += 1
                tally.leading_dropped_turns += normalized.dropped_leading
            tally.normalized.update(normalized.fixes)
            batch.append((rank, where, normalized.messages, normalized.dropped_leading, normalized.tools))
            if reasoning == "as_generated":
                records[rank] = (normalized.messages, normalized.tools)
            if len(batch) == BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    results: dict[int, list] = {}
    records: dict[int, tuple] = {}  # rank -> (messages, tools): as_generated keeps them for regenerate
    def selected() -> int:  # counted only for runs long enough to report on
        count = source.count()
        return count if max_samples is None else min(count, max_samples)

    progress = Progress("tokenize", selected, unit="records", logger=log)
    for done in _ordered_map(_encode_batch, batches(), workers, _init_worker,
                             (model_dir, trust_remote_code, seq_length, template, reasoning)):
        for rank, where, outcome in done:
            if outcome[0] == "skip":
                records.pop(rank, None)
                tally.skip(where, outcome[1], outcome[2])
                if isinstance(budget.value, int) and not budget.allows(tally.num_skipped, 0):
                    raise over_budget()
                continue
            _, samples, total, kept, dropped, stats = outcome
            results[rank] = samples
            if rank in records:
                messages, tools = records[rank]
                records[rank] = {"where": where, "messages": messages, **({"tools": tools} if tools else {})}
            tally.drop_exchanges(where, dropped)
            tally.num_conversations += 1
            tally.num_split += len(samples) > 1
            tally.num_truncated += sum(truncated for _, _, truncated, _ in samples)
            tally.tool_result_samples += sum(bool(marks.any()) for _, _, _, marks in samples)
            tally.assistant_tokens += total
            tally.kept_tokens += kept
            tally.reasoning_replies += stats["reasoning"]
            tally.reasoning_dropped += stats["reasoning_dropped"]
            tally.reasoning_tokens += stats["reasoning_tokens"]
            tally.num_samples += len(samples)
            tally.num_tokens += sum(len(ids) for ids, _, _, _ in samples)
            if reasoning == "as_generated":
                tally.add_as_generated(where, stats)
        progress.advance_to(tally.num_records, detail=f"{tally.num_skipped} skipped")
    if not budget.allows(tally.num_skipped, tally.num_records):
        raise over_budget()
    if not results:
        raise DataError(f"{source.label}: no usable conversation among {tally.num_records} "
                        f"records: the tokenized dataset is empty\n{tally.table()}")
    conversations = [records[rank] for rank in sorted(results)] if reasoning == "as_generated" else None
    return _flatten(results, tally, conversations)


def _flatten(results: dict[int, list], tally: Tally, conversations: list[dict] | None = None) -> TokenizedSet:
    samples = [sample for rank in sorted(results) for sample in results[rank]]
    lengths = np.array([len(ids) for ids, _, _, _ in samples], dtype=np.int64)
    offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths)])
    ids = np.concatenate([ids for ids, _, _, _ in samples]).astype(np.int64)
    mask = np.concatenate([mask for _, mask, _, _ in samples])
    marks = np.concatenate([marks for _, _, _, marks in samples]) if tally.tool_result_samples else None
    return TokenizedSet(ids, mask, offsets, tally, marks, conversations)

