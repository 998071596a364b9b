"""The anchor: a draft trained on a run's prepared data by speculators 0.3.0's own Trainer.

    .venv/bin/python -m benchmarks.anchor --exp tiny --steps 5           # CPU, a few steps
    .venv/bin/python -m benchmarks.anchor --exp llama-3.1-8b             # GPU, train.steps
    .venv/bin/python -m benchmarks.anchor --exp tiny numerics.torch_threads=1   # + Hydra overrides
    make evaluate EXP=tiny OVERRIDES="evaluate.draft=runs/tiny/anchor/draft"      # then evaluate it

What it is for: draftline trains its draft with its own loop (``draftline.train.loop``); this
trains one the way speculators 0.3.0 does, on exactly the same inputs, so the two drafts (and
their speeds) can be compared.  Same inputs: the train split of prepare's index over extract's
shards, the vocabulary mapping train uses (``draftline.train.run.vocab_path``), the run's
target (``model.path``), the aux layer ids extract captured, ``train.ttt_steps``,
``train.num_layers``, ``train.seed`` and the token budget per step
``train.max_tokens_per_step`` (``--max-tokens-per-step`` replaces it); ``train.steps``
optimizer steps unless ``--steps`` says otherwise.

speculators' own, unchanged: its ``Trainer`` and ``TrainerConfig`` (AdamW over
``model.named_parameters()`` with torch's default kernel at its script's default lr 1e-4, its
linear schedule with 1% warm-up, its forward/TTT loss, grad clip 1.0, its
``SingleGPUCheckpointer`` and ``save_pretrained``); the draft built as its
``scripts/train.py`` (v0.3.0) builds it -- ``LlamaConfig`` from the verifier's ``AutoConfig``,
``simple_flex_attention``, ``norm_before_residual=True``, greedy proposals with
``speculative_tokens`` = the TTT steps, ``Eagle3DraftModel`` (speculators' class, not
draftline's subclass); its batch sampler ``MultipackDistributedBatchSamplerV2`` and collate
``create_collate_fn`` at the token budget; its training-data noise
``AddUniformNoise(std=0.05)`` on ``hidden_states`` and ``verifier_last_hidden_states`` (none
for validation); its validation pass over the validation split after training;
``ttt_step_loss_decay=1.0`` and ``use_off_policy_tokens=False``.  ``AnchorDataset`` yields
per sample exactly what
speculators' ``Eagle3SampleFileDataset.__getitem__`` yields for the same sample saved in its
v1 ``.pt`` format: speculators' ``standardize_data_v1`` (aux slots concatenated, final slot as
``verifier_last_hidden_states``), hidden states in float32, ``lengths``, ``position_ids``, the
transform, then ``shift_batch``.

What had to be adapted, and why (also written into the manifest's ``adaptations``):

1. Device.  ``Trainer`` moves the model and every batch to ``TrainerConfig.local_rank`` (an int,
   so ``cuda:<n>``) and its script builds ``torch.device(local_rank)``: on a machine without a
   GPU that fails.  On CPU ``local_rank="cpu"`` is passed (``.to("cpu")`` works for both);
   a side effect is that the Trainer's rank-0 tqdm bar is not shown there (it tests
   ``local_rank == 0``); the progress lines below replace it.  On CUDA it is the GPU's index.
2. Compilation.  ``Eagle3DraftModel.forward`` is decorated with ``@torch.compile``, which fails
   on CPU with flex attention (inductor: ``IndexError: tuple index out of range``).  On CPU
   ``TORCHDYNAMO_DISABLE=1`` is set before speculators is imported (the decorator reads it
   when the class is defined), so the same forward runs eagerly, still with flex attention.
3. Precision.  speculators 0.3.0 trains in float32 on one GPU (bf16 only under FSDP).  On
   CUDA the draft's forward runs under ``torch.autocast("cuda", torch.bfloat16)`` (the forward
   alone: backward, clip and AdamW outside it, float32 master weights), installed by wrapping
   ``model.forward``; the Trainer is untouched.  On CPU: float32, speculators' own.
4. Steps.  The Trainer runs whole epochs (``num_epochs * len(train_loader)`` steps, schedule
   sized from that).  To run exactly N steps the loader's batch sampler chains epochs of
   speculators' sampler (its ``set_epoch(0), (1), ...`` orders) and stops after N batches;
   the Trainer runs it as one epoch, so its schedule is sized to N steps (warm-up N // 100),
   its validation runs once and its checkpointer saves once (``checkpoints/0``).
5. Data.  ``Eagle3SampleFileDataset`` reads one ``.pt`` per sample; draftline has shards, so
   ``AnchorDataset`` reads the same sample from them (above).  speculators' sampler packs by
   ``approx_lengths`` (file size over the first file's size, times that sample's length
   after the shift); here they are the exact lengths after the shift.  speculators' split
   (``split_files``, 90/10 by file) is replaced by prepare's train/validation split.  The
   sampler's seed is ``train.seed`` (its script leaves it at 0, the default seed).
6. Loader.  speculators' script uses 12 workers, prefetch 4, pinned memory: on CUDA those; on
   CPU (tests, 2-core machines) no workers and no pinning.
7. Run setup.  The checkpoint directory is emptied first and ``resume_from_checkpoint=False``
   (its script resumes by default; a leftover epoch would make the Trainer skip training, and
   its CPU resume loads onto ``cuda:0``).  The draft is seeded with ``train.seed`` (its script
   does not seed).  No metric logger backends (its script's default ``--logger ""``).
8. Saved config.  ``eagle_aux_hidden_state_layer_ids`` is set in speculators' own
   ``Eagle3SpeculatorConfig`` (the script leaves it null): vLLM 0.16 reads it from
   config.json to pick the target layers it feeds the draft, and draftline's evaluate refuses
   a draft whose ids differ from the extracted ones.  The verifier's ``architectures`` are
   its config's (the script writes ``LlamaForCausalLM`` whatever the verifier is).  Neither
   changes a weight or a step.

Output under ``--out`` (default ``<run_dir>/anchor``): ``checkpoints/0/`` (speculators'
checkpoint: config.json, bf16 model.safetensors, optimizer and scheduler state), ``draft/``
(the checkpoint less the optimizer and scheduler state: config.json, model.safetensors and
what else ``save_pretrained`` writes, the speculators-format draft evaluate and vLLM read)
and ``manifest.json`` (steps, token budget, real tokens, seconds, tokens/s, the loss history,
validation metrics, versions, the adaptations).

Printed per step: ``anchor STEP/TOTAL steps (steps/s, tok/s, ETA) | loss ... | lr ...``,
tokens counting real tokens (padding excluded, as draftline's train counts them).

Where the anchor's recipe differs from draftline's own run of the same experiment (by
speculators' defaults, not by adaptation; the manifest's ``recipe`` and ``draftline_train``
say which): lr 1e-4 (draftline: ``train.lr``, 3e-4 by default); ``norm_before_residual=True``
(draftline: False); uniform noise on the inputs and targets (draftline: none); the draft
layer's rope from ``LlamaConfig``'s defaults (draftline copies the verifier's ``rope_theta``);
float32 on one GPU in speculators itself (here bf16 autocast, as draftline); its sampler's
packing instead of draftline's step planner.  speculators reads the verifier through
``AutoConfig`` and the tensors ``model.embed_tokens.weight``/``lm_head.weight``, so targets
that need remote code or keep their weights under another prefix (Kimi-K2.5) do not build.

Not run on a GPU yet: the CUDA path (compiled forward, bf16 autocast wrapper, 12 workers) is
written from speculators' script and draftline's ``benchmarks.train`` reference step.
Measured on this 2-core CPU shared with other work (load average ~4; no GPU; torch 2.10,
EXP=tiny: hidden 256, draft vocab 256, 512 tokens per step, 442 real, TTT 3, float32, eager
flex attention), ``--steps 5`` four times: 21-45 s of training steps, 49-104 tokens/s (1.1-10 s
per step), the validation pass over 38 samples 25-58 s, the whole command 51-108 s; loss
0.342 -> 0.228 every time (the same batches, noise and init from ``train.seed``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

log = logging.getLogger("draftline.anchor")

# speculators 0.3.0 scripts/train.py: its defaults (argparse and module constants).
SPECULATORS_LR = 1e-4  # --lr
NORM_BEFORE_RESIDUAL = True  # NORM_BEFORE_RESIDUAL
NOISE_STD = 0.05  # NOISE_STD, AddUniformNoise on the training data only
TTT_STEP_LOSS_DECAY = 1.0  # --ttt-step-loss-decay
GPU_LOADER = {"num_workers": 12, "prefetch_factor": 4, "pin_memory": True,
              "persistent_workers": True}  # NUM_WORKERS, PREFETCH_FACTOR, DataLoader(...)
HIDDEN_KEYS = ("hidden_states", "verifier_last_hidden_states")  # the keys its noise touches
# The Trainer's optimizer/scheduler state; the rest of a checkpoint is what speculators'
# save_pretrained wrote (config.json, config.py, generation_config.json, model.safetensors).
TRAINER_STATE = ("optimizer_state_dict.pt", "scheduler_state_dict.pt")
CHECKPOINTS = "checkpoints"
DRAFT = "draft"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exp", required=True, help="experiment (conf/experiment/<exp>.yaml)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps (default: train.steps)")
    parser.add_argument("--max-tokens-per-step", type=int, default=None,
                        help="token budget per step (default: train.max_tokens_per_step)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: <run_dir>/anchor)")
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides, e.g. numerics.torch_threads=1")
    return parser.parse_args(argv)


def disable_compile_before_speculators() -> None:
    """``TORCHDYNAMO_DISABLE=1``, which ``@torch.compile`` reads when it decorates: it must be
    set before ``speculators`` (which defines ``Eagle3DraftModel``) is first imported."""
    if "speculators" in sys.modules:
        raise RuntimeError("speculators was imported before TORCHDYNAMO_DISABLE=1 was set: "
                           "its forward is already compiled, which fails on CPU")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"


# --------------------------------------------------------------------------- data


def collated_tokens(lengths: Sequence[int], max_len: int) -> int:
    """Real tokens of one batch of samples of ``lengths`` (after ``shift_batch``) through
    speculators' collate: lengths kept while they fit, the last one cut at ``max_len``."""
    used = 0
    for length in lengths:
        if length + used >= max_len:
            return max_len
        used += length
    return used


class StepBatches:
    """speculators' batch sampler, its epochs back to back, cut after ``steps`` batches.

    The Trainer runs this as one epoch of exactly ``steps`` steps (adaptation 4).  Each batch's
    real token count is queued in ``tokens`` as the batch is handed out, in training order
    (the DataLoader keeps it), for the progress lines.  No ``set_epoch``: the Trainer would
    call it with its own epoch number; the data epochs are this class's.
    """

    def __init__(self, sampler, steps: int, lengths: Sequence[int], max_len: int):
        self.sampler, self.steps, self.lengths, self.max_len = sampler, steps, lengths, max_len
        self.tokens: collections.deque[int] = collections.deque()
        self.data_epochs = 0

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator:
        done, epoch = 0, 0
        while done < self.steps:
            self.data_epochs = epoch + 1
            self.sampler.set_epoch(epoch)
            batches = list(self.sampler)
            if not batches:
                raise ValueError("speculators' sampler packs the train split into zero batches")
            for batch in batches[: self.steps - done]:
                self.tokens.append(collated_tokens([self.lengths[i] for i in batch], self.max_len))
                done += 1
                yield batch
            epoch += 1


class AnchorDataset:
    """One split-index row -> what ``Eagle3SampleFileDataset.__getitem__`` yields for it.

    draftline's ``ShardSampleDataset`` checks the rows against the shards and maps them; the
    item itself is rebuilt in speculators' order: its v1 sample dict (``hidden_states`` a list
    of [T, H] slots, aux first, final last), ``standardize_data_v1``, hidden states to float32,
    ``lengths`` [1] and ``position_ids`` [T], the transform (``noise``: speculators' training
    noise), ``shift_batch``.  A module-level class that imports speculators only when built
    (after the compile switch), and pickles into DataLoader workers (mapped shards reopen there).
    """

    def __init__(self, shards: Sequence[str], rows, num_aux: int, noise: bool):
        import torch
        from speculators.train.noise_transforms import AddUniformNoise

        from draftline.train.dataset import ShardSampleDataset

        self.samples = ShardSampleDataset(shards, rows, num_aux_slots=num_aux,
                                          hidden_dtype=torch.float32)
        self.transform = AddUniformNoise(std=NOISE_STD, tensors=HIDDEN_KEYS) if noise else None
        # What speculators' estimate approximates: each item's length after the shift (its
        # estimate scales the first file's shifted length by each file's size).
        self.approx_lengths = list(self.samples.lengths)

    def __len__(self) -> int:
        return len(self.samples)

    def v1_sample(self, index: int) -> dict:
        """The sample as speculators' data generation saves it (v1 ``.pt`` contents)."""
        import torch

        from draftline import formats

        views, start, length = self.samples._locate(index)
        span = slice(start, start + length)
        slots = views.hidden[span]  # [T, aux + 1, H], stored dtype
        if views.scales is not None:  # fp8 shards: value * scale
            slots = formats.dequantize(slots, views.scales[span], torch.float32)
        return {"input_ids": views.input_ids[span].clone(),
                "loss_mask": views.loss_mask[span].to(torch.long),
                "hidden_states": list(slots.unbind(dim=1))}  # aux + 1 of [T, H]

    def __getitem__(self, index: int) -> dict:
        import torch
        from speculators.train.data import shift_batch, standardize_data_v1

        data = standardize_data_v1(self.v1_sample(index))
        data = {k: v.to(torch.float32) if "hidden_states" in k else v for k, v in data.items()}
        seq_len = data["input_ids"].shape[0]
        data["lengths"] = torch.tensor([seq_len], dtype=torch.long)
        data["position_ids"] = torch.arange(seq_len, dtype=torch.long)
        if self.transform:
            data = self.transform(data)
        return shift_batch(data)


def make_loader(dataset, batch_sampler, max_len: int, cuda: bool):
    from speculators.train.data import create_collate_fn
    from torch.utils.data import DataLoader

    extra = GPU_LOADER if cuda else {"num_workers": 0, "pin_memory": False}
    return DataLoader(dataset, batch_sampler=batch_sampler,
                      collate_fn=create_collate_fn(max_len), **extra)


# --------------------------------------------------------------------------- model


def build_draft(verifier: str, num_layers: int, ttt_steps: int, d2t, t2d,
                aux_layer_ids: Sequence[int]):
    """speculators' ``Eagle3DraftModel`` configured as its train script configures it, with
    the aux layer ids written into its config (adaptation 8)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig, LlamaConfig

    target = AutoConfig.from_pretrained(verifier)
    layer = LlamaConfig(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads, hidden_act=target.hidden_act,
        max_position_embeddings=target.max_position_embeddings,
        initializer_range=target.initializer_range, rms_norm_eps=target.rms_norm_eps,
        head_dim=getattr(target, "head_dim", None))
    layer._attn_implementation = "simple_flex_attention"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=int(d2t.shape[0]),
        norm_before_residual=NORM_BEFORE_RESIDUAL,
        eagle_aux_hidden_state_layer_ids=[int(i) for i in aux_layer_ids],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(proposal_type="greedy",
                                                        speculative_tokens=ttt_steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier,
                                    architectures=list(target.architectures or [])),
        ),
    )
    return Eagle3DraftModel(config=config, t2d=t2d, d2t=d2t)


def autocast_forward(model) -> None:
    """The forward (speculators' compiled one) under bf16 autocast on CUDA (adaptation 3)."""
    import torch

    forward = model.forward

    def bf16_forward(*args, **kwargs):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return forward(*args, **kwargs)

    model.forward = bf16_forward  # the instance attribute nn.Module.__call__ calls


# --------------------------------------------------------------------------- progress


class MetricsTap(logging.Handler):
    """Reads what the Trainer logs to ``speculators.metrics`` once per step (and once after
    validation) and turns the train records into progress lines."""

    def __init__(self, progress, tokens: collections.deque, ttt_steps: int):
        super().__init__(logging.INFO)
        self.progress, self.tokens, self.ttt_steps = progress, tokens, ttt_steps
        self.train: list[dict] = []
        self.lrs: list[float] = []
        self.step_tokens: list[int] = []
        self.step_times: list[float] = []  # time.monotonic() when each step's metrics came
        self.validation: dict = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.msg
        if not isinstance(message, dict):
            return
        if "val" in message:
            self.validation = dict(message["val"])
            return
        metrics = dict(message["train"])
        self.train.append(metrics)
        self.lrs.append(float(message["lr"]))
        self.step_times.append(time.monotonic())
        self.step_tokens.append(self.tokens.popleft())
        per_ttt = " | ".join(f"ttt{k} loss {metrics[f'loss_{k}']:.4f} acc "
                             f"{metrics[f'full_acc_{k}']:.3f}" for k in range(self.ttt_steps))
        self.progress.advance_to(record.step + 1, self.step_tokens[-1],
                                 f"loss {metrics['loss']:.4f} | {per_ttt} | lr {message['lr']:.2e}")


# --------------------------------------------------------------------------- run


# What each adaptation is; which of them a run made depends on its device (ADAPTED).
ADAPTATIONS = {
    "device": "Trainer moves the model and batches to TrainerConfig.local_rank (an int, i.e. "
              "cuda:<n>); on CPU local_rank='cpu' is passed instead (its rank-0 tqdm bar is "
              "then not shown)",
    "compile": "Eagle3DraftModel.forward is @torch.compile'd and inductor fails on it on CPU "
               "with flex attention; TORCHDYNAMO_DISABLE=1 is set on CPU before speculators "
               "is imported (eager forward, still flex attention)",
    "precision": "speculators 0.3.0 trains float32 on one GPU; on CUDA the forward runs under "
                 "torch.autocast(bfloat16) (backward, clip, AdamW outside, float32 weights) by "
                 "wrapping model.forward; float32 on CPU",
    "steps": "the Trainer runs whole epochs; its batch sampler is wrapped to chain speculators' "
             "sampler epochs (set_epoch 0, 1, ...) and stop after exactly N batches, run as "
             "one Trainer epoch: schedule sized to N (warm-up N // 100), one validation, one "
             "checkpoint",
    "data": "samples come from draftline's shards through the prepare split instead of one .pt "
            "per sample and split_files; each item is what Eagle3SampleFileDataset yields "
            "(standardize_data_v1, float32, lengths, position_ids, noise, shift_batch); the "
            "sampler gets exact lengths instead of file-size estimates and train.seed as its "
            "seed",
    "loader": "12 workers, prefetch 4, pinned memory on CUDA as its script; none on CPU",
    "run_setup": "fresh checkpoint dir and resume_from_checkpoint=False (its CPU resume loads "
                 "onto cuda:0); the draft init is seeded with train.seed; no metric logger "
                 "backends",
    "saved_config": "eagle_aux_hidden_state_layer_ids set in Eagle3SpeculatorConfig (vLLM 0.16 "
                    "reads it, draftline's evaluate checks it) and the verifier's real "
                    "architectures; no weight or step changes",
}
COMMON = ("steps", "data", "run_setup", "saved_config")
ADAPTED = {"cpu": ("device", "compile", *COMMON, "loader"), "cuda": ("precision", *COMMON)}


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What the run reads: prepare's split over extract's shards, train's vocabulary mapping,
    the aux ids extract captured, and the sizes of draftline's own run (or the flags')."""

    shards: list[str]
    index: Path
    vocab: Path
    aux_ids: list[int]
    steps: int
    budget: int  # tokens per step (speculators' total_seq_len)
    ttt_steps: int
    num_layers: int
    seed: int
    prepare_manifest: Path

    @classmethod
    def read(cls, cfg, steps: int | None, budget: int | None) -> "Inputs":
        from draftline.pipeline import artifacts, config
        from draftline.train.run import vocab_path

        prepare_dir = config.stage_dir(cfg, "prepare")
        prepared = artifacts.read_manifest(prepare_dir)
        extract = artifacts.read_manifest(config.stage_dir(cfg, "extract"))
        inputs = cls(
            shards=list(prepared["shards"]), index=prepare_dir / prepared["index"],
            vocab=vocab_path(cfg), aux_ids=[int(i) for i in extract["aux_layer_ids"]],
            steps=int(cfg.train.steps if steps is None else steps),
            budget=int(cfg.train.max_tokens_per_step if budget is None else budget),
            ttt_steps=int(cfg.train.ttt_steps), num_layers=int(cfg.train.num_layers),
            seed=int(cfg.train.seed), prepare_manifest=prepare_dir / artifacts.MANIFEST)
        if inputs.steps < 1 or inputs.budget < 2:
            raise ValueError(f"need steps >= 1 and a token budget >= 2, got {inputs.steps} "
                             f"and {inputs.budget}")
        return inputs


def loaders(inputs: Inputs, cuda: bool) -> tuple:
    """(train loader, its ``StepBatches``, validation loader or None), each through
    speculators' sampler and collate at the token budget."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    from draftline import formats

    def sampler(dataset):
        return MultipackDistributedBatchSamplerV2(
            batch_max_length=inputs.budget, lengths=dataset.approx_lengths, num_replicas=1,
            rank=0, seed=inputs.seed)

    train_set = AnchorDataset(inputs.shards, formats.load_split(inputs.index, formats.TRAIN),
                              len(inputs.aux_ids), noise=True)
    batches = StepBatches(sampler(train_set), inputs.steps, train_set.approx_lengths,
                          inputs.budget)
    val_rows = formats.load_split(inputs.index, formats.VALIDATION)
    val_loader = None
    if len(val_rows):
        val_set = AnchorDataset(inputs.shards, val_rows, len(inputs.aux_ids), noise=False)
        val_loader = make_loader(val_set, sampler(val_set), inputs.budget, cuda)
    return make_loader(train_set, batches, inputs.budget, cuda), batches, val_loader


def train(cfg, inputs: Inputs, device: str, checkpoints: Path) -> tuple["MetricsTap", dict]:
    """speculators' Trainer on a fresh draft; returns what it logged and the timings."""
    import torch
    from speculators.train.trainer import Trainer, TrainerConfig

    from draftline.formats import load_vocab_mapping
    from draftline.pipeline.progress import Progress

    cuda = device.startswith("cuda")
    d2t, t2d = load_vocab_mapping(inputs.vocab)
    shutil.rmtree(checkpoints, ignore_errors=True)  # adaptation 7: never resume
    torch.manual_seed(inputs.seed)
    model = build_draft(str(cfg.model.path), inputs.num_layers, inputs.ttt_steps, d2t, t2d,
                        inputs.aux_ids)
    if cuda:
        autocast_forward(model)
    train_loader, batches, val_loader = loaders(inputs, cuda)
    call = {"use_off_policy_tokens": False, "ttt_steps": inputs.ttt_steps,
            "ttt_step_loss_decay": TTT_STEP_LOSS_DECAY}
    trainer = Trainer(model, TrainerConfig(
        lr=SPECULATORS_LR, num_epochs=1, save_path=str(checkpoints),
        resume_from_checkpoint=False, is_distributed=False,
        local_rank=(torch.device(device).index or 0) if cuda else "cpu",
        train_call_kwargs=call, val_call_kwargs=call), train_loader, val_loader)
    batches.sampler.set_epoch(0)
    per_pass = len(batches.sampler)  # steps of one pass over the train split (epoch 0)
    log.info("speculators %s Trainer on %s (%s): %d steps of %d tokens, lr %.1e, TTT %d; "
             "%d train samples, %d batches per pass", importlib.metadata.version("speculators"),
             device, "bf16 autocast" if cuda else "float32", inputs.steps, inputs.budget,
             SPECULATORS_LR, inputs.ttt_steps, len(train_loader.dataset), per_pass)

    progress = Progress("anchor", inputs.steps, unit="steps", interval=0.0, logger=log)
    tap = MetricsTap(progress, batches.tokens, inputs.ttt_steps)
    metrics_logger = logging.getLogger("speculators.metrics")
    metrics_logger.setLevel(logging.INFO)
    metrics_logger.propagate = False  # its dict records are the tap's, not the console's
    metrics_logger.addHandler(tap)
    start = time.monotonic()
    try:
        trainer.run_training()
    finally:
        metrics_logger.removeHandler(tap)
    if len(tap.train) != inputs.steps:
        raise RuntimeError(f"the Trainer ran {len(tap.train)} steps, {inputs.steps} were planned")
    losses = [m["loss"] for m in tap.train]
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"non-finite loss in the anchor's run: {losses}")
    # Steady: steps 2..N, without the first step's compilation (CUDA) and first batch.
    steady = tap.step_times[-1] - tap.step_times[0] if inputs.steps > 1 else None
    return tap, {
        "seconds": round(time.monotonic() - start, 3),  # training, validation and the save
        "train_seconds": round(progress.last_work - progress.start, 3),
        "tokens": progress.tokens, "fill": progress.tokens / (inputs.steps * inputs.budget),
        "tokens_per_second": progress.tokens_per_second(),
        "steady_tokens_per_second": sum(tap.step_tokens[1:]) / steady if steady else None,
        "data_epochs": batches.data_epochs, "batches_per_pass": per_pass,
        "draft_vocab_size": int(d2t.numel()),
    }


def run(cfg, inputs: Inputs, device: str, out: Path, command: str, numerics: dict) -> dict:
    """Train, save the draft, check it as train checks its own, write the manifest."""
    import torch

    from draftline.pipeline import artifacts

    cuda = device.startswith("cuda")
    tap, measured = train(cfg, inputs, device, out / CHECKPOINTS)
    draft = save_draft(out / CHECKPOINTS / "0", out / DRAFT, inputs.aux_ids)
    vllm, skipped = vllm_parse(draft, inputs.aux_ids, measured["draft_vocab_size"])
    losses = [m["loss"] for m in tap.train]
    manifest = {
        "exp": str(cfg.exp), "command": command, "device": device,
        "precision": "bf16 autocast over float32 weights" if cuda else "float32",
        "speculators_version": importlib.metadata.version("speculators"),
        "torch_version": torch.__version__, "numerics": numerics,
        "steps": inputs.steps, "max_tokens_per_step": inputs.budget, **measured,
        "loss_first": losses[0], "loss_last": losses[-1], "loss_history": losses,
        "lr_history": tap.lrs, "final": tap.train[-1], "validation": tap.validation,
        "recipe": {"optimizer": "torch.optim.AdamW(model.named_parameters()), default kernel",
                   "lr": SPECULATORS_LR, "scheduler": "linear",
                   "warmup_steps": inputs.steps // 100,  # the Trainer's default: 1%
                   "total_steps": inputs.steps, "grad_clip": 1.0, "ttt_steps": inputs.ttt_steps,
                   "ttt_step_loss_decay": TTT_STEP_LOSS_DECAY, "num_layers": inputs.num_layers,
                   "norm_before_residual": NORM_BEFORE_RESIDUAL,
                   "noise": {"kind": "AddUniformNoise", "std": NOISE_STD,
                             "tensors": list(HIDDEN_KEYS)},
                   "sampler": "MultipackDistributedBatchSamplerV2", "seed": inputs.seed},
        # draftline's own run of this experiment, to set beside the anchor's
        "draftline_train": {"lr": float(cfg.train.lr), "steps": int(cfg.train.steps),
                            "max_tokens_per_step": int(cfg.train.max_tokens_per_step),
                            "precision": str(cfg.train.precision)},
        "draft": str(draft), "checkpoint": str(out / CHECKPOINTS / "0"),
        "aux_layer_ids": inputs.aux_ids, "verifier": str(cfg.model.path),
        "vllm": vllm, "skipped": skipped,
        "inputs": {"prepare_manifest_sha256": artifacts.sha256_file(inputs.prepare_manifest),
                   "vocab_sha256": artifacts.sha256_file(inputs.vocab)},
        "adaptations": [{"what": k, "why": ADAPTATIONS[k]}
                        for k in ADAPTED["cuda" if cuda else "cpu"]],
    }
    artifacts.write_json(out / artifacts.MANIFEST, manifest)
    log.info("anchor: %d steps, %d tokens in %.1f s (training %.1f s): %.0f tok/s (steady %s); "
             "loss %.4f -> %.4f; draft %s", inputs.steps, measured["tokens"],
             measured["seconds"], measured["train_seconds"], measured["tokens_per_second"],
             "n/a" if measured["steady_tokens_per_second"] is None
             else f"{measured['steady_tokens_per_second']:.0f}", losses[0], losses[-1], draft)
    return manifest


def save_draft(checkpoint: Path, draft: Path, aux_ids: list[int]) -> Path:
    """What speculators' ``save_pretrained`` wrote into the checkpoint (config.json,
    model.safetensors in bf16, config.py, generation_config.json; not the optimizer or
    scheduler state) as the draft directory, after checking the saved aux ids."""
    from draftline.pipeline.artifacts import atomic_dir

    saved = json.loads((checkpoint / "config.json").read_text())
    if saved.get("eagle_aux_hidden_state_layer_ids") != aux_ids:
        raise RuntimeError(f"{checkpoint}/config.json has eagle_aux_hidden_state_layer_ids "
                           f"{saved.get('eagle_aux_hidden_state_layer_ids')}, extract captured "
                           f"{aux_ids}")
    with atomic_dir(draft) as tmp:
        for path in sorted(checkpoint.iterdir()):
            if path.name not in TRAINER_STATE:
                shutil.copy2(path, tmp / path.name)
    return draft


def vllm_parse(draft: Path, aux_ids: list[int], draft_vocab_size: int) -> tuple[dict | None, list]:
    """vLLM's config parser on the saved draft, checked as train checks its own draft
    (``draftline.train.vllm_parse``); skipped, and said so, where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        log.warning("vLLM is not installed: the saved draft's vLLM parse was skipped")
        return None, [{"what": "vLLM parse of the saved draft",
                       "reason": "vLLM is not installed here"}]
    from draftline.train.vllm_parse import check_vllm_parse

    return check_vllm_parse(draft, aux_ids, draft_vocab_size), []


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from draftline.pipeline import config, launch, numerics

    cfg = config.compose(config.experiment_overrides(args.exp, args.overrides))
    device = launch.rank_device(str(cfg.train.device))
    if not device.startswith("cuda"):
        disable_compile_before_speculators()
    applied = numerics.apply(cfg.numerics.torch_threads, bool(cfg.numerics.deterministic))
    inputs = Inputs.read(cfg, args.steps, args.max_tokens_per_step)
    out = args.out or Path(cfg.run_dir) / "anchor"
    command = " ".join(["python -m benchmarks.anchor",
                        *(sys.argv[1:] if argv is None else argv)])
    return run(cfg, inputs, device, out, command, applied)


if __name__ == "__main__":
    main()
