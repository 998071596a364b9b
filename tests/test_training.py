"""Draft training on CPU: data contract, packed loader, speculators' model, resume, saved
format, vLLM parse.  (``-m gpu`` adds the loader's CUDA path.)

The fixture writes exactly what the upstream stages produce: hidden-state shards (real
hidden states of a tiny random Llama: aux layer inputs + the post-norm final state), a split
index and a vocab mapping.
"""

import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftline import formats
from draftline.train.vllm_parse import check_vllm_parse
from draftline.formats import load_split
from draftline.tiny import builders as tiny
from draftline.train.dataset import ShardSampleDataset, make_loader
from draftline.train.loader import PackedLoader
from draftline.train.mapped import MappedShard
from draftline.train.checkpoint import latest_checkpoint
from draftline.train.draft import build_draft, set_attention
from draftline.train.loop import train
from draftline.train.packing import (
    PACKING,
    epoch_batches,
    make_sampler,
    plan_steps,
    steps_in_epochs,
)
from draftline.train.settings import TrainData, TrainSettings

from conftest import REPO

AUX_IDS = [2, 3, 4]
NUM_LAYERS = 6
VOCAB, DRAFT_VOCAB, HIDDEN = 512, 128, 256
MAX_TOKENS = 512
# Two shards (bf16 and float32 hidden states); lengths per sample row.
SHARD_LENGTHS = [[100, 130, 90, 150, 70], [120, 80, 110, 60]]
SMALL_TRAIN = [(0, 0), (0, 1), (0, 2), (0, 3)]  # 466 tokens after the shift: one packed batch
FULL_TRAIN = SMALL_TRAIN + [(0, 4), (1, 0), (1, 1)]  # several batches per epoch
VALIDATION = [(1, 2), (1, 3)]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread for this module.

    Why: on a small shared CPU box, two OpenMP threads competing with other processes
    stall at every parallel region (measured: 3 s per step instead of 0.2 s); one thread
    is barely slower when the box is idle.  Every run below uses the same count, which
    bit-identical resume also needs.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# --------------------------------------------------------------------------- fixture data


def _hidden_slots(model, ids: list[int]) -> torch.Tensor:
    """[T, 4, H]: inputs of the aux layers, then the final state after the final norm."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    states = out.hidden_states  # L + 1 entries; entry L is post-norm (see draftline.tiny.reference)
    return torch.stack([states[i][0] for i in AUX_IDS] + [states[-1][0]], dim=1)


def write_shards(root: Path, verifier_dir: Path, lengths: list[list[int]]) -> list[Path]:
    """Shards in the extraction stage's layout; shard 0 bf16, the others float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(verifier_dir), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    paths, sample_id = [], 0
    for shard, shard_lengths in enumerate(lengths):
        ids = [torch.randint(7, VOCAB, (n,), generator=generator).tolist() for n in shard_lengths]
        masks = [[0] * (n // 4) + [1] * (n - n // 4) for n in shard_lengths]  # prompt, answer
        dtype = torch.bfloat16 if shard == 0 else torch.float32
        offsets = torch.tensor([0] + shard_lengths).cumsum(0)
        tensors = {
            formats.HIDDEN_STATES: torch.cat([_hidden_slots(model, s) for s in ids]).to(dtype),
            formats.INPUT_IDS: torch.tensor(sum(ids, []), dtype=torch.int64),
            formats.LOSS_MASK: torch.tensor(sum(masks, []), dtype=torch.uint8),
            formats.SAMPLE_OFFSETS: offsets.to(torch.int64),
            formats.SAMPLE_IDS: torch.arange(sample_id, sample_id + len(ids), dtype=torch.int64),
        }
        sample_id += len(ids)
        paths.append(root / f"shard-{shard:05d}.safetensors")
        save_file(tensors, str(paths[-1]))
    return paths


def write_split_index(path: Path, train_rows, validation_rows) -> Path:
    def rows(pairs):
        return torch.tensor([(s, r, SHARD_LENGTHS[s][r]) for s, r in pairs],
                            dtype=torch.int64).reshape(-1, 3)

    formats.write_split_index(path, rows(train_rows), rows(validation_rows))
    return path


def write_vocab_mapping(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft vocab of the special tokens plus a seeded random subset of the rest."""
    rest = 7 + torch.randperm(VOCAB - 7, generator=torch.Generator().manual_seed(1))
    selected = torch.cat([torch.arange(7), rest[: DRAFT_VOCAB - 7]]).sort().values
    d2t = selected - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[selected] = True
    formats.write_vocab_mapping(path, d2t, t2d)
    return d2t, t2d


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    verifier = tiny.build_tiny_llama(root / "verifier", num_layers=NUM_LAYERS)
    shards = write_shards(root, verifier, SHARD_LENGTHS)
    d2t, t2d = write_vocab_mapping(root / "vocab.safetensors")
    return {
        "root": root, "verifier": verifier, "shards": shards, "d2t": d2t, "t2d": t2d,
        "vocab": root / "vocab.safetensors",
        "small": write_split_index(root / "split-small.safetensors", SMALL_TRAIN, VALIDATION),
        "full": write_split_index(root / "split-full.safetensors", FULL_TRAIN, VALIDATION),
    }


def _train(data, out_dir: Path, split: str, stop_after: int | None = None, **kwargs) -> dict:
    args = dict(steps=10, lr=1e-3, ttt_steps=3, max_tokens_per_step=MAX_TOKENS, seed=0,
                checkpoint_every=5, keep_checkpoints=None, check_vllm=False)
    inputs = TrainData(data["shards"], data[split], data["vocab"], data["verifier"], AUX_IDS)
    return train(inputs, TrainSettings(**{**args, **kwargs}), out_dir, stop_after=stop_after)


# --------------------------------------------------------------------------- data


def test_dataset_yields_shifted_speculators_samples(data):
    dataset = ShardSampleDataset(data["shards"], load_split(data["full"], formats.TRAIN))
    item = dataset[4]  # shard 0, row 4: 70 tokens starting at 100 + 130 + 90 + 150
    start, length = 470, 70
    with safe_open(str(data["shards"][0]), framework="pt") as f:
        slots = f.get_tensor(formats.HIDDEN_STATES)[start:start + length].float()  # [T, 4, H]
        ids = f.get_tensor(formats.INPUT_IDS)[start:start + length]
        mask = f.get_tensor(formats.LOSS_MASK)[start:start + length]
    # speculators' shift: token t+1 is predicted from the aux states of token t.
    assert torch.equal(item["hidden_states"], slots[:-1, :3].reshape(length - 1, 3 * HIDDEN))
    assert torch.equal(item["verifier_last_hidden_states"], slots[1:, 3])
    assert torch.equal(item["input_ids"], ids[1:])
    assert torch.equal(item["loss_mask"], mask[1:].long())
    assert item["lengths"].tolist() == [length - 1]
    assert dataset.lengths[4] == length - 1


def test_packing_respects_token_budget(data):
    dataset = ShardSampleDataset(data["shards"], load_split(data["full"], formats.TRAIN))
    batches = epoch_batches(make_sampler(dataset.lengths, MAX_TOKENS, seed=0), 0)
    assert sorted(i for b in batches for i in b.tolist()) == list(range(len(dataset)))
    for batch in make_loader(dataset, batches, MAX_TOKENS):
        assert batch["hidden_states"].shape == (1, MAX_TOKENS, 3 * HIDDEN)
        assert batch["input_ids"].shape == (1, MAX_TOKENS)
        assert int(batch["lengths"].sum()) <= MAX_TOKENS


def test_step_plan_is_a_pure_function_of_seed_and_steps(data):
    dataset = ShardSampleDataset(data["shards"], load_split(data["full"], formats.TRAIN))
    sampler = make_sampler(dataset.lengths, MAX_TOKENS, seed=0)
    full = plan_steps(sampler, 0, 10)
    assert [epoch for epoch, _ in full] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]  # step 5 is mid-epoch
    assert steps_in_epochs(sampler, 5) == 10
    resumed = plan_steps(sampler, 5, 10)
    assert [(e, b.tolist()) for e, b in resumed] == [(e, b.tolist()) for e, b in full[5:]]


def test_mapped_shard_views_match_safetensors(data):
    shard = MappedShard(data["shards"][0])
    with safe_open(str(data["shards"][0]), framework="pt") as f:
        for name in f.keys():
            view = shard.tensor(name)
            assert view.dtype == f.get_tensor(name).dtype
            assert torch.equal(view, f.get_tensor(name)), name


def _planned(dataset: ShardSampleDataset, max_tokens: int, steps: int = 10) -> list:
    return [batch for _, batch in plan_steps(make_sampler(dataset.lengths, max_tokens, 0),
                                             0, steps)]


def _assert_same_batch(packed: dict, reference: dict) -> None:
    assert packed.keys() == reference.keys()
    for key, expected in reference.items():
        assert packed[key].shape == expected.shape, key
        assert torch.equal(packed[key].to(expected.dtype), expected), key


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("max_tokens", [MAX_TOKENS, 96])  # 96: samples cut at the budget
def test_packed_loader_matches_speculators_collate(data, threads, max_tokens):
    """Same batches as DataLoader + speculators' collate, also when the ring buffers wrap."""
    dataset = ShardSampleDataset(data["shards"], load_split(data["full"], formats.TRAIN))
    batches = _planned(dataset, max_tokens)
    packed = PackedLoader(dataset, batches, max_tokens, threads=threads, prefetch=1)
    reference = make_loader(dataset, batches, max_tokens)
    count = 0
    for fast, slow in zip(packed, reference, strict=True):
        _assert_same_batch(fast, slow)  # before the next batch: ring buffers are reused
        count += 1
    assert count == len(batches) == 10


def test_packed_loader_keeps_bf16_until_the_device(data):
    """bf16 shards stay bf16 through packing; the cast happens where the batch lands."""
    dataset = ShardSampleDataset(data["shards"], load_split(data["small"], formats.TRAIN))
    assert dataset.storage_dtype == torch.bfloat16
    batches = _planned(dataset, MAX_TOKENS, steps=2)
    raw = next(iter(PackedLoader(dataset, batches, MAX_TOKENS, threads=1)))
    assert raw["hidden_states"].dtype == raw["verifier_last_hidden_states"].dtype == torch.bfloat16
    cast = next(iter(PackedLoader(dataset, batches, MAX_TOKENS, hidden_dtype=torch.float32)))
    _assert_same_batch(cast, next(iter(make_loader(dataset, batches, MAX_TOKENS))))


@pytest.mark.gpu
def test_packed_loader_on_cuda_matches_reference(data):
    """Pinned buffers, side-stream copies one batch ahead, cast on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dataset = ShardSampleDataset(data["shards"], load_split(data["full"], formats.TRAIN))
    batches = _planned(dataset, MAX_TOKENS)
    packed = PackedLoader(dataset, batches, MAX_TOKENS, "cuda", torch.float32, threads=2,
                          prefetch=1)
    kept = list(packed)  # CUDA batches are separate allocations: keeping them is allowed
    for fast, slow in zip(kept, make_loader(dataset, batches, MAX_TOKENS), strict=True):
        assert fast["hidden_states"].is_cuda
        _assert_same_batch({k: v.cpu() for k, v in fast.items()}, slow)


def test_the_loader_says_when_its_first_prefetch_was_full(data):
    """``primed_at``: start-up ends once the first ``prefetch`` batches are ready."""
    dataset = ShardSampleDataset(data["shards"], load_split(data["full"], formats.TRAIN))
    loader = PackedLoader(dataset, _planned(dataset, MAX_TOKENS), MAX_TOKENS, threads=2,
                          prefetch=3)
    before = time.perf_counter()
    batches = iter(loader)
    assert loader.primed_at is None  # nothing packed before the first request
    next(batches)
    deadline = time.monotonic() + 10
    while loader.primed_at is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the other two batches finish on their threads
    assert loader.primed_at is not None and loader.primed_at > before
    batches.close()


def test_an_unknown_staging_is_refused(data):
    dataset = ShardSampleDataset(data["shards"], load_split(data["small"], formats.TRAIN))
    with pytest.raises(ValueError, match="staging must be one of"):
        PackedLoader(dataset, [], MAX_TOKENS, staging="gpu")


@pytest.mark.gpu
@pytest.mark.parametrize("staging", ["workers", "consumer"])
def test_both_stagings_on_cuda_match_the_reference_several_batches_ahead(data, staging):
    """Batches staged by the packing threads (or by the consumer, the earlier way) with
    several waiting on the GPU: the reference's batches, in plan order."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dataset = ShardSampleDataset(data["shards"], load_split(data["full"], formats.TRAIN))
    batches = _planned(dataset, 96)
    packed = PackedLoader(dataset, batches, 96, "cuda", torch.float32, threads=3, prefetch=3,
                          staging=staging)
    for fast, slow in zip(packed, make_loader(dataset, batches, 96), strict=True):
        _assert_same_batch({k: v.cpu() for k, v in fast.items()}, slow)


@pytest.fixture(scope="module")
def fp8_shards(data, tmp_path_factory):
    """The fixture's shards with fp8 hidden states and their scales, as extract writes them."""
    root = tmp_path_factory.mktemp("fp8")
    paths = []
    for path in data["shards"]:
        tensors = formats.read_shard(path)
        values, scales = formats.quantize_fp8(tensors[formats.HIDDEN_STATES])
        tensors.update({formats.HIDDEN_STATES: values, formats.HIDDEN_SCALES: scales})
        paths.append(root / path.name)
        save_file(tensors, str(paths[-1]))
    return paths


def test_fp8_items_are_the_dequantized_stored_states(fp8_shards, data):
    dataset = ShardSampleDataset(fp8_shards, load_split(data["full"], formats.TRAIN))
    assert dataset.storage_dtype == torch.float8_e4m3fn
    item, start, length = dataset[4], 470, 70
    stored = formats.read_shard(fp8_shards[0])
    slots = formats.dequantize(stored[formats.HIDDEN_STATES][start:start + length],
                               stored[formats.HIDDEN_SCALES][start:start + length])  # [T, 4, H]
    assert torch.equal(item["hidden_states"], slots[:-1, :3].reshape(length - 1, 3 * HIDDEN))
    assert torch.equal(item["verifier_last_hidden_states"], slots[1:, 3])
    exact = ShardSampleDataset(data["shards"], load_split(data["full"], formats.TRAIN))[4]
    error = (item["hidden_states"] - exact["hidden_states"]).abs().max()
    assert 0 < error <= exact["hidden_states"].abs().max() / 16  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("max_tokens", [MAX_TOKENS, 96])
def test_packed_fp8_loader_matches_the_reference(fp8_shards, data, threads, max_tokens):
    """fp8 bytes and scales packed, dequantized where the batch is cast: the reference's
    batches exactly, scale keys gone."""
    dataset = ShardSampleDataset(fp8_shards, load_split(data["full"], formats.TRAIN))
    batches = _planned(dataset, max_tokens)
    packed = PackedLoader(dataset, batches, max_tokens, hidden_dtype=torch.float32,
                          threads=threads, prefetch=1)
    assert packed._new_slots()[0].buffers["hidden_states"].dtype == torch.float8_e4m3fn
    for fast, slow in zip(packed, make_loader(dataset, batches, max_tokens), strict=True):
        _assert_same_batch(fast, slow)


def test_a_split_of_fp8_and_bf16_shards_is_refused(fp8_shards, data):
    dataset = ShardSampleDataset([fp8_shards[0], data["shards"][1]],
                                 load_split(data["full"], formats.TRAIN))
    with pytest.raises(ValueError, match="mixes fp8 shards"):
        dataset.storage_dtype


@pytest.mark.gpu
def test_packed_fp8_loader_on_cuda_matches_reference(fp8_shards, data):
    """fp8 crosses to the GPU as one byte per value and is dequantized there."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dataset = ShardSampleDataset(fp8_shards, load_split(data["full"], formats.TRAIN))
    batches = _planned(dataset, MAX_TOKENS)
    packed = PackedLoader(dataset, batches, MAX_TOKENS, "cuda", torch.float32, threads=2,
                          prefetch=1)
    for fast, slow in zip(list(packed), make_loader(dataset, batches, MAX_TOKENS), strict=True):
        assert fast["hidden_states"].is_cuda
        _assert_same_batch({k: v.cpu() for k, v in fast.items()}, slow)


def test_split_index_must_match_shards(data, tmp_path):
    bad = tmp_path / "bad.safetensors"
    formats.write_split_index(bad, torch.tensor([[0, 1, 999]]), torch.zeros(0, 3).long())
    with pytest.raises(ValueError, match="index says 999"):
        ShardSampleDataset(data["shards"], load_split(bad, formats.TRAIN))


# --------------------------------------------------------------------------- model


def test_dense_sdpa_matches_speculators_flex_attention(data):
    dataset = ShardSampleDataset(data["shards"], load_split(data["full"], formats.TRAIN))
    batches = epoch_batches(make_sampler(dataset.lengths, MAX_TOKENS, 0), 0)
    batch = next(iter(make_loader(dataset, batches, MAX_TOKENS)))
    draft = build_draft(data["verifier"], AUX_IDS, data["d2t"], data["t2d"])
    results = {}
    for kind in ("flex", "sdpa"):
        set_attention(draft, kind)
        draft.zero_grad()
        with torch.compiler.set_stance("force_eager"):
            _tokens, loss, _metrics = draft(**batch, ttt_steps=3)
            loss.backward()
        results[kind] = (loss.detach(), draft.fc.weight.grad.clone())
    torch.testing.assert_close(results["sdpa"][0], results["flex"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results["sdpa"][1], results["flex"][1], rtol=1e-4, atol=1e-7)


def test_draft_targets_are_the_verifier_logits(data):
    """The final slot is post-norm, so the draft's verifier head reproduces the target."""
    from transformers import AutoModelForCausalLM

    dataset = ShardSampleDataset(data["shards"], load_split(data["full"], formats.TRAIN))
    item = dataset[5]  # shard 1 (float32), row 0
    with safe_open(str(data["shards"][1]), framework="pt") as f:
        ids = f.get_tensor(formats.INPUT_IDS)[:SHARD_LENGTHS[1][0]]
    verifier = AutoModelForCausalLM.from_pretrained(str(data["verifier"]), dtype=torch.float32)
    with torch.no_grad():
        logits = verifier(input_ids=ids[None]).logits[0, 1:]  # [T-1, vocab], shifted like item
        draft = build_draft(data["verifier"], AUX_IDS, data["d2t"], data["t2d"])
        targets = draft.verifier_lm_head(item["verifier_last_hidden_states"])  # [T-1, draft]
    torch.testing.assert_close(targets, logits[:, data["t2d"]], rtol=1e-4, atol=1e-5)


def test_build_draft_finds_prefixed_verifier_weights(data, tmp_path):
    """A multimodal-style verifier: text_config, language_model.* names, sharded index."""
    config = json.loads((data["verifier"] / "config.json").read_text())
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": config}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    weights = load_file(str(data["verifier"] / "model.safetensors"))
    text = {f"language_model.{k}": v for k, v in weights.items()}
    decoy = {"vision_tower.patch.embed_tokens.weight": torch.zeros(16, HIDDEN)}
    save_file(text, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(decoy, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {**dict.fromkeys(text, "model-00001-of-00002.safetensors"),
                  **dict.fromkeys(decoy, "model-00002-of-00002.safetensors")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    draft = build_draft(tmp_path, AUX_IDS, data["d2t"], data["t2d"])
    assert torch.equal(draft.embed_tokens.weight, weights["model.embed_tokens.weight"])
    assert torch.equal(draft.verifier_lm_head.weight, weights["lm_head.weight"][data["t2d"]])
    verifier = draft.config.speculators_config.verifier
    assert verifier.architectures == ["KimiK25ForConditionalGeneration"]


# --------------------------------------------------------------------------- training


def test_loss_decreases_on_a_repeated_batch(data, tmp_path):
    result = _train(data, tmp_path / "run", "small", checkpoint_every=100)
    history = result["loss_history"]
    assert len(history) == 10 and result["completed"]
    assert history[-1] < 0.5 * history[0]
    assert set(result["final"]) >= {f"{m}_{k}" for m in ("loss", "full_acc", "cond_acc")
                                     for k in range(3)}
    assert result["validation"]["loss"] > 0


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    return out, _train(data, out, "full", check_vllm=True, checkpoint_every=2,
                       keep_checkpoints=2)


def test_a_run_records_the_optimizer_that_ran_and_its_step_planner(uninterrupted):
    out, result = uninterrupted
    assert result["optimizer"] == {"name": "AdamW", "implementation": "fused"}  # CPU has it
    assert result["packing"] == PACKING
    state = json.loads((latest_checkpoint(out) / "state.json").read_text())
    assert state["optimizer"] == "fused" and state["spec"]["packing"] == PACKING


def test_a_run_reports_its_wait_for_data_per_step(uninterrupted):
    """Every step is timed, start-up apart from the steady state; the manifest takes it."""
    _, result = uninterrupted
    timing = result["timing"]
    assert timing["startup"]["steps"] + timing["steady"]["steps"] == result["steps"] == 10
    steady = timing["steady"]
    assert steady["steps"] >= 1  # packing inline on CPU: primed at the first batch
    assert 0 <= steady["wait_ms"]["p50"] <= steady["wait_ms"]["p90"] <= steady["wait_ms"]["max"]
    assert steady["wait_ms"]["max"] <= steady["step_ms"]["max"]
    assert steady["idle_ms"] is None and isinstance(timing["input_bound"], bool)
    json.dumps(timing)


def test_resume_is_bit_identical(data, uninterrupted, tmp_path):
    reference_dir, reference = uninterrupted
    first = _train(data, tmp_path, "full", stop_after=5)
    assert not first["completed"] and first["draft_dir"] is None
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint.name == "step-00000005"
    # Neither a killed save's temporary nor a directory without state.json is resumable.
    shutil.copytree(checkpoint, tmp_path / "checkpoints" / ".step-00000009.x.tmp")
    shutil.copytree(checkpoint, tmp_path / "checkpoints" / "step-00000008",
                    ignore=shutil.ignore_patterns("state.json"))
    assert latest_checkpoint(tmp_path) == checkpoint
    second = _train(data, tmp_path, "full")
    assert second["resumed_from"] == 5 and second["steps"] == 10
    assert second["loss_history"] == reference["loss_history"][5:]
    for name in ("checkpoints/step-00000010/draft.safetensors", "draft/model.safetensors"):
        ours, theirs = load_file(str(tmp_path / name)), load_file(str(reference_dir / name))
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name


def test_a_run_moved_with_its_inputs_resumes_and_its_state_names_no_path_of_the_machine(
        data, uninterrupted, tmp_path):
    """The run spec names its inputs relative to the run, so a run dir copied elsewhere with
    its inputs beside it (another checkout, a container's /app, another host) resumes, and
    its state.json is the same bytes wherever it was written."""
    def at(root: Path) -> dict:
        shutil.copytree(data["root"], root / "data", ignore=shutil.ignore_patterns("run*"))
        return {**data, "verifier": root / "data" / "verifier",
                **{key: root / "data" / data[key].name for key in ("vocab", "full")},
                "shards": [root / "data" / shard.name for shard in data["shards"]]}

    here = at(tmp_path / "here")
    first = _train(here, tmp_path / "here" / "run", "full", stop_after=5)
    assert not first["completed"]
    state = (latest_checkpoint(tmp_path / "here" / "run") / "state.json").read_text()
    assert str(tmp_path) not in state and "../data/shard-00000.safetensors" in state
    there = tmp_path / "elsewhere" / "there"
    shutil.copytree(tmp_path / "here" / "run", there / "run")
    second = _train(at(there), there / "run", "full")
    assert second["resumed_from"] == 5
    assert second["loss_history"] == uninterrupted[1]["loss_history"][5:]
    assert (there / "run/checkpoints/step-00000005/state.json").read_text() == state


def test_old_checkpoints_are_pruned(uninterrupted):
    out, _result = uninterrupted
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step-00000008", "step-00000010"]


def test_a_steps_log_line_carries_its_progress_loss_per_ttt_step_and_lr(caplog):
    from draftline.pipeline.progress import Progress
    from draftline.train.loop import _step_detail

    clock = iter([0.0, 2.0, 2.0])
    progress = Progress("train", 10, 4, unit="steps", interval=0.0,
                        logger=logging.getLogger("draftline.train.loop"), clock=lambda: next(clock))
    metrics = {"loss": 1.5, "loss_0": 0.75, "full_acc_0": 0.5, "cond_acc_0": 0.5,
               "loss_1": 0.25, "full_acc_1": 0.125, "cond_acc_1": 0.25}
    with caplog.at_level(logging.INFO, "draftline.train.loop"):
        progress.advance_to(5, 400, _step_detail(metrics, 3e-4, 2))
    assert caplog.messages == [
        "train 5/10 steps (0.50 steps/s, 200 tok/s, ETA 0:00:10) | loss 1.5000 | "
        "ttt0 loss 0.7500 acc 0.500 cond 0.500 | ttt1 loss 0.2500 acc 0.125 cond 0.250 | lr 3.00e-04"]


def test_resume_refuses_a_different_run(data, uninterrupted):
    with pytest.raises(ValueError, match="different run"):
        _train(data, uninterrupted[0], "full", lr=2e-3)


def test_saved_draft_config_and_vllm(data, uninterrupted):
    out, result = uninterrupted
    draft_dir = out / "draft"
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX_IDS
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["speculators_model_type"] == "eagle3"
    assert config["architectures"] == ["Eagle3DraftModel"]
    verifier = config["speculators_config"]["verifier"]
    assert verifier == {"architectures": ["LlamaForCausalLM"],
                        "name_or_path": str(data["verifier"])}
    weights = load_file(str(draft_dir / "model.safetensors"))
    assert torch.equal(weights["d2t"], data["d2t"]) and torch.equal(weights["t2d"], data["t2d"])
    assert "verifier_lm_head.weight" not in weights
    expected = {"architectures": ["Eagle3LlamaForCausalLM"],
                "eagle_aux_hidden_state_layer_ids": AUX_IDS, "draft_vocab_size": DRAFT_VOCAB}
    assert result["vllm"] == expected and result["skipped"] == []
    assert check_vllm_parse(draft_dir, AUX_IDS, DRAFT_VOCAB) == expected
    # What vLLM reads is compared, not only parsed: other ids or another vocabulary size fail.
    with pytest.raises(ValueError, match="vLLM reads .* expected"):
        check_vllm_parse(draft_dir, [a + 1 for a in AUX_IDS], DRAFT_VOCAB)
    with pytest.raises(ValueError, match="vLLM reads .* expected"):
        check_vllm_parse(draft_dir, AUX_IDS, DRAFT_VOCAB * 2)


def test_a_vllm_parse_that_did_not_run_is_listed_as_skipped(data, tmp_path):
    """On a training host without vLLM the draft's parse cannot run: the result (and so the
    train manifest) lists it under ``skipped`` with why, rather than only logging it."""
    paths = {k: [str(p) for p in v] if k == "shards" else str(data[k])
             for k, v in data.items() if k in ("shards", "small", "vocab", "verifier")}
    script = f"""
import json, sys
sys.modules["vllm"] = None  # as where vLLM is not installed: find_spec finds nothing
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_training
result = test_training._train({paths!r}, {str(tmp_path / "absent")!r}, "small", steps=2,
                              check_vllm=None)
print(json.dumps({{"vllm": result["vllm"], "skipped": result["skipped"]}}))
"""
    child = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-3000:]
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    assert seen == {"vllm": None, "skipped": [{"what": "vLLM parse of the saved draft",
                                               "reason": "vLLM is not installed here"}]}
    turned_off = _train(data, tmp_path / "off", "small", steps=2)  # check_vllm=False
    assert turned_off["vllm"] is None
    assert [s["reason"] for s in turned_off["skipped"]] == ["turned off by the caller (check_vllm=False)"]


def test_a_draft_config_vllm_would_read_otherwise_is_refused(uninterrupted, tmp_path):
    draft_dir = tmp_path / "draft"
    shutil.copytree(uninterrupted[0] / "draft", draft_dir)
    config = json.loads((draft_dir / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = list(reversed(AUX_IDS))
    (draft_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'eagle_aux_hidden_state_layer_ids': \[" +
                       ", ".join(str(i) for i in reversed(AUX_IDS))):
        check_vllm_parse(draft_dir, AUX_IDS, DRAFT_VOCAB)
