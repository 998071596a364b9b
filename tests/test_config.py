"""The real Hydra config: every experiment composes, and stamps change only with config."""

import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from draftline import errors
from draftline.pipeline import artifacts, config

from conftest import compose

EXPERIMENTS = sorted(p.stem for p in (config.CONF_DIR / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("exp", EXPERIMENTS)
def test_every_experiment_composes(exp):
    cfg = compose(exp, "model.path=/models/x", "data.path=/data/x")
    assert cfg.exp == exp and cfg.run_dir == f"runs/{exp}"
    for stage in config.STAGES:
        resolved = config.stage_config(cfg, stage)
        assert resolved["run_dir"] == f"runs/{exp}"
    assert len(cfg.model.aux_layer_ids) == 3
    assert all(0 < i < cfg.model.num_layers for i in cfg.model.aux_layer_ids)


def test_kimi_uses_vllm_default_layer_ids():
    cfg = compose("kimi-k2.5", "model.path=/m", "data.path=/d")
    n = cfg.model.num_layers
    assert n == 61 and list(cfg.model.aux_layer_ids) == [2, n // 2, n - 3]


def test_unknown_experiment_is_named():
    with pytest.raises(errors.UserConfigError, match="^EXP=nope: there is no conf/experiment/nope.yaml$") as refused:
        config.experiment_overrides("nope", [])
    assert refused.value.hint == f"known: {', '.join(EXPERIMENTS)}"


def test_a_train_key_changes_only_the_train_stamp():
    base = compose("tiny")
    changed = compose("tiny", "train.lr=1e-3")
    differs = [s for s in config.STAGES if config.stage_config(base, s) != config.stage_config(changed, s)]
    assert differs == ["train"]


@pytest.mark.parametrize("launch_key", ["extract.replicas=8", "extract.shard=1/4"])
def test_extract_launch_keys_change_no_stamp(launch_key):
    """Replicas and slices make the same shards: no stage (extract included) goes stale."""
    base = compose("tiny")
    changed = compose("tiny", launch_key)
    assert [s for s in config.STAGES if config.stage_config(base, s) != config.stage_config(changed, s)] == []
    assert "replicas" not in config.stage_config(base, "extract")["extract"]


def test_aux_layer_ids_do_not_make_regenerated_replies_stale():
    base = compose("tiny-trained")
    changed = compose("tiny-trained", "model.aux_layer_ids=[0,1,2]")
    differs = [s for s in config.STAGES if config.stage_config(base, s) != config.stage_config(changed, s)]
    assert "regenerate" not in differs and "extract" in differs


def test_stamp_is_rewritten_only_when_it_changes(tmp_path: Path):
    stamp = tmp_path / "config.json"
    assert artifacts.write_stamp(stamp, {"a": 1})
    before = stamp.stat().st_mtime_ns
    assert not artifacts.write_stamp(stamp, {"a": 1})
    assert stamp.stat().st_mtime_ns == before
    assert artifacts.write_stamp(stamp, {"a": 2})


def test_launch_keys_change_no_stamp_and_are_recorded_apart():
    """GPUS=1 -> GPUS=8 (train.gpus) says where the draft trains, not what it learns: no stage's
    stamp moves, so `make` retrains nothing; the values are still at hand for the manifest."""
    base = compose("tiny")
    launched = compose("tiny", "train.gpus=8", "train.nodes=2", "train.rendezvous=host:29500",
                       "train.collective_timeout_s=60", "extract.writer=driver")
    assert [s for s in config.STAGES if config.stage_config(base, s) != config.stage_config(launched, s)] == []
    assert "gpus" not in config.stage_config(launched, "train")["train"]
    assert config.launch_config(launched, "train") == {"train": {
        "gpus": 8, "nodes": 2, "rendezvous": "host:29500", "collective_timeout_s": 60}}
    # Who writes the shards (the engine's rank 0 or this process) changes no byte of them.
    assert config.launch_config(launched, "extract") == {"extract": {"replicas": 1, "shard": None,
                                                                     "writer": "driver"}}


def _conf_copy(tmp_path: Path, local: str | None) -> Path:
    """The project's conf/ in a temporary dir (never the user's conf/local.yaml), with ``local``."""
    conf = tmp_path / "conf"
    shutil.copytree(config.CONF_DIR, conf, ignore=shutil.ignore_patterns("local.yaml", "local.*.yaml"))
    if local is not None:
        (conf / config.LOCAL).write_text(local)
    return conf


def test_conf_local_fills_what_an_experiment_leaves_required_and_nothing_else(tmp_path):
    conf = _conf_copy(tmp_path / "with", "model:\n  path: /models/kimi-k2.5\ndata:\n  path: /data/chats.jsonl\n")
    plain = _conf_copy(tmp_path / "without", None)
    kimi = config.compose(["experiment=kimi-k2.5"], conf_dir=conf)
    assert kimi.model.path == "/models/kimi-k2.5" and kimi.data.path == "/data/chats.jsonl"
    assert OmegaConf.is_missing(config.compose(["experiment=kimi-k2.5"], conf_dir=plain).model, "path")
    # An experiment that sets its own paths (the embedded runs, make smoke, the tests) is unchanged.
    for exp in ("tiny", "tiny-trained"):
        assert OmegaConf.to_container(config.compose([f"experiment={exp}"], conf_dir=conf), resolve=True) == \
            OmegaConf.to_container(config.compose([f"experiment={exp}"], conf_dir=plain), resolve=True)
    # A command-line override is not required any more: it wins.
    assert config.compose(["experiment=kimi-k2.5", "model.path=/other"], conf_dir=conf).model.path == "/other"


def test_a_key_conf_local_misspells_is_refused(tmp_path):
    conf = _conf_copy(tmp_path, "model:\n  pth: /models/kimi-k2.5\n")
    with pytest.raises(ValueError, match=r"local.yaml: model.pth is no config key"):
        config.compose(["experiment=kimi-k2.5"], conf_dir=conf)
