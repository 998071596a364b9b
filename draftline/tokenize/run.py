"""tokenize's stage: the conversations (the user's file, or the embedded set) rendered with the
target's chat template into samples and loss masks, and the draft vocabulary (d2t/t2d).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from draftline import target
from draftline.formats import write_flat_samples, write_records
from draftline.pipeline import config
from draftline.public import assets as public_assets
from draftline.tiny import embedded
from draftline.tokenize import vocab
from draftline.tokenize.conversations import check_roles
from draftline.tokenize.encode import Budget, TokenizeSettings, default_workers, load_tokenizer, tokenize_source
from draftline.tokenize.generated import check_setting, thinking_template
from draftline.tokenize.sources import open_source

log = logging.getLogger("draftline.tokenize")


# apply_chat_template arguments tokenize passes itself (tools come from each record)
RENDER_ARGUMENTS = {"tools", "tokenize", "add_generation_prompt", "continue_final_message"}


def target_vocab_size(model_dir: str) -> int:
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(target.text_config(model_config)["vocab_size"])


def run(cfg: DictConfig) -> dict:
    out_dir = config.stage_dir(cfg, "tokenize")
    data, settings = cfg.data, cfg.tokenize
    # Everything that can be wrong with the config is checked before the first record.
    if data.build == public_assets.PROMPTS_BUILD:  # project-built sets only at their own places
        public_assets.check_under_assets(data.path, cfg.assets_dir, data.build)
    elif data.build:  # the embedded set is read only from its own place, never a user's path
        embedded.check_data_path(data.path, cfg.assets_dir, str(data.build))
    budget = Budget(settings.max_skipped)
    if not isinstance(settings.chat_template_kwargs, DictConfig):
        raise ValueError(f"tokenize.chat_template_kwargs must be a mapping of template arguments, "
                         f"got {settings.chat_template_kwargs!r}")
    taken = RENDER_ARGUMENTS & set(settings.chat_template_kwargs)
    if taken:  # tokenize sets these itself for every render
        raise ValueError(f"tokenize.chat_template_kwargs may not set {sorted(taken)}")
    chosen = settings.reasoning
    reasoning = None if chosen is None else check_setting(chosen)
    roles = check_roles(OmegaConf.to_container(data.roles))
    workers = default_workers() if settings.workers is None else int(settings.workers)
    source = open_source(data.path, split=str(data.split))
    tokenizer = load_tokenizer(str(cfg.model.path), bool(cfg.model.trust_remote_code))
    # t2d must match the target's embedding rows (config vocab_size), which can exceed
    # len(tokenizer) when the embedding is padded.
    target_vocab = target_vocab_size(str(cfg.model.path))
    if len(tokenizer) > target_vocab:
        raise ValueError(f"tokenizer has {len(tokenizer)} ids > model vocab {target_vocab}")
    if reasoning is None:  # the default: each reply as generated where the template drops reasoning
        reasoning = "as_generated" if thinking_template(tokenizer) else "template"
        log.info("tokenize.reasoning=null: %s (%s)", reasoning, "the target's template is a thinking "
                 "model's" if reasoning == "as_generated" else "the target's template does not think")
    draft_vocab = int(settings.draft_vocab_size)
    if draft_vocab > target_vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab} > target vocab {target_vocab}")

    log.info("tokenizing %s (%s) with %d worker(s)", data.path, source.kind, workers)
    result = tokenize_source(source, TokenizeSettings(
        model_dir=str(cfg.model.path), trust_remote_code=bool(cfg.model.trust_remote_code),
        seq_length=int(settings.seq_length), roles=roles,
        text_field=None if data.field is None else str(data.field),
        max_samples=None if data.max_samples is None else int(data.max_samples),
        shuffle=bool(data.shuffle), seed=int(cfg.seed), workers=workers, budget=budget,
        template=OmegaConf.to_container(settings.chat_template_kwargs), reasoning=reasoning))
    write_flat_samples(out_dir / "samples.safetensors", result.input_ids, result.loss_mask, result.offsets,
                       result.tool_results)
    if result.conversations is not None:  # what regenerate generates the target's replies from
        write_records(out_dir / "conversations.jsonl", result.conversations)
    ids, mask = torch.from_numpy(result.input_ids), torch.from_numpy(result.loss_mask)
    freq, t2d = vocab.write_vocab(out_dir / "vocab.safetensors", [ids], [mask], target_vocab, draft_vocab)
    tally = result.tally
    log.info("%d records -> %d samples from %d conversations, %d skipped%s",
             tally.num_records, len(result.offsets) - 1, tally.num_conversations, tally.num_skipped,
             f":\n{tally.table()}" if tally.num_skipped else "")
    if tally.dropped_exchanges:
        log.info("%d exchanges dropped from %d kept conversations (prompt alone fills seq_length), "
                 "e.g. %s", tally.dropped_exchanges, tally.dropped_exchange_conversations,
                 tally.dropped_exchange_examples[0])
    manifest = tally.manifest()
    trained, extra = manifest["reasoning_trained"], manifest["as_generated"]
    log.info("tokenize.reasoning=%s: %d of %d replies with reasoning trained with it (%d tokens)%s",
             reasoning, trained["replies"], tally.reasoning_replies, trained["tokens"],
             "" if extra is None else f"; {extra['extra_samples']} extra samples, their prompts "
             f"{100 * extra['overhead_fraction']:.1f}% of the tokens")
    log.info("%d tokens (%d masked), %.1f%% of assistant tokens kept, draft vocab covers %.1f%% of "
             "masked tokens", len(ids), int(mask.sum()), 100 * manifest["assistant_tokens_kept_fraction"],
             100 * vocab.coverage(freq, t2d))
    return {
        "samples": "samples.safetensors",
        "vocab": "vocab.safetensors",
        **({"conversations": "conversations.jsonl"} if result.conversations is not None else {}),
        "num_samples": len(result.offsets) - 1,
        "num_tokens": len(ids),
        "num_masked_tokens": int(mask.sum()),
        **manifest,
        "reasoning_trained": {**manifest["reasoning_trained"],
                              "chosen": "configured" if chosen is not None else "by default: tokenize.reasoning=null"},
        "target_vocab_size": target_vocab,
        "draft_vocab_size": draft_vocab,
        "draft_vocab_coverage": vocab.coverage(freq, t2d),
        "inputs": {"data": str(data.path), **source.fingerprint()},
    }
