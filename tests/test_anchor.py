"""benchmarks.anchor: speculators 0.3.0's own Trainer on EXP=tiny's prepared data, 2 steps, and
the draft it saves read back the way evaluate reads it."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, compose
from helpers import run_make


@pytest.fixture(scope="module")
def prepared_tiny() -> Path:
    """runs/tiny prepared (tokenize, regenerate, extract, prepare): made here only when
    `make prepare EXP=tiny` has not run yet."""
    run = REPO / "runs/tiny"
    if not (run / "prepare/manifest.json").exists():
        run_make("prepare", "EXP=tiny", f"VENV={sys.prefix}", expect=0)
    return run


@pytest.fixture(scope="module")
def anchor(prepared_tiny, tmp_path_factory) -> Path:
    """Its own process: TORCHDYNAMO_DISABLE must be set before speculators is imported, which
    this test process may already have done."""
    out = tmp_path_factory.mktemp("anchor")
    ran = subprocess.run([sys.executable, "-m", "benchmarks.anchor", "--exp", "tiny", "--steps",
                          "2", "--out", str(out), "numerics.torch_threads=1"],
                         cwd=REPO, capture_output=True, text=True)
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-4000:]
    assert "anchor 2/2 steps" in ran.stdout  # a progress line per step
    return out


@pytest.mark.slow  # about 1-2 min on 2 cores plus `make prepare EXP=tiny`; the long tier runs the anchor in tests/test_smollm2.py
def test_the_anchor_trains_two_steps_and_saves_a_draft_evaluate_reads(anchor):
    from draftline.evaluate.rollout import load_draft, num_speculative_tokens
    from draftline.evaluate.run import check_features
    from draftline.formats import load_vocab_mapping
    from draftline.pipeline import artifacts, config
    from draftline.train.run import vocab_path

    cfg = compose("tiny")
    extract = artifacts.read_manifest(config.stage_dir(cfg, "extract"))
    manifest = json.loads((anchor / "manifest.json").read_text())
    assert manifest["steps"] == 2 and len(manifest["loss_history"]) == 2
    assert all(math.isfinite(x) for x in manifest["loss_history"])
    assert manifest["speculators_version"] == "0.3.0" and manifest["adaptations"]
    assert 0 < manifest["tokens"] <= 2 * manifest["max_tokens_per_step"]

    draft = anchor / "draft"
    saved = json.loads((draft / "config.json").read_text())
    assert saved["eagle_aux_hidden_state_layer_ids"] == extract["aux_layer_ids"]
    assert check_features(draft, extract) == extract["aux_layer_ids"]  # what evaluate checks
    assert num_speculative_tokens(draft) == int(cfg.train.ttt_steps)
    model = load_draft(draft, cfg.model.path)
    d2t, t2d = load_vocab_mapping(vocab_path(cfg))
    assert bool((model.d2t == d2t).all()) and bool((model.t2d == t2d).all())
