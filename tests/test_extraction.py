"""The patched speculators generator on the real vLLM CPU engine, checked against HF.

Convention under test (patches/speculators/0002): for aux id i the captured row is the input of decoder
layer i, which is transformers' ``hidden_states[i]``; the last slot is the final hidden state
after the final norm, which is transformers' ``hidden_states[num_layers]``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import environment
from draftline.tiny import builders, kimi_k25
from draftline.tiny import reference as tiny_reference

pytestmark = pytest.mark.vllm

NUM_LLAMA_LAYERS = 6
LLAMA_AUX_IDS = [2, 3, 4]  # vLLM's default (2, n//2, n-3) for n = 6
NUM_DSV3_LAYERS = 4
DSV3_AUX_IDS = [1, 2, 3]  # layer 0 is dense, 1..3 are MoE
# vLLM 0.16's Kimi-K2.5 has a single modality, "vision_chunk" (image and video limits do not
# apply to it): zero runs it text-only, with no vision tower and no multimodal profiling.
KIMI_TEXT_ONLY = {"vision_chunk": 0}
# Six prompts for three sequence slots and a 64-token budget: queueing and chunked prefill.
PROMPT_LENGTHS = (191, 7, 40, 130, 64, 1)
MAX_NUM_SEQS = 3
TOKEN_BUDGET = 64


@pytest.fixture(scope="module")
def cpu_engine_env():
    """Small KV cache for the CPU engine (GiB); DeepseekV3 needs MLA off on CPU."""
    with environment({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_MLA_DISABLE": "1"}):
        yield


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [
        torch.randint(7, vocab_size, (n,), generator=generator).tolist()
        for n in PROMPT_LENGTHS
    ]


def _make_generator(model_dir, layer_ids, dtype="float32", **kwargs):
    """float32 by default: compared with HF in float32 ("auto" would downcast to bf16)."""
    from speculators.data_generation import VllmHiddenStatesGenerator

    return VllmHiddenStatesGenerator(
        str(model_dir),
        layer_ids=layer_ids,
        max_model_len=512,
        dtype=dtype,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=TOKEN_BUDGET,
        **kwargs,
    )


def _built_engine(tmp_path_factory, name, builder, num_layers, aux_ids):
    """Build a tiny target and start the generator on it; shut it down after the module."""
    model_dir = builder(tmp_path_factory.mktemp(name) / "model", num_layers=num_layers)
    generator = _make_generator(model_dir, aux_ids)
    yield model_dir, generator
    generator.shutdown()


@pytest.fixture(scope="module")
def llama(tmp_path_factory, cpu_engine_env):
    yield from _built_engine(tmp_path_factory, "llama", builders.build_tiny_llama,
                             NUM_LLAMA_LAYERS, LLAMA_AUX_IDS)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, cpu_engine_env):
    yield from _built_engine(tmp_path_factory, "dsv3", builders.build_tiny_deepseek_v3,
                             NUM_DSV3_LAYERS, DSV3_AUX_IDS)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory, cpu_engine_env):
    """The tiny Kimi-K2.5 wrapper, text-only (patches/speculators/0005's limit_mm_per_prompt)."""
    model_dir = kimi_k25.build_tiny_kimi_k25(tmp_path_factory.mktemp("kimi") / "model",
                                         num_layers=NUM_DSV3_LAYERS)
    # The generator reads kimi_k25 with vLLM's config parser (patches/speculators/0005): no remote code.
    generator = _make_generator(model_dir, DSV3_AUX_IDS, limit_mm_per_prompt=KIMI_TEXT_ONLY)
    yield model_dir, generator
    generator.shutdown()


def _slot_differences(model_dir, aux_ids, num_layers, prompts, results):
    """Max abs difference per slot (aux ids..., final) over all prompts."""
    worst = [0.0] * (len(aux_ids) + 1)
    for prompt, result in zip(prompts, results):
        reference = tiny_reference.hf_hidden_states(model_dir, prompt)
        expected = [reference[i] for i in aux_ids] + [reference[num_layers]]
        for slot, (got, want) in enumerate(zip(result["hidden_states"], expected)):
            assert got.shape == want.shape, (slot, got.shape, want.shape)
            worst[slot] = max(worst[slot], (got.float() - want).abs().max().item())
    return worst


def _report(capsys, family, aux_ids, worst):
    names = [f"input of layer {i}" for i in aux_ids] + ["final (post-norm)"]
    with capsys.disabled():
        print(f"\n[{family}] max |vLLM - HF| per slot, float32:")
        for name, value in zip(names, worst):
            print(f"  {name:>20}: {value:.3e}")


def test_llama_slots_match_hf(llama, capsys):
    model_dir, generator = llama
    prompts = _prompts(512)
    results = generator.generate(prompts)

    assert [r["input_ids"].tolist() for r in results] == prompts  # input order kept
    for prompt, result in zip(prompts, results):
        assert all(h.shape[0] == len(prompt) for h in result["hidden_states"])
    worst = _slot_differences(model_dir, LLAMA_AUX_IDS, NUM_LLAMA_LAYERS, prompts, results)
    _report(capsys, "llama", LLAMA_AUX_IDS, worst)
    assert max(worst) < 1e-4, worst


def test_llama_output_of_layer_is_not_what_we_capture(llama):
    """Guards the convention: the aux slot must differ from the output of the same layer."""
    model_dir, generator = llama
    prompt = _prompts(512)[2]
    result = generator.generate([prompt])[0]
    reference = tiny_reference.hf_hidden_states(model_dir, prompt)
    for slot, layer_id in enumerate(LLAMA_AUX_IDS):
        off_by_one = (result["hidden_states"][slot] - reference[layer_id + 1]).abs().max()
        assert off_by_one > 1e-2, (layer_id, off_by_one)


def test_batch_matches_single_with_chunked_prefill(llama):
    _, generator = llama
    prompts = _prompts(512)
    batch = generator.generate(prompts)
    for index in (0, 3, 5):  # 191 tokens (three chunks), 130 tokens, 1 token
        single = generator.generate([prompts[index]])[0]
        for got, want in zip(batch[index]["hidden_states"], single["hidden_states"]):
            assert got.shape == want.shape
            assert (got - want).abs().max().item() < 1e-5


def test_worker_error_reaches_driver_with_traceback(llama):
    _, generator = llama
    out_of_vocab = 10_000  # the tiny vocabulary has 512 ids: the embedding lookup fails
    with pytest.raises(RuntimeError) as failure:
        generator.generate([[5, 6, 7], [5, out_of_vocab, 3]])
    message = str(failure.value)
    assert "IndexError" in message
    assert "Traceback (most recent call last)" in message
    assert "embed_input_ids" in message  # a frame from inside the worker's forward pass
    # The failed batch was dropped; the engine keeps working.
    assert generator.generate([[5, 6, 7, 8]])[0]["hidden_states"][0].shape[0] == 4


def test_overlong_prompt_is_refused_not_truncated(llama):
    _, generator = llama
    with pytest.raises(ValueError, match="longer than 511 tokens"):
        generator.generate([[5] * 512])


@pytest.fixture(scope="module")
def llama_fp8(llama):
    """A second engine on the llama target whose worker quantizes to fp8 (patches/0006)."""
    model_dir, _ = llama
    generator = _make_generator(model_dir, LLAMA_AUX_IDS, hidden_states_dtype="float8_e4m3fn")
    yield model_dir, generator
    generator.shutdown()


def test_fp8_capture_is_the_quantized_float32_capture(llama, llama_fp8, capsys):
    """The worker hands over fp8 values and float32 scales (so the RPC carries one byte per
    value), byte for byte what draftline.formats quantizes from the float32 capture, and
    they dequantize to HF's hidden states within e4m3's rounding (3 mantissa bits)."""
    from draftline import formats

    model_dir, exact = llama
    _, fp8 = llama_fp8
    prompts = _prompts(512)
    for want, got in zip(exact.generate(prompts), fp8.generate(prompts), strict=True):
        assert all(h.dtype == torch.float8_e4m3fn for h in got["hidden_states"])
        assert all(s.dtype == torch.float32 and s.shape == (len(got["input_ids"]),)
                   for s in got["hidden_states_scales"])
        values, scales = formats.quantize_fp8(torch.stack(want["hidden_states"], dim=1))
        assert torch.equal(torch.stack(got["hidden_states"], dim=1).view(torch.uint8),
                           values.view(torch.uint8))
        assert torch.equal(torch.stack(got["hidden_states_scales"], dim=1), scales)
    results = fp8.generate(prompts)
    dequantized = [{"hidden_states": [formats.dequantize(h, s) for h, s in
                                      zip(r["hidden_states"], r["hidden_states_scales"])]}
                   for r in results]
    worst = _slot_differences(model_dir, LLAMA_AUX_IDS, NUM_LLAMA_LAYERS, prompts, dequantized)
    _report(capsys, "llama, fp8 in the worker", LLAMA_AUX_IDS, worst)
    reference = tiny_reference.hf_hidden_states(model_dir, prompts[0])
    largest = max(reference[i].abs().max().item() for i in [*LLAMA_AUX_IDS, NUM_LLAMA_LAYERS])
    assert max(worst) <= largest / 16, (worst, largest)  # half an e4m3 step at the row's amax


def test_generate_refuses_offsets_that_do_not_match_its_prompts():
    """Unchecked input 7: generate(offsets=) with another count of offsets than prompts used
    to place what zip() kept; now it refuses before any request reaches the engine."""
    import types

    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    stand_in = types.SimpleNamespace(_check_lengths=lambda ids: None)  # no engine is reached
    with pytest.raises(ValueError, match="2 offsets for 1 prompts"):
        VllmHiddenStatesGenerator.generate(stand_in, [[1, 2, 3]], offsets=[0, 3])


def test_worker_and_formats_quantize_to_the_same_bytes():
    """The worker quantizes with draftline.formats' quantize_fp8 (one formula since issue 44):
    its bytes on rows of every kind, across the row-chunk boundary, with non-finite rows
    marked by a non-finite scale."""
    from speculators.data_generation import custom_worker

    from draftline import formats

    assert custom_worker._quantize_fp8 is formats.quantize_fp8

    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(formats.QUANTIZE_ROWS + 5, 3, 96, generator=generator)
    rows[0] = 0.0  # an all-zero row: scale 1
    rows[1] *= 1e4
    rows[2] *= 1e-6
    rows[3, 0, 7], rows[3, 1, 0], rows[3, 2, 5] = float("nan"), float("inf"), -float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        got, want = custom_worker._quantize_fp8(rows.to(dtype)), formats.quantize_fp8(rows.to(dtype))
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))  # NaN too
        assert torch.equal(got[1][0], torch.ones(3))
        assert not torch.isfinite(got[1][3]).any() and torch.isfinite(got[1][4:]).all()
        finite = formats.dequantize(got[0][4:], got[1][4:])
        assert ((finite - rows[4:].to(dtype).float()).abs()
                <= rows[4:].abs().amax(-1, keepdim=True) / 16).all()


@pytest.mark.long  # the Kimi-K2.5 test keeps the DeepseekV3 path in the default tier; 70-135 s
def test_deepseek_v3_slots_match_hf(deepseek, capsys):
    model_dir, generator = deepseek
    prompts = _prompts(512)
    results = generator.generate(prompts)
    assert [r["input_ids"].tolist() for r in results] == prompts
    worst = _slot_differences(model_dir, DSV3_AUX_IDS, NUM_DSV3_LAYERS, prompts, results)
    _report(capsys, "deepseek_v3 (MLA disabled, MoE)", DSV3_AUX_IDS, worst)
    assert max(worst) < 1e-4, worst


def test_kimi_k25_slots_match_hf(kimi, capsys):
    """Extraction through the Kimi-K2.5 wrapper (get_language_model(), patches/0002) equals HF
    DeepseekV3 run on the same language-model weights."""
    model_dir, generator = kimi
    model_config = generator.vllm_config.model_config
    assert model_config.architectures == [kimi_k25.KIMI_K25_ARCHITECTURE]
    assert model_config.hf_config.model_type == "kimi_k25"
    assert model_config.multimodal_config.get_limit_per_prompt("vision_chunk") == 0
    assert type(tiny_reference.load_hf_model(model_dir)).__name__ == "DeepseekV3ForCausalLM"

    prompts = _prompts(512)
    results = generator.generate(prompts)
    assert [r["input_ids"].tolist() for r in results] == prompts
    for prompt, result in zip(prompts, results):
        assert all(h.shape == (len(prompt), 256) for h in result["hidden_states"])
    worst = _slot_differences(model_dir, DSV3_AUX_IDS, NUM_DSV3_LAYERS, prompts, results)
    _report(capsys, "kimi_k25 wrapper vs HF DeepseekV3 (MLA disabled, MoE)", DSV3_AUX_IDS, worst)
    assert max(worst) < 1e-4, worst


_KIMI_VISION_CHECK = """
import json, sys
import torch
from safetensors.torch import load_file
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration
from vllm.model_executor.models.kimi_k25_vit import (
    KimiK25MultiModalProjector, MoonViT3dPretrainedModel, vision_tower_forward)
from vllm.transformers_utils.configs.kimi_k25 import KimiK25Config

if __name__ == "__main__":
    model_dir, port = sys.argv[1], sys.argv[2]
    config = KimiK25Config.from_pretrained(model_dir)
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
        towers = torch.nn.Module()
        towers.vision_tower = MoonViT3dPretrainedModel(config.vision_config, prefix="vision_tower")
        towers.mm_projector = KimiK25MultiModalProjector(config.vision_config, prefix="mm_projector")
    params = dict(towers.named_parameters())
    checkpoint = {name: tensor for name, tensor in load_file(model_dir + "/model.safetensors").items()
                  if not name.startswith("language_model.")}
    mapped = dict(KimiK25ForConditionalGeneration.hf_to_vllm_mapper.apply(checkpoint.items()))
    report = {"missing": sorted(set(params) - set(mapped)),
              "unexpected": sorted(set(mapped) - set(params)),
              "shape": sorted(n for n in params if n in mapped and params[n].shape != mapped[n].shape)}
    if not any(report.values()):
        for name, param in params.items():
            getattr(param, "weight_loader", lambda p, w: p.data.copy_(w))(param, mapped[name])
        for module in towers.modules():
            if getattr(module, "quant_method", None) is not None:
                module.quant_method.process_weights_after_loading(module)
        patches = torch.randn(4, 3, config.vision_config.patch_size, config.vision_config.patch_size)
        out = vision_tower_forward(towers.vision_tower, patches, torch.tensor([[1, 2, 2]]),
                                   towers.mm_projector, False)
        report["embedding_shapes"] = [list(t.shape) for t in out]
    print("RESULT " + json.dumps(report))
"""


@pytest.mark.long  # a child process of its own, about 90 s on 2 cores; CI runs it
def test_kimi_k25_vision_weights_load_into_vllm_tower(tmp_path):
    """The tower/projector tensors are exactly what vLLM's MoonViT and projector load (after
    KimiK25ForConditionalGeneration's name mapping), and a 2x2-patch image runs through them.
    The text-only engine never builds the tower, so this checks it in a child process."""
    model_dir = kimi_k25.build_tiny_kimi_k25(tmp_path / "kimi", num_layers=2)
    script = tmp_path / "check_vision.py"
    script.write_text(_KIMI_VISION_CHECK)
    port = str(29500 + os.getpid() % 1000)
    done = subprocess.run([sys.executable, str(script), str(model_dir), port],
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    report = json.loads(lines[-1][len("RESULT "):])
    assert report == {"missing": [], "unexpected": [], "shape": [],
                      "embedding_shapes": [[1, 256]]}, report


# --------------------------------------------------------------------------- rank 0 writes the shards
POISONED_TOKEN = 6  # _prompts draws from 7 up: only prompts that add it meet a NaN


@pytest.fixture(scope="module")
def poisoned(llama, tmp_path_factory):
    """The llama target with token 6's embedding NaN: prompts without it are the plain
    model's, a prompt with it carries NaN from that position on (a NaN in the engine)."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = tmp_path_factory.mktemp("poisoned") / "model"
    shutil.copytree(llama[0], model_dir)
    (weights,) = model_dir.glob("*.safetensors")
    tensors = load_file(weights)
    (embedding,) = [name for name in tensors if name.endswith("embed_tokens.weight")]
    tensors[embedding][POISONED_TOKEN] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    return model_dir


# fp8 in the long tier: a second engine (~20 s on 2 cores) for the default tier's budget; the
# worker-side fp8 path is also held to the driver's bytes on CUDA (tests/test_cuda_capture.py).
@pytest.fixture(scope="module", params=["bfloat16", pytest.param("float8_e4m3fn", marks=pytest.mark.long)])
def shard_engine(request, poisoned):
    """One engine per storage dtype, its rank 0 ready to write shards (patches/0008); with
    no shard open it returns rows to the driver as before, so it serves both writers."""
    from draftline.extract import writer

    generator = _make_generator(poisoned, LLAMA_AUX_IDS, hidden_states_dtype=request.param)
    generator.open_shard_writer(capacity_tokens=400, writer=writer.WRITER, num_buffers=2)
    yield request.param, generator
    generator.shutdown()


def _write_shards(generator, path, save_dtype, out_dir, prompts, shard_tokens=200, budget=150):
    """Every shard of ``prompts`` by one of the writers; the time split."""
    from draftline import formats
    from draftline.extract import shards, writer
    from draftline.extract.settings import ShardJob
    from draftline.pipeline.progress import TOKENS, Progress

    lengths = [len(p) for p in prompts]
    plans = shards.plan_shards(lengths, shard_tokens)
    masks = [[(i + j) % 2 for j in range(n)] for i, n in enumerate(lengths)]
    metadata = formats.shard_metadata("identity test", LLAMA_AUX_IDS, 256)
    progress = Progress("test", sum(lengths), unit=TOKENS, quiet=True)
    split = writer.TimeSplit()
    job = ShardJob(prompts, masks, Path(out_dir), metadata, budget, save_dtype)
    if path == "rank0":
        writer.on_rank0(generator, plans, job, progress, split)
    else:
        writer.in_driver(generator, plans, job, progress, split)
    return plans, split


def test_rank0_writer_writes_the_driver_paths_shards(shard_engine, tmp_path):
    """The same prompts through both writers: every shard byte-identical (a shard spans
    several generate() calls, a prompt is prefilled in chunks across steps and shares steps
    with others); rank 0 reports its writes and the driver never sees a row."""
    from draftline.pipeline.artifacts import sha256_file

    save_dtype, generator = shard_engine
    prompts = _prompts(512) * 2
    hashes = {}
    for path in ("driver", "rank0"):
        plans, split = _write_shards(generator, path, save_dtype, tmp_path / path, prompts)
        hashes[path] = [sha256_file(tmp_path / path / plan.name) for plan in plans]
        assert all((tmp_path / path / plan.name).with_suffix(".timing.json").exists() for plan in plans)
        assert split.forward > 0 and (split.writing > 0) and split.serial == (path == "driver")
    assert len(hashes["rank0"]) == 4 and hashes["rank0"] == hashes["driver"], hashes


def test_rank0_writer_never_writes_a_shard_with_nan(shard_engine, tmp_path):
    """A NaN in the engine (the poisoned token's embedding, in the fourth prompt) stops both
    writers with the same NonFiniteHiddenStates (shard, sample, slot, token); neither leaves
    the shard, the shard before it is written, and the engine goes on afterwards."""
    from draftline import formats

    save_dtype, generator = shard_engine
    prompts = _prompts(512)
    prompts[3] = prompts[3][:11] + [POISONED_TOKEN] + prompts[3][12:]  # in the second shard
    messages = {}
    for path in ("driver", "rank0"):
        out_dir = tmp_path / path
        with pytest.raises(formats.NonFiniteHiddenStates) as failure:
            _write_shards(generator, path, save_dtype, out_dir, prompts)
        messages[path] = str(failure.value).replace(str(out_dir), "<dir>")
        # CPU attention spreads the NaN to the sample's earlier rows too (0 x NaN): its first
        # row is the first bad one; the samples before it are clean.
        assert failure.value.sample_id == 3, messages[path]
        assert sorted(p.name for p in out_dir.glob("*.safetensors")) == ["shard-00000.safetensors"]
        assert not list(out_dir.glob(".*.tmp"))
    assert messages["rank0"] == messages["driver"], messages
    plans, _ = _write_shards(generator, "rank0", save_dtype, tmp_path / "after", _prompts(512))
    assert all((tmp_path / "after" / plan.name).exists() for plan in plans)
