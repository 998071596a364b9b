"""prepare's shard validation refuses bad shards, also under `python -O` (no asserts)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftline import formats

from conftest import REPO



def save_shard(path: Path, hidden, ids, mask, offsets, sample_ids) -> None:
    """A shard's tensors as given, consistent or not (prepare is what checks them)."""
    save_file({formats.HIDDEN_STATES: hidden, formats.INPUT_IDS: ids, formats.LOSS_MASK: mask,
               formats.SAMPLE_OFFSETS: offsets, formats.SAMPLE_IDS: sample_ids}, str(path))


def write_shard(path: Path, *, nan: bool = False, empty_sample: bool = False) -> Path:
    """Two samples of 3 and 2 tokens, 2 slots of width 4 (optionally broken)."""
    hidden = torch.zeros(5, 2, 4)
    if nan:
        hidden[3, 1, 2] = float("nan")
    offsets = torch.tensor([0, 3, 3, 5] if empty_sample else [0, 3, 5])
    save_shard(path, hidden, torch.arange(5), torch.ones(5, dtype=torch.uint8), offsets,
               torch.arange(len(offsets) - 1))
    return path


def validate_optimized(path: Path) -> subprocess.CompletedProcess:
    """draftline.prepare.split.validate_shard in a `python -O` interpreter (asserts stripped)."""
    code = ("import sys; from pathlib import Path; from draftline.prepare.split import validate_shard; "
            "print(validate_shard(Path(sys.argv[1]), 2, 4))")
    return subprocess.run([sys.executable, "-O", "-c", code, str(path)], cwd=REPO,
                          capture_output=True, text=True)


def test_a_good_shard_is_indexed(tmp_path):
    result = validate_optimized(write_shard(tmp_path / "good.safetensors"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[(0, 0, 3, 3), (1, 1, 2, 2)]"


@pytest.mark.parametrize("broken, message", [({"nan": True}, "non-finite hidden states"),
                                             ({"empty_sample": True}, "empty sample")])
def test_bad_shards_are_refused_under_python_O(tmp_path, broken, message):
    result = validate_optimized(write_shard(tmp_path / "bad.safetensors", **broken))
    assert result.returncode != 0
    assert "ValueError" in result.stderr and message in result.stderr


# --------------------------------------------------------------------------- in-process (mutation-tested)


def test_validation_reads_each_row_length_and_masked_count(tmp_path):
    from draftline.prepare.split import validate_shard

    path = write_shard(tmp_path / "good.safetensors")
    assert validate_shard(path, 2, 4) == [(0, 0, 3, 3), (1, 1, 2, 2)]
    with pytest.raises(ValueError, match=r"hidden_states \(5, 2, 4\)"):
        validate_shard(path, 3, 4)
    with pytest.raises(ValueError, match="non-finite hidden states"):
        validate_shard(write_shard(tmp_path / "nan.safetensors", nan=True), 2, 4)
    with pytest.raises(ValueError, match="empty sample"):
        validate_shard(write_shard(tmp_path / "empty.safetensors", empty_sample=True), 2, 4)


def test_fp8_shards_are_validated_through_their_values_and_scales(tmp_path):
    from safetensors.torch import save_file

    from draftline.prepare.split import validate_shard

    values, scales = formats.quantize_fp8(torch.randn(5, 2, 4))

    def save(path, values, scales):
        tensors = {formats.HIDDEN_STATES: values, formats.INPUT_IDS: torch.arange(5),
                   formats.LOSS_MASK: torch.ones(5, dtype=torch.uint8),
                   formats.SAMPLE_OFFSETS: torch.tensor([0, 3, 5]),
                   formats.SAMPLE_IDS: torch.arange(2)}
        save_file({**tensors, **({} if scales is None else {formats.HIDDEN_SCALES: scales})},
                  str(path))
        return path

    assert validate_shard(save(tmp_path / "good.safetensors", values, scales), 2, 4) == [
        (0, 0, 3, 3), (1, 1, 2, 2)]
    nan_value = values.clone()
    nan_value.view(torch.uint8)[3, 1, 2] = 0x7F  # e4m3fn's NaN
    nan_scale = scales.clone()
    nan_scale[4, 0] = float("inf")
    for name, broken in (("value", (nan_value, scales)), ("scale", (values, nan_scale))):
        with pytest.raises(ValueError, match="non-finite hidden states"):
            validate_shard(save(tmp_path / f"{name}.safetensors", *broken), 2, 4)
    with pytest.raises(ValueError, match="without hidden_state_scales"):
        validate_shard(save(tmp_path / "bare.safetensors", values, None), 2, 4)
    with pytest.raises(ValueError, match=r"hidden_state_scales \(5, 1\), expected \(5, 2\)"):
        validate_shard(save(tmp_path / "short.safetensors", values, scales[:, :1].contiguous()), 2, 4)


def test_offsets_that_do_not_cover_the_tokens_are_refused(tmp_path):
    from draftline.prepare.split import validate_shard

    path = tmp_path / "short.safetensors"
    save_shard(path, torch.zeros(5, 2, 4), torch.arange(5), torch.ones(5, dtype=torch.uint8),
               torch.tensor([0, 3, 4]), torch.arange(2))
    with pytest.raises(ValueError, match="offsets/mask do not cover 5 tokens"):
        validate_shard(path, 2, 4)
    save_shard(path, torch.zeros(5, 2, 4), torch.arange(5), torch.ones(4, dtype=torch.uint8),
               torch.tensor([0, 3, 5]), torch.arange(2))
    with pytest.raises(ValueError, match="offsets/mask do not cover 5 tokens"):
        validate_shard(path, 2, 4)


def test_a_one_token_sample_is_valid_and_an_empty_split_is_an_integer_table(tmp_path):
    from safetensors.torch import load_file

    from draftline.prepare.split import validate_shard, write_index

    path = tmp_path / "one.safetensors"
    save_shard(path, torch.zeros(3, 2, 4), torch.arange(3), torch.ones(3, dtype=torch.uint8),
               torch.tensor([0, 1, 3]), torch.tensor([5, 6]))
    assert validate_shard(path, 2, 4) == [(5, 0, 1, 1), (6, 1, 2, 2)]
    write_index(tmp_path / "index.safetensors", [(0, 5, 0, 1, 1)], [])
    index = load_file(str(tmp_path / "index.safetensors"))
    assert index[formats.VALIDATION].dtype == torch.int64
    assert index[formats.VALIDATION].shape == (0, 3)


def rows(n: int, masked=lambda i: 1) -> list[tuple[int, int, int, int, int]]:
    """(shard, sample_id, row, length, masked): sample i is row i % 10 of shard i // 10."""
    return [(i // 10, i, i % 10, 5 + i % 7, masked(i)) for i in range(n)]


def test_the_split_is_by_sample_deterministic_disjoint_and_near_the_fraction():
    from draftline.prepare.split import is_validation, split_rows

    train, validation = split_rows(rows(2000), 0.1, seed=7, min_validation=1)
    assert split_rows(rows(2000), 0.1, seed=7, min_validation=1) == (train, validation)
    train_ids, validation_ids = {r[1] for r in train}, {r[1] for r in validation}
    assert not train_ids & validation_ids and train_ids | validation_ids == set(range(2000))
    assert 150 < len(validation) < 250  # binomial(2000, 0.1): mean 200, sd 13
    assert validation_ids == {i for i in range(2000) if is_validation(i, 0.1, 7)}
    other_seed = {r[1] for r in split_rows(rows(2000), 0.1, seed=8, min_validation=1)[1]}
    assert other_seed != validation_ids
    # The coin is per sample: a sample keeps its side when the others change.
    subset = {r[1] for r in split_rows(rows(1000), 0.1, seed=7, min_validation=1)[1]}
    assert subset == {i for i in validation_ids if i < 1000}


def test_the_coin_is_the_samples_hash_below_the_fraction():
    from draftline.prepare.split import is_validation

    assert not any(is_validation(i, 0.0, 0) for i in range(100))
    assert all(is_validation(i, 1.0, 0) for i in range(100))
    assert 400 < sum(is_validation(i, 0.5, 3) for i in range(1000)) < 600


def test_a_split_that_meets_min_validation_by_the_coin_keeps_the_rows_order():
    """Exactly min_validation samples won the coin: they are the validation split as drawn, in
    the rows' order (the lowest-hash fallback is only for fewer)."""
    import hashlib

    from draftline.prepare.split import split_rows

    def coin(seed, i):
        return int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:8], "big") / 2**64

    for seed in range(100):  # a seed whose two lowest coins are not in sample order
        lowest = sorted(range(15), key=lambda i: coin(seed, i))
        if lowest[0] > lowest[1]:
            break
    fraction = (coin(seed, lowest[1]) + coin(seed, lowest[2])) / 2  # exactly two win
    _, validation = split_rows(rows(15), fraction, seed=seed, min_validation=2)
    assert [r[1] for r in validation] == sorted(lowest[:2])


def test_tiny_runs_get_min_validation_samples_and_keep_the_rest_for_training():
    from draftline.prepare.split import split_rows

    train, validation = split_rows(rows(5), 0.0, seed=0, min_validation=2)
    assert len(validation) == 2 and len(train) == 3
    assert {r[1] for r in train} | {r[1] for r in validation} == set(range(5))
    assert split_rows(rows(5), 0.0, seed=0, min_validation=2) == (train, validation)
    with pytest.raises(ValueError, match="no training samples left"):
        split_rows(rows(2), 0.0, seed=0, min_validation=2)


def test_tiny_runs_take_the_lowest_hash_samples_by_sample_id():
    import hashlib

    from draftline.prepare.split import split_rows

    many = rows(15)  # rows 0..9 of shard 0, then rows 0..4 of shard 1: row != sample id
    _, validation = split_rows(many, 0.0, seed=4, min_validation=3)
    by_hash = sorted(range(15), key=lambda i: hashlib.sha256(f"4:{i}".encode()).digest())
    assert [r[1] for r in validation] == by_hash[:3]
    with pytest.raises(ValueError, match="^no training samples left after the validation split$"):
        split_rows(rows(2), 0.0, seed=0, min_validation=2)


def test_samples_without_masked_tokens_are_dropped_from_both_splits():
    from draftline.prepare.split import split_rows

    train, validation = split_rows(rows(50, masked=lambda i: int(i % 5 != 0)), 0.2, seed=1, min_validation=1)
    kept = {r[1] for r in train + validation}
    assert kept == {i for i in range(50) if i % 5 != 0}


def test_the_index_holds_shard_row_and_length_per_split(tmp_path):
    from safetensors.torch import load_file

    from draftline.prepare.split import write_index

    train, validation = [(0, 11, 1, 9, 3), (1, 20, 0, 4, 4)], [(0, 10, 0, 7, 2)]
    write_index(tmp_path / "index.safetensors", train, validation)
    index = load_file(str(tmp_path / "index.safetensors"))
    assert set(index) == {formats.TRAIN, formats.VALIDATION}
    assert index[formats.TRAIN].tolist() == [[0, 1, 9], [1, 0, 4]]
    assert index[formats.TRAIN].dtype == torch.int64
    assert index[formats.VALIDATION].tolist() == [[0, 0, 7]]
    write_index(tmp_path / "empty.safetensors", train, [])
    assert load_file(str(tmp_path / "empty.safetensors"))[formats.VALIDATION].shape == (0, 3)
