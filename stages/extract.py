"""extract: target hidden states for every sample (regenerate's output), through vLLM (prefill only).

    make extract EXP=tiny          # or: python -m stages.extract experiment=tiny
    make extract EXP=tiny OVERRIDES=extract.replicas=2   # two engines on this host
    make extract EXP=tiny SHARD=1/3   # one host's slice; then a plain `make extract` finalizes

Validates everything it can (paths, layer ids, lengths, TP size, disk space) before the
model load; writes resumable safetensors shards under <run_dir>/extract/.

Scaling out: every process plans the same shards, and which process makes a shard changes
nothing in it, so replicas and slices leave exactly the shards one engine writes.
- ``extract.replicas=N``: this process starts N children (this stage again, with
  DRAFTLINE_EXTRACT_REPLICA=r/N), one engine each on devices of its own (CUDA_VISIBLE_DEVICES,
  or a share of the CPU cores); replica r makes shards r, r+N, ...  The parent shows their
  progress, ends them all when one fails (raising with that one's traceback), and writes the
  manifest.
- ``extract.shard=i/N`` (`make extract SHARD=i/N`, one per host on shared storage): the shards
  with index % N == i, no manifest; N is recorded in extract/.slices.json. A plain run in a
  sliced run dir only finalizes: it writes the manifest when every planned shard is complete,
  else fails naming the missing shards and the commands that fill them.
Replicas and slices leave what they imported in extract/.deps-<part>.json; the manifest's
dependency record includes it (vLLM and its patches), though its writer loaded no engine.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from draftline import engine, formats, target
from draftline.extract import shards
from draftline.pipeline import artifacts, config, launch
from draftline.pipeline.progress import TOKENS, Progress
from draftline.pipeline.stage import refuse_mistakes, run_part, run_stage

log = logging.getLogger("draftline.extract")
REPLICA_ENV = "DRAFTLINE_EXTRACT_REPLICA"  # "r/N" in a replica child, set by its parent
# The target's per-file sha256 by size and mtime, so a large target is read once, not per run
# (a dot file: never an output, never compared by `make reproduce`).
TARGET_DIGEST_CACHE = ".target-sha256.json"


def preflight(cfg: DictConfig, lengths: list[int], replicas: int | None = 1) -> target.TargetShape:
    """Every check that can fail before a (possibly 25-minute) model load. ``replicas``: the
    engines this process may start, whose devices are checked (None: it starts none)."""
    if cfg.extract.save_dtype not in formats.SAVE_DTYPES:
        raise ValueError(f"extract.save_dtype={cfg.extract.save_dtype!r}: expected one of "
                         f"{sorted(formats.SAVE_DTYPES)}")
    target.check(cfg.model.path, bool(cfg.model.trust_remote_code))
    shape = target.read_target_shape(cfg.model.path)
    target.check_layer_ids(list(cfg.model.aux_layer_ids), shape)
    if (shape.num_layers, shape.hidden_size) != (cfg.model.num_layers, cfg.model.hidden_size):
        raise ValueError(f"model config says {cfg.model.num_layers} layers x {cfg.model.hidden_size}, "
            f"{cfg.model.path}/config.json says {shape.num_layers} x {shape.hidden_size}")
    if max(lengths) >= cfg.extract.max_model_len:
        raise ValueError(f"longest sample has {max(lengths)} tokens; extract.max_model_len="
            f"{cfg.extract.max_model_len} must exceed it (vLLM needs one more for the sampled token)")
    if replicas is not None:
        check_devices(int(cfg.model.tensor_parallel_size), replicas)
    return shape


def check_devices(tensor_parallel_size: int, replicas: int = 1) -> None:
    import torch

    if replicas < 1:
        raise ValueError(f"extract.replicas={replicas}: need at least one engine")
    what = "" if replicas == 1 else f"{replicas} replicas x "
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if replicas * tensor_parallel_size > count:
            raise ValueError(f"{what}tensor_parallel_size={tensor_parallel_size} > {count} GPUs")
    else:
        if replicas * tensor_parallel_size > os.cpu_count():
            raise ValueError(f"{what}TP {tensor_parallel_size} > CPU cores")


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


def make_generator(cfg: DictConfig):
    """speculators' hidden-state generator on the run's target, with the project's one set of
    engine options (draftline.engine); their environment is set before vLLM is imported."""
    options = engine.engine_options(cfg, cfg.extract)
    os.environ.update(options.environment())
    from speculators.data_generation import VllmHiddenStatesGenerator

    return VllmHiddenStatesGenerator(
        str(cfg.model.path), layer_ids=list(cfg.model.aux_layer_ids),
        # Cast (fp8: quantized) in the engine's worker, on its device, so the worker-to-driver
        # transfer already moves the shard's bytes (patches/speculators/0006).
        hidden_states_dtype=str(cfg.extract.save_dtype),
        **engine.generator_kwargs(options,
                                  max_num_batched_tokens=int(cfg.extract.max_num_batched_tokens)))


# Keys that say where the target lives or how it was made (its files' content stands for them),
# or that only check the run: they change no byte of a shard.
NOT_IN_SHARD_BYTES = {"model": ("name", "path", "build", "train", "trust_remote_code",
                                 "enforce_eager"),  # extraction always runs eager
                      "extract": ("disk_headroom", "rank_timeout_s")}


def shard_fingerprint(cfg: DictConfig, samples_path: Path) -> str:
    """What a shard on disk must have been made from to be reused, and what its header holds:
    the samples' bytes, the target's files (their content), and the model and extract keys that
    shape the tensors. No path, time or host enters it, so the same inputs give byte-identical
    shards in any run dir and on any machine."""
    resolved = config.stage_config(cfg, "extract")
    return artifacts.config_hash({
        "samples": artifacts.sha256_file(samples_path),
        "target": target.target_digest(cfg.model.path, config.stage_dir(cfg, "extract") / TARGET_DIGEST_CACHE),
        **{group: {key: value for key, value in resolved[group].items() if key not in skipped}
           for group, skipped in NOT_IN_SHARD_BYTES.items()},
    })


def remove_unplanned(out_dir: Path, plans: list[shards.ShardPlan]) -> None:
    """Shards beyond the current plan (left by a run with other data) must not linger."""
    planned = {plan.name for plan in plans}
    for path in out_dir.glob("shard-*.safetensors"):
        if path.name not in planned:
            path.unlink(missing_ok=True)  # slices on other hosts remove them too
            shards.timing_path(path).unlink(missing_ok=True)


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What every extract process reads and plans before any engine starts."""

    out_dir: Path
    regenerate_dir: Path
    samples: list[list[int]]
    masks: list[list[int]]
    shape: target.TargetShape
    plans: list[shards.ShardPlan]
    fingerprint: str


def read_inputs(cfg: DictConfig, replicas: int | None = 1) -> Inputs:
    regenerate_dir = config.stage_dir(cfg, "regenerate")
    regenerate_manifest = artifacts.read_manifest(regenerate_dir)
    samples_path = regenerate_dir / regenerate_manifest["samples"]
    samples, masks = formats.read_samples(samples_path)
    lengths = [len(s) for s in samples]
    shape = preflight(cfg, lengths, replicas)
    return Inputs(config.stage_dir(cfg, "extract"), regenerate_dir, samples, masks, shape,
                  shards.plan_shards(lengths, int(cfg.extract.shard_tokens)),
                  shard_fingerprint(cfg, samples_path))


def shard_metadata(cfg: DictConfig, inputs: Inputs) -> dict[str, str]:
    return formats.shard_metadata(inputs.fingerprint, list(cfg.model.aux_layer_ids),
                                  inputs.shape.hidden_size)


def extract(cfg: DictConfig, inputs: Inputs, plans: list[shards.ShardPlan],
            overrides: list[str]) -> tuple[list[shards.ShardPlan], float]:
    """Make the shards of ``plans`` that are not complete, with one engine in this process
    or ``extract.replicas`` children; return those that were pending and the tokens/s."""
    pending = shards.incomplete_shards(plans, inputs.out_dir, inputs.fingerprint)
    num_slots = len(cfg.model.aux_layer_ids) + 1
    per_token = shards.bytes_per_token(num_slots, inputs.shape.hidden_size, cfg.extract.save_dtype)
    remaining = sum(p.num_tokens for p in pending)
    estimate = shards.check_disk(inputs.out_dir, remaining, per_token, float(cfg.extract.disk_headroom))
    log.info("%d shards planned here, %d to extract (%d tokens, about %.1f MiB)",
             len(plans), len(pending), remaining, estimate / 2**20)
    if not pending:
        return pending, 0.0
    total = sum(p.num_tokens for p in plans)
    progress = Progress("extract", total, total - remaining, unit=TOKENS, logger=log)
    if int(cfg.extract.replicas) > 1:
        extract_in_replicas(cfg, inputs, plans, pending, overrides, progress)
    else:
        extract_here(cfg, inputs, plans, progress)
    progress.finish()
    return pending, progress.tokens_per_second()


def extract_here(cfg: DictConfig, inputs: Inputs, plans: list[shards.ShardPlan],
                 progress: Progress) -> None:
    """One engine in this process over ``plans`` (complete shards are skipped)."""
    generator = make_generator(cfg)
    try:
        shards.extract_shards(generator, plans, inputs.samples, inputs.masks, inputs.out_dir,
                                  int(cfg.extract.token_budget), cfg.extract.save_dtype,
                                  shard_metadata(cfg, inputs), progress)
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


def host_plans(cfg: DictConfig, plans: list[shards.ShardPlan]) -> list[shards.ShardPlan]:
    """This host's shards: all of them, or its slice under ``extract.shard=i/N``."""
    if cfg.extract.shard is None:
        return plans
    return shards.Part.parse(cfg.extract.shard, "extract.shard").take(plans)


def run(cfg: DictConfig, overrides: list[str] = ()) -> dict:
    """The stage: extract what is pending (or, in a sliced run dir, only check the slices'
    shards), then the manifest's fields."""
    out_dir = config.stage_dir(cfg, "extract")
    num_slices = shards.read_slices_record(out_dir)
    inputs = read_inputs(cfg, None if num_slices else int(cfg.extract.replicas))
    plans = inputs.plans
    remove_unplanned(out_dir, plans)
    if num_slices is None:
        pending, tokens_per_second = extract(cfg, inputs, plans, list(overrides))
    else:
        missing = shards.incomplete_shards(plans, out_dir, inputs.fingerprint)
        if missing:
            raise RuntimeError(shards.finalize_error(missing, len(plans), num_slices, out_dir,
                                                         list(overrides)))
        log.info("finalize: all %d shards of %d slices are complete", len(plans), num_slices)
        pending, tokens_per_second = [], 0.0

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
    pending, _ = extract(cfg, inputs, mine, overrides)
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
        extract_here(cfg, inputs, mine, Progress("extract", 0, unit=TOKENS, quiet=True))


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    overrides = list(HydraConfig.get().overrides.task)
    out_dir = config.stage_dir(cfg, "extract")
    shard, replica = cfg.extract.shard, os.environ.get(REPLICA_ENV)
    # Each part's dependency record, named by the part (a replica of a slice by both).
    part_name = "-".join(f"{kind}-{str(value).replace('/', '-of-')}"
                         for kind, value in (("slice", shard), ("replica", replica)) if value)
    record = shards.part_deps_path(out_dir, part_name)
    if replica:
        part = shards.Part.parse(replica, REPLICA_ENV)
        run_part(f"extract replica {part}", cfg, lambda c: run_replica(c, part), record)
    elif shard is not None:
        run_part(f"extract slice {shard}", cfg, lambda c: run_slice(c, overrides), record)
    else:
        run_stage("extract", cfg, lambda c: run(c, overrides), lambda: shards.read_part_deps(out_dir))


if __name__ == "__main__":
    refuse_mistakes()
    main()
