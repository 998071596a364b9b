"""draftline.target in-process: the remote-code check on a model directory of a few JSON files
(no weights: the check reads only the configs' auto_map before anything is loaded)."""

import json

import pytest

from draftline import target
from draftline.target import RemoteCodeRefused


def write(directory, name, content):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(json.dumps(content))


@pytest.fixture
def tokenizer_only(tmp_path):
    """Remote code in tokenizer_config.json only; no config.json (the first file looked at)."""
    directory = tmp_path / "tokenizer-only"
    write(directory, "tokenizer_config.json",
          {"model_max_length": 64,
           "auto_map": {"AutoTokenizer": [None, "remote_tokenizer.RemoteTokenizer"]}})
    return directory


@pytest.fixture
def two_files(tmp_path):
    directory = tmp_path / "two-files"
    write(directory, "config.json",
          {"model_type": "custom",
           "auto_map": {"AutoModelForCausalLM": "modeling.CustomLM",
                        "AutoConfig": "configuration.CustomConfig"}})
    write(directory, "tokenizer_config.json",
          {"auto_map": {"AutoTokenizer": ["tok.Slow", "tok.Fast"]}})
    write(directory, "preprocessor_config.json", {"auto_map": {}})
    return directory


@pytest.fixture
def plain(tmp_path):
    directory = tmp_path / "plain"
    write(directory, "config.json", {"model_type": "llama", "AUTO_MAP": {"AutoConfig": "x.Y"}})
    write(directory, "tokenizer_config.json", {"model_max_length": 64, "auto_map": None})
    return directory


def test_references_name_file_class_and_target_in_file_then_class_order(two_files):
    assert target.remote_code_references(two_files) == [
        "config.json: AutoConfig -> configuration.CustomConfig",
        "config.json: AutoModelForCausalLM -> modeling.CustomLM",
        "tokenizer_config.json: AutoTokenizer -> ['tok.Slow', 'tok.Fast']",
    ]
    assert target.remote_code_references(str(two_files)) == target.remote_code_references(
        two_files)


def test_a_missing_config_does_not_stop_the_search(tokenizer_only):
    assert target.remote_code_references(tokenizer_only) == [
        "tokenizer_config.json: AutoTokenizer -> [None, 'remote_tokenizer.RemoteTokenizer']"]


def test_no_auto_map_no_references(plain, tmp_path):
    assert target.remote_code_references(plain) == []
    assert target.remote_code_references(tmp_path / "nothing-here") == []


def test_check_refuses_remote_code_not_allowed_with_the_exact_message(two_files):
    with pytest.raises(RemoteCodeRefused) as refused:
        target.check(two_files, False)
    assert str(refused.value) == (
        f"{two_files} asks to run its own Python (config.json: AutoConfig -> "
        "configuration.CustomConfig; config.json: AutoModelForCausalLM -> modeling.CustomLM; "
        "tokenizer_config.json: AutoTokenizer -> ['tok.Slow', 'tok.Fast']); draftline runs it "
        "only when the model config allows it: set model.trust_remote_code=true if you trust "
        "this directory")
    assert isinstance(refused.value, ValueError)


def test_check_message_for_one_reference(tokenizer_only):
    with pytest.raises(RemoteCodeRefused) as refused:
        target.check(tokenizer_only, None)
    assert str(refused.value) == (
        f"{tokenizer_only} asks to run its own Python (tokenizer_config.json: AutoTokenizer -> "
        "[None, 'remote_tokenizer.RemoteTokenizer']); draftline runs it only when the model "
        "config allows it: set model.trust_remote_code=true if you trust this directory")


def test_check_returns_the_flag_when_the_directory_agrees(two_files, tokenizer_only, plain):
    assert target.check(two_files, True) is True
    assert target.check(tokenizer_only, 1) is True
    assert target.check(plain, True) is True
    assert target.check(plain, False) is False


def test_config_classes_transformers_has_itself_need_no_remote_code(tmp_path):
    """DeepSeek-V3's config.json still names its configuration_deepseek.py: transformers 4.57
    reads deepseek_v3 itself, so only a tokenizer's auto_map asks for the directory's Python;
    Kimi-K2's kimi_k2 is no transformers model_type, so its entries stay."""
    auto_map = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
    write(tmp_path / "v3", "config.json", {"model_type": "deepseek_v3", "auto_map": auto_map})
    assert target.remote_code_references(tmp_path / "v3") == []
    assert target.check(tmp_path / "v3", False) is False
    write(tmp_path / "v3", "tokenizer_config.json", {"auto_map": {"AutoTokenizer": ["tok.Slow", None]}})
    assert target.remote_code_references(tmp_path / "v3") == [
        "tokenizer_config.json: AutoTokenizer -> ['tok.Slow', None]"]
    write(tmp_path / "k2", "config.json", {"model_type": "kimi_k2", "auto_map": auto_map})
    assert target.remote_code_references(tmp_path / "k2") == [
        "config.json: AutoConfig -> configuration_deepseek.DeepseekV3Config",
        "config.json: AutoModelForCausalLM -> modeling_deepseek.DeepseekV3ForCausalLM"]
