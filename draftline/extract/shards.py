"""Hidden-state extraction into resumable safetensors shards.

The shard plan depends only on the sample lengths and the configured shard size, so a rerun
after a crash rebuilds the same plan, keeps every shard already on disk (each was renamed
into place whole) and produces byte-identical remaining shards. Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shlex
import shutil
from pathlib import Path

from draftline import formats
from draftline.pipeline.artifacts import read_json, sha256_file, write_json

log = logging.getLogger(__name__)
ID_AND_MASK_BYTES = 8 + 1  # int64 input id + uint8 loss mask per token


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    index: int
    sample_ids: tuple[int, ...]
    num_tokens: int

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}.safetensors"


def plan_shards(lengths: list[int], shard_tokens: int) -> list[ShardPlan]:
    """Consecutive samples per shard until it holds at least ``shard_tokens`` tokens."""
    plans, current, tokens = [], [], 0
    for sample_id, length in enumerate(lengths):
        current.append(sample_id)
        tokens += length
        if tokens >= shard_tokens:
            plans.append(ShardPlan(len(plans), tuple(current), tokens))
            current, tokens = [], 0
    if current:
        plans.append(ShardPlan(len(plans), tuple(current), tokens))
    return plans


def plan_batches(sample_ids: tuple[int, ...], lengths: list[int], token_budget: int) -> list[list[int]]:
    """Split a shard's samples into generate() calls of at most ``token_budget`` tokens."""
    batches, current, tokens = [], [], 0
    for sample_id in sample_ids:
        if current and tokens + lengths[sample_id] > token_budget:
            batches.append(current)
            current, tokens = [], 0
        current.append(sample_id)
        tokens += lengths[sample_id]
    if current:
        batches.append(current)
    return batches


def bytes_per_token(num_slots: int, hidden_size: int, save_dtype: str) -> int:
    """A token's bytes in a shard: every slot's values (and its fp8 scale), its id and mask.

    Per-sample offsets and ids, and the header, come on top (a few bytes per sample).
    """
    return num_slots * formats.stored_bytes_per_slot(save_dtype, hidden_size) + ID_AND_MASK_BYTES


def check_disk(out_dir: Path, remaining_tokens: int, per_token: int, headroom: float) -> int:
    """Refuse to start a model load whose output cannot fit on disk; return the estimate."""
    estimate = int(remaining_tokens * per_token * headroom)
    out_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out_dir).free
    if free < estimate:
        raise RuntimeError(
            f"{out_dir}: {free / 2**30:.1f} GiB free, extraction needs about "
            f"{estimate / 2**30:.1f} GiB ({remaining_tokens} tokens x {per_token} B x {headroom})"
        )
    return estimate


def shard_is_complete(path: Path, plan: ShardPlan, fingerprint: str) -> bool:
    """A shard on disk counts only if the same inputs and config made the planned samples.

    ``fingerprint`` hashes the regenerate manifest and the extract config, so a shard left by
    a run with other aux ids or other data is redone, never reused.
    """
    if not path.exists():
        return False
    metadata, sample_ids = formats.read_shard_identity(path)
    return metadata.get(formats.FINGERPRINT) == fingerprint and sample_ids == plan.sample_ids

def remove_partial_writes(out_dir: Path, plans: list[ShardPlan]) -> int:
    """Temp files a killed writer left of these shards (artifacts.atomic_path's names); each
    may be a shard's size, so restarts would fill the disk. Only the shards this process is
    about to make: another slice's host may be writing its own. Returns how many went."""
    partial = [tmp for plan in plans for tmp in out_dir.glob(f".{plan.name}.*.tmp")]
    for tmp in partial:
        tmp.unlink(missing_ok=True)
    return len(partial)


def timing_path(shard: Path) -> Path:
    """shard-NNNNN.safetensors -> shard-NNNNN.timing.json (extraction seconds of that shard)."""
    return shard.with_suffix(".timing.json")


def shard_records(plans: list[ShardPlan], out_dir: Path) -> list[dict]:
    """Per-shard rows, tokens, bytes, sha256 and, where recorded, extraction seconds."""
    records = []
    for plan in plans:
        path = out_dir / plan.name
        timing = read_json(timing_path(path)) if timing_path(path).exists() else {}
        records.append({
            "file": plan.name,
            "samples": len(plan.sample_ids),
            "tokens": plan.num_tokens,
            "bytes": path.stat().st_size,
            "sha256": sha256_file(path),
            **timing,
        })
    return records


# --------------------------------------------------------------------------- scaling out
# Replicas (several engines on one host) and slices (one `make extract SHARD=i/N` per host)
# both take every N-th shard of the same plan: which process makes a shard changes nothing
# in it, so the shards are those a single engine writes.

LISTED = 50  # missing shards named one per line in the finalize error
SLICES_RECORD = ".slices.json"  # dot-named: launch bookkeeping, not an output (make reproduce)


@dataclasses.dataclass(frozen=True)
class Part:
    """Part ``index`` of ``count``: every ``count``-th item of a list, from position ``index``."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str, what: str) -> "Part":
        """``"i/N"`` with 0 <= i < N; ``what`` names the setting in the error."""
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
        if match is None or not int(match[1]) < int(match[2]):
            raise ValueError(f"{what}={text!r}: expected i/N with 0 <= i < N, e.g. 0/4")
        return cls(int(match[1]), int(match[2]))

    def take(self, items: list) -> list:
        """Over a whole shard plan (position = shard index): the shards with index % N == i."""
        return items[self.index::self.count]

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def part_deps_path(out_dir: Path, name: str) -> Path:
    """Where a replica or slice process leaves what it imported (``stage.run_part``)."""
    return out_dir / f".deps-{name}.json"


def read_part_deps(out_dir: Path) -> list[dict]:
    """Every part's dependency record: the manifest names what the engines ran on (vLLM, its
    patches), though the process that writes it never loaded an engine."""
    return [read_json(path) for path in sorted(out_dir.glob(".deps-*.json"))]


def write_slices_record(out_dir: Path, count: int) -> None:
    """Mark the run dir as extracted in ``count`` slices: a plain run then only finalizes."""
    write_json(out_dir / SLICES_RECORD, {"num_slices": count})


def read_slices_record(out_dir: Path) -> int | None:
    """The slice count a `make extract SHARD=i/N` recorded, or None for a one-host run."""
    path = out_dir / SLICES_RECORD
    return int(read_json(path)["num_slices"]) if path.exists() else None


def incomplete_shards(plans: list[ShardPlan], out_dir: Path, fingerprint: str) -> list[ShardPlan]:
    """Planned shards that are missing, or were made from other inputs or config."""
    return [plan for plan in plans if not shard_is_complete(out_dir / plan.name, plan, fingerprint)]


def fill_commands(slices: list[int], count: int, overrides: list[str]) -> list[str]:
    """The commands that extract these slices with the config of this run.

    ``overrides`` are the stage's own (Hydra's task overrides); `make` sets
    ``experiment=$(EXP)`` and passes OVERRIDES after it, so with an experiment the Make form
    is exact. Without one the stage ran outside Make: the python form is given instead.
    """
    exp = next((o.split("=", 1)[1] for o in overrides if o.startswith("experiment=")), None)
    rest = [o for o in overrides if not o.startswith(("experiment=", "extract.shard="))]
    commands = []
    for index in slices:
        if exp is None:
            words = ["python", "-m", "stages.extract", *rest, f"extract.shard={index}/{count}"]
            commands.append(" ".join(shlex.quote(w) for w in words))
        else:
            extra = f" OVERRIDES={shlex.quote(' '.join(rest))}" if rest else ""
            commands.append(f"make extract EXP={shlex.quote(exp)} SHARD={index}/{count}{extra}")
    return commands


def finalize_error(missing: list[ShardPlan], num_planned: int, count: int, out_dir: Path,
                   overrides: list[str]) -> str:
    """What a finalize that cannot write the manifest tells the user: the shards and the
    commands that fill them."""
    slices = sorted({plan.index % count for plan in missing})
    lines = [f"{out_dir} is extracted in {count} slices ({out_dir / SLICES_RECORD}) and "
             f"{len(missing)} of {num_planned} planned shards are missing or were made from "
             "other inputs or config:"]
    lines += [f"  {plan.name} (slice {plan.index % count}/{count})" for plan in missing[:LISTED]]
    if len(missing) > LISTED:
        lines.append(f"  ... and {len(missing) - LISTED} more")
    lines += ["Fill them (each command resumes its slice), then run `make extract` again:"]
    lines += [f"  {command}" for command in fill_commands(slices, count, overrides)]
    lines += [f"(To extract them all on this host instead, delete {out_dir / SLICES_RECORD}.)"]
    return "\n".join(lines)
