"""Token counting over masked tokens and the EAGLE-3 d2t/t2d draft-vocab mapping."""

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from draftline.tokenize.vocab import coverage, draft_vocab_mapping, token_frequencies, validate_mapping

# --------------------------------------------------------------------------- frequencies


def test_frequencies_count_only_masked_tokens():
    samples = [
        ([0, 1, 2, 2, 3], [0, 0, 1, 1, 1]),
        {"input_ids": torch.tensor([3, 3, 4]), "loss_mask": torch.tensor([1, 0, 1])},
    ]
    freq = token_frequencies(samples, vocab_size=6)
    assert freq.dtype == torch.int64 and freq.shape == (6,)
    assert freq.tolist() == [0, 0, 2, 2, 1, 0]


@pytest.mark.parametrize(
    "sample, message",
    [
        (([1, 2], [1]), r"sample 1: input_ids has 2 tokens but loss_mask 1"),
        (([1, 9], [1, 1]), r"sample 1: token id 9 outside \[0, 5\)"),
        (([1, -1], [1, 0]), r"sample 1: token id -1 outside"),
        (([1, 2], [1, 2]), r"sample 1: loss_mask must be 0/1, found 2"),
        (([[1, 2]], [[1, 1]]), r"sample 1: input_ids must be 1-D"),
        (([1.0, 2.0], [1, 1]), r"sample 1: input_ids must hold integers"),
    ],
)
def test_frequency_errors_name_the_sample(sample, message):
    with pytest.raises(ValueError, match=message):
        token_frequencies([([0], [1]), sample], vocab_size=5)


@pytest.mark.parametrize("sample, message", [
    (([1, 2], [[1, 1]]), r"^sample 1: loss_mask must be 1-D, got shape \(1, 2\)$"),
    (([1, 5], [1, 1]), r"^sample 1: token id 5 outside \[0, 5\)$"),  # the vocab size itself
])
def test_mask_shape_and_the_first_id_past_the_vocab_are_refused_by_name(sample, message):
    with pytest.raises(ValueError, match=message):
        token_frequencies([([0], [1]), sample], vocab_size=5)


# --------------------------------------------------------------------------- mapping


def test_most_frequent_ids_win_and_ties_go_to_the_lower_id():
    freq = torch.tensor([5, 0, 3, 3, 9, 0, 1, 0])
    d2t, t2d = draft_vocab_mapping(freq, draft_vocab_size=3)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert (torch.arange(3) + d2t).tolist() == [0, 2, 4]  # 4 (9), 0 (5), 2 beats 3 (3 each)
    assert d2t.tolist() == [0, 1, 2]
    assert t2d.nonzero().flatten().tolist() == [0, 2, 4]


def test_too_few_seen_ids_are_filled_with_the_lowest_unchosen():
    freq = torch.tensor([0, 0, 7, 0, 0, 2])
    d2t, t2d = draft_vocab_mapping(freq, draft_vocab_size=4)
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 2, 5]
    assert int(t2d.sum()) == 4


def test_round_trip_and_coverage_on_random_counts():
    generator = torch.Generator().manual_seed(0)
    freq = torch.randint(0, 50, (1000,), generator=generator) * (torch.rand(1000, generator=generator) < 0.7)
    d2t, t2d = draft_vocab_mapping(freq, draft_vocab_size=128)
    assert d2t.shape == (128,) and t2d.shape == (1000,)
    for draft_idx in range(128):
        assert t2d[draft_idx + d2t[draft_idx]]
    targets = torch.arange(128) + d2t
    assert torch.equal(targets, t2d.nonzero().flatten())
    assert bool((d2t[1:] >= d2t[:-1]).all()) and int(d2t.min()) >= 0
    # The chosen ids carry the 128 largest counts, so nothing left out beats them.
    assert int(freq[t2d].min()) >= int(freq[~t2d].max())
    assert coverage(freq, t2d) == pytest.approx(int(freq[targets].sum()) / int(freq.sum()))


def test_mapping_is_deterministic():
    freq = torch.tensor([1, 1, 1, 1, 2, 2, 0, 0])
    first = draft_vocab_mapping(freq, 4)
    second = draft_vocab_mapping(freq.clone(), 4)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert (torch.arange(4) + first[0]).tolist() == [0, 1, 4, 5]


def _speculators_builder():
    """speculators' own mapping builder, compiled alone (its package import takes ~20 s)."""
    spec = importlib.util.find_spec("speculators")
    if spec is None or spec.origin is None:
        pytest.skip("speculators is not installed")
    source = (Path(spec.origin).parent / "train" / "vocab_mapping.py").read_text(encoding="utf-8")
    name = "build_vocab_mappings_from_distribution"
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "vocab_mapping.py", "exec"), namespace)
    return namespace[name]


@pytest.mark.parametrize("draft_vocab_size", [1, 16, 40, 64])
def test_matches_speculators_conventions(draft_vocab_size):
    build = _speculators_builder()
    generator = torch.Generator().manual_seed(draft_vocab_size)
    freq = torch.randint(0, 4, (64,), generator=generator) * (torch.arange(64) % 3 == 0)
    counts = {i: int(c) for i, c in enumerate(freq.tolist()) if c}
    want_d2t, want_t2d = build(counts, draft_vocab_size, 64)
    d2t, t2d = draft_vocab_mapping(freq, draft_vocab_size)
    assert d2t.dtype == want_d2t.dtype and t2d.dtype == want_t2d.dtype
    assert torch.equal(d2t, want_d2t) and torch.equal(t2d, want_t2d)


@pytest.mark.parametrize(
    "freq, size, message",
    [
        (torch.tensor([1, 2]), 3, r"draft_vocab_size=3 must be in \[1, 2\]"),
        (torch.tensor([1, 2]), 0, r"draft_vocab_size=0"),
        (torch.tensor([1.0, 2.0]), 1, "1-D integer tensor"),
        (torch.tensor([1, -2]), 1, "negative count at id 1"),
    ],
)
def test_mapping_rejects_bad_arguments(freq, size, message):
    with pytest.raises(ValueError, match=message):
        draft_vocab_mapping(freq, size)


def test_a_vocab_of_one_is_allowed_and_of_zero_refused():
    assert token_frequencies([([0, 0], [1, 1])], vocab_size=1).tolist() == [2]
    with pytest.raises(ValueError, match=r"^vocab_size must be >= 1, got 0$"):
        token_frequencies([], vocab_size=0)
    with pytest.raises(ValueError, match=r"^freq counts no tokens, so coverage is undefined$"):
        coverage(torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool))


# --------------------------------------------------------------------------- validation


def _valid():
    return draft_vocab_mapping(torch.tensor([4, 0, 3, 0, 2, 1]), draft_vocab_size=3)  # targets 0, 2, 4


def _broken(kind):
    d2t, t2d = _valid()
    if kind == "d2t dtype":
        return d2t.to(torch.int32), t2d
    if kind == "t2d size":
        return d2t, torch.cat([t2d, torch.tensor([False])])
    if kind == "t2d count":
        t2d = t2d.clone()
        t2d[1] = True
        return d2t, t2d
    if kind == "unmarked":
        return torch.tensor([0, 0, 2]), t2d  # targets 0, 1, 4; 1 is not marked
    if kind == "out of range":
        return torch.tensor([0, 1, 4]), t2d  # last target 6
    return torch.tensor([0, 2, 0]), t2d  # "order": targets 0, 3, 2


@pytest.mark.parametrize(
    "kind, message",
    [
        ("d2t dtype", r"d2t must be torch.int64 \[3\], got torch.int32"),
        ("t2d size", r"t2d must be torch.bool \[6\], got torch.bool \[7\]"),
        ("t2d count", "t2d marks 4 ids, expected draft_vocab_size=3"),
        ("unmarked", "draft index 1 maps to target id 1, which t2d does not mark"),
        ("out of range", r"draft index 2 maps to target id 6 outside \[0, 6\)"),
        ("order", "not strictly ascending at draft index 2: 3 then 2"),
    ],
)
def test_validate_mapping_names_the_problem(kind, message):
    d2t, t2d = _broken(kind)
    with pytest.raises(ValueError, match=message):
        validate_mapping(d2t, t2d, target_vocab_size=6, draft_vocab_size=3)


def test_validate_accepts_a_built_mapping():
    validate_mapping(*_valid(), target_vocab_size=6, draft_vocab_size=3)


def test_a_repeated_target_is_refused_as_not_ascending():
    d2t, t2d = _valid()  # targets 0, 2, 4
    with pytest.raises(ValueError, match="not strictly ascending at draft index 1: 0 then 0"):
        validate_mapping(torch.tensor([0, -1, 2]), t2d, target_vocab_size=6, draft_vocab_size=3)


# --------------------------------------------------------------------------- coverage


def test_coverage_is_the_fraction_of_counted_tokens_in_the_draft_vocab():
    freq = torch.tensor([6, 0, 3, 1])
    _, t2d = draft_vocab_mapping(freq, 2)
    assert coverage(freq, t2d) == pytest.approx(0.9)
    assert coverage(freq, torch.ones(4, dtype=torch.bool)) == 1.0


def test_coverage_errors():
    with pytest.raises(ValueError, match="counts no tokens"):
        coverage(torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"t2d must be bool \[3\]"):
        coverage(torch.ones(3, dtype=torch.long), torch.ones(4, dtype=torch.bool))
