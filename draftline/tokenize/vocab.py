"""Draft-vocabulary selection for EAGLE-3: token counts, d2t/t2d mapping, coverage.

Conventions match speculators 0.3.0 (``speculators.train.vocab_mapping``), so
the tensors can be stored in a draft checkpoint as they are:

* ``d2t``: int64 ``[draft_vocab]``, an *offset* per draft index:
  ``target_id = draft_idx + d2t[draft_idx]``.  Draft indices are ordered by
  ascending target id, so ``d2t`` is non-decreasing and ``>= 0``.
* ``t2d``: bool ``[target_vocab]``, True iff the target id is in the draft vocab.

Only masked (assistant) tokens are counted, because those are the tokens the
draft is trained and later asked to predict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

__all__ = ["token_frequencies", "draft_vocab_mapping", "validate_mapping", "coverage"]

Sample = Mapping[str, Any] | tuple[Any, Any]


def _as_1d_long(values: Any, what: str, index: int) -> torch.Tensor:
    """Sample field as an int64 1-D tensor; the error names the sample index."""
    tensor = torch.as_tensor(values)
    if tensor.dim() != 1:
        raise ValueError(f"sample {index}: {what} must be 1-D, got shape {tuple(tensor.shape)}")
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        raise ValueError(f"sample {index}: {what} must hold integers, got {tensor.dtype}")
    return tensor.to(torch.long)


def _masked_ids(sample: Sample, index: int, vocab_size: int) -> torch.Tensor:
    """Ids of the sample's masked tokens ``[num_masked]``, checked against the vocab size."""
    ids, mask = (sample["input_ids"], sample["loss_mask"]) if isinstance(sample, Mapping) else sample
    ids = _as_1d_long(ids, "input_ids", index)  # [seq]
    mask = _as_1d_long(mask, "loss_mask", index)  # [seq]
    if ids.shape != mask.shape:
        raise ValueError(
            f"sample {index}: input_ids has {ids.numel()} tokens but loss_mask {mask.numel()}"
        )
    bad_mask = mask[(mask != 0) & (mask != 1)]
    if bad_mask.numel():
        raise ValueError(f"sample {index}: loss_mask must be 0/1, found {bad_mask[0].item()}")
    bad_ids = ids[(ids < 0) | (ids >= vocab_size)]
    if bad_ids.numel():
        raise ValueError(f"sample {index}: token id {bad_ids[0].item()} outside [0, {vocab_size})")
    return ids[mask.bool()]


def token_frequencies(samples: Iterable[Sample], vocab_size: int) -> torch.Tensor:
    """Count each token id over the masked positions of all samples.

    ``samples`` yields ``(input_ids, loss_mask)`` pairs or mappings with those
    keys (e.g. dataset rows); each field is a list or 1-D tensor.  Returns
    int64 ``[vocab_size]``.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    freq = torch.zeros(vocab_size, dtype=torch.long)  # [vocab]
    for index, sample in enumerate(samples):
        freq += torch.bincount(_masked_ids(sample, index, vocab_size), minlength=vocab_size)
    return freq


def _check_freq(freq: torch.Tensor) -> None:
    if freq.dim() != 1 or freq.dtype.is_floating_point or freq.dtype == torch.bool:
        raise ValueError(f"freq must be a 1-D integer tensor, got {freq.dtype} {tuple(freq.shape)}")
    if freq.numel() and freq.min() < 0:
        raise ValueError(f"freq has a negative count at id {int(freq.argmin())}")


def _select_ids(freq: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Chosen target ids, ascending ``[draft_vocab]``: most frequent first, ties to lower id.

    If fewer ids were ever seen than the draft vocab holds, the rest are the lowest unseen
    ids (count 0 ties too), so the draft vocab always has exactly the asked size.
    """
    # A stable sort keeps equal counts in ascending id order, which breaks ties.
    order = torch.sort(-freq, stable=True).indices  # [target_vocab]
    return torch.sort(order[:draft_vocab_size]).values


def draft_vocab_mapping(freq: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the ``draft_vocab_size`` most frequent ids of ``freq`` ``[target_vocab]``.

    Returns ``(d2t int64 [draft_vocab], t2d bool [target_vocab])`` in the
    speculators convention (see the module docstring).
    """
    _check_freq(freq)
    target_vocab_size = freq.numel()
    if not 1 <= draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in [1, {target_vocab_size}]")
    selected = _select_ids(freq.to(torch.long), draft_vocab_size)  # [draft_vocab], ascending
    d2t = selected - torch.arange(draft_vocab_size, dtype=torch.long)  # [draft_vocab]
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)  # [target_vocab]
    t2d[selected] = True
    validate_mapping(d2t, t2d, target_vocab_size, draft_vocab_size)
    return d2t, t2d


def _check_tensor(name: str, tensor: torch.Tensor, dtype: torch.dtype, size: int) -> None:
    if tensor.dtype != dtype or tuple(tensor.shape) != (size,):
        raise ValueError(f"{name} must be {dtype} [{size}], got {tensor.dtype} {list(tensor.shape)}")


def validate_mapping(
    d2t: torch.Tensor, t2d: torch.Tensor, target_vocab_size: int, draft_vocab_size: int
) -> None:
    """Raise ValueError unless ``d2t``/``t2d`` form a consistent mapping of the given sizes.

    Checks dtypes and shapes, ``t2d.sum() == draft_vocab_size``, that the
    targets ``arange + d2t`` are in range and strictly ascending, and that they
    are exactly the ids ``t2d`` marks.
    """
    _check_tensor("d2t", d2t, torch.long, draft_vocab_size)
    _check_tensor("t2d", t2d, torch.bool, target_vocab_size)
    if int(t2d.sum()) != draft_vocab_size:
        raise ValueError(f"t2d marks {int(t2d.sum())} ids, expected draft_vocab_size={draft_vocab_size}")
    targets = torch.arange(draft_vocab_size, dtype=torch.long) + d2t  # [draft_vocab]
    out = ((targets < 0) | (targets >= target_vocab_size)).nonzero().flatten()
    if out.numel():
        i = int(out[0])
        raise ValueError(
            f"draft index {i} maps to target id {int(targets[i])} outside [0, {target_vocab_size})"
        )
    unordered = (targets[1:] <= targets[:-1]).nonzero().flatten()
    if unordered.numel():
        i = int(unordered[0]) + 1
        raise ValueError(
            f"target ids not strictly ascending at draft index {i}: "
            f"{int(targets[i - 1])} then {int(targets[i])}"
        )
    missing = (~t2d[targets]).nonzero().flatten()
    if missing.numel():
        i = int(missing[0])
        raise ValueError(
            f"draft index {i} maps to target id {int(targets[i])}, which t2d does not mark"
        )


def coverage(freq: torch.Tensor, t2d: torch.Tensor) -> float:
    """Fraction of counted (masked) tokens whose target id is in the draft vocabulary.

    This is the ceiling on the draft's acceptance: a token outside the draft
    vocab can never be proposed.
    """
    _check_freq(freq)
    if t2d.dtype != torch.bool or t2d.shape != freq.shape:
        raise ValueError(f"t2d must be bool {list(freq.shape)}, got {t2d.dtype} {list(t2d.shape)}")
    total = int(freq.sum())
    if total == 0:
        raise ValueError("freq counts no tokens, so coverage is undefined")
    return int(freq[t2d].sum()) / total


def write_vocab(path: str | Path, ids: Iterable[Sequence[int]], masks: Iterable[Sequence[int]],
                target_vocab: int, draft_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked-token counts -> checked d2t/t2d, written atomically with the counts to ``path``.

    Returns (token_freq [target_vocab], t2d [target_vocab]) for coverage reporting.
    """
    from draftline import formats

    freq = token_frequencies(zip(ids, masks), target_vocab)  # [target_vocab]
    d2t, t2d = draft_vocab_mapping(freq, draft_vocab)
    validate_mapping(d2t, t2d, target_vocab, draft_vocab)
    formats.write_vocab_mapping(path, d2t, t2d, freq)
    return freq, t2d
