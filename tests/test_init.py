"""`make init` (draftline.cli.init) in a copy of conf/: a tiny Llama directory built here and
the Kimi-K2.5-shaped one in tests/assets become a model and an experiment config that compose,
with the machine's paths only in conf/local.yaml; every refusal is one line, exit 2, and writes
nothing."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from typer.testing import CliRunner

from draftline.cli import init
from draftline.pipeline import config
from draftline.errors import UserConfigError

from conftest import REPO

KIMI = REPO / "tests/assets/kimi-k2.5-shaped"
CHAT = {"conversations": [{"from": "human", "value": "What does a draft model do?"},
                          {"from": "gpt", "value": "It proposes tokens that the target verifies."}]}
# Public config.json values (the model cards' repositories), as `make init` reads them.
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 12288, "vocab_size": 151936, "max_position_embeddings": 40960,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from draftline.tiny.builders import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "My_Tiny-Llama", hidden_size=64,
                            num_layers=8, num_heads=2, num_kv_heads=1, intermediate_size=128)


@pytest.fixture
def conf(tmp_path) -> Path:
    """The project's conf/ in a checkout-like temporary dir, without the user's local.yaml."""
    conf = tmp_path / "repo" / "conf"
    shutil.copytree(config.CONF_DIR, conf, ignore=shutil.ignore_patterns("local.yaml", "local.*.yaml"))
    return conf


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(CHAT) + "\n")
    return path


def written(conf: Path) -> set[str]:
    """What init wrote into the copy: its files beyond the project's own conf/ (this checkout's
    untracked local files, left out of the copy, count as written when init writes them there)."""
    project = {str(p.relative_to(config.CONF_DIR)) for p in config.CONF_DIR.rglob("*.yaml")
               if not p.name.startswith("local.")}
    return {str(p.relative_to(conf)) for p in conf.rglob("*.yaml")} - project


def test_init_writes_an_experiment_that_composes_with_the_paths_from_its_local_yaml(tiny, data, conf):
    result = CliRunner().invoke(init.build_cli(), [str(tiny), str(data), "--conf-dir", str(conf)])
    assert result.exit_code == 0, result.output
    assert written(conf) == {"model/my-tiny-llama.yaml", "experiment/my-tiny-llama.yaml", "local.my-tiny-llama.yaml"}
    cfg = config.compose(["experiment=my-tiny-llama"], conf_dir=conf)
    assert (cfg.exp, cfg.model.name, cfg.model.path, cfg.data.path) == ("my-tiny-llama", "my-tiny-llama", str(tiny), str(data))
    assert (cfg.model.num_layers, cfg.model.hidden_size, list(cfg.model.aux_layer_ids)) == (8, 64, [2, 4, 5])
    assert (cfg.model.dtype, cfg.model.trust_remote_code, cfg.model.tensor_parallel_size) == ("float32", False, 1)
    assert cfg.model.build is None and cfg.data.build is None and cfg.tokenize.draft_vocab_size == 512
    config.check(cfg)  # what every stage asks first: nothing required left unset, the paths exist
    for tracked in ("model/my-tiny-llama.yaml", "experiment/my-tiny-llama.yaml"):
        assert str(tiny.parent) not in (conf / tracked).read_text() and str(data) not in (conf / tracked).read_text()
    assert "make train EXP=my-tiny-llama" in result.output and "runs/my-tiny-llama/draft" in result.output


def test_the_kimi_shaped_directory_gets_remote_code_and_its_text_config_shape(data, conf):
    init.init(str(KIMI), str(data), "kimi-mine", conf_dir=conf)
    model = OmegaConf.load(conf / "model/kimi-mine.yaml")
    assert (model.trust_remote_code, model.num_layers, model.hidden_size, list(model.aux_layer_ids)) == (True, 61, 7168, [2, 30, 58])
    assert (model.dtype, model.tensor_parallel_size, dict(model.limit_mm_per_prompt)) == ("bfloat16", 8, {"vision_chunk": 0})
    assert config.compose(["experiment=kimi-mine"], conf_dir=conf).model.path == str(KIMI)


def test_an_existing_config_is_refused_and_nothing_is_written(tiny, data, conf):
    (conf / "experiment/mine.yaml").write_text("# someone's\n")
    for name in ("mine", "tiny-llama"):  # an experiment, then a model config of that name
        with pytest.raises(UserConfigError, match=f"{name}.yaml exists: init never overwrites"):
            init.init(str(tiny), str(data), name, conf_dir=conf)
    assert written(conf) == {"experiment/mine.yaml"}
    # From the command line: the message and its hint, exit 2, no traceback.
    cli = subprocess.run([sys.executable, "-m", "draftline.cli.init", str(tiny), str(data), "--name", "mine",
                          "--conf-dir", str(conf)], capture_output=True, text=True, cwd=REPO)
    assert cli.returncode == 2 and cli.stdout == ""
    assert cli.stderr.splitlines() == [f"draftline: {conf}/experiment/mine.yaml exists: init never overwrites a config",
                                       "hint: pick another name with EXP=<name>, or edit that file"]


def test_a_tokenizer_without_chat_template_is_refused(tiny, data, conf, tmp_path):
    plain = shutil.copytree(tiny, tmp_path / "base-model")
    (plain / "chat_template.jinja").unlink()
    with pytest.raises(UserConfigError, match="its tokenizer has no chat template"):
        init.init(str(plain), str(data), conf_dir=conf)
    assert written(conf) == set()


@pytest.mark.parametrize("content, message", [
    ('{"text": "a pretraining document"}\n', "record needs exactly one of 'conversations'"),
    ('{"messages": [{"role": "user", "content": "hi"}\n', "malformed JSON"),
    ("\n", "no records"),
])
def test_data_in_no_known_format_is_refused(tiny, conf, tmp_path, content, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    with pytest.raises(UserConfigError, match=message) as refused:
        init.init(str(tiny), str(bad), conf_dir=conf)
    assert "ShareGPT" in refused.value.hint and written(conf) == set()


def test_a_second_target_gets_its_own_paths_and_conf_local_yaml_is_never_written(tiny, data, conf, tmp_path):
    """Two inits on one machine: each experiment composes with its own model.path, whatever
    conf/local.yaml (the user's) says; before, the second was told to pass OVERRIDES on every
    command, and one without them rehearsed the first target under the second's name."""
    local = conf / config.LOCAL
    local.write_text("model:\n  path: /models/kimi-k2.5\n")
    other = shutil.copytree(REPO / "tests/assets/llama-3.1-8b-shaped", tmp_path / "llama")
    init.init(str(tiny), str(data), "mine", conf_dir=conf)
    lines = init.init(str(other), str(data), "other", conf_dir=conf)
    assert local.read_text() == "model:\n  path: /models/kimi-k2.5\n" and "  make tokenize EXP=other" in lines
    for name, path in (("mine", tiny), ("other", other)):
        cfg = config.compose([f"experiment={name}"], conf_dir=conf)
        assert (cfg.model.path, cfg.data.path) == (str(path), str(data))
        config.check(cfg)
    # A leftover file of that name (a removed experiment's) is never rewritten: OVERRIDES instead.
    for made in ("model/other.yaml", "experiment/other.yaml"):
        (conf / made).unlink()
    (conf / "local.other.yaml").write_text("model:\n  path: /elsewhere\n")
    lines = init.init(str(other), str(data), "other", conf_dir=conf)
    assert (conf / "local.other.yaml").read_text() == "model:\n  path: /elsewhere\n"
    assert f'  make tokenize EXP=other OVERRIDES="model.path={other} data.path={data}"' in lines


def test_model_path_of_another_target_is_refused_before_any_stage(tiny, data, conf):
    """conf/local.yaml's model.path fills every experiment that leaves it unset: a target of
    another shape is refused in one line by config.check, which every stage and Make's parse run."""
    init.init(str(tiny), str(data), "mine", conf_dir=conf)
    (conf / "local.mine.yaml").unlink()
    (conf / config.LOCAL).write_text(f"model:\n  path: {REPO / 'tests/assets/qwen3-8b-shaped'}\n"
                                     f"data:\n  path: {data}\n")
    cfg = config.compose(["experiment=mine"], conf_dir=conf)
    with pytest.raises(UserConfigError, match=r"is a 36-layer x 4096 target \(Qwen3ForCausalLM, its config.json\); "
                                              r"conf/model/mine.yaml says 8 x 64") as refused:
        config.check(cfg)
    assert "conf/local.mine.yaml" in refused.value.hint


def test_aux_ids_tensor_parallel_size_and_the_weight_estimate():
    assert [init.aux_layer_ids(n) for n in (32, 36, 61, 6, 4)] == [[2, 16, 29], [2, 18, 33], [2, 30, 58], [2, 3, 4], [1, 2, 3]]
    assert [init.tensor_parallel_size(int(gb * 1e9)) for gb in (16, 48, 49, 141, 570)] == [1, 1, 2, 4, 8]
    assert init.estimate_weight_bytes(QWEN3_8B) == pytest.approx(16.4e9, rel=0.01)  # 16.4 GB on disk
    kimi = json.loads((KIMI / "config.json").read_text())
    assert init.estimate_weight_bytes(kimi) == pytest.approx(554e9, rel=0.07)  # 554 GB quoted, INT4 experts
    snapshot = Path("/cache/models--Qwen--Qwen3-8B/snapshots/0123abc")
    assert init.experiment_name(snapshot) == "qwen3-8b" and init.experiment_name("/m/Llama_3.1 8B") == "llama-3.1-8b"


@pytest.mark.parametrize("name, layers", [("qwen3-8b", 36), ("llama-3.1-8b", 32)])
def test_the_shipped_examples_compose_with_vllms_aux_ids(name, layers):
    cfg = config.compose([f"experiment={name}", "model.path=/m", "data.path=/d"])
    assert (cfg.exp, cfg.model.name, cfg.model.num_layers) == (name, name, layers)
    assert list(cfg.model.aux_layer_ids) == init.aux_layer_ids(layers)
    assert OmegaConf.is_missing(OmegaConf.load(config.CONF_DIR / f"model/{name}.yaml"), "path")


# Each weightless directory of tests/assets/ (a public model's config.json, tests/test_families.py):
# (layers, vLLM's default aux ids, suggested TP from the estimated weights, remote code).
FAMILIES = {"llama-3.1-8b-shaped": (32, [2, 16, 29], 1, False), "qwen2.5-7b-shaped": (28, [2, 14, 25], 1, False),
            "qwen3-8b-shaped": (36, [2, 18, 33], 1, False), "qwen3-30b-a3b-shaped": (48, [2, 24, 45], 2, False),
            "gpt-oss-20b-shaped": (24, [2, 12, 21], 1, False), "kimi-k2.5-shaped": (61, [2, 30, 58], 8, True),
            "hy-mt2-7b-shaped": (32, [2, 16, 29], 1, False), "kimi-k2-instruct-shaped": (61, [2, 30, 58], 8, True),
            "deepseek-v3-shaped": (61, [2, 30, 58], 8, False), "llama-4-scout-shaped": (48, [2, 24, 45], 8, False),
            "qwen2.5-vl-7b-shaped": (28, [2, 14, 25], 1, False), "qwen3-vl-8b-shaped": (36, [2, 18, 33], 1, False),
            "qwen3-vl-30b-a3b-shaped": (48, [2, 24, 45], 2, False), "llava-1.5-7b-shaped": (32, [2, 16, 29], 1, False)}
# The wrappers' runs are text-only: a count of 0 for each modality vLLM 0.16's class takes.
TEXT_ONLY = {"kimi-k2.5-shaped": {"vision_chunk": 0}, "llama-4-scout-shaped": {"image": 0}, **{name: {"image": 0, "video": 0} for name in (
    "qwen2.5-vl-7b-shaped", "qwen3-vl-8b-shaped", "qwen3-vl-30b-a3b-shaped")}, "llava-1.5-7b-shaped": {"image": 0}}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_init_on_every_family_writes_configs_that_compose(name, data, conf):
    layers, aux_ids, tp, remote = FAMILIES[name]
    init.init(str(REPO / "tests/assets" / name), str(data), name, conf_dir=conf)
    cfg = config.compose([f"experiment={name}"], conf_dir=conf)
    assert (cfg.model.num_layers, list(cfg.model.aux_layer_ids)) == (layers, aux_ids)
    assert (cfg.model.tensor_parallel_size, cfg.model.trust_remote_code) == (tp, remote)
    assert config.mm_limits(cfg) == TEXT_ONLY.get(name)
    config.check(cfg)


def test_a_family_vllm_does_not_serve_with_eagle3_is_refused_with_the_tables_path(tiny, data, conf, tmp_path):
    mixtral = shutil.copytree(tiny, tmp_path / "mixtral")
    cfg = json.loads((mixtral / "config.json").read_text())
    (mixtral / "config.json").write_text(json.dumps({**cfg, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}))
    cli = subprocess.run([sys.executable, "-m", "draftline.cli.init", str(mixtral), str(data),
                          "--conf-dir", str(conf)], capture_output=True, text=True, cwd=REPO)
    assert cli.returncode == 2 and written(conf) == set()
    assert cli.stderr.splitlines() == [
        "draftline: model_type 'mixtral' (MixtralForCausalLM): not a family vLLM 0.16 serves with an "
        "EAGLE-3 draft (see docs/families.md)",
        "hint: the families draftline serves with EAGLE-3, and why others are left out: docs/families.md"]


def test_sizes_follow_the_host_cpu_sizes_where_torch_sees_no_gpu(tiny, data, conf):
    """Without a GPU the experiment trains with the CPU's levers (bf16, a small token budget and
    draft vocabulary, EXP=smollm2's measured sizes) instead of kimi-k2.5's 20,000 GPU steps;
    both ask for the standard benchmarks."""
    init.init(str(tiny), str(data), "on-cpu", conf_dir=conf, on_gpu=False)
    init.init(str(tiny), str(data), "on-gpu", conf_dir=conf, on_gpu=True)
    cpu = config.compose(["experiment=on-cpu"], conf_dir=conf)
    gpu = config.compose(["experiment=on-gpu"], conf_dir=conf)
    assert (cpu.train.precision, cpu.train.max_tokens_per_step, cpu.train.steps) == ("bf16", 2048, 300)
    assert cpu.tokenize.draft_vocab_size <= 8192 and cpu.extract.save_dtype == "bfloat16"
    assert (gpu.train.precision, gpu.train.max_tokens_per_step, gpu.train.steps) == ("auto", 8192, 20000)
    for cfg in (cpu, gpu):
        assert list(cfg.evaluate.benchmarks.names) == ["mt_bench", "humaneval", "bfcl_simple"]
