"""Tokenize throughput with 1 and N workers on a generated ShareGPT-style file, one run.

    .venv/bin/python -m benchmarks.tokenize                       # 100k conversations, 1 and 2 workers
    .venv/bin/python -m benchmarks.tokenize --conversations 20000 --workers 1 2 4
    .venv/bin/python -m benchmarks.tokenize --conversations 20000 --workers 1 --formats jsonl parquet datasets

Writes a deterministic JSONL file of synthetic ShareGPT conversations with the quirks of
real dumps in about their real proportions (a third start with the assistant, odd role
names, empty turns, empty conversations, same-role runs), builds the tiny target's
tokenizer, then runs the tokenize library path once per worker count, each in a fresh
process, and prints conversations/s, peak memory and a hash of the samples, which must be the
same for every worker count.  ``--formats`` also writes the same records as a parquet file
and a ``datasets`` ``save_to_disk`` directory and runs each (the hash must not change either).  Peak memory is given three ways: the main process's and the
largest worker's own peaks (getrusage), and the peak of the whole process tree's summed RSS,
sampled every 0.2 s (pages shared between processes count once per process); sampling can miss
a short spike such as the final concatenation, so the tree figure is at least the main
process's exact peak.  Timing covers the
tokenize call only (not interpreter start-up or the tokenizer load of the main process;
spawned workers load theirs inside the timed call).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import resource
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

# Words for the synthetic text: common English, so the tiny BPE tokenizes it like prose.
_WORDS = (
    "the of and to a in is it you that he was for on are with as I his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said an each she which do their time if will way about many then them write "
    "would like so these her long make thing see him two has look more day could go come did "
    "number sound no most people my over know water than call first who may down side been "
    "now find any new work part take get place made live where after back little only round "
    "man year came show every good me give our under name very through just form sentence "
    "great think say help low line differ turn cause much mean before move right boy old too "
    "same tell does set three want air well also play small end put home read hand port large "
    "spell add even land here must big high such follow act why ask men change went light"
).split()
# Quirk -> probability per conversation, roughly as counted in a ShareGPT V3 split file
# (17,671 conversations: 36% assistant-first, 126 empty, 75 same-role runs, a few odd roles).
_QUIRKS = {"assistant_first": 0.36, "empty_text": 0.008, "no_turns": 0.007,
           "same_role_run": 0.004, "alias": 0.003, "unknown_role": 0.002}


def _text(rng: random.Random, low: int, high: int) -> str:
    words = rng.choices(_WORDS, k=rng.randint(low, high))
    return " ".join(words).capitalize() + "."


def _conversation(rng: random.Random) -> tuple[dict, str | None]:
    """One record and the quirk it carries (None for a clean one)."""
    roll, quirk, edge = rng.random(), None, 0.0
    for name, probability in _QUIRKS.items():
        edge += probability
        if roll < edge:
            quirk = name
            break
    turns = []
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4))):
        turns.append({"from": "human", "value": _text(rng, 4, 40)})
        turns.append({"from": "gpt", "value": _text(rng, 10, 120)})
    if quirk == "assistant_first":
        turns.insert(0, {"from": "gpt", "value": _text(rng, 10, 120)})
    elif quirk == "empty_text":
        turns[rng.randrange(len(turns))]["value"] = rng.choice(("", " ", "\n"))
    elif quirk == "no_turns":
        turns = []
    elif quirk == "same_role_run":
        turns.insert(1, {"from": "human", "value": _text(rng, 4, 30)})
    elif quirk == "alias":
        turns[1]["from"] = rng.choice(("chatgpt", "bing", "bard"))
    elif quirk == "unknown_role":
        turns[1]["from"] = "tool"
    return {"id": f"c{rng.getrandbits(40):010x}", "conversations": turns}, quirk


def generate(path: str | Path, conversations: int, seed: int = 0) -> Counter:
    """Write ``conversations`` JSONL records to ``path``; return how many carry each quirk."""
    rng = random.Random(seed)
    quirks: Counter = Counter()
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(conversations):
            record, quirk = _conversation(rng)
            quirks[quirk] += 1
            out.write(json.dumps(record) + "\n")
    return quirks


class TreeRSS:
    """Samples the summed RSS of this process and all its descendants in a thread; ``peak`` in bytes."""

    INTERVAL = 0.2  # seconds between samples

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _tree_rss() -> int:
        parents: dict[int, int] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/stat") as f:  # "pid (comm) state ppid ..."
                        parents[int(entry.name)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except (FileNotFoundError, ProcessLookupError):
                    continue  # exited between the listing and the read
        tree, frontier = {os.getpid()}, [os.getpid()]
        while frontier:
            parent = frontier.pop()
            children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
            tree.update(children)
            frontier += children
        total = 0
        for pid in tree:
            try:
                with open(f"/proc/{pid}/statm") as f:  # size resident ... in pages
                    total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (FileNotFoundError, ProcessLookupError):
                continue
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._tree_rss())
            self._stop.wait(self.INTERVAL)

    def __enter__(self) -> "TreeRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def measure(data: str, model: str, workers: int, seq_length: int) -> dict:
    """Tokenize ``data`` once in this process; numbers and a hash of the output."""
    from draftline.tokenize.conversations import DEFAULT_ROLES
    from draftline.tokenize.encode import Budget, TokenizeSettings, tokenize_source
    from draftline.tokenize.sources import open_source

    with TreeRSS() as tree:
        start = time.perf_counter()
        result = tokenize_source(open_source(data), TokenizeSettings(
            model_dir=model, seq_length=seq_length, roles=DEFAULT_ROLES, workers=workers,
            budget=Budget(0.05)))
        seconds = time.perf_counter() - start
    digest = hashlib.sha256()
    for array in (result.input_ids, result.loss_mask, result.offsets):
        digest.update(array.tobytes())
    tally = result.tally.manifest()
    kib = 1024  # ru_maxrss is in KiB on Linux
    main_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib
    return {
        "workers": workers, "seconds": round(seconds, 1),
        "conversations_per_s": round(tally["num_records"] / seconds, 1),
        "peak_rss_main_mib": round(main_peak / 2**20),
        "peak_rss_worker_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / kib),
        "peak_rss_tree_mib": round(max(tree.peak, main_peak) / 2**20),
        "load_avg": open("/proc/loadavg").read().split()[:3],
        "samples": len(result.offsets) - 1, "tokens": len(result.input_ids),
        "skipped": tally["skipped"] and {k: v["count"] for k, v in tally["skipped"].items()},
        "leading_dropped": tally["leading_assistant_turns_dropped"],
        "kept_fraction": tally["assistant_tokens_kept_fraction"], "sha256": digest.hexdigest(),
    }


def convert(jsonl: Path, fmt: str) -> Path:
    """The records of ``jsonl`` as ``fmt`` (jsonl, parquet or datasets) next to it."""
    if fmt == "jsonl":
        return jsonl
    with open(jsonl, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = jsonl.with_suffix(".parquet")
        pq.write_table(pa.Table.from_pylist(records), path)
        return path
    import datasets

    path = jsonl.with_suffix(".datasets")
    datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=100_000, help="records to generate")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts")
    parser.add_argument("--seq-length", type=int, default=2048, help="tokens per sample")
    parser.add_argument("--formats", nargs="+", default=["jsonl"], choices=["jsonl", "parquet", "datasets"],
                        help="input formats to run, each with every worker count")
    parser.add_argument("--measure", nargs=2, metavar=("DATA", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # child mode: one measurement in a fresh process
        print(json.dumps(measure(*args.measure, args.workers[0], args.seq_length)))
        return

    from draftline.tiny import builders

    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
        data, model = Path(tmp) / "sharegpt.jsonl", Path(tmp) / "model"
        quirks = generate(data, args.conversations)
        print(f"generated {args.conversations} conversations ({data.stat().st_size / 2**20:.1f} MiB), "
              f"quirks: {dict(sorted((str(k), v) for k, v in quirks.items()))}", flush=True)
        builders.build_tiny_llama(model)
        rows = []
        for fmt in args.formats:
            path = convert(data, fmt)
            for workers in args.workers:
                child = subprocess.run(
                    [sys.executable, "-m", "benchmarks.tokenize", "--measure", str(path), str(model),
                     "--workers", str(workers), "--seq-length", str(args.seq_length)],
                    check=True, capture_output=True, text=True)
                rows.append({"format": fmt, **json.loads(child.stdout.strip().splitlines()[-1])})
                print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    for row in rows:
        print(f"{row['format']}, workers={row['workers']}: {row['conversations_per_s']} conversations/s "
              f"({row['seconds']} s, x{row['conversations_per_s'] / base['conversations_per_s']:.2f}), "
              f"peak RSS main {row['peak_rss_main_mib']} MiB, worker {row['peak_rss_worker_mib']} MiB, "
              f"all processes together {row['peak_rss_tree_mib']} MiB, "
              f"output {'identical' if row['sha256'] == base['sha256'] else 'DIFFERENT'}")
    if any(row["sha256"] != base["sha256"] for row in rows):
        raise SystemExit("outputs differ between worker counts or formats")


if __name__ == "__main__":
    main()
