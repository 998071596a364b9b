"""prepare's shard validation refuses bad shards, also under `python -O` (no asserts)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]


def write_shard(path: Path, *, nan: bool = False, empty_sample: bool = False) -> Path:
    """Two samples of 3 and 2 tokens, 2 slots of width 4 (optionally broken)."""
    hidden = torch.zeros(5, 2, 4)
    if nan:
        hidden[3, 1, 2] = float("nan")
    offsets = torch.tensor([0, 3, 3, 5] if empty_sample else [0, 3, 5])
    save_file({"hidden_states": hidden, "input_ids": torch.arange(5), "loss_mask": torch.ones(5, dtype=torch.uint8),
               "sample_offsets": offsets, "sample_ids": torch.arange(len(offsets) - 1)}, str(path))
    return path


def validate_optimized(path: Path) -> subprocess.CompletedProcess:
    """draftline.preparation.validate_shard in a `python -O` interpreter (asserts stripped)."""
    code = ("import sys; from pathlib import Path; from draftline.preparation import validate_shard; "
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
