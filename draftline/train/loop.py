"""Train an EAGLE-3 draft with speculators 0.3.0 on pre-extracted hidden states.

Reused from speculators: the model and its forward (TTT rollout, KL loss, per-step
accuracies), its config classes and ``save_pretrained`` format, its data alignment
(``shift_batch``) and collate (see ``draftline.train.loader``), and the optimisation recipe
of its ``Trainer`` (AdamW, linear warm-up/decay schedule, grad-norm clip 1.0).  Not reused:
its packing sampler (``draftline.train.packing`` plans steps that fill the token budget), and
``Trainer`` itself and its checkpointers -- they move the model to ``local_rank`` (an int,
so CUDA) and load checkpoints with ``map_location="cuda:0"``, checkpoint only per epoch, and store bfloat16 weights and optimizer state, which rules out
CPU runs, mid-epoch resume and exact resume.  The loop below is the same few calls.

CPU: speculators decorates ``Eagle3DraftModel.forward`` with ``@torch.compile``, and inductor
fails on it on CPU (torch 2.10: ``InductorError: IndexError: tuple index out of range``
after ~90 s of compiling), so CPU runs call it under
``torch.compiler.set_stance("force_eager")`` -- documented API, scoped to the forward call
and restored afterwards, unlike the process-global ``torch._dynamo.config.disable`` or
``TORCHDYNAMO_DISABLE=1`` -- and use the dense-mask SDPA kernel from
``draftline.train.draft``.

Resume (``draftline.train.checkpoint``): the latest complete checkpoint of the same run spec
is loaded and the same planned batches are replayed from there (``plan_steps``), so on CPU
(same torch thread count) a resumed run ends with bit-identical weights.

Speed (``python -m benchmarks.train`` measures it): ``precision`` (``auto``: bf16 autocast
over float32 master weights on CUDA, float32 on CPU; see ``draftline.train.draft.Precision``)
the packed, pinned, prefetched loader of ``draftline.train.loader.PackedLoader``, and torch's
fused AdamW (one kernel for every parameter's update) on CUDA and CPU: speculators' Trainer
runs the default implementation, ``foreach`` on CUDA, which took ~9% of a Kimi-dims step.

Several processes (torchrun, ``draftline.pipeline.launch``): ``world`` says which rank this is.
``max_tokens_per_step`` stays the global budget: each of N ranks packs ``1/N`` of it
(``draftline.train.packing``: one global packing, dealt out by rank, the same number of
batches on every rank), the draft is wrapped in ``DistributedDataParallel`` (gradients
averaged, so a step sees the same tokens' gradient as one GPU with the whole budget, up to
the per-rank loss normalisation), metrics are averaged over ranks once per step, and rank 0
alone writes checkpoints and the draft.  A checkpoint holds no world size, so it resumes on
another one (the batches from that step on are then the new world size's packing).
bf16 autocast over float32 masters replicated by DDP fits one H200 even at Kimi-K2.5 draft
dimensions (about 31 GiB), so no FSDP sharding is needed there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import get_linear_schedule_with_warmup

from draftline.formats import TRAIN, VALIDATION, load_split, load_vocab_mapping
from draftline.pipeline.artifacts import atomic_dir
from draftline.pipeline.launch import World, rank_tokens
from draftline.pipeline.progress import Progress
from draftline.train.checkpoint import latest_checkpoint, resume_checkpoint, save_checkpoint
from draftline.train.dataset import ShardSampleDataset
from draftline.train.loader import HIDDEN_KEYS, PackedLoader
from draftline.train.packing import (
    PACKING,
    StepPlanner,
    epoch_batches,
    make_sampler,
    plan_steps,
    steps_in_epochs,
)
from draftline.train.optimizer import adamw, optimizer_implementation
from draftline.train.parallel import draft_class
from draftline.train.settings import TrainData, TrainSettings
from draftline.train.timing import StepClock
from draftline.train.draft import (
    Eagle3DraftModel,
    Precision,
    apply_precision,
    build_draft,
    resolve_precision,
    set_attention,
)

__all__ = ["train", "latest_checkpoint", "Session", "make_session"]


log = logging.getLogger(__name__)
GRAD_CLIP = 1.0  # speculators' Trainer


def _fresh_draft(verifier_dir: str | Path, aux_layer_ids: Sequence[int], d2t: torch.Tensor,
                 t2d: torch.Tensor, num_layers: int, ttt_steps: int,
                 seed: int, method: str = "eagle3") -> Eagle3DraftModel:
    # Seeded init without disturbing the caller's RNG; CPU init makes it device-independent.
    cls = draft_class(method)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_draft(verifier_dir, aux_layer_ids, d2t, t2d, num_layers,
                           num_speculative_tokens=ttt_steps, draft_class=cls)


def _sampler(lengths: Sequence[int], rank_tokens: int, seed: int, world: World) -> StepPlanner:
    """The step planner; rank r of N gets its part of each global pack."""
    return make_sampler(lengths, rank_tokens, seed, world.rank, world.world_size)


def _total_steps(sampler: StepPlanner, steps: int | None,
                 epochs: int | None) -> int:
    if (steps is None) == (epochs is None):
        raise ValueError("give exactly one of steps or epochs")
    total = steps if steps is not None else steps_in_epochs(sampler, epochs)
    if total < 1:
        raise ValueError(f"training needs at least one step, got {total}")
    return total


def _optimizer(model: torch.nn.Module, lr: float, warmup_steps: int, total_steps: int,
               implementation: str = "for-loop") -> tuple[torch.optim.Optimizer, LambdaLR]:
    """speculators' Trainer recipe: AdamW over trainable params, linear warm-up and decay;
    ``implementation``: ``draftline.train.optimizer.optimizer_implementation``'s answer."""
    optimizer = adamw([p for p in model.parameters() if p.requires_grad], lr, implementation)
    scheduler = get_linear_schedule_with_warmup(optimizer, warmup_steps, total_steps)
    return optimizer, scheduler


def _forward_mode(model: Eagle3DraftModel, device: str, compile: bool | None,
                  attention: str) -> Callable[[], contextlib.AbstractContextManager]:
    """Pick compile and kernel: compiled flex on CUDA, eager + dense SDPA elsewhere."""
    if compile is None:
        compile = device.startswith("cuda")
    if attention == "auto":
        attention = "flex" if compile else "sdpa"
    set_attention(model, attention)
    if compile:
        return contextlib.nullcontext
    return lambda: torch.compiler.set_stance("force_eager")


def _prepare_model(model: Eagle3DraftModel, device: str, precision: Precision) -> None:
    """Move the draft to its device in its storage dtypes."""
    apply_precision(model, precision)
    model.to(device).train()


def _wrap(model: Eagle3DraftModel, device: str, world: World,
          ddp: bool | None = None) -> torch.nn.Module:
    """DDP across ranks (it broadcasts rank 0's weights once); the model itself alone.

    ``ddp=None`` wraps when there are several ranks; ``True`` wraps a single rank too (its
    process group must exist), which is how the benchmark measures DDP's own cost.
    No buffer broadcast: d2t/t2d are the same on every rank and never change.  Every
    trainable parameter gets a gradient each step, so no search for unused ones.
    """
    if not (world.distributed if ddp is None else ddp):
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [torch.device(device).index] if device.startswith("cuda") else None
    return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)


def _mean_over_ranks(values: torch.Tensor, world: World) -> torch.Tensor:
    """Element-wise mean over ranks (one all-reduce); unchanged in a single process."""
    if world.distributed:
        import torch.distributed as dist

        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values /= world.world_size
    return values


def _model_inputs(batch: dict, device: str, dtype: torch.dtype) -> dict:
    """The batch on ``device`` with hidden states in ``dtype``, cast after the move.

    No-ops for ``PackedLoader`` batches, which arrive that way; other batches (tests,
    benchmarks) may come in any dtype or place.
    """
    moved = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return {k: v.to(dtype) if k in HIDDEN_KEYS else v for k, v in moved.items()}


def _step_detail(metrics: dict, lr: float, ttt_steps: int) -> str:
    """A step's loss, per-TTT-step loss and accuracies, and learning rate, for its log line."""
    per_ttt = " | ".join(
        f"ttt{k} loss {metrics[f'loss_{k}']:.4f} acc {metrics[f'full_acc_{k}']:.3f} "
        f"cond {metrics[f'cond_acc_{k}']:.3f}" for k in range(ttt_steps))
    return f"loss {metrics['loss']:.4f} | {per_ttt} | lr {lr:.2e}"


@dataclasses.dataclass
class Session:
    """What every step needs: the draft, its optimizer/schedule and how to call it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    device: str
    forward_mode: Callable[[], contextlib.AbstractContextManager]
    ttt_steps: int
    decay: float
    precision: Precision
    world: World = World()
    optimizer_implementation: str = "for-loop"  # fused | foreach | for-loop

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """speculators' forward with targets: (summed TTT loss, per-step metric tensors)."""
        inputs = _model_inputs(batch, self.device, self.precision.input_dtype)
        with self.forward_mode(), self.precision.autocast():
            _draft_tokens, loss, metrics = self.model(
                **inputs, ttt_steps=self.ttt_steps, ttt_step_loss_decay=self.decay)
        return loss, metrics

    def step(self, batch: dict) -> dict:
        """One optimizer step exactly as speculators' Trainer.train_epoch does it.

        The backward runs outside autocast (it follows the forward's dtypes), so gradients
        land in the float32 master weights and AdamW updates those.
        """
        loss, metrics = self.forward(batch)
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.scheduler.step()
        return self._reduce(metrics)

    def _reduce(self, metrics: dict[str, torch.Tensor]) -> dict[str, float]:
        """Per-rank metric tensors -> their mean over ranks, as floats."""
        names = sorted(metrics)
        stacked = torch.stack([metrics[k].detach().float().reshape(()) for k in names])
        stacked = stacked.to(self.device)  # NCCL reduces only device tensors
        return dict(zip(names, _mean_over_ranks(stacked, self.world).tolist()))

    @torch.no_grad()
    def evaluate(self, loader: Iterable) -> dict:
        """Mean of speculators' metrics over the batches (empty dict if none).

        Ranks evaluate their own batches (the sampler gives each the same count), and the
        per-rank means are averaged.
        """
        self.model.eval()
        totals: dict[str, float] = {}
        count = 0
        for batch in loader:
            for k, v in self.forward(batch)[1].items():
                totals[k] = totals.get(k, 0.0) + v.item()
            count += 1
        self.model.train()
        if not count:
            return {}
        return self._reduce({k: torch.tensor(v / count) for k, v in totals.items()})


def make_session(model: Eagle3DraftModel, settings: TrainSettings, *, warmup_steps: int,
                 total_steps: int, world: World = World(), ddp: bool | None = None) -> Session:
    """The draft on ``settings.device`` with its optimizer (``lr``; ``fused_optimizer``, None:
    fused AdamW where the device has it), schedule, precision and forward mode (``compile``,
    ``attention``), wrapped in DDP when ``world`` has several ranks, or when ``ddp``; the
    device is this rank's."""
    device = settings.device
    numerics = resolve_precision(settings.precision, device)
    _prepare_model(model, device, numerics)
    mode = _forward_mode(model, device, settings.compile, settings.attention)
    implementation = optimizer_implementation(device, settings.fused_optimizer)
    optimizer, scheduler = _optimizer(model, settings.lr, warmup_steps, total_steps, implementation)
    return Session(_wrap(model, device, world, ddp), optimizer, scheduler, device, mode,
                   settings.ttt_steps, settings.ttt_step_loss_decay, numerics, world, implementation)


def _run_spec(data: TrainData, out: Path, **hyper) -> dict:
    """Everything that shapes the result; a checkpoint resumes only the same spec. Inputs are
    named relative to ``out`` (the checkpoints' own run), so a run dir copied to another
    path or machine, with its inputs beside it as before, writes the same state and resumes."""
    def where(path: str | Path) -> str:
        return os.path.relpath(Path(path).absolute(), out.absolute())

    return {
        "shards": [where(s) for s in data.shards],
        "split_index": where(data.split_index),
        "vocab_mapping": where(data.vocab_mapping),
        "verifier_dir": where(data.verifier_dir),
        "aux_layer_ids": [int(i) for i in data.aux_layer_ids],
        **hyper,
    }


def _loader(session: Session, dataset: ShardSampleDataset, batches: list, max_tokens: int,
            settings: TrainSettings) -> PackedLoader:
    """The packed batches on the session's device, with the settings' threads and lookahead."""
    return PackedLoader(dataset, batches, max_tokens, session.device,
                        session.precision.input_dtype, settings.loader_threads,
                        settings.prefetch_batches)


def _loop(session: Session, train_set: ShardSampleDataset, plan: list, out: Path,
          spec: dict, start: int, stop: int, settings: TrainSettings
          ) -> tuple[list[dict], Progress, dict]:
    """Run the planned steps; return per-step metrics, their progress (the rates) and their
    timing (``_timing``)."""
    total = spec["total_steps"]
    max_tokens = rank_tokens(spec["max_tokens_per_step"], session.world)
    loader = _loader(session, train_set, [batch for _, batch in plan], max_tokens, settings)
    # A line per step: each carries that step's loss.
    progress, history = Progress("train", total, start, unit="steps", interval=0.0, logger=log), []
    clock = StepClock(session.device, lambda: loader.primed_at)
    log.info("training steps %d..%d of %d on %s", start + 1, stop, total, session.device)
    for step, ((epoch, _), batch) in enumerate(zip(plan, clock.timed(loader)), start=start + 1):
        lr = session.optimizer.param_groups[0]["lr"]
        history.append(session.step(batch))
        clock.step_done()
        # Logged rate: this rank's tokens times the ranks (ranks pack about equal shares).
        tokens = int(batch["lengths"].sum()) * session.world.world_size
        progress.advance_to(step, tokens, _step_detail(history[-1], lr, session.ttt_steps))
        if session.world.is_main and (step % settings.checkpoint_every == 0 or step == stop):
            state = {"step": step, "epoch": epoch, "spec": spec, "metrics": history[-1],
                     "world_size": session.world.world_size,
                     "optimizer": session.optimizer_implementation}
            save_checkpoint(out, step, _unwrapped(session.model), session.optimizer,
                            session.scheduler, state, settings.keep_checkpoints)
    return history, progress, _timing(clock)


def _timing(clock: StepClock) -> dict:
    """The steps' wait-for-data distribution (``draftline.train.timing``), logged as a
    warning when the steady state was input-bound."""
    timing = clock.summary()
    if timing["input_bound"]:
        steady = timing["steady"]
        log.warning("training was input-bound: %.1f%% of the steady state's step time waiting "
                    "for data (wait per step p50 %.1f, p90 %.1f, max %.1f ms); more "
                    "train.loader_threads or train.prefetch_batches may help",
                    100 * steady["wait_ms"]["total"] / steady["step_ms"]["total"],
                    steady["wait_ms"]["p50"], steady["wait_ms"]["p90"], steady["wait_ms"]["max"])
    return timing


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The draft inside a DDP wrapper (its checkpoint keys carry no ``module.`` prefix)."""
    return getattr(model, "module", model)


def _validate(session: Session, data: TrainData, max_tokens: int, settings: TrainSettings) -> dict:
    """speculators' metrics averaged over the validation split ({} when it is empty)."""
    rows = load_split(data.split_index, VALIDATION)
    if len(rows) < session.world.world_size:  # too few to give every rank a batch
        return {}
    dataset = ShardSampleDataset(data.shards, rows)
    batches = epoch_batches(_sampler(dataset.lengths, max_tokens, settings.seed, session.world), 0)
    return session.evaluate(_loader(session, dataset, batches, max_tokens, settings))


def _vllm_check(check_vllm: bool | None, draft_dir: str, aux_layer_ids: Sequence[int],
                draft_vocab_size: int) -> tuple[dict | None, list[dict]]:
    """vLLM's reading of the saved draft (None if not checked), and what was skipped and why.

    ``None`` checks when vLLM is installed: training hosts need not have it (the benchmark
    and GPU training environments do not), and nothing on the training path imports it.
    """
    what = "vLLM parse of the saved draft"
    if check_vllm is None and importlib.util.find_spec("vllm") is None:
        log.warning("vLLM is not installed: the saved draft's vLLM parse was skipped")
        return None, [{"what": what, "reason": "vLLM is not installed here"}]
    if check_vllm is False:
        return None, [{"what": what, "reason": "turned off by the caller (check_vllm=False)"}]
    from draftline.train.vllm_parse import check_vllm_parse

    return check_vllm_parse(draft_dir, aux_layer_ids, draft_vocab_size), []


def _save_draft(model: Eagle3DraftModel, out_dir: Path, save_dtype: str) -> Path:
    """speculators' save format: config.json + model.safetensors (with d2t/t2d buffers)."""
    model.to(getattr(torch, save_dtype))  # d2t/t2d are integer/bool buffers: unchanged
    path = out_dir / "draft"
    with atomic_dir(path) as tmp:
        model.save_pretrained(str(tmp))
    return path


def _summary(history: list[dict], progress: Progress, start: int, stop: int, total: int,
             last: dict) -> dict:
    return {
        "steps": stop, "total_steps": total, "completed": stop == total, "resumed_from": start,
        "final": history[-1] if history else last,
        "loss_history": [m["loss"] for m in history],
        "tokens_per_second": progress.tokens_per_second() if history else None,
        "seconds_per_step": 1 / progress.rate() if history else None,
        "validation": {}, "draft_dir": None, "vllm": None, "skipped": [],
    }


def train(data: TrainData, settings: TrainSettings, out_dir: str | Path, *,
          world: World = World(), stop_after: int | None = None) -> dict:
    """Train (or resume) a draft on ``data`` as ``settings`` say; write ``out_dir/draft/``
    once all steps are done.

    ``stop_after`` ends this call after that global step (with a checkpoint), e.g. for
    time-sliced jobs; the next call resumes.  ``world``: this process's rank among torchrun's
    (the process group is set up by the caller; ``settings.device`` is this rank's); only
    rank 0 writes.  Returns ``steps``, ``total_steps``, ``completed``, ``resumed_from``,
    ``final`` (speculators' per-TTT-step loss/accuracies of the last step), ``loss_history``
    (this call's steps), ``validation``, ``tokens_per_second``, ``seconds_per_step``,
    ``draft_dir``, ``vllm``, ``skipped`` (checks that did not run, each with why),
    ``precision`` (the resolved one), ``optimizer`` (AdamW's implementation: fused, foreach or
    for-loop), ``packing`` (the planner), ``timing`` (this call's wait for data per step:
    start-up and steady-state p50/p90/max, ``input_bound``;
    ``draftline.train.timing.StepClock.summary``).
    """
    out = Path(out_dir)
    numerics = resolve_precision(settings.precision, settings.device)
    d2t, t2d = load_vocab_mapping(data.vocab_mapping)
    model = _fresh_draft(data.verifier_dir, data.aux_layer_ids, d2t, t2d, settings.num_layers,
                         settings.ttt_steps, settings.seed, settings.method)
    train_set = ShardSampleDataset(data.shards, load_split(data.split_index, TRAIN))
    tokens_per_rank = rank_tokens(settings.max_tokens_per_step, world)
    sampler = _sampler(train_set.lengths, tokens_per_rank, settings.seed, world)
    total = _total_steps(sampler, settings.steps, settings.epochs)
    warmup = total // 100 if settings.warmup_steps is None else settings.warmup_steps
    spec = _run_spec(data, out, total_steps=total, lr=settings.lr, warmup_steps=warmup,
                     ttt_steps=settings.ttt_steps, ttt_step_loss_decay=settings.ttt_step_loss_decay,
                     seed=settings.seed, num_layers=settings.num_layers,
                     max_tokens_per_step=settings.max_tokens_per_step, precision=numerics.name,
                     packing=PACKING, **({} if settings.method == "eagle3" else {"method": settings.method}))
    session = make_session(model, settings, warmup_steps=warmup, total_steps=total, world=world)
    log.info("optimizer: AdamW, %s implementation", session.optimizer_implementation)
    start, last = resume_checkpoint(out, spec, model, session.optimizer, session.scheduler,
                                    settings.device)
    stop = total if stop_after is None else max(start, min(total, stop_after))
    history, progress, timing = _loop(session, train_set, plan_steps(sampler, start, stop), out,
                                      spec, start, stop, settings)
    result = {**_summary(history, progress, start, stop, total, last), "timing": timing,
              "precision": numerics.name,
              "world_size": world.world_size, "packing": PACKING,
              "optimizer": {"name": "AdamW", "implementation": session.optimizer_implementation}}
    if stop < total:
        return result
    result["validation"] = _validate(session, data, tokens_per_rank, settings)
    if not world.is_main:
        return result
    result["draft_dir"] = str(_save_draft(model, out, settings.save_dtype))
    result["vllm"], result["skipped"] = _vllm_check(settings.check_vllm, result["draft_dir"],
                                                    data.aux_layer_ids, d2t.numel())
    return result
