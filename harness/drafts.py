"""A draft that has learnt its target's text: trained on a few sequences until it predicts them.

A random draft accepts next to nothing, so its acceptance says nothing about the engine that
runs it. ``overfit_draft`` trains an EAGLE-3 draft, with the project's own training session,
on the target's hidden states of ``sequences`` (transformers, float32) until it proposes
their tokens: vLLM then accepts several tokens per step on those sequences' prompts, so two
engines (eager and compiled, TP=1 and TP=2) can be compared on how many they accept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch


def overfit_draft(target_dir, target, sequences: Sequence[torch.Tensor], aux_ids: list[int],
                  out_dir: Path, steps: int = 150, draft_vocab_size: int = 128) -> Path:
    """An EAGLE-3 draft for ``target_dir`` trained ``steps`` full-batch steps on ``sequences``
    (token tensors), saved in speculators' format in ``out_dir``. ``target`` is the loaded
    transformers model (``draftline.tiny.reference.load_hf_model``)."""
    from speculators.train.data import create_collate_fn, shift_batch

    from draftline.tiny import reference
    from draftline.tokenize import vocab
    from draftline.train.draft import build_draft
    from draftline.train.loop import make_session
    from draftline.train.settings import TrainSettings

    rows = []
    for tokens in sequences:
        hidden = reference.hf_hidden_states(target, tokens.tolist())
        rows.append(shift_batch({
            "hidden_states": torch.cat([hidden[i] for i in aux_ids], -1),
            "verifier_last_hidden_states": hidden[-1], "input_ids": tokens,
            "loss_mask": torch.ones(len(tokens), dtype=torch.long),
            "lengths": torch.tensor([len(tokens)]), "position_ids": torch.arange(len(tokens))}))
    batch = create_collate_fn(sum(len(t) for t in sequences))(rows)
    vocab_size = int(target.config.vocab_size)
    freq = torch.bincount(torch.cat(list(sequences)), minlength=vocab_size)
    d2t, t2d = vocab.draft_vocab_mapping(freq, draft_vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_draft(target_dir, aux_ids, d2t, t2d, num_speculative_tokens=3)
        settings = TrainSettings(lr=3e-3, ttt_steps=3, precision="fp32", compile=False)
        session = make_session(model, settings, warmup_steps=5, total_steps=steps)
        for _ in range(steps):
            session.step(batch)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)
