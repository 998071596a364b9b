"""The embedded inputs: committed files with pinned sha256, the same bytes on every interpreter."""

import hashlib
import json
import platform
import shutil

import pytest

from draftline.tiny import embedded, tokenizer
from draftline.tokenize.conversations import load_conversations

# Pinned here as well as in draftline/tiny/embedded.py: changing the data needs both edits.
CONVERSATIONS_SHA256 = "4877a1fcd7dc62a65b134175ccb2983f3e8497ca985de2e54b3ace6b8bfdfecb"
TOKENIZER_CORPUS_SHA256 = "5315f55f28e6a21110b18c6d3c6fdbf362a1e080e6ef1a8b5cd1b136ca2e2155"


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_committed_files_have_the_pinned_sha256():
    assert sha256(embedded.DATA_DIR / embedded.CONVERSATIONS) == CONVERSATIONS_SHA256
    assert sha256(embedded.DATA_DIR / embedded.TOKENIZER_CORPUS) == TOKENIZER_CORPUS_SHA256
    assert embedded.PINNED_SHA256 == {embedded.CONVERSATIONS: CONVERSATIONS_SHA256,
                                      embedded.TOKENIZER_CORPUS: TOKENIZER_CORPUS_SHA256}


@pytest.fixture(scope="module")
def default_set(tmp_path_factory):
    path = tmp_path_factory.mktemp("default") / "conversations.jsonl"
    embedded.write_conversations(path)
    return path


def test_the_written_set_is_the_committed_one_small_valid_and_varied(default_set):
    assert sha256(default_set) == CONVERSATIONS_SHA256
    assert 100_000 < default_set.stat().st_size <= 1_000_000
    conversations, skipped = load_conversations(default_set, max_skipped=0)
    assert skipped == [] and len(conversations) > 300
    assistant_turns = [sum(m["role"] == "assistant" for m in c) for c in conversations]
    assert max(assistant_turns) >= 3 and assistant_turns.count(1) > len(conversations) // 2
    assert sum(c[0]["role"] == "system" for c in conversations) > 50
    openers = {c[-2]["content"].split("`")[0] for c in conversations if len(c) == 2}
    assert len(openers) >= 5  # the deterministic phrasing varies
    assert any("JSON" in c[-1]["content"] for c in conversations)  # real stdlib docstrings


def test_smaller_cap_gives_a_prefix(default_set, tmp_path):
    small = tmp_path / "small.jsonl"
    count = embedded.write_conversations(small, max_bytes=20_000)
    data = small.read_bytes()
    assert len(data) <= 20_000 and data.count(b"\n") == count
    assert default_set.read_bytes().startswith(data)
    with pytest.raises(ValueError, match="too small"):
        embedded.write_conversations(tmp_path / "none.jsonl", max_bytes=10)


def test_ensure_rewrites_a_copy_that_differs(tmp_path):
    path = tmp_path / "conversations.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "made by an older builder"}]}\n')
    embedded.ensure_conversations(path, tmp_path)
    assert sha256(path) == CONVERSATIONS_SHA256


def test_the_embedded_set_is_written_only_under_the_assets(tmp_path):
    user_file = tmp_path / "my_chats.jsonl"
    user_file.write_text("mine\n")
    for path in (user_file, tmp_path / "absent.jsonl", tmp_path / "sub" / "conversations.jsonl"):
        with pytest.raises(embedded.NotTheEmbeddedPath, match="did you mean data=file"):
            embedded.ensure_conversations(path, tmp_path)
    assert user_file.read_text() == "mine\n" and sorted(tmp_path.iterdir()) == [user_file]


def test_an_edited_committed_file_is_refused(tmp_path, monkeypatch):
    copy = tmp_path / "embedded_data"
    shutil.copytree(embedded.DATA_DIR, copy)
    corpus = copy / embedded.TOKENIZER_CORPUS
    corpus.write_bytes(corpus.read_bytes().replace(b"JSON", b"Json", 1))
    monkeypatch.setattr(embedded, "DATA_DIR", copy)
    embedded.write_conversations(tmp_path / "ok.jsonl")  # the untouched file still passes
    with pytest.raises(embedded.EmbeddedDataError, match="tokenizer_corpus.jsonl has sha256"):
        embedded.tokenizer_corpus()
    (copy / embedded.CONVERSATIONS).unlink()
    with pytest.raises(embedded.EmbeddedDataError, match="conversations.jsonl is missing"):
        embedded.write_conversations(tmp_path / "x.jsonl")


def test_tiny_tokenizer_trains_on_the_committed_corpus():
    corpus = tokenizer.default_corpus()
    assert corpus == embedded.tokenizer_corpus() and len(corpus) > 400
    assert all(isinstance(doc, str) and doc for doc in corpus)


@pytest.mark.skipif(platform.python_version() != embedded.BUILT_WITH_PYTHON,
                    reason=f"the committed files hold Python {embedded.BUILT_WITH_PYTHON}'s "
                           "docstrings; other patch releases build other bytes (the reason they "
                           "are committed)")
def test_the_builder_on_the_recorded_python_rebuilds_the_committed_bytes():
    assert embedded.conversations_bytes() == (embedded.DATA_DIR / embedded.CONVERSATIONS).read_bytes()
    assert embedded.corpus_bytes() == (embedded.DATA_DIR / embedded.TOKENIZER_CORPUS).read_bytes()
    first = json.loads(embedded.conversations_bytes().splitlines()[0])
    assert first == {"messages": next(iter(embedded.build_conversations()))}
