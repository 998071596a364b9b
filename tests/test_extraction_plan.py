"""Extraction before the engine: the shard plan, generate() batches, the preflight refusals, the
disk estimate and the fingerprint that decides whether a shard on disk may be reused.

All in-process and fast (no vLLM engine): `make mutation` runs these against mutants of
draftline/extract/shards.py, draftline/target.py and the shard part of draftline/formats.py. The stage-level refusal through `python -m stages.extract` is in
tests/test_stages.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from draftline import formats, target
from draftline.extract import shards
from draftline.pipeline import artifacts
from draftline.extract import plan as extract_plan
from draftline.extract import preflight as extract_preflight
from draftline.extract import run as extract_run
from conftest import compose


# --------------------------------------------------------------------------- plans


def test_shards_close_once_they_hold_shard_tokens_and_cover_every_sample_in_order():
    plans = shards.plan_shards([3, 4, 2, 5, 1, 1], shard_tokens=6)
    assert [(p.index, p.sample_ids, p.num_tokens) for p in plans] == [
        (0, (0, 1), 7), (1, (2, 3), 7), (2, (4, 5), 2)]
    assert [p.name for p in plans] == [f"shard-0000{i}.safetensors" for i in range(3)]
    exact = shards.plan_shards([3, 3, 3], shard_tokens=3)  # reaching the size closes it
    assert [p.sample_ids for p in exact] == [(0,), (1,), (2,)]
    assert shards.plan_shards([], shard_tokens=4) == []


def test_the_plan_depends_only_on_lengths_and_size():
    lengths = [int(n) for n in torch.randint(1, 50, (200,), generator=torch.Generator().manual_seed(0))]
    first, again = shards.plan_shards(lengths, 300), shards.plan_shards(list(lengths), 300)
    assert first == again
    assert [i for p in first for i in p.sample_ids] == list(range(200))
    assert sum(p.num_tokens for p in first) == sum(lengths)
    assert all(p.num_tokens >= 300 for p in first[:-1])


def test_batches_stay_within_the_token_budget_unless_one_sample_is_larger():
    lengths = [5, 5, 5, 12, 1, 4]
    assert shards.plan_batches((0, 1, 2, 3, 4, 5), lengths, token_budget=10) == [
        [0, 1], [2], [3], [4, 5]]
    assert shards.plan_batches((2, 4), lengths, token_budget=6) == [[2, 4]]  # 5 + 1 fits exactly
    assert shards.plan_batches((), lengths, token_budget=10) == []


def test_a_batch_that_fills_the_budget_exactly_closes_it():
    assert shards.plan_batches((0, 1, 2, 3), [5, 5, 5, 5], 10) == [[0, 1], [2, 3]]


# --------------------------------------------------------------------------- preflight


def tiny_cfg(model_dir: Path, *overrides: str):
    return compose("tiny", f"model.path={model_dir}", *overrides)


def test_the_target_shape_comes_from_config_json(model_dir, tmp_path):
    assert target.read_target_shape(model_dir) == target.TargetShape(6, 256, "LlamaForCausalLM")
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    (wrapped / "config.json").write_text(json.dumps(
        {"architectures": ["KimiK25ForConditionalGeneration"],
         "text_config": {"num_hidden_layers": 61, "hidden_size": 7168}}))
    assert target.read_target_shape(wrapped) == target.TargetShape(
        61, 7168, "KimiK25ForConditionalGeneration")
    with pytest.raises(FileNotFoundError, match="target model config not found"):
        target.read_target_shape(tmp_path / "missing")


def test_weights_shipped_as_safetensors_and_bin_count_once(tmp_path):
    assert target.weight_bytes(tmp_path / "missing") == 0
    (tmp_path / "pytorch_model.bin").write_bytes(b"x" * 300)
    assert target.weight_bytes(tmp_path) == 300  # .bin alone: what there is
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 50)
    (tmp_path / "config.json").write_text("{}")
    assert target.weight_bytes(tmp_path) == 150  # what vLLM loads, not both copies


def test_a_config_without_architectures_reads_as_unknown(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 8}))
    assert target.read_target_shape(tmp_path).architecture == "unknown"


@pytest.mark.parametrize("ids", [[1, 2, 5], [2, 3, 4], [1]])
def test_aux_ids_between_one_and_the_last_layer_are_accepted(ids):
    target.check_layer_ids(ids, target.TargetShape(6, 8, "x"))


@pytest.mark.parametrize("ids", [[0, 2, 3], [2, 3, 6], [2, 2, 3], [-1, 2, 3]])
def test_aux_ids_outside_the_layers_or_repeated_are_refused(ids):
    with pytest.raises(ValueError, match=r"invalid for a 6-layer target: need distinct ids in \[1, 5\]"):
        target.check_layer_ids(ids, target.TargetShape(6, 8, "x"))


def test_preflight_passes_the_tiny_target(model_dir):
    shape = extract_preflight.preflight(tiny_cfg(model_dir), [10, 500])
    assert (shape.num_layers, shape.hidden_size) == (6, 256)


@pytest.mark.parametrize("overrides, lengths, message", [
    (["model.aux_layer_ids=[2,3,6]"], [10], "aux_layer_ids [2, 3, 6] invalid for a 6-layer target"),
    (["model.num_layers=7"], [10], "is a 6-layer x 256 target (LlamaForCausalLM, its config.json); conf/model/tiny-llama.yaml says 7 x 256"),
    (["model.hidden_size=128"], [10], "says 6 x 128"),
    (["extract.max_model_len=64"], [10, 64], "longest sample has 64 tokens; extract.max_model_len=64"),
    (["model.tensor_parallel_size=100000"], [10], "TP 100000 > CPU cores"),
    (["extract.save_dtype=float8"], [10], "extract.save_dtype='float8': expected one of"),
])
def test_preflight_refuses_before_any_model_load(model_dir, overrides, lengths, message):
    """preflight reads config.json only; each refusal names the mismatch."""
    with pytest.raises(ValueError, match=re.escape(message)):
        extract_preflight.preflight(tiny_cfg(model_dir, *overrides), lengths)


def test_the_shard_buffers_must_fit_in_available_memory(model_dir, tmp_path):
    """Rank 0's two shard buffers (pinned on CUDA) per engine, against MemAvailable; the
    refusal names the key that shrinks them. Kimi-K2.5's widths: a 65,536-token bf16 shard
    is 3.76 GB, a buffer holds max_model_len more tokens."""
    kimi = compose("kimi-k2.5", "extract.save_dtype=bfloat16")
    assert extract_preflight.buffer_bytes(kimi, 7168) == 2 * (65536 + 8192) * 4 * 7168 * 2
    assert extract_preflight.buffer_bytes(compose("kimi-k2.5"), 7168) == 2 * (65536 + 8192) * 4 * (7168 + 4)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   16000000 kB\n")
    assert extract_preflight.check_host_memory(kimi, 7168, 1, meminfo) < 16000000 * 1024
    with pytest.raises(ValueError, match=re.escape(
            "need 15.8 GiB of host memory (2 engines x 2 buffers of extract.shard_tokens=65536 + "
            "extract.max_model_len=8192 tokens, bfloat16), 15.3 GiB is available: lower "
            "extract.shard_tokens")):
        extract_preflight.check_host_memory(kimi, 7168, 2, meminfo)
    with pytest.raises(ValueError, match="lower extract.shard_tokens"):  # through the preflight
        extract_preflight.preflight(tiny_cfg(model_dir, "extract.shard_tokens=100000000"), [10])
    extract_preflight.preflight(tiny_cfg(model_dir, "extract.shard_tokens=100000000",
                                         "extract.writer=driver"), [10])  # no buffers there


def test_a_sample_one_token_shorter_than_max_model_len_fits(model_dir):
    extract_preflight.preflight(tiny_cfg(model_dir, "extract.max_model_len=64"), [63])


def test_bytes_per_token_and_the_disk_check(tmp_path):
    assert shards.bytes_per_token(4, 256, "bfloat16") == 4 * 256 * 2 + 9
    assert shards.bytes_per_token(4, 7168, "float32") == 4 * 7168 * 4 + 9
    assert shards.bytes_per_token(4, 7168, "float8_e4m3fn") == 4 * (7168 + 4) + 9  # + scales
    assert shards.check_disk(tmp_path / "out", 1000, 100, 1.5) == 150_000
    assert (tmp_path / "out").is_dir()
    with pytest.raises(RuntimeError, match=r"GiB free, extraction needs about .* \(1000000000000000 tokens x 2057 B x 1.1\)"):
        shards.check_disk(tmp_path / "out", 10**15, 2057, 1.1)


@pytest.mark.parametrize("hidden, bar", [(4096, 0.51), (7168, 0.51), (128, 0.53)])
def test_fp8_halves_the_bytes_per_token_scales_ids_and_masks_included(hidden, bar):
    """Issue 24's bar at Llama-8B, Kimi-K2.5 and the embedded run's widths (4 slots)."""
    fp8, bf16 = (shards.bytes_per_token(4, hidden, d) for d in ("float8_e4m3fn", "bfloat16"))
    assert 0.5 < fp8 / bf16 <= bar


def test_the_disk_check_names_free_and_needed_space_and_makes_nested_dirs(tmp_path, monkeypatch):
    out = tmp_path / "a" / "b" / "extract"
    free = 3 * 2**30
    monkeypatch.setattr(shards.shutil, "disk_usage", lambda path: type("U", (), {"free": free})())
    assert shards.check_disk(out, 3 * 2**20, 2**10, 1.0) == free  # exactly what is free: fits
    assert out.is_dir()
    with pytest.raises(RuntimeError, match=re.escape(
            f"{out}: 3.0 GiB free, extraction needs about 4.5 GiB (3145728 tokens x 1024 B x 1.5)")):
        shards.check_disk(out, 3 * 2**20, 2**10, 1.5)


# --------------------------------------------------------------------------- reuse of shards


def write_planned_shard(path: Path, plan: shards.ShardPlan, fingerprint: str) -> None:
    results = {i: {"hidden_states": [torch.full((2, 4), float(i))] * 2, "input_ids": torch.arange(2)}
               for i in plan.sample_ids}
    tensors = formats.pack_shard(plan.sample_ids, results, {i: [0, 1] for i in plan.sample_ids},
                                 "float32")
    formats.write_shard(path, tensors, {formats.FINGERPRINT: fingerprint})


def test_a_shard_is_reused_only_with_the_same_fingerprint_and_samples(tmp_path):
    plan = shards.ShardPlan(0, (3, 4), 4)
    path = tmp_path / plan.name
    assert not shards.shard_is_complete(path, plan, "abc")
    write_planned_shard(path, plan, "abc")
    assert shards.shard_is_complete(path, plan, "abc")
    assert not shards.shard_is_complete(path, plan, "abd")
    assert not shards.shard_is_complete(path, shards.ShardPlan(0, (3, 5), 4), "abc")


def test_a_shard_without_draftline_metadata_is_not_reused(tmp_path):
    from safetensors.torch import save_file

    plan = shards.ShardPlan(0, (3,), 2)
    save_file({formats.SAMPLE_IDS: torch.tensor([3])}, str(tmp_path / plan.name))
    assert not shards.shard_is_complete(tmp_path / plan.name, plan, "abc")


def test_packed_shards_keep_plan_order_offsets_and_dtype(tmp_path):
    plan = shards.ShardPlan(0, (7, 2), 5)
    results = {7: {"hidden_states": [torch.ones(3, 4), torch.zeros(3, 4)], "input_ids": torch.arange(3)},
               2: {"hidden_states": [torch.full((2, 4), 2.0)] * 2, "input_ids": torch.arange(10, 12)}}
    tensors = formats.pack_shard(plan.sample_ids, results, {7: [0, 1, 1], 2: [1, 0]}, "bfloat16")
    hidden = tensors[formats.HIDDEN_STATES]
    assert hidden.shape == (5, 2, 4) and hidden.dtype == torch.bfloat16
    assert hidden[:3, 0].eq(1).all() and hidden[:3, 1].eq(0).all()
    assert tensors[formats.INPUT_IDS].tolist() == [0, 1, 2, 10, 11]
    mask = tensors[formats.LOSS_MASK]
    assert mask.tolist() == [0, 1, 1, 1, 0] and mask.dtype == torch.uint8
    assert tensors[formats.SAMPLE_OFFSETS].tolist() == [0, 3, 5]
    assert tensors[formats.SAMPLE_IDS].tolist() == [7, 2]


def _float_results(lengths: dict[int, int], slots: int = 2, width: int = 8) -> dict[int, dict]:
    generator = torch.Generator().manual_seed(5)
    return {i: {"hidden_states": [torch.randn(n, width, generator=generator) * (s + 1)
                                  for s in range(slots)], "input_ids": torch.arange(n)}
            for i, n in lengths.items()}


def test_an_fp8_shard_holds_e4m3_values_and_a_float32_scale_per_token_and_slot(tmp_path):
    results = _float_results({4: 3, 9: 2})
    tensors = formats.pack_shard((4, 9), results, {4: [1, 1, 1], 9: [0, 1]}, "float8_e4m3fn")
    hidden, scales = tensors[formats.HIDDEN_STATES], tensors[formats.HIDDEN_SCALES]
    assert hidden.dtype == torch.float8_e4m3fn and hidden.shape == (5, 2, 8)
    assert scales.dtype == torch.float32 and scales.shape == (5, 2)
    exact = torch.cat([torch.stack(results[i]["hidden_states"], 1) for i in (4, 9)])  # [5, 2, 8]
    assert torch.equal(scales, exact.abs().amax(-1) / 448)
    assert ((formats.dequantize(hidden, scales) - exact).abs() <= scales[..., None] * 16).all()
    # A generator that quantized in its worker hands over values and scales: kept as they are.
    given = {i: {**r, "hidden_states": [h for h in torch.stack(r["hidden_states"], 1)
                                        .to(torch.float8_e4m3fn).unbind(1)],
                 "hidden_states_scales": [torch.full((len(r["input_ids"]),), 0.5)] * 2}
             for i, r in results.items()}
    kept = formats.pack_shard((4, 9), given, {4: [1, 1, 1], 9: [0, 1]}, "float8_e4m3fn")
    assert kept[formats.HIDDEN_SCALES].eq(0.5).all()
    formats.write_shard(tmp_path / "s.safetensors", tensors, {formats.FINGERPRINT: "f"})
    rows = formats.read_shard_rows(tmp_path / "s.safetensors", [1], [formats.HIDDEN_STATES])
    assert torch.equal(rows[0][formats.HIDDEN_STATES], formats.dequantize(hidden, scales)[3:])
    with pytest.raises(ValueError, match="fp8 scales, save_dtype is bfloat16"):
        formats.pack_shard((4, 9), given, {4: [1, 1, 1], 9: [0, 1]}, "bfloat16")


@pytest.mark.parametrize("save_dtype", ["float8_e4m3fn", "bfloat16"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_state_is_refused_naming_shard_sample_slot_and_token(save_dtype, value):
    results = _float_results({4: 3, 9: 5})
    results[9]["hidden_states"][1][2, 6] = value  # sample 9, slot 1, token 2
    with pytest.raises(formats.NonFiniteHiddenStates, match=re.escape(
            "shard-00003.safetensors: sample 9, slot 1, token 2: hidden state")) as failure:
        formats.pack_shard((4, 9), results, {4: [1] * 3, 9: [1] * 5}, save_dtype,
                           name="shard-00003.safetensors")
    assert (failure.value.sample_id, failure.value.slot, failure.value.token) == (9, 1, 2)


def test_packed_input_ids_are_int64_whatever_the_engine_returns():
    plan = shards.ShardPlan(0, (1,), 2)
    results = {1: {"hidden_states": [torch.zeros(2, 4)] * 2, "input_ids": torch.tensor([4, 5], dtype=torch.int32)}}
    packed = formats.pack_shard(plan.sample_ids, results, {1: [0, 1]}, "float32")
    assert packed[formats.INPUT_IDS].dtype == torch.int64


def test_the_file_keys_are_the_ones_runs_on_disk_hold():
    """Spelled out once here on purpose: a renamed key would leave every shard, index and
    vocab mapping already written unreadable."""
    assert (formats.INPUT_IDS, formats.LOSS_MASK, formats.SAMPLE_OFFSETS) == (
        "input_ids", "loss_mask", "sample_offsets")
    assert formats.SHARD_KEYS == (
        "hidden_states", "input_ids", "loss_mask", "sample_offsets", "sample_ids")
    assert formats.HIDDEN_SCALES == "hidden_state_scales"
    assert (formats.SHARD_METADATA, formats.FINGERPRINT) == ("draftline", "fingerprint")
    assert formats.SPLITS == ("train", "validation")
    assert (formats.D2T, formats.T2D, formats.TOKEN_FREQ) == ("d2t", "t2d", "token_freq")


def test_identical_shards_are_byte_identical_files(tmp_path):
    plan = shards.ShardPlan(0, (1, 2), 4)
    write_planned_shard(tmp_path / "a.safetensors", plan, "f")
    write_planned_shard(tmp_path / "b.safetensors", plan, "f")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_shard_metadata_bytes_do_not_depend_on_key_order(tmp_path):
    tensors = {"x": torch.arange(3)}
    formats.write_shard(tmp_path / "a.safetensors", tensors, {formats.FINGERPRINT: "f", "aux": [1, 2]})
    formats.write_shard(tmp_path / "b.safetensors", tensors, {"aux": [1, 2], formats.FINGERPRINT: "f"})
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


@pytest.mark.parametrize("change", ["extract.save_dtype=float32", "extract.save_dtype=float8_e4m3fn",
                                    "model.aux_layer_ids=[1,2,3]",
                                    "extract.max_model_len=2048", "model.dtype=bfloat16",
                                    "extract.max_num_batched_tokens=1024"])
def test_an_extract_config_change_invalidates_every_shard(model_dir, tmp_path, change):
    """A change of a model or extract key that shapes the tensors changes the fingerprint, so
    no shard made with the old config is reused (`make` reruns extract for the same reason)."""
    samples = tmp_path / "samples.safetensors"
    samples.write_bytes(b"samples")
    run = f"run_dir={tmp_path}"
    before = extract_plan.shard_fingerprint(tiny_cfg(model_dir, run), samples)
    assert before == extract_plan.shard_fingerprint(tiny_cfg(model_dir, run), samples)
    after = extract_plan.shard_fingerprint(tiny_cfg(model_dir, run, change), samples)
    assert after != before
    plan = shards.ShardPlan(0, (0,), 2)
    write_planned_shard(tmp_path / plan.name, plan, before)
    assert not shards.shard_is_complete(tmp_path / plan.name, plan, after)


def test_other_samples_or_another_target_invalidate_the_shards(model_dir, tmp_path):
    samples = tmp_path / "samples.safetensors"
    samples.write_bytes(b"samples")
    cfg = tiny_cfg(model_dir, f"run_dir={tmp_path}")
    base = extract_plan.shard_fingerprint(cfg, samples)
    samples.write_bytes(b"samplez")
    assert extract_plan.shard_fingerprint(cfg, samples) != base
    samples.write_bytes(b"samples")
    other = shutil.copytree(model_dir, tmp_path / "other-target")
    weights = other / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight: same size, same names
    weights.write_bytes(bytes(data))
    assert extract_plan.shard_fingerprint(tiny_cfg(other, f"run_dir={tmp_path}"), samples) != base


def test_the_same_inputs_in_two_run_dirs_give_one_fingerprint_and_identical_shards(model_dir, tmp_path):
    """Nothing about where a run lives or when its target was written enters a shard: the
    target copied elsewhere (new path, new mtimes, a download cache and a build record beside
    it) and another run dir give the same fingerprint, so the stage writes the same bytes
    (the host and the image, a run and its `make reproduce` replay); a key that does not
    shape the tensors (the disk headroom) leaves it alone."""
    samples = tmp_path / "samples.safetensors"
    samples.write_bytes(b"samples")
    first = extract_plan.shard_fingerprint(tiny_cfg(model_dir, f"run_dir={tmp_path / 'a'}"), samples)
    copy = shutil.copytree(model_dir, tmp_path / "elsewhere" / "target", copy_function=shutil.copy)
    os.utime(copy / "config.json", ns=(1, 1))
    (copy / ".cache").mkdir()
    (copy / ".cache" / "download.metadata").write_text("etag, fetched at 12:00")
    (copy / "build.json").write_text('{"seconds": 189.1}')
    elsewhere = tiny_cfg(copy, f"run_dir={tmp_path / 'elsewhere' / 'b'}", "extract.disk_headroom=2")
    second = extract_plan.shard_fingerprint(elsewhere, samples)
    assert second == first
    plan = shards.ShardPlan(0, (1, 2), 4)
    for run in ("a", "elsewhere/b"):
        write_planned_shard(tmp_path / run / plan.name, plan, first if run == "a" else second)
    assert (tmp_path / "a" / plan.name).read_bytes() == (tmp_path / "elsewhere/b" / plan.name).read_bytes()
    # The per-file hashes are cached by path, size and mtime, and only content reaches the digest.
    cache = tmp_path / "elsewhere" / "b" / "extract" / extract_plan.TARGET_DIGEST_CACHE
    assert sorted(Path(p).name for p in artifacts.read_json(cache)) == sorted(
        p.name for p in model_dir.iterdir() if p.name != "build.json")
    assert extract_plan.shard_fingerprint(elsewhere, samples) == first


def test_the_target_digest_reads_a_file_again_once_its_size_or_mtime_moves(model_dir, tmp_path):
    copy = shutil.copytree(model_dir, tmp_path / "target")
    cache = tmp_path / "cache.json"
    base = target.target_digest(copy, cache)
    weights = copy / "model.safetensors"
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert target.target_digest(copy, cache) != base
    with pytest.raises(FileNotFoundError, match="target model directory not found"):
        target.target_digest(tmp_path / "missing", cache)


def test_the_target_digest_is_pinned_and_an_unchanged_file_is_not_read_again(tmp_path):
    """The digest is sha256 over 'relative name NUL file sha256' per file in name order;
    the cache answers for a file whose size and mtime it recorded, even across calls (shown
    by content changed behind its back with size and mtime put back)."""
    root = tmp_path / "target"
    (root / "sub").mkdir(parents=True)
    files = {"config.json": b"{}", "sub/w.bin": b"weights"}
    for name, data in files.items():
        (root / name).write_bytes(data)
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).hexdigest().encode())
    cache = tmp_path / "cache.json"
    assert target.target_digest(root, cache) == digest.hexdigest()
    recorded = artifacts.read_json(cache)
    weights = root / "sub/w.bin"
    assert recorded[str(weights.resolve())] == [
        [len(b"weights"), weights.stat().st_mtime_ns], hashlib.sha256(b"weights").hexdigest()]
    stat = weights.stat()
    weights.write_bytes(b"WEIGHTS")
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert target.target_digest(root, cache) == digest.hexdigest()  # twice: the cache is kept
    assert target.target_digest(root, cache) == digest.hexdigest()


# --------------------------------------------------------------------------- replicas and slices


def test_parts_take_every_nth_shard_and_together_cover_the_plan_once():
    plans = shards.plan_shards([3] * 10, shard_tokens=3)
    parts = [shards.Part.parse(f"{i}/3", "extract.shard") for i in range(3)]
    taken = [[p.index for p in part.take(plans)] for part in parts]
    assert taken == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert str(parts[1]) == "1/3"
    assert shards.Part.parse(" 2 / 5 ", "x") == shards.Part(2, 5)
    # A replica of a slice takes every N-th shard of the slice: slice 1/2, replica 1/2.
    inner = shards.Part(1, 2).take(shards.Part(1, 2).take(plans))
    assert [p.index for p in inner] == [3, 7]


@pytest.mark.parametrize("text", ["3/3", "1", "-1/3", "1/0", "a/b", "0/3/1", ""])
def test_a_part_outside_zero_to_n_is_refused(text):
    with pytest.raises(ValueError, match=re.escape(f"extract.shard={text!r}: expected i/N")):
        shards.Part.parse(text, "extract.shard")


@pytest.mark.parametrize("launch_key", ["extract.replicas=4", "extract.shard=1/3"])
def test_replicas_and_slices_leave_the_fingerprint_alone(model_dir, tmp_path, launch_key):
    """Which process makes a shard is not part of what the shard is made from."""
    samples = tmp_path / "samples.safetensors"
    samples.write_bytes(b"samples")
    run = f"run_dir={tmp_path}"
    one = extract_plan.shard_fingerprint(tiny_cfg(model_dir, run), samples)
    assert extract_plan.shard_fingerprint(tiny_cfg(model_dir, run, launch_key), samples) == one


def test_replicas_get_disjoint_gpus_or_cpu_cores():
    from draftline.pipeline import launch

    assert launch.split_devices([str(i) for i in range(8)], 4, 2) == ["0,1", "2,3", "4,5", "6,7"]
    assert launch.split_devices(["3", "5", "7"], 3, 1) == ["3", "5", "7"]
    with pytest.raises(ValueError, match=r"3 replicas x 2 GPUs need 6 GPUs; 4 visible \(0,1,2,3\)"):
        launch.split_devices(["0", "1", "2", "3"], 3, 2)
    assert launch.split_cores([0, 1], 2, 1) == ["0", "1"]
    assert launch.split_cores(list(range(9)), 2, 2) == ["0,1|2,3", "4,5|6,7"]
    with pytest.raises(ValueError, match="3 replicas x TP 1 need 3 CPU cores; 2 usable"):
        launch.split_cores([0, 1], 3, 1)


def sliced_run(tmp_path: Path, model_dir: Path, lengths: list[int]):
    """A run dir as regenerate leaves it (samples, manifest) and the composed config."""
    regenerate_dir = tmp_path / "run" / "regenerate"
    ids = [[7 + (i + j) % 100 for j in range(n)] for i, n in enumerate(lengths)]
    formats.write_samples(regenerate_dir / "samples.safetensors", ids, [[1] * n for n in lengths])
    artifacts.write_manifest(regenerate_dir, {"replies": "data"}, samples="samples.safetensors")
    cfg = tiny_cfg(model_dir, f"run_dir={tmp_path / 'run'}", "extract.shard_tokens=10")
    fingerprint = extract_plan.shard_fingerprint(cfg, regenerate_dir / "samples.safetensors")
    return cfg, shards.plan_shards(lengths, 10), fingerprint


def test_finalize_names_the_missing_shards_and_the_commands_then_writes_the_manifest(model_dir, tmp_path):
    """A plain run in a sliced run dir never starts an engine: with shards of slice 1/3
    missing (one absent, one made from another config) it fails naming them and the make
    command; once they are there it returns the manifest's fields, shard for shard."""
    cfg, plans, fingerprint = sliced_run(tmp_path, model_dir, [10] * 7)
    out_dir = tmp_path / "run" / "extract"
    shards.write_slices_record(out_dir, 3)
    for plan in plans:
        if plan.index != 1:
            write_planned_shard(out_dir / plan.name, plan, fingerprint if plan.index != 4 else "old")
    overrides = ["experiment=tiny", f"run_dir={tmp_path / 'run'}", "extract.shard_tokens=10"]
    with pytest.raises(RuntimeError) as failure:
        extract_run.run(cfg, overrides)
    message = str(failure.value)
    assert "2 of 7 planned shards are missing" in message, message
    assert "shard-00001.safetensors (slice 1/3)" in message and "shard-00004.safetensors (slice 1/3)" in message
    assert "shard-00002" not in message
    assert f"make extract EXP=tiny SHARD=1/3 OVERRIDES='run_dir={tmp_path / 'run'} extract.shard_tokens=10'" in message
    assert "SHARD=0/3" not in message and "SHARD=2/3" not in message
    assert not (out_dir / "manifest.json").exists()

    for index in (1, 4):
        write_planned_shard(out_dir / plans[index].name, plans[index], fingerprint)
    fields = extract_run.run(cfg, overrides)
    assert [r["file"] for r in fields["shards"]] == [p.name for p in plans]
    assert fields["resumed_shards"] == 7 and fields["num_tokens"] == 70
    assert fields["shards"][4]["sha256"] == artifacts.sha256_file(out_dir / plans[4].name)


def test_the_finalize_error_is_exact_and_lists_at_most_listed_shards(tmp_path):
    """Every line of the message, for exactly LISTED missing shards (all named) and for two
    more (LISTED named, then the count of the rest)."""
    plans = shards.plan_shards([1] * (shards.LISTED + 2), 1)
    out_dir = tmp_path / "extract"
    record = out_dir / shards.SLICES_RECORD

    def expected(missing, more):
        return "\n".join([
            f"{out_dir} is extracted in 2 slices ({record}) and {len(missing)} of {len(plans)} planned "
            "shards are missing or were made from other inputs or config:",
            *[f"  {p.name} (slice {p.index % 2}/2)" for p in missing[:shards.LISTED]],
            *([f"  ... and {more} more"] if more else []),
            "Fill them (each command resumes its slice), then run `make extract` again:",
            "  make extract EXP=tiny SHARD=0/2",
            "  make extract EXP=tiny SHARD=1/2",
            f"(To extract them all on this host instead, delete {record}.)"])

    exact = plans[:shards.LISTED]
    assert shards.finalize_error(exact, len(plans), 2, out_dir, ["experiment=tiny"]) == expected(exact, 0)
    assert shards.finalize_error(plans, len(plans), 2, out_dir, ["experiment=tiny"]) == expected(plans, 2)


def test_fill_commands_without_an_experiment_are_the_python_form():
    assert shards.fill_commands([0, 2], 4, ["run_dir=/x y", "extract.shard=9/9"]) == [
        "python -m stages.extract 'run_dir=/x y' extract.shard=0/4",
        "python -m stages.extract 'run_dir=/x y' extract.shard=2/4"]
    assert shards.fill_commands([1], 2, ["experiment=tiny"]) == ["make extract EXP=tiny SHARD=1/2"]


def test_an_experiment_value_is_taken_whole_after_its_first_equals_sign():
    assert shards.fill_commands([0], 2, ["experiment=a=b"]) == ["make extract EXP=a=b SHARD=0/2"]


def test_no_slices_record_reads_as_a_one_host_run(tmp_path):
    assert shards.read_slices_record(tmp_path) is None
    shards.write_slices_record(tmp_path, 3)
    assert shards.read_slices_record(tmp_path) == 3


def test_shard_records_name_samples_tokens_bytes_sha_and_recorded_seconds(tmp_path):
    plans = shards.plan_shards([3, 4, 5], 7)
    for plan in plans:
        (tmp_path / plan.name).write_bytes(plan.name.encode() * (plan.index + 1))
    # make reproduce leaves files with this suffix out of the outputs it compares
    assert shards.timing_path(tmp_path / plans[0].name) == tmp_path / "shard-00000.timing.json"
    artifacts.write_json(shards.timing_path(tmp_path / plans[0].name), {"seconds": 1.5})
    records = shards.shard_records(plans, tmp_path)
    assert records == [
        {"file": p.name, "samples": len(p.sample_ids), "tokens": p.num_tokens,
         "bytes": len(p.name) * (p.index + 1), "sha256": artifacts.sha256_file(tmp_path / p.name),
         **({"seconds": 1.5} if p.index == 0 else {})}
        for p in plans]
    assert [(r["samples"], r["tokens"]) for r in records] == [(2, 7), (1, 5)]


def test_a_stopped_writers_temp_files_of_pending_shards_go_and_no_others(tmp_path):
    """A kill -9 mid-write leaves `.shard-NNNNN.safetensors.<random>.tmp` (atomic_path), up to
    a shard's size each; the next run removes those of the shards it is about to make only
    (another host's slice may be writing its own)."""
    from draftline.pipeline.artifacts import atomic_path

    plans = shards.plan_shards([10] * 4, 10)
    for plan in plans:
        with pytest.raises(KeyboardInterrupt), atomic_path(tmp_path / plan.name) as tmp:
            tmp.write_bytes(b"partial")
            (tmp_path / f"{tmp.name}.kept").write_bytes(tmp.read_bytes())  # what a kill leaves
            raise KeyboardInterrupt
    for kept in tmp_path.glob("*.kept"):
        kept.rename(tmp_path / kept.name.removesuffix(".kept"))
    assert shards.remove_partial_writes(tmp_path, plans[1:3]) == 2
    assert sorted(p.name.split(".")[1] for p in tmp_path.glob(".*.tmp")) == ["shard-00000", "shard-00003"]


def test_the_time_split_counts_serial_writes_and_waits_as_capture():
    from draftline.extract import writer

    beside = writer.TimeSplit(forward=90.0, waiting=1.0, writing=50.0)
    assert beside.capture_share() == pytest.approx(1 / 91) and not beside.record("rank0")["capture_bound"]
    assert beside.line() == "forward 90 s, waiting 1 s, writing 50 s (beside)"
    serial = writer.TimeSplit(forward=90.0, waiting=0.0, writing=50.0, serial=True)
    assert serial.capture_share() == pytest.approx(50 / 140) and serial.record("driver")["capture_bound"]
    assert serial.line().endswith("(in between); capture-bound")
