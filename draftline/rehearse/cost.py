"""What the run's extraction will cost before it starts: bytes on disk, free disk, time.

The bytes are tokenize's token count times extract's own per-token size
(draftline.extract.shards.bytes_per_token: every slot's hidden states in the save dtype, ids
and masks; the one formula extract's disk check uses too). Each shard adds its header and 16
bytes per sample (offsets, sample ids), well under 0.1% at any real shard size, so the
estimate is the per-token bytes alone. With ``regenerate.replies=target`` the replies are
rewritten before extract, so the count extract sees differs from tokenize's by the new
replies' lengths.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from draftline.extract import shards
from draftline.pipeline import artifacts

SHARD_GLOB = "shard-*.safetensors"


def size(num_bytes: float) -> str:
    """Decimal units, as disks are sold: 9.40 TB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def duration(seconds: float) -> str:
    hours, rest = divmod(int(round(seconds)), 3600)
    return f"{hours} h {rest // 60:02d} min" if hours else f"{rest // 60} min {rest % 60:02d} s"


@dataclasses.dataclass(frozen=True)
class Cost:
    num_tokens: int                 # tokenize's
    num_samples: int
    bytes_per_token: int            # extract's formula, for the real target
    total_bytes: int                # what extract writes for these tokens
    shard_dir: Path
    present_bytes: int              # shards already there (a resumed extraction keeps them)
    needed_bytes: int               # what extract's disk check asks for: (total - present) x headroom
    free_bytes: int
    tokens_per_second: float | None
    throughput_from: str
    train_tokens: int | None        # train.steps x train.max_tokens_per_step
    regenerated: bool               # regenerate.replies=target rewrites the replies first

    @property
    def fits(self) -> bool:
        return self.free_bytes >= self.needed_bytes

    @property
    def seconds(self) -> float | None:
        return self.num_tokens / self.tokens_per_second if self.tokens_per_second else None

    def lines(self) -> list[str]:
        out = [f"extract writes {size(self.total_bytes)}: {self.num_tokens:,} tokens x "
               f"{self.bytes_per_token:,} B/token ({self.num_samples:,} samples, tokenize's count)"]
        if self.regenerated:
            out.append("  regenerate.replies=target rewrites the replies first: extract's count "
                       "differs by the new replies' lengths")
        out.append(f"disk at {self.shard_dir}: {size(self.free_bytes)} free, extract asks for "
                   f"{size(self.needed_bytes)} (shards already there: {size(self.present_bytes)})"
                   + ("" if self.fits else ": DOES NOT FIT"))
        if self.seconds is None:
            out.append(f"time: unknown ({self.throughput_from})")
        else:
            out.append(f"time: about {duration(self.seconds)} at {self.tokens_per_second:,.0f} "
                       f"tokens/s ({self.throughput_from})")
        if self.train_tokens:
            passes = self.train_tokens / max(self.num_tokens, 1)
            out.append(f"train reads {self.train_tokens:,} tokens (steps x max_tokens_per_step): "
                       f"{passes:.1f} passes over these shards; as many distinct tokens would be "
                       f"{size(self.train_tokens * self.bytes_per_token)} of shards")
        return out

    def record(self) -> dict:
        return {**{k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()},
                "fits": self.fits, "seconds": self.seconds, "lines": self.lines()}


def _free_bytes(path: Path) -> int:
    """Free space of the file system ``path`` will be on (its nearest existing parent)."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def throughput(configured: float | None, extract_manifest: Path) -> tuple[float | None, str]:
    """tokens/s of the whole extraction: the configured rate, or the last run's measured one."""
    if configured:
        return float(configured), "rehearse.extract_tokens_per_second"
    if extract_manifest.exists():
        measured = float(artifacts.read_json(extract_manifest).get("tokens_per_second") or 0)
        if measured > 0:
            return measured, f"measured by the last extraction, {extract_manifest}"
    return None, ("no rate configured and no extraction measured yet: set "
                  "rehearse.extract_tokens_per_second (tokens/s)")


def shard_bytes(num_tokens: int, num_slots: int, hidden_size: int, save_dtype: str) -> int:
    """What extract writes for ``num_tokens`` tokens (headers and per-sample offsets aside)."""
    return num_tokens * shards.bytes_per_token(num_slots, hidden_size, save_dtype)


def estimate(num_tokens: int, num_samples: int, *, num_slots: int, hidden_size: int,
             save_dtype: str, shard_dir: Path, headroom: float, tokens_per_second: float | None,
             throughput_from: str, train_tokens: int | None = None,
             regenerated: bool = False) -> Cost:
    per_token = shards.bytes_per_token(num_slots, hidden_size, save_dtype)
    total = shard_bytes(num_tokens, num_slots, hidden_size, save_dtype)
    present = sum(p.stat().st_size for p in shard_dir.glob(SHARD_GLOB)) if shard_dir.is_dir() else 0
    return Cost(num_tokens, num_samples, per_token, total, shard_dir, present,
                int(max(total - present, 0) * headroom), _free_bytes(shard_dir),
                tokens_per_second, throughput_from, train_tokens, regenerated)


def run_cost(cfg, tokenize_manifest: dict) -> Cost:
    """The cost of ``cfg``'s extraction of tokenize's samples, on the real target's shape."""
    from draftline import target
    from draftline.pipeline import config

    shape = target.read_target_shape(cfg.model.path)
    extract_dir = config.stage_dir(cfg, "extract")
    rate, source = throughput(cfg.rehearse.extract_tokens_per_second,
                              extract_dir / artifacts.MANIFEST)
    train = cfg.get("train")
    return estimate(int(tokenize_manifest["num_tokens"]), int(tokenize_manifest["num_samples"]),
                    num_slots=len(cfg.model.aux_layer_ids) + 1, hidden_size=shape.hidden_size,
                    save_dtype=str(cfg.extract.save_dtype), shard_dir=extract_dir,
                    headroom=float(cfg.extract.disk_headroom), tokens_per_second=rate,
                    throughput_from=source,
                    train_tokens=int(train.steps) * int(train.max_tokens_per_step) if train else None,
                    regenerated=str(cfg.regenerate.replies) == "target")
