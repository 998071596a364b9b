"""Draft evaluation: alignment, statistics, baselines, the serving-style rollout, acceptance in
vLLM against the offline walk, vLLM loadability, the tau gate.

Default tier: synthetic data and a tiny random target/draft built here (about a minute, the
vLLM load check included).  `slow` tier: the gated smoke run EXP=tiny-trained (built by
`make target` / `make report EXP=tiny-trained`, or here when missing): the draft beats both
baselines, vLLM's own acceptance agrees with the offline simulation, the gate passes and catches a
draft with a shuffled d2t.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftline import evaluation as ev
from draftline import regeneration
from stages.evaluate import apply_gate, check_features

REPO = Path(__file__).resolve().parents[1]
GATE = REPO / "tests/assets/tau_gate.json"


# --------------------------------------------------------------------------- synthetic data


def sample(ids: list[int], mask: list[int], target_next: list[int], hidden: int = 4) -> ev.Sample:
    T = len(ids)
    return ev.Sample(torch.tensor(ids), torch.tensor(mask, dtype=torch.bool),
                     torch.zeros(T, 3 * hidden), torch.tensor(target_next))


class Oracle:
    """Proposes the target's greedy tokens shifted by ``shift`` positions (0 = always right)."""

    name = "oracle"

    def __init__(self, shift: int = 0):
        self.shift = shift

    def propose(self, s: ev.Sample, starts: torch.Tensor, k: int) -> torch.Tensor:
        offsets = starts[:, None] + 1 + self.shift + torch.arange(k)[None, :]  # [S, k]
        offsets = offsets.clamp(max=len(s.input_ids) - 1)
        return s.target_next[offsets]


def test_scored_starts_lie_inside_replies():
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    # k=2: start t needs mask[t+1..t+3]; reply 2..6 gives t=1,2,3; reply 8..11 gives t=7,8.
    assert ev.valid_starts(mask, 2).tolist() == [1, 2, 3, 7, 8]
    assert ev.reply_starts(mask) == [2, 8]


def test_walk_moves_on_by_accepted_plus_one():
    mask = torch.tensor([0] + [1] * 12, dtype=torch.bool)
    starts = ev.valid_starts(mask, 2)  # t = 0 .. 9
    accepted = torch.tensor([2, 0, 0, 1, 0, 0, 0, 0, 0, 0])
    # t=0 (a=2) -> t=3 (a=1) -> t=5 (a=0) -> t=6 -> ... -> t=9 -> t=10 is not scored.
    assert starts[ev.walk(mask, starts, accepted)].tolist() == [0, 3, 5, 6, 7, 8, 9]


def test_truth_is_the_greedy_token_of_each_proposed_position():
    # target_next[t] is the target's token for position t + 1; from start t the chain proposes
    # positions t+2 .. t+k+1, so its truth is target_next[t+1 .. t+k].
    s = sample(list(range(10)), [1] * 10, [100 + t for t in range(10)])
    assert ev.truth_for(s, torch.tensor([0, 3]), 3).tolist() == [[101, 102, 103], [104, 105, 106]]


def test_a_perfect_draft_gets_k_plus_one_and_an_off_by_one_draft_nothing():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (40,), generator=g).tolist()
    s = sample(ids, [0] * 5 + [1] * 35, torch.randint(0, 50, (40,), generator=g).tolist())
    perfect = ev.evaluate_offline([Oracle(0)], [s], 3, resamples=50, level=0.95, seed=0)["oracle"]
    assert perfect["tau"] == 4.0 and perfect["acceptance"] == [1.0, 1.0, 1.0]
    shifted = ev.evaluate_offline([Oracle(1)], [s], 3, resamples=50, level=0.95, seed=0)["oracle"]
    assert shifted["tau"] < 1.2


def test_on_policy_depth_counts_where_the_data_follows_the_greedy_path():
    # data x_{t+1} == target_next[t] everywhere except where the data continues with 99.
    ids = [0, 1, 2, 99, 4, 5, 6, 7]
    s = sample(ids, [1] * 8, [1, 2, 3, 4, 5, 6, 7, 8])
    assert ev.on_policy_depth(s, torch.tensor([0, 1, 3]), 3).tolist() == [2, 1, 3]


def test_summary_and_bootstrap():
    lengths = [torch.tensor([0, 1, 3]), torch.tensor([2, 2])]
    counts = ev.Counts.from_lengths(lengths, 3)
    summary = ev.summarize(counts.at_least.sum(0))
    assert summary["tau"] == pytest.approx(1 + 8 / 5)
    assert summary["acceptance"] == pytest.approx([4 / 5, 3 / 4, 1 / 3])
    assert summary["accepted_histogram"] == [1, 1, 2, 1]
    boot = ev.bootstrap(counts, 200, 0.95, seed=0)
    assert boot["tau_ci"][0] <= boot["tau"] <= boot["tau_ci"][1]
    same = ev.paired_difference(counts, counts, "tau", 200, 0.95, 0)
    assert same["agrees"] and same["difference"] == 0


def test_baselines_from_training_counts(tmp_path):
    ids = torch.tensor([5, 1, 2, 1, 2, 1, 3, 7, 7, 7])
    mask = torch.tensor([0, 1, 1, 1, 1, 1, 1, 1, 1, 1], dtype=torch.uint8)
    shard = tmp_path / "shard.safetensors"
    save_file({"input_ids": ids, "loss_mask": mask, "sample_offsets": torch.tensor([0, 10])}, str(shard))
    unigram, bigram = ev.count_tokens([shard], torch.tensor([[0, 0, 10]]), 10)
    assert unigram.tolist()[1] == 3 and int(unigram.argmax()) == 1
    frequent, bigrams = ev.baseline_drafts(unigram, bigram)
    assert frequent.token == 1
    s = sample([0, 1, 9], [1, 1, 1], [0, 0, 0])
    # after 1 comes 2 (twice) before 3 (once); after 2 comes 1; 9 was never a predecessor -> mode 1
    assert bigrams.propose(s, torch.tensor([0]), 3).tolist() == [[2, 1, 2]]
    assert bigrams.propose(s, torch.tensor([1]), 2).tolist() == [[1, 2]]


# --------------------------------------------------------------------------- a tiny random pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny random target, and a random draft for it saved in speculators format."""
    from draftline import tiny, vocab
    from draftline.train_model import build_draft

    root = tmp_path_factory.mktemp("pair")
    target_dir = tiny.build_tiny_llama(root / "target", hidden_size=64, num_layers=4, num_heads=2,
                                       num_kv_heads=1, intermediate_size=128)
    freq = torch.randint(0, 100, (512,), generator=torch.Generator().manual_seed(0))
    d2t, t2d = vocab.draft_vocab_mapping(freq, 128)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        draft = build_draft(target_dir, [1, 2, 3], d2t, t2d, num_speculative_tokens=3)
    draft.to(torch.bfloat16).save_pretrained(str(root / "draft"))
    return target_dir, root / "draft"


def test_serving_rollout_matches_speculators_ttt_forward(pair):
    """The serving-style rollout proposes exactly what speculators' training forward drafts."""
    from draftline.train_model import set_attention

    target_dir, draft_dir = pair
    model = ev.load_draft(draft_dir, target_dir)
    runner = ev.DraftRunner(model)
    set_attention(model, "sdpa")
    g = torch.Generator().manual_seed(1)
    T = 48
    s = ev.Sample(torch.randint(0, 512, (T,), generator=g), torch.ones(T, dtype=torch.bool),
                  torch.randn(T, 3 * 64, generator=g), torch.zeros(T, dtype=torch.long))
    starts = torch.arange(T - 1)
    ours = ev.Eagle3Draft(runner).propose(s, starts, 3)  # [T-1, 3] target ids
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        drafted = model(hidden_states=s.aux[None, :-1], input_ids=s.input_ids[None, 1:],
                        position_ids=torch.arange(T - 1)[None], ttt_steps=3)
    theirs = torch.stack([d[0] + model.d2t[d[0]] for d in drafted], -1)
    assert torch.equal(ours, theirs)


@torch.no_grad()
def hf_states(target, tokens: torch.Tensor) -> tuple:
    """transformers' hidden_states for ``tokens`` (entry i = input of layer i, the last one
    post-norm) and its greedy next tokens: what extraction stores, in float32."""
    out = target(input_ids=tokens[None], output_hidden_states=True)
    return [h[0] for h in out.hidden_states], out.logits[0].argmax(-1)


def overfit_draft(target_dir, target, sequences, aux_ids: list[int], out_dir: Path) -> Path:
    """An EAGLE-3 draft trained on ``sequences`` (token tensors) until it predicts them: a
    draft whose verdicts depend on its features, unlike a random one (which accepts nothing)."""
    from speculators.train.data import create_collate_fn, shift_batch

    from draftline import vocab
    from draftline.train_model import build_draft
    from draftline.training import make_session

    rows = []
    for tokens in sequences:
        hidden, _ = hf_states(target, tokens)
        rows.append(shift_batch({
            "hidden_states": torch.cat([hidden[i] for i in aux_ids], -1),
            "verifier_last_hidden_states": hidden[-1], "input_ids": tokens,
            "loss_mask": torch.ones(len(tokens), dtype=torch.long),
            "lengths": torch.tensor([len(tokens)]), "position_ids": torch.arange(len(tokens))}))
    batch = create_collate_fn(sum(len(t) for t in sequences))(rows)
    freq = torch.bincount(torch.cat(list(sequences)), minlength=512)
    d2t, t2d = vocab.draft_vocab_mapping(freq, 128)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_draft(target_dir, aux_ids, d2t, t2d, num_speculative_tokens=3)
        session = make_session(model, "cpu", lr=3e-3, warmup_steps=5, total_steps=150, ttt_steps=3,
                               precision="fp32", compile=False)
        for _ in range(150):
            session.step(batch)
    model.save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="module")
def decoded(pair, tmp_path_factory):
    """The target's own greedy replies to six prompts (vLLM without a draft), the samples
    extraction would store for them (transformers), a draft trained on them, and vLLM's
    speculative decoding of the prompts with that draft."""
    from transformers import AutoModelForCausalLM

    from draftline import serving

    target_dir, _ = pair
    options = serving.EngineOptions(target=str(target_dir), dtype="float32", max_model_len=256)
    stops = regeneration.stop_token_ids(target_dir)
    prompts = [[0, 4, 60 + i, 70, 80, 6, 5] for i in range(6)]
    replies = serving.generate_timed(options, None, None, prompts, [24] * 6, stops)["tokens"]
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    sequences = [torch.tensor(p + r) for p, r in zip(prompts, replies, strict=True)]
    draft_dir = overfit_draft(target_dir, target, sequences, [1, 2, 3],
                              tmp_path_factory.mktemp("overfit") / "draft")
    samples = {}
    for ids in ((1, 2, 3), (2, 3, 4)):
        samples[ids] = []
        for prompt, tokens in zip(prompts, sequences, strict=True):
            hidden, greedy = hf_states(target, tokens)
            mask = torch.zeros(len(tokens), dtype=torch.bool)
            mask[len(prompt):] = True
            samples[ids].append(ev.Sample(tokens, mask, torch.cat([hidden[i] for i in ids], -1), greedy))
    measured = serving.measure_replies(options, draft_dir, 3, prompts, [24] * 6, stops)
    return samples, measured, ev.DraftRunner(ev.load_draft(draft_dir, target_dir))


STATS = {"resamples": 200, "level": 0.95, "seed": 0}


@pytest.mark.vllm
def test_vllm_speculative_decoding_is_lossless_and_takes_the_simulated_steps(decoded):
    """On the target's own greedy text, vLLM's steps are the offline walk's, verdict for verdict."""
    samples, measured, runner = decoded
    replies = ev.held_out_replies(samples[(1, 2, 3)])
    result = ev.vllm_vs_offline(replies, measured["replies"], ev.Eagle3Draft(runner), 3, STATS)
    print({key: result[key] for key in ("text_mismatches", "diverging_replies", "shared_steps")},
          "vllm", round(result["vllm"]["tau"], 3), "offline", round(result["offline"]["tau"], 3))
    assert result["replies"] == 6 and result["text_mismatches"] == 0
    assert result["vllm"]["tau"] > 1.5, "the overfit draft must get tokens accepted"
    assert result["shared_steps"] > 20 and result["diverging_replies"] == 0
    assert result["paired_difference"]["difference"] == 0 and result["agrees"]
    # vLLM's own counters add up to the per-step record.
    counters = measured["counters"]
    assert counters["drafts"] == sum(len(r["accepted"]) for r in measured["replies"])
    assert counters["accepted"] == sum(sum(r["accepted"]) for r in measured["replies"])


@pytest.mark.vllm
def test_vllm_and_offline_disagree_when_the_stored_features_are_wrong(decoded):
    """Features from the layer after each aux id (what an off-by-one extraction stores): the
    offline walk no longer takes vLLM's verdicts, and the agreement check says so."""
    samples, measured, runner = decoded
    good, shifted = samples[(1, 2, 3)], samples[(2, 3, 4)]
    wrong = [dataclasses.replace(g, aux=s.aux) for g, s in zip(good, shifted)]
    result = ev.vllm_vs_offline(ev.held_out_replies(wrong), measured["replies"],
                                ev.Eagle3Draft(runner), 3, STATS)
    print(result["divergences"], result["paired_difference"])
    assert result["diverging_replies"] > 0 and not result["agrees"]


def test_offline_evaluation_refuses_features_the_draft_does_not_expect(pair):
    _, draft_dir = pair
    assert check_features(draft_dir, {"aux_layer_ids": [1, 2, 3]}) == [1, 2, 3]
    with pytest.raises(ValueError, match="asks vLLM for aux layers"):
        check_features(draft_dir, {"aux_layer_ids": [2, 3, 4]})


@pytest.mark.vllm
def test_vllm_parses_and_loads_every_saved_tensor(pair):
    target_dir, draft_dir = pair
    report = ev.check_vllm_load(draft_dir, target_dir, 3)
    saved = set(load_file(str(draft_dir / "model.safetensors")))
    assert report["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert report["model_class"] == "Eagle3LlamaForCausalLM"
    assert report["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert set(report["placed"]) == saved - {"t2d"} and report["ignored_by_vllm"] == ["t2d"]
    assert "model.layers.0.self_attn.qkv_proj.weight" in report["parameters"]


def test_the_name_mapping_rejects_unknown_and_missing_tensors():
    params = {"model.fc.weight": torch.ones(2, 2), "lm_head.weight": torch.ones(2, 2)}
    ok = ev.compare_loaded(params, {"fc.weight": torch.ones(2, 2), "lm_head.weight": torch.ones(2, 2),
                                    "t2d": torch.ones(3, dtype=torch.bool)})
    assert ok["ignored_by_vllm"] == ["t2d"]
    with pytest.raises(ValueError, match="does not have"):
        ev.compare_loaded(params, {"fc_typo.weight": torch.ones(2, 2), "lm_head.weight": torch.ones(2, 2)})
    with pytest.raises(ValueError, match="no saved tensor filled"):
        ev.compare_loaded(params, {"lm_head.weight": torch.ones(2, 2)})


# --------------------------------------------------------------------------- the gate


def test_the_gate_asset_records_measured_runs_with_a_margin():
    entry = json.loads(GATE.read_text())["tiny-trained"]
    assert entry["k"] == 3
    lowest = min(run["tau"] for run in entry["measured"])
    assert entry["tau_min"] < lowest - 0.05, "the floor needs a margin below every measured run"
    assert entry["tau_min"] > max(run["baseline_tau_max"] for run in entry["measured"]), \
        "the floor must sit above the baselines, or a collapsed draft would pass"


def _offline(tau: float, ci: list[float], bigram_ci: list[float]) -> dict:
    return {"eagle3": {"tau": tau, "tau_ci": ci}, "bigram": {"tau": sum(bigram_ci) / 2, "tau_ci": bigram_ci}}


def test_the_gate_fails_below_the_floor():
    assert apply_gate({"tau_min": 1.5}, _offline(1.6, [1.55, 1.65], [1.3, 1.4]), "gate.json")["passed"]
    assert not apply_gate(None, _offline(1.0, [0.9, 1.1], [1.3, 1.4]), "gate.json")["checked"]
    with pytest.raises(AssertionError, match="below the floor"):
        apply_gate({"tau_min": 1.5}, _offline(1.4, [1.35, 1.45], [1.0, 1.1]), "gate.json")


def test_the_gate_fails_when_the_tau_ci_overlaps_the_bigram_ci():
    # Above the floor, but a machine where the bigram baseline does as well (CIs overlap).
    with pytest.raises(AssertionError, match="does not lie above the bigram baseline's CI"):
        apply_gate({"tau_min": 1.5}, _offline(1.6, [1.52, 1.68], [1.45, 1.55]), "gate.json")
    verdict = apply_gate({"tau_min": 1.5}, _offline(1.6, [1.56, 1.68], [1.45, 1.55]), "gate.json")
    assert verdict["above_baseline"] and verdict["baseline_tau_ci"] == [1.45, 1.55]


# --------------------------------------------------------------------------- the smoke run (slow)


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True)


@pytest.fixture(scope="module")
def smoke_run() -> Path:
    """runs/tiny-trained, evaluated: built here only when `make report EXP=tiny-trained` has not."""
    run = REPO / "runs/tiny-trained"
    if not (REPO / "runs/_assets/tiny-llama-trained/build.json").exists():
        built = _run(sys.executable, "-m", "draftline.target_training", "experiment=tiny-trained")
        assert built.returncode == 0, built.stderr[-4000:]
    if not (run / "evaluate/manifest.json").exists():
        made = _run("make", "--no-print-directory", "all", "EXP=tiny-trained", f"VENV={sys.prefix}")
        assert made.returncode == 0, made.stderr[-4000:]
        stage = _run(sys.executable, "-m", "stages.evaluate", "experiment=tiny-trained")
        assert stage.returncode == 0, stage.stderr[-4000:]
    return run


@pytest.mark.slow
def test_trained_draft_beats_both_baselines(smoke_run):
    offline = json.loads((smoke_run / "evaluate/results.json").read_text())["offline"]
    for baseline in ("bigram", "most_frequent"):
        assert offline["eagle3"]["tau_ci"][0] > offline[baseline]["tau_ci"][1], baseline
    print({name: round(r["tau"], 3) for name, r in offline.items()})


@pytest.mark.slow
def test_vllm_acceptance_agrees_with_the_offline_estimate(smoke_run):
    measured = json.loads((smoke_run / "evaluate/results.json").read_text())["in_vllm"]
    assert measured["on_target_text"], "EXP=tiny-trained evaluates on the target's own replies"
    print({"vllm": measured["vllm"]["tau"], "offline": measured["offline"]["tau"],
           "offline_ci": measured["offline"]["tau_ci"], "text_mismatches": measured["text_mismatches"]})
    assert measured["agrees"] and measured["vllm_tau_inside_offline_ci"], measured["paired_difference"]
    assert measured["replies"] > 20


def _broken_run(smoke_run: Path, tmp_path: Path) -> Path:
    """A copy of the run's manifests whose draft has a seeded permutation of d2t."""
    run = tmp_path / "run"
    for stage in ("tokenize", "regenerate", "extract", "prepare", "train"):
        shutil.copytree(smoke_run / stage, run / stage,
                        ignore=shutil.ignore_patterns("shard-*", "runs", "checkpoints", "samples.*", "chunks"))
    draft = json.loads((smoke_run / "train/manifest.json").read_text())["draft"]
    shutil.copytree(REPO / draft, tmp_path / "draft")
    tensors = load_file(str(tmp_path / "draft/model.safetensors"))
    perm = torch.randperm(len(tensors["d2t"]), generator=torch.Generator().manual_seed(0))
    targets = torch.arange(len(perm)) + tensors["d2t"]  # target id of each draft id
    tensors["d2t"] = targets[perm] - torch.arange(len(perm))  # draft id i -> another id's target
    save_file(tensors, str(tmp_path / "draft/model.safetensors"))
    return run


@pytest.mark.slow
def test_gate_passes_the_smoke_run_and_catches_a_shuffled_d2t(smoke_run, tmp_path):
    manifest = json.loads((smoke_run / "evaluate/manifest.json").read_text())
    assert manifest["gate"]["checked"] and manifest["gate"]["passed"]
    run = _broken_run(smoke_run, tmp_path)
    broken = _run(sys.executable, "-m", "stages.evaluate", "experiment=tiny-trained", f"run_dir={run}",
                  f"evaluate.draft={tmp_path / 'draft'}", "evaluate.vllm.enabled=false",
                  "evaluate.vllm_check=false")
    assert broken.returncode != 0 and "below the floor" in broken.stdout + broken.stderr
    assert not (run / "evaluate/manifest.json").exists()
    tau = json.loads((run / "evaluate/results.json").read_text())["offline"]["eagle3"]["tau"]
    print(f"shuffled d2t: tau {tau:.3f}")
    assert tau < json.loads(GATE.read_text())["tiny-trained"]["tau_min"]
