"""bf16 mixed precision vs float32: same data, same seed, losses must agree (on CPU).

CPU autocast runs the draft's matmuls (linear, SDPA) in bf16 with float32 accumulation,
which is the same policy as CUDA autocast, so parity is checked here; the GPU only changes
the kernels.  Tolerance: bf16 keeps an 8-bit mantissa (relative rounding ~0.4% per
operation).  At step 0 (identical weights) the two losses differ by ~0.2%; afterwards the
weights differ too and the trajectories drift apart slowly (measured at step 4: 5%, on a loss
that has fallen 6x), so steps 0-4 must agree within 2% + 0.005 absolute, and step 0 within 1%.
"""

import pytest
import torch
from safetensors.torch import load_file

from draftline.train.draft import build_draft, resolve_precision
from draftline.train.loop import make_session
from draftline.train.settings import TrainSettings
from test_training import AUX_IDS, MAX_TOKENS, _train, data, one_torch_thread  # noqa: F401

STEPS = 5
RTOL, ATOL, FIRST_STEP_RTOL = 2e-2, 5e-3, 1e-2


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):  # noqa: F811 (the imported fixture)
    root = tmp_path_factory.mktemp("precision")
    return {p: (root / p, _train(data, root / p, "full", steps=STEPS, precision=p,
                                 checkpoint_every=STEPS))
            for p in ("fp32", "bf16")}


def test_bf16_loss_tracks_fp32(runs):
    fp32 = torch.tensor(runs["fp32"][1]["loss_history"])
    bf16 = torch.tensor(runs["bf16"][1]["loss_history"])
    assert runs["bf16"][1]["precision"] == "bf16" and runs["fp32"][1]["precision"] == "fp32"
    assert len(fp32) == len(bf16) == STEPS
    print(f"\nloss per step  fp32: {[round(x, 5) for x in fp32.tolist()]}"
          f"\n               bf16: {[round(x, 5) for x in bf16.tolist()]}"
          f"\n  relative difference: {[round(x, 4) for x in ((bf16 - fp32).abs() / fp32).tolist()]}")
    assert not torch.equal(bf16, fp32), "bf16 run computed exactly like fp32: no autocast?"
    torch.testing.assert_close(bf16[0], fp32[0], rtol=FIRST_STEP_RTOL, atol=0)
    torch.testing.assert_close(bf16, fp32, rtol=RTOL, atol=ATOL)
    assert bf16[-1] < bf16[0]  # and it learns


def test_bf16_keeps_float32_master_weights_and_optimizer_state(runs):
    out = runs["bf16"][0] / "checkpoints" / f"step-{STEPS:08d}"
    assert {t.dtype for t in load_file(str(out / "draft.safetensors")).values()} == {
        torch.float32}
    state = torch.load(out / "optimizer.pt", weights_only=True)["state"]
    moments = [s[k] for s in state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.dtype for m in moments} == {torch.float32}


def test_bf16_session_computes_in_bf16(data):  # noqa: F811
    """Matmuls in bf16, trainable weights and their gradients float32, frozen ones bf16."""
    draft = build_draft(data["verifier"], AUX_IDS, data["d2t"], data["t2d"])
    session = make_session(draft, TrainSettings(lr=1e-3, ttt_steps=3, precision="bf16"),
                           warmup_steps=0, total_steps=1)
    seen = []
    draft.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    batch = {"hidden_states": torch.randn(1, MAX_TOKENS, 3 * draft.hidden_size),
             "verifier_last_hidden_states": torch.randn(1, MAX_TOKENS, draft.hidden_size),
             "input_ids": torch.randint(0, 100, (1, MAX_TOKENS)),
             "loss_mask": torch.ones(1, MAX_TOKENS, dtype=torch.long),
             "position_ids": torch.arange(1, MAX_TOKENS + 1)[None],
             "lengths": torch.tensor([MAX_TOKENS])}
    loss, _metrics = session.forward(batch)
    loss.backward()
    assert seen == [torch.bfloat16] * 3 and loss.dtype == torch.float32
    assert draft.fc.weight.dtype == draft.fc.weight.grad.dtype == torch.float32
    assert draft.embed_tokens.weight.dtype == draft.verifier_lm_head.weight.dtype == (
        torch.bfloat16)


def test_auto_precision_is_bf16_on_cuda_and_fp32_on_cpu():
    assert resolve_precision("auto", "cuda:0").name == "bf16"
    assert resolve_precision("auto", "cpu").name == "fp32"
    assert resolve_precision("bf16", "cpu").name == "bf16"
    with pytest.raises(ValueError, match="precision"):
        resolve_precision("fp16", "cpu")


@pytest.mark.gpu
def test_cuda_training_is_compiled_bf16_and_tracks_cpu_fp32(data, runs, tmp_path):  # noqa: F811
    """train() on CUDA with its defaults (bf16, compiled flex attention), resumed midway.

    Tolerance doubled against the CPU test: the GPU run also differs in its kernels (flex
    attention, cuBLAS) from the CPU fp32 reference, not only in rounding.
    """
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    first = _train(data, tmp_path, "full", steps=STEPS, device="cuda", stop_after=2,
                   checkpoint_every=STEPS)
    rest = _train(data, tmp_path, "full", steps=STEPS, device="cuda", checkpoint_every=STEPS)
    assert rest["precision"] == "bf16" and rest["completed"] and rest["resumed_from"] == 2
    losses = torch.tensor(first["loss_history"] + rest["loss_history"])
    reference = torch.tensor(runs["fp32"][1]["loss_history"])
    torch.testing.assert_close(losses, reference, rtol=2 * RTOL, atol=2 * ATOL)
