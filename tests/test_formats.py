"""draftline.formats in-process: the samples file's layout (names, dtypes, offsets) and its
read-back, the contract every stage after tokenize reads."""

import pytest
import torch
from safetensors.torch import load_file

from draftline import formats


def test_samples_round_trip_with_the_documented_layout(tmp_path):
    path = tmp_path / "samples.safetensors"
    ids, masks = [[5, 6, 7], [], [9]], [[0, 1, 1], [], [1]]
    formats.write_samples(path, ids, masks)

    tensors = load_file(str(path))
    assert sorted(tensors) == sorted([formats.INPUT_IDS, formats.LOSS_MASK,
                                      formats.SAMPLE_OFFSETS])
    assert tensors[formats.INPUT_IDS].dtype == torch.int64
    assert tensors[formats.LOSS_MASK].dtype == torch.uint8
    assert tensors[formats.SAMPLE_OFFSETS].dtype == torch.int64
    assert tensors[formats.INPUT_IDS].tolist() == [5, 6, 7, 9]
    assert tensors[formats.LOSS_MASK].tolist() == [0, 1, 1, 1]
    assert tensors[formats.SAMPLE_OFFSETS].tolist() == [0, 3, 3, 4]

    assert formats.read_samples(path) == (ids, masks)
    assert formats.read_samples(str(path)) == (ids, masks)


def test_zero_samples_keep_the_integer_dtypes(tmp_path):
    """With nothing to infer from, torch.tensor([]) is float32: the dtypes are stated, so an
    empty samples file has the same layout as any other."""
    path = tmp_path / "empty.safetensors"
    formats.write_samples(path, [], [])

    tensors = load_file(str(path))
    assert tensors[formats.INPUT_IDS].dtype == torch.int64
    assert tensors[formats.LOSS_MASK].dtype == torch.uint8
    assert tensors[formats.SAMPLE_OFFSETS].dtype == torch.int64
    assert tensors[formats.INPUT_IDS].shape == (0,)
    assert tensors[formats.LOSS_MASK].shape == (0,)
    assert tensors[formats.SAMPLE_OFFSETS].tolist() == [0]
    assert formats.read_samples(path) == ([], [])


def test_flat_samples_read_back_like_listed_ones(tmp_path):
    import numpy as np

    listed, flat = tmp_path / "listed.safetensors", tmp_path / "flat.safetensors"
    ids, masks = [[1, 2], [3]], [[1, 0], [1]]
    formats.write_samples(listed, ids, masks)
    # Narrower input dtypes (int32 ids and offsets, bool mask) are stored in the file's own.
    formats.write_flat_samples(flat, np.array([1, 2, 3], dtype=np.int32),
                               np.array([True, False, True]), np.array([0, 2, 3], dtype=np.int32))
    tensors = load_file(str(flat))
    assert tensors[formats.INPUT_IDS].dtype == torch.int64
    assert tensors[formats.LOSS_MASK].dtype == torch.uint8
    assert tensors[formats.SAMPLE_OFFSETS].dtype == torch.int64
    assert formats.read_samples(flat) == formats.read_samples(listed) == (ids, masks)


def test_flat_samples_that_disagree_are_refused_with_the_exact_message(tmp_path):
    import numpy as np

    path = tmp_path / "flat.safetensors"
    with pytest.raises(ValueError) as short:
        formats.write_flat_samples(path, np.array([1, 2, 3]), np.array([1, 0]),
                                   np.array([0, 1, 2, 3]))
    assert str(short.value) == "flat samples disagree: 3 ids, 2 mask entries, offsets 0..3"
    # The lengths agree with the last offset, but the offsets do not start at 0.
    with pytest.raises(ValueError) as shifted:
        formats.write_flat_samples(path, np.array([1, 2, 3]), np.array([1, 0, 1]),
                                   np.array([1, 2, 3]))
    assert str(shifted.value) == "flat samples disagree: 3 ids, 3 mask entries, offsets 1..3"
    assert not path.exists()


def test_tool_result_marks_round_trip_and_are_optional(tmp_path):
    import numpy as np

    path = tmp_path / "s.safetensors"
    offsets = np.array([0, 2, 5])
    formats.write_flat_samples(path, np.array([1, 2, 3, 4, 5]), np.array([0, 1, 0, 1, 1]), offsets,
                               np.array([0, 0, 1, 0, 0]))
    assert formats.read_tool_results(path) == [[0, 0], [1, 0, 0]]
    formats.write_flat_samples(path, np.array([1, 2, 3, 4, 5]), np.array([0, 1, 0, 1, 1]), offsets)
    assert formats.read_tool_results(path) is None
    with pytest.raises(ValueError, match="5 ids, 4 tool marks"):
        formats.write_flat_samples(path, np.array([1, 2, 3, 4, 5]), np.array([0, 1, 0, 1, 1]), offsets,
                                   np.array([0, 0, 1, 0]))
