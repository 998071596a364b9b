"""tokenize: conversations -> token ids, assistant loss masks, token frequencies, d2t/t2d.

    make tokenize EXP=tiny          # or: python -m stages.tokenize experiment=tiny

Run as a module: a script named tokenize.py would shadow the standard library's tokenize.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from draftline import artifacts, config, remote_code, vocab
from draftline.chat import EmptyLossMaskError, encode_conversation
from draftline.conversations import DataError, load_conversations
from draftline.samples import write_samples
from draftline.stage import run_stage

log = logging.getLogger("draftline.tokenize")


def load_tokenizer(model_dir: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    trust = remote_code.check(model_dir, trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust)
    if not tokenizer.chat_template:
        raise ValueError(f"{model_dir}: tokenizer has no chat_template")
    return tokenizer


def target_vocab_size(model_dir: str) -> int:
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(model_config.get("text_config", model_config)["vocab_size"])


def encode_all(tokenizer, conversations, seq_length: int, budget: int, skipped: list):
    """Encode every conversation; all-masked-out ones count against the skip budget."""
    ids, masks, truncated = [], [], 0
    for index, messages in enumerate(conversations):
        try:
            encoded = encode_conversation(tokenizer, messages, seq_length, sample=index)
        except EmptyLossMaskError as error:
            skipped.append({"sample": index, "reason": str(error)})
            if len(skipped) > budget:
                raise DataError(f"{len(skipped)} conversations skipped, budget "
                                f"tokenize.max_skipped={budget}; last: {error}") from error
            continue
        ids.append(encoded.input_ids)
        masks.append(encoded.loss_mask)
        truncated += encoded.num_truncated > 0
    if not ids:
        raise DataError("no usable conversation: the tokenized dataset is empty")
    return ids, masks, truncated


def run(cfg: DictConfig) -> dict:
    out_dir = config.stage_dir(cfg, "tokenize")
    data_path = Path(cfg.data.path)
    budget = int(cfg.tokenize.max_skipped)
    conversations, load_skipped = load_conversations(data_path, max_skipped=budget)
    skipped = [{"where": s.where, "reason": s.reason} for s in load_skipped]
    tokenizer = load_tokenizer(str(cfg.model.path), bool(cfg.model.trust_remote_code))
    # One budget for both kinds of skip: encode_all appends to the load-time list.
    ids, masks, truncated = encode_all(tokenizer, conversations, int(cfg.tokenize.seq_length),
                                       budget, skipped)

    # t2d must match the target's embedding rows (config vocab_size), which can exceed
    # len(tokenizer) when the embedding is padded.
    target_vocab = target_vocab_size(str(cfg.model.path))
    if len(tokenizer) > target_vocab:
        raise ValueError(f"tokenizer has {len(tokenizer)} ids > model vocab {target_vocab}")
    draft_vocab = int(cfg.tokenize.draft_vocab_size)
    if draft_vocab > target_vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab} > target vocab {target_vocab}")
    write_samples(out_dir / "samples.safetensors", ids, masks)
    freq, t2d = vocab.write_vocab(out_dir / "vocab.safetensors", ids, masks, target_vocab, draft_vocab)
    num_tokens = sum(len(x) for x in ids)
    masked = sum(sum(m) for m in masks)
    log.info("%d samples, %d tokens (%d masked), draft vocab covers %.1f%% of masked tokens",
             len(ids), num_tokens, masked, 100 * vocab.coverage(freq, t2d))
    return {
        "samples": "samples.safetensors",
        "vocab": "vocab.safetensors",
        "num_samples": len(ids),
        "num_tokens": num_tokens,
        "num_masked_tokens": masked,
        "num_truncated_samples": truncated,
        "target_vocab_size": target_vocab,
        "draft_vocab_size": draft_vocab,
        "draft_vocab_coverage": vocab.coverage(freq, t2d),
        "skipped": skipped,
        "inputs": {"data": str(data_path), "data_sha256": artifacts.sha256_file(data_path)},
    }


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_stage("tokenize", cfg, run)


if __name__ == "__main__":
    main()
