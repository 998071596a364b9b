"""Stage entry points fail loudly and leave no manifest: a mistake of the user's in two lines on
stderr with the traceback in the stage's log (exit 2), any other failure with its traceback."""

import subprocess
import sys
from pathlib import Path

import json

import pytest


from conftest import REPO, compose



def run_stage(stage: str, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"stages.{stage}", "experiment=tiny", *overrides],
                          cwd=REPO, capture_output=True, text=True, env={"HYDRA_FULL_ERROR": "1",
                                                                         "PATH": "/usr/bin:/bin"})


def stopped(result: subprocess.CompletedProcess, run_dir: Path, stage: str) -> str:
    """A stage's stop for the user: exit 2, message and hint on stderr, no traceback there; the
    traceback in the log the hint names. Returns what the user can read: stderr and that log."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    lines = result.stderr.splitlines()  # a message may carry a table (skip reasons) before the hint
    message, hint = lines[0], lines[-1]
    log = run_dir / "logs" / f"{stage}.log"
    assert message.startswith(f"draftline: stage {stage} stopped after ") and hint.startswith("hint: ")
    assert hint.endswith(f"the traceback is in {log}") and "Traceback" not in result.stdout + result.stderr
    logged = log.read_text()
    assert "Traceback (most recent call last)" in logged
    return result.stderr + logged


@pytest.mark.parametrize("content, message", [
    ('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}\n{not json\n',
     ":2"),
    ('{"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}\n',
     "wizard"),
    ('{"messages": [{"role": "user", "content": "only a question"}]}\n', "assistant"),
])
def test_bad_input_fails_tokenize_naming_file_and_line(tmp_path, model_dir, content, message):
    data = tmp_path / "bad.jsonl"
    data.write_text(content)
    result = run_stage("tokenize", f"data.path={data}", "data.build=null",
                       f"model.path={model_dir}", f"run_dir={tmp_path / 'run'}")
    output = stopped(result, tmp_path / "run", "tokenize")
    assert "DataError" in output and "bad.jsonl" in result.stderr and message in result.stderr
    assert not (tmp_path / "run/tokenize/manifest.json").exists()


def test_bad_input_within_budget_is_recorded(tmp_path, model_dir):
    data = tmp_path / "data.jsonl"
    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}'
    data.write_text(f"{good}\n{{broken\n{good}\n")
    result = run_stage("tokenize", f"data.path={data}", "data.build=null", "tokenize.max_skipped=1",
                       f"model.path={model_dir}", f"run_dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    manifest = json.loads((tmp_path / "run/tokenize/manifest.json").read_text())
    assert manifest["num_samples"] == 2
    assert manifest["num_skipped"] == 1 and manifest["skipped"]["malformed_json"]["count"] == 1
    assert manifest["skipped"]["malformed_json"]["examples"][0].startswith(f"{data}:2: ")


def test_extract_refuses_bad_layer_ids_before_loading_the_model(tmp_path, model_dir):
    data = tmp_path / "data.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, '
                    '{"role": "assistant", "content": "hello"}]}\n')
    common = [f"data.path={data}", "data.build=null", f"model.path={model_dir}",
              f"run_dir={tmp_path / 'run'}"]
    assert run_stage("tokenize", *common).returncode == 0
    assert run_stage("regenerate", *common).returncode == 0
    kept = json.loads((tmp_path / "run/regenerate/manifest.json").read_text())
    assert kept["replies"] == "data"
    assert (tmp_path / "run/regenerate" / kept["samples"]).resolve() == \
        (tmp_path / "run/tokenize/samples.safetensors").resolve()
    result = run_stage("extract", *common, "model.aux_layer_ids=[2,3,6]")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "aux_layer_ids [2, 3, 6] invalid for a 6-layer target" in output
    assert "Initializing executor" not in output  # failed before the engine started
    assert not (tmp_path / "run/extract/manifest.json").exists()


REMOTE_TOKENIZER = '''
from transformers import PreTrainedTokenizerFast
from pathlib import Path

Path(MARKER).write_text("remote code ran")  # transformers imports a copy from its module cache


class RemoteTokenizer(PreTrainedTokenizerFast):
    pass
'''


@pytest.fixture
def remote_code_model(tmp_path, model_dir) -> Path:
    """The tiny target whose tokenizer is a class in the directory's own Python."""
    import shutil

    directory = tmp_path / "remote-model"
    shutil.copytree(model_dir, directory)
    marker = f"MARKER = {str(directory / 'RAN')!r}\n"
    (directory / "remote_tokenizer.py").write_text(marker + REMOTE_TOKENIZER)
    config_path = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": [None, "remote_tokenizer.RemoteTokenizer"]}
    config_path.write_text(json.dumps(tokenizer_config))
    return directory


def test_remote_code_tokenizer_is_refused_unless_asked_for(tmp_path, remote_code_model):
    data = tmp_path / "data.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, '
                    '{"role": "assistant", "content": "hello"}]}\n')
    common = [f"data.path={data}", "data.build=null", f"model.path={remote_code_model}"]
    refused = run_stage("tokenize", *common, f"run_dir={tmp_path / 'refused'}")
    output = stopped(refused, tmp_path / "refused", "tokenize")
    assert "RemoteCodeRefused" in output and "set model.trust_remote_code=true" in refused.stderr
    assert "tokenizer_config.json: AutoTokenizer" in refused.stderr
    assert not (remote_code_model / "RAN").exists()  # refused before importing anything

    allowed = [*common, f"run_dir={tmp_path / 'allowed'}"]
    tokenized = run_stage("tokenize", *allowed, "model.trust_remote_code=true")
    assert tokenized.returncode == 0, tokenized.stderr[-3000:]
    assert (remote_code_model / "RAN").exists()  # the key is honoured: its class was used
    assert run_stage("regenerate", *allowed, "model.trust_remote_code=true").returncode == 0
    # extract checks the same key before its model load.
    extract = run_stage("extract", *allowed)
    assert "RemoteCodeRefused" in stopped(extract, tmp_path / "allowed", "extract")
    assert "Initializing executor" not in extract.stdout + extract.stderr


def test_train_leaves_the_run_dir_a_relative_link_to_the_latest_draft(tmp_path):
    """<run_dir>/draft names the draft the train manifest names, relative (the run dir moves and
    mounts as one), and is swapped in one step; a real directory there is never replaced."""
    import os

    from draftline.pipeline import artifacts
    from draftline.train import run as train_run

    run_dir = tmp_path / "runs" / "x"
    cfg = compose("tiny", f"run_dir={run_dir}")
    for key in ("0123456789ab", "ba9876543210"):
        draft = run_dir / "train" / key / "draft"
        draft.mkdir(parents=True)
        (draft / "config.json").write_text(key)
        artifacts.write_json(run_dir / "train" / artifacts.MANIFEST, {"draft": str(draft)})
        link = train_run.link_draft(cfg)
        assert link == run_dir / "draft" and link.is_symlink()
        assert os.readlink(link) == f"train/{key}/draft"
        assert (link / "config.json").read_text() == key
    assert [p.name for p in run_dir.iterdir() if p.name.startswith(".")] == []  # no temp link left
    link.unlink()
    link.mkdir()
    with pytest.raises(FileExistsError):
        train_run.link_draft(cfg)
    assert link.is_dir() and not link.is_symlink()


# --------------------------------------------------------------------------- serve: safe by default

SENTINEL_KEY = "sk-draftline-sentinel-7f3a91"


def _serve_cfg(tmp_path, model_dir, *overrides):
    from draftline.pipeline import artifacts

    run_dir = tmp_path / "run"
    draft = run_dir / "train" / "0123456789ab" / "draft"
    draft.mkdir(parents=True)
    (draft / "config.json").write_text("{}")
    artifacts.write_json(run_dir / "train" / artifacts.MANIFEST, {"draft": str(draft)})
    return compose("tiny", f"run_dir={run_dir}", f"model.path={model_dir}", "serve.steps=3", *overrides), run_dir


def test_serve_listens_on_loopback_by_default_and_never_writes_the_key(tmp_path, model_dir, monkeypatch):
    from draftline.serve import server

    monkeypatch.setenv("VLLM_API_KEY", SENTINEL_KEY)
    for host in ("127.0.0.1", "0.0.0.0"):  # the default, and beyond loopback with the key set
        overrides = () if host == "127.0.0.1" else (f"serve.host={host}",)
        cfg, run_dir = _serve_cfg(tmp_path / host, model_dir, *overrides)
        command, env, differences = server.server_command(cfg)
        assert command[command.index("--host") + 1] == host
        server.write_command(cfg, command, env, differences)
        assert SENTINEL_KEY not in " ".join(command) and SENTINEL_KEY not in json.dumps(env)
        written = [p for p in run_dir.rglob("*") if p.is_file()]
        assert run_dir / "serve" / "command.json" in written
        assert not [p for p in written if SENTINEL_KEY in p.read_text(errors="replace")]


def test_serve_beyond_loopback_without_a_key_or_with_a_key_in_argv_is_refused(tmp_path, model_dir, monkeypatch):
    from draftline.serve import server

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv(server.IN_CONTAINER, raising=False)
    cfg, _ = _serve_cfg(tmp_path / "a", model_dir, "serve.host=0.0.0.0")
    with pytest.raises(ValueError, match=r"serve.host=0.0.0.0 listens beyond this machine with no API "
                                         r"key: set VLLM_API_KEY in the environment"):
        server.server_command(cfg)
    cfg, _ = _serve_cfg(tmp_path / "b", model_dir, f"serve.extra_args=[--api-key,{SENTINEL_KEY}]")
    with pytest.raises(ValueError, match="serve.extra_args holds --api-key"):
        server.server_command(cfg)
    # The compose service binds the container's addresses; its port is published on loopback.
    monkeypatch.setenv(server.IN_CONTAINER, "1")
    cfg, _ = _serve_cfg(tmp_path / "c", model_dir, "serve.host=0.0.0.0")
    assert server.server_command(cfg)[0]


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("::", False),
                                            ("10.0.0.5", False), ("myhost", False)])
def test_loopback_addresses(host, loopback):
    from draftline.serve import server

    assert server.is_loopback(host) is loopback
