"""Extraction's knobs as one typed object, built once from ``cfg.extract`` and passed down
(``conf/extract/default.yaml`` says what each is), and the job the shard writers are given.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from pathlib import Path

__all__ = ["ExtractSettings", "ShardJob"]


@dataclasses.dataclass(frozen=True)
class ExtractSettings:
    """``cfg.extract``, typed."""

    token_budget: int  # prompt tokens per generate() call
    shard_tokens: int  # tokens per shard
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    gpu_memory_utilization: float
    cpu_kvcache_gib: float
    save_dtype: str  # hidden states on disk
    rank_timeout_s: float
    writer_timeout_s: float
    disk_headroom: float
    replicas: int
    writer: str  # rank0 | driver (draftline.extract.writer)
    shard: str | None  # i/N: this host's slice

    @classmethod
    def from_config(cls, extract: Mapping) -> ExtractSettings:
        shard = extract.get("shard")
        return cls(
            token_budget=int(extract["token_budget"]), shard_tokens=int(extract["shard_tokens"]),
            max_num_seqs=int(extract["max_num_seqs"]),
            max_num_batched_tokens=int(extract["max_num_batched_tokens"]),
            max_model_len=int(extract["max_model_len"]),
            gpu_memory_utilization=float(extract["gpu_memory_utilization"]),
            cpu_kvcache_gib=float(extract["cpu_kvcache_gib"]), save_dtype=str(extract["save_dtype"]),
            rank_timeout_s=float(extract["rank_timeout_s"]),
            writer_timeout_s=float(extract.get("writer_timeout_s", 1800)),
            disk_headroom=float(extract["disk_headroom"]), replicas=int(extract["replicas"]),
            writer=str(extract["writer"]), shard=None if shard is None else str(shard))

    def job(self, samples: list[list[int]], loss_masks: list[list[int]], out_dir: str | Path,
            metadata: dict[str, str]) -> ShardJob:
        """The writers' job for these samples, with this run's budget and storage dtype."""
        return ShardJob(samples, loss_masks, Path(out_dir), metadata, self.token_budget, self.save_dtype)


@dataclasses.dataclass(frozen=True)
class ShardJob:
    """What a shard writer makes: the samples (token ids) and loss masks by sample id, the
    directory the shards go to, the metadata each carries, the prompt tokens per generate()
    call and the dtype of the hidden states on disk."""

    samples: list[list[int]]
    loss_masks: list[list[int]]
    out_dir: Path
    metadata: dict[str, str]
    token_budget: int
    save_dtype: str

    @functools.cached_property
    def lengths(self) -> list[int]:
        """Each sample's tokens (computed once: a run reads them for every shard)."""
        return [len(s) for s in self.samples]
