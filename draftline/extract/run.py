"""extract's work: the shards this process (or its replicas) makes, and the manifest's fields.

Scaling out: every process plans the same shards, and which process makes a shard changes
nothing in it, so replicas and slices leave exactly the shards one engine writes.
- ``extract.replicas=N``: this process starts N children (the stage again, with
  DRAFTLINE_EXTRACT_REPLICA=r/N), one engine each on devices of its own (CUDA_VISIBLE_DEVICES,
  or a share of the CPU cores); replica r makes shards r, r+N, ...  The parent shows their
  progress, ends them all when one fails (raising with that one's traceback), and writes the
  manifest.
- ``extract.shard=i/N`` (`make extract SHARD=i/N`, one per host on shared storage): the shards
  with index % N == i, no manifest; N is recorded in extract/.slices.json. A plain run in a
  sliced run dir only finalizes: it writes the manifest when every planned shard is complete,
  else fails naming the missing shards and the commands that fill them.
"""

from __future__ import annotations

import logging
import os
import sys

from omegaconf import DictConfig

from draftline import engine, formats
from draftline.extract import preflight, shards, writer
from draftline.extract.generator import make_generator
from draftline.extract.plan import Inputs, host_plans, read_inputs, remove_unplanned, shard_metadata
from draftline.extract.settings import ExtractSettings, ShardJob
from draftline.pipeline import artifacts, config, launch
from draftline.pipeline.progress import TOKENS, Progress

log = logging.getLogger("draftline.extract")
REPLICA_ENV = "DRAFTLINE_EXTRACT_REPLICA"  # "r/N" in a replica child, set by its parent


def replica_environments(replicas: int, tensor_parallel_size: int) -> list[dict[str, str]]:
    """Each replica's devices, decided here at the stage boundary: disjoint visible GPUs, or on
    the CPU platform an even share of this process's cores (vLLM's OpenMP binding)."""
    import torch

    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        ids = ([d.strip() for d in visible.split(",")] if visible
               else [str(i) for i in range(torch.cuda.device_count())])
        return [{"CUDA_VISIBLE_DEVICES": d}
                for d in launch.split_devices(ids, replicas, tensor_parallel_size)]
    cores = sorted(os.sched_getaffinity(0))
    return [{"VLLM_CPU_OMP_THREADS_BIND": b}
            for b in launch.split_cores(cores, replicas, tensor_parallel_size)]


def extract(cfg: DictConfig, inputs: Inputs, plans: list[shards.ShardPlan],
            overrides: list[str]) -> tuple[list[shards.ShardPlan], float, dict | None]:
    """Make the shards of ``plans`` that are not complete, with one engine in this process
    or ``extract.replicas`` children; return those that were pending, the tokens/s and,
    with one engine here, where its seconds went."""
    pending = shards.incomplete_shards(plans, inputs.out_dir, inputs.fingerprint)
    if removed := shards.remove_partial_writes(inputs.out_dir, pending):
        log.info("removed %d partial shard writes a stopped run left", removed)
    num_slots = len(cfg.model.aux_layer_ids) + 1
    per_token = shards.bytes_per_token(num_slots, inputs.shape.hidden_size, cfg.extract.save_dtype)
    remaining = sum(p.num_tokens for p in pending)
    estimate = shards.check_disk(inputs.out_dir, remaining, per_token, float(cfg.extract.disk_headroom))
    log.info("%d shards planned here, %d to extract (%d tokens, about %.1f MiB)",
             len(plans), len(pending), remaining, estimate / 2**20)
    if not pending:
        return pending, 0.0, None
    total = sum(p.num_tokens for p in plans)
    progress = Progress("extract", total, total - remaining, unit=TOKENS, logger=log)
    split = None
    if int(cfg.extract.replicas) > 1:
        extract_in_replicas(cfg, inputs, plans, pending, overrides, progress)
    else:
        split = extract_here(cfg, inputs, plans, progress)
    progress.finish()
    if split is not None:
        log.info("extract: %s", split.line())
    return pending, progress.tokens_per_second(), split and split.record(str(cfg.extract.writer))


def extract_here(cfg: DictConfig, inputs: Inputs, plans: list[shards.ShardPlan],
                 progress: Progress) -> writer.TimeSplit:
    """One engine in this process over ``plans`` (complete shards are skipped)."""
    generator = make_generator(cfg)
    split = writer.TimeSplit()
    settings = ExtractSettings.from_config(cfg.extract)
    job = settings.job(inputs.samples, inputs.masks, inputs.out_dir, shard_metadata(cfg, inputs))
    try:
        write_shards(settings, generator, plans, job, progress, split)
    except Exception as error:
        failure = engine.worker_failure(getattr(generator, "executor", None))
        if failure is None and engine.timed_out(error):
            failure = (f"the TP ranks did not answer one capture step within extract.rank_timeout_s="
                       f"{cfg.extract.rank_timeout_s} s: a rank hangs (the log above may say where), "
                       f"or one step of up to extract.max_num_batched_tokens="
                       f"{cfg.extract.max_num_batched_tokens} tokens takes longer on this target "
                       "(then raise extract.rank_timeout_s)")
        if failure is None:
            raise
        raise RuntimeError(failure) from error
    finally:
        generator.shutdown()
    return split


def write_shards(settings: ExtractSettings, generator, plans: list[shards.ShardPlan], job: ShardJob,
                 progress: Progress, split: writer.TimeSplit) -> list[int]:
    """The pending shards of ``plans`` through ``generator``, by extract.writer's path."""
    if settings.writer == preflight.RANK0:
        return writer.on_rank0(generator, plans, job, progress, split)
    return writer.in_driver(generator, plans, job, progress, split)


def extract_in_replicas(cfg: DictConfig, inputs: Inputs, plans: list[shards.ShardPlan],
                        pending: list[shards.ShardPlan], overrides: list[str],
                        progress: Progress) -> None:
    """``extract.replicas`` children of this stage, replica r on plans[r::N]; only those with
    pending shards start. Progress counts the shards that appear complete on disk."""
    replicas = int(cfg.extract.replicas)
    environments = replica_environments(replicas, int(cfg.model.tensor_parallel_size))
    waiting = {plan.index: plan for plan in pending}
    children = {}
    for replica, environment in enumerate(environments):
        if any(plan.index in waiting for plan in plans[replica::replicas]):
            children[f"replica {replica}"] = {**environment, REPLICA_ENV: f"{replica}/{replicas}"}
    log.info("starting %d of %d replicas: %s", len(children), replicas,
             "; ".join(f"{name}: {env}" for name, env in children.items()))

    def poll() -> None:
        for index, plan in list(waiting.items()):
            if shards.shard_is_complete(inputs.out_dir / plan.name, plan, inputs.fingerprint):
                progress.advance(plan.num_tokens)
                del waiting[index]

    launch.supervise([sys.executable, "-m", "stages.extract", *overrides], children, poll)


def run(cfg: DictConfig, overrides: list[str] = ()) -> dict:
    """The stage: extract what is pending (or, in a sliced run dir, only check the slices'
    shards), then the manifest's fields."""
    out_dir = config.stage_dir(cfg, "extract")
    num_slices = shards.read_slices_record(out_dir)
    inputs = read_inputs(cfg, None if num_slices else int(cfg.extract.replicas))
    plans = inputs.plans
    remove_unplanned(out_dir, plans)
    if num_slices is None:
        pending, tokens_per_second, split = extract(cfg, inputs, plans, list(overrides))
    else:
        missing = shards.incomplete_shards(plans, out_dir, inputs.fingerprint)
        if missing:
            raise RuntimeError(shards.finalize_error(missing, len(plans), num_slices, out_dir,
                                                     list(overrides)))
        log.info("finalize: all %d shards of %d slices are complete", len(plans), num_slices)
        pending, tokens_per_second, split = [], 0.0, None

    lengths = [len(s) for s in inputs.samples]
    records = shards.shard_records(plans, out_dir)
    total_bytes = sum(r["bytes"] for r in records)
    num_slots = len(cfg.model.aux_layer_ids) + 1
    per_token = shards.bytes_per_token(num_slots, inputs.shape.hidden_size, cfg.extract.save_dtype)
    return {
        "shards": records,
        "num_samples": len(inputs.samples),
        "num_tokens": sum(lengths),
        "resumed_shards": len(plans) - len(pending),
        "aux_layer_ids": list(cfg.model.aux_layer_ids),
        "num_slots": num_slots,
        "hidden_size": inputs.shape.hidden_size,
        "target_architecture": inputs.shape.architecture,
        "target": str(cfg.model.path),
        "bytes_per_token": {"on_disk": total_bytes / max(sum(lengths), 1), "raw_minimum": per_token},
        "save_dtype": str(cfg.extract.save_dtype),
        "scales": (f"{formats.HIDDEN_SCALES}: {str(formats.SCALE_DTYPE).removeprefix('torch.')} "
                   "[tokens, num_slots], state = value x scale, scale = amax(|row|) / "
                   f"{formats.FP8_MAX:g}" if formats.is_quantized(str(cfg.extract.save_dtype))
                   else None),
        "tokens_per_second": tokens_per_second,
        # Where this run's seconds went (one engine here; None when replicas or slices made
        # the shards, or every shard was already on disk).
        "time_split": split,
        "inputs": {"regenerate_manifest_sha256": artifacts.sha256_file(inputs.regenerate_dir / artifacts.MANIFEST)},
        "skipped": [],
    }


def run_slice(cfg: DictConfig, overrides: list[str]) -> None:
    """`make extract SHARD=i/N`: this host's slice into the shared run dir, no manifest."""
    part = shards.Part.parse(cfg.extract.shard, "extract.shard")
    inputs = read_inputs(cfg, int(cfg.extract.replicas))
    remove_unplanned(inputs.out_dir, inputs.plans)
    shards.write_slices_record(inputs.out_dir, part.count)
    mine = part.take(inputs.plans)
    if shards.incomplete_shards(mine, inputs.out_dir, inputs.fingerprint):
        # A manifest of an earlier run must not outlive shards being replaced under it.
        (inputs.out_dir / artifacts.MANIFEST).unlink(missing_ok=True)
    pending, _, _ = extract(cfg, inputs, mine, overrides)
    log.info("slice %s: %d shards, %d made now, %d already complete; once every slice is done, "
             "`make extract` checks them all and writes the manifest", part, len(mine),
             len(pending), len(mine) - len(pending))


def run_replica(cfg: DictConfig, replica: shards.Part) -> None:
    """A replica child: its share of this host's shards with one engine, quietly (the parent
    shows progress and writes the manifest)."""
    inputs = read_inputs(cfg)
    mine = replica.take(host_plans(cfg, inputs.plans))
    pending = shards.incomplete_shards(mine, inputs.out_dir, inputs.fingerprint)
    log.info("replica %s: %d shards, %d to extract", replica, len(mine), len(pending))
    if pending:
        split = extract_here(cfg, inputs, mine, Progress("extract", 0, unit=TOKENS, quiet=True))
        log.info("replica %s: %s", replica, split.line())
