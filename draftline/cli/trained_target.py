"""A tiny Llama target trained briefly on the embedded corpus, so its drafts mean something.

    python -m draftline.cli.trained_target experiment=tiny-trained     # or: make target

A random target's greedy token is nearly a fixed function of the current token (its random
layers barely mix context), so a bigram table predicts it as well as any EAGLE draft and
acceptance numbers say nothing.  Trained for a few CPU minutes on the chat-rendered embedded
conversations, the target's next token depends on context, and a draft reading its hidden
states can beat the frequency baselines.

What is trained: ``draftline.tiny.builders.build_tiny_llama`` (the model config's shape, the random
target's tokenizer and seed) as a causal LM on every token of the chat-rendered
conversations, packed into ``seq_length`` chunks.  Conversations that ``prepare`` will hold out (the same
``is_validation`` coin on the conversation index, which is the sample id when tokenize skips
nothing) are left out, so held-out evaluation runs on text neither the target nor the draft
saw.  Deterministic for a fixed torch build and thread count (recorded): seeded init, seeded
batch order, no dropout.  The model directory is written atomically with ``build.json``
(spec, losses, held-out next-token accuracy, seconds) last inside it; Make's rule targets
that file, so the build is cached like a stage and reused by every run that names the path.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from draftline.pipeline import artifacts

log = logging.getLogger("draftline.cli.trained_target")
BUILD_RECORD = "build.json"


@dataclasses.dataclass(frozen=True)
class TargetTrainSpec:
    """``model.train`` of a trained-target model config."""

    steps: int  # optimizer steps
    batch_size: int  # packed chunks per step
    seq_length: int  # tokens per chunk (= the longest sample the pipeline tokenizes)
    lr: float  # AdamW peak learning rate
    warmup_steps: int  # linear warm-up, then cosine decay to 10% of lr
    weight_decay: float  # AdamW weight decay
    seed: int  # init (base model) and batch order

    @classmethod
    def from_config(cls, train: DictConfig) -> "TargetTrainSpec":
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        missing = sorted(set(fields) - set(train.keys()))
        if missing:
            raise ValueError(f"model.train lacks {missing}")
        return cls(**{name: (int if kind == "int" else float)(train[name])
                      for name, kind in fields.items()})


def split_conversations(conversations: list, fraction: float, seed: int) -> tuple[list, list]:
    """(kept for training, held out): the held-out ones are those ``prepare`` will hold out."""
    from draftline.prepare.split import is_validation

    held = [is_validation(i, fraction, seed) for i in range(len(conversations))]
    return ([c for c, h in zip(conversations, held, strict=True) if not h],
            [c for c, h in zip(conversations, held, strict=True) if h])


def encode(tokenizer, conversations: list, seq_length: int) -> list[list[int]]:
    """Chat-rendered token ids per conversation, truncated like tokenize does.  For a thinking
    template, each reply as generated after its own prompt (``tokenize.reasoning=as_generated``):
    the target learns to write its reasoning where the server asks it for a reply."""
    from draftline.tokenize.chat import encode_conversation
    from draftline.tokenize.windows import encode_windows
    from draftline.tokenize.generated import thinking_template

    if thinking_template(tokenizer):
        return [s.input_ids for i, messages in enumerate(conversations)
                for s in encode_windows(tokenizer, messages, seq_length, sample=i, reasoning="as_generated").samples]
    return [encode_conversation(tokenizer, messages, seq_length, sample=i).input_ids
            for i, messages in enumerate(conversations)]


def pack(sequences: list[list[int]], seq_length: int) -> torch.Tensor:
    """All sequences back to back, cut into chunks: int64 [chunks, seq_length].

    Chunks cross conversation boundaries (plain LM packing): every conversation starts with
    <|bos|>, which is all the model needs to tell them apart; the ragged tail is dropped.
    """
    stream = torch.tensor([t for seq in sequences for t in seq], dtype=torch.long)  # [tokens]
    chunks = stream.numel() // seq_length
    if chunks < 1:
        raise ValueError(f"corpus has {stream.numel()} tokens, fewer than one chunk of {seq_length}")
    return stream[: chunks * seq_length].view(chunks, seq_length)


def batch_order(num_chunks: int, steps: int, batch_size: int, seed: int) -> torch.Tensor:
    """Chunk indices per step: int64 [steps, batch_size], epochs of seeded permutations."""
    generator = torch.Generator().manual_seed(seed)
    needed = steps * batch_size
    epochs = math.ceil(needed / num_chunks)
    order = torch.cat([torch.randperm(num_chunks, generator=generator) for _ in range(epochs)])
    return order[:needed].view(steps, batch_size)


def lr_lambda(warmup: int, total: int):
    def scale(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return scale


def train_lm(model: torch.nn.Module, chunks: torch.Tensor, spec: TargetTrainSpec) -> list[float]:
    """Causal-LM training on ``chunks`` [n, seq_length]; returns the loss per step."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec.warmup_steps, spec.steps))
    losses = []
    start = time.monotonic()
    for step, rows in enumerate(batch_order(len(chunks), spec.steps, spec.batch_size, spec.seed)):
        batch = chunks[rows]  # [batch, seq_length]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if (step + 1) % 10 == 0 or step + 1 == spec.steps:
            log.info("target step %d/%d loss %.3f (%.1f s)", step + 1, spec.steps, losses[-1],
                     time.monotonic() - start)
    model.eval()
    return losses


@torch.no_grad()
def next_token_accuracy(model: torch.nn.Module, sequences: list[list[int]]) -> float:
    """Top-1 next-token accuracy over ``sequences`` (teacher forcing, every position)."""
    correct = total = 0
    for seq in sequences:
        ids = torch.tensor([seq], dtype=torch.long)  # [1, T]
        predicted = model(input_ids=ids).logits[0, :-1].argmax(-1)  # [T-1]
        correct += int((predicted == ids[0, 1:]).sum())
        total += len(seq) - 1
    return correct / max(total, 1)


def ensure_corpus(cfg: DictConfig) -> Path:
    """The embedded conversations, written by the same builder `make` stamping uses."""
    path = Path(cfg.data.path)
    if cfg.data.build:
        from draftline.tiny import embedded

        embedded.ensure_conversations(path, cfg.assets_dir, max_bytes=int(cfg.data.max_bytes),
                                        build=str(cfg.data.build))
    if not path.exists():
        raise FileNotFoundError(f"{path}: no conversations to train the target on")
    return path


def build_trained_target(cfg: DictConfig) -> Path:
    """Build ``cfg.model.path``: the random tiny Llama, then ``model.train`` steps of LM training."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from draftline.pipeline import numerics
    from draftline.tiny import builders
    from draftline.tokenize.conversations import load_conversations

    spec = TargetTrainSpec.from_config(cfg.model.train)
    corpus = ensure_corpus(cfg)
    out = Path(cfg.model.path)
    start = time.monotonic()
    with artifacts.atomic_dir(out) as tmp:
        builders.build_tiny_llama(tmp, num_layers=int(cfg.model.num_layers),
                              hidden_size=int(cfg.model.hidden_size),
                              num_heads=int(cfg.model.num_heads),
                              num_kv_heads=int(cfg.model.num_kv_heads),
                              intermediate_size=int(cfg.model.intermediate_size), seed=spec.seed,
                              chat=str(cfg.model.get("chat", "plain")))
        tokenizer = AutoTokenizer.from_pretrained(str(tmp))
        conversations, _skipped = load_conversations(corpus, max_skipped=0)
        kept, held = split_conversations(
            conversations, float(cfg.prepare.validation_fraction), int(cfg.seed))
        train_ids = encode(tokenizer, kept, spec.seq_length)
        held_ids = encode(tokenizer, held, spec.seq_length)
        model = LlamaForCausalLM.from_pretrained(str(tmp), dtype=torch.float32,
                                                 attn_implementation="sdpa")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            losses = train_lm(model, pack(train_ids, spec.seq_length), spec)
        accuracy = next_token_accuracy(model, held_ids)
        log.info("held-out next-token accuracy %.3f after %d steps", accuracy, spec.steps)
        model.save_pretrained(str(tmp), safe_serialization=True)
        # Written last inside the directory: Make's target for this build.
        artifacts.write_json(tmp / BUILD_RECORD, {
            "spec": dataclasses.asdict(spec),
            "corpus": str(corpus), "corpus_sha256": artifacts.sha256_file(corpus),
            "train_conversations": len(kept), "held_out_conversations": len(held),
            "train_tokens": sum(map(len, train_ids)),
            "loss_first": losses[0], "loss_last": losses[-1],
            "loss_history": losses, "held_out_next_token_accuracy": accuracy,
            "torch_threads": torch.get_num_threads(),
            "numerics": numerics.describe(),
            "seconds": round(time.monotonic() - start, 1),
            "versions": artifacts.package_versions(),
        })
    return out


def main(argv: list[str]) -> None:
    """``python -m draftline.cli.trained_target experiment=NAME [overrides]``; fails loudly."""
    from draftline.pipeline import config

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    cfg = config.compose(argv)
    if "train" not in cfg.model:
        raise SystemExit(f"model {cfg.model.name} has no model.train block: nothing to train")
    from draftline.pipeline import numerics

    numerics.apply(cfg.numerics.torch_threads, bool(cfg.numerics.deterministic))
    path = build_trained_target(cfg)
    log.info("trained target written to %s", path)


if __name__ == "__main__":
    main(sys.argv[1:])
