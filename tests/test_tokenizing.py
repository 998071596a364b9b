"""The tokenize library path on the bundled quirk set: counted skips, budgets, formats, workers."""

import hashlib
import json
import re
from pathlib import Path

import pytest

from draftline.tiny import tokenizer as tiny_tokenizer
from draftline.tokenize import chat
from draftline.errors import DataError
from draftline.tokenize.conversations import DEFAULT_ROLES
from draftline.tokenize.encode import Budget, TokenizeSettings, tokenize_source
from draftline.tokenize.sources import open_source

QUIRKS = Path(__file__).parent / "assets" / "quirks.jsonl"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A directory holding only a tiny BPE tokenizer (tiny.tokenizer.build_tokenizer), no weights: the
    part of a target tokenize reads. Not conftest's ``model_dir`` (the whole tiny Llama)."""
    directory = tmp_path_factory.mktemp("tok") / "model"
    tiny_tokenizer.build_tokenizer(directory)
    return directory


def run(tokenizer_dir, data, budget=20, workers=1, seq_length=256, **options):
    return tokenize_source(open_source(data), TokenizeSettings(
        model_dir=str(tokenizer_dir), seq_length=seq_length, roles=DEFAULT_ROLES, workers=workers,
        budget=Budget(budget), **options))


def digest(result) -> str:
    return hashlib.sha256(b"".join(a.tobytes() for a in (result.input_ids, result.loss_mask,
                                                          result.offsets))).hexdigest()


def test_quirk_set_skip_table_and_fixes(tokenizer_dir):
    tally = run(tokenizer_dir, QUIRKS).tally.manifest()
    counts = {reason: entry["count"] for reason, entry in tally["skipped"].items()}
    assert counts == {"bad_record": 1, "empty_reply": 1, "malformed_json": 1, "no_assistant_tokens": 1,
                      "no_assistant_turn": 1, "no_turns": 1, "not_utf8": 1, "same_role_run": 1,
                      "template_error": 1}
    # line 8 has a tool result: it reaches the template, which (the tiny target's) has no tool role
    assert tally["skipped"]["template_error"]["examples"] == [
        f"{QUIRKS}:8: conversation: chat template failed on messages[:3] (add_generation_prompt=False): "
        "TemplateError: unsupported role: tool"]
    assert tally["skipped"]["empty_reply"]["examples"] == [
        f"{QUIRKS}:9: turn 1 (assistant) has neither text nor tool calls"]
    assert tally["unknown_roles"] == {}
    # lines 2 and 3 start with the assistant: kept, 1 + 2 leading turns dropped
    assert tally["leading_assistant_turns_dropped"] == {"conversations": 2, "turns": 3}
    assert tally["num_records"] == 19 and tally["num_conversations"] == 10
    # line 16's first exchange alone is over 256 tokens: the later exchange is kept on its own,
    # the dropped one is counted with its location (the conversation itself is not a skip)
    assert tally["num_split_conversations"] == 1
    assert tally["dropped_exchanges"]["count"] == 1 and tally["dropped_exchanges"]["conversations"] == 1
    assert tally["dropped_exchanges"]["examples"][0].startswith(
        f"{QUIRKS}:16: exchange of turns 0-1 dropped: its prompt fills seq_length=256")
    assert 0.5 < tally["assistant_tokens_kept_fraction"] < 1.0


def test_dropped_exchanges_are_counted_in_source_turn_numbers(tokenizer_dir, tmp_path):
    long = "Read this log line by line and tell me what went wrong with the job. " * 30
    short = [{"from": "human", "value": "And now?"}, {"from": "gpt", "value": "Fixed."}]
    records = [  # 1 leading assistant turn dropped, so the long exchange is turns 1-2 of the record
        {"conversations": [{"from": "gpt", "value": "...as I said."}, {"from": "human", "value": long},
                           {"from": "gpt", "value": "Out of memory."}, *short]},
        {"conversations": [*short, {"from": "human", "value": long}, {"from": "gpt", "value": "OK."},
                           {"from": "human", "value": long}, {"from": "gpt", "value": "Same."}]},
    ]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    tally = run(tokenizer_dir, data, budget=0, seq_length=128).tally
    assert tally.num_conversations == 2 and tally.num_skipped == 0
    assert (tally.dropped_exchanges, tally.dropped_exchange_conversations) == (3, 2)
    assert [e.split(" dropped")[0] for e in tally.dropped_exchange_examples] == [
        f"{data}:1: exchange of turns 1-2", f"{data}:2: exchange of turns 2-3",
        f"{data}:2: exchange of turns 4-5"]
    # Each example names how long the exchange renders alone: more than seq_length.
    rendered = [int(re.search(r"\((\d+) tokens rendered alone\)", e).group(1))
                for e in tally.dropped_exchange_examples]
    assert len(rendered) == 3 and all(n > 128 for n in rendered), tally.dropped_exchange_examples
    assert tally.kept_tokens < tally.assistant_tokens


# Many real templates refuse a system turn anywhere but first (quirk line 18 has one).
SYSTEM_FIRST_ONLY = (
    "{%- for message in messages -%}{%- if message['role'] == 'system' and not loop.first -%}"
    "{{- raise_exception('System message must be at the beginning.') -}}{%- endif -%}{%- endfor -%}"
)


def test_template_failure_is_a_counted_skip(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.chat_template = SYSTEM_FIRST_ONLY + tokenizer.chat_template
    strict = tmp_path / "strict"
    tokenizer.save_pretrained(str(strict))
    tally = run(strict, QUIRKS).tally.manifest()
    assert tally["skipped"]["template_error"] == {"count": 2, "examples": [
        f"{QUIRKS}:8: conversation: chat template failed on messages[:3] (add_generation_prompt="
        "False): TemplateError: unsupported role: tool",
        f"{QUIRKS}:18: conversation: chat template failed on messages[:5] (add_generation_prompt="
        "False): TemplateError: System message must be at the beginning."]}
    assert tally["num_skipped"] == 10 and tally["num_conversations"] == 9
    with pytest.raises(DataError, match=rf"10 of \d+ records skipped.*\n(.*\n)*  template_error +2 .*{QUIRKS}:8"):
        run(strict, QUIRKS, budget=9)


def test_budget_as_count_and_fraction(tokenizer_dir):
    with pytest.raises(DataError, match=r"9 of \d+ records skipped, over tokenize.max_skipped=8 \(count\)"):
        run(tokenizer_dir, QUIRKS, budget=8)
    with pytest.raises(DataError, match=r"9 of 19 records skipped.*fraction") as info:
        run(tokenizer_dir, QUIRKS, budget=0.4)
    assert "template_error" in str(info.value) and f"{QUIRKS}:8" in str(info.value)
    assert run(tokenizer_dir, QUIRKS, budget=0.5).tally.num_skipped == 9


def test_long_conversation_windows_end_with_replies(tokenizer_dir):
    result = run(tokenizer_dir, QUIRKS, seq_length=256)
    offsets = result.offsets.tolist()
    for a, b in zip(offsets[:-1], offsets[1:]):
        assert b - a <= 256 and result.loss_mask[a:b].any()
    whole = run(tokenizer_dir, QUIRKS, seq_length=4096).tally.manifest()
    assert whole["assistant_tokens_kept_fraction"] == 1.0 and whole["num_split_conversations"] == 0


def test_offsets_shortcut_gives_the_prefix_strategy_masks(tokenizer_dir, monkeypatch):
    fast = digest(run(tokenizer_dir, QUIRKS))
    monkeypatch.setattr(chat, "USE_OFFSETS", False)
    assert digest(run(tokenizer_dir, QUIRKS)) == fast


def test_assistant_first_error_says_so(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    messages = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "b"}]
    with pytest.raises(chat.ChatTemplateError, match="starts with an assistant turn"):
        chat.encode_conversation(tokenizer, messages, 100, sample=4)


def test_parquet_and_datasets_dir_match_jsonl(tokenizer_dir, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from benchmarks.tokenize import generate

    jsonl = tmp_path / "c.jsonl"
    generate(jsonl, 80, seed=3)
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "c.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "c_ds"))
    expected = run(tokenizer_dir, jsonl)
    assert expected.tally.num_skipped > 0 and expected.tally.leading_dropped_conversations > 0
    for other in (tmp_path / "c.parquet", tmp_path / "c_ds"):
        got = run(tokenizer_dir, other)
        assert digest(got) == digest(expected), other
        assert got.tally.skips == expected.tally.skips


def test_max_samples_and_seeded_shuffle(tokenizer_dir):
    first = run(tokenizer_dir, QUIRKS, max_samples=7)
    assert first.tally.num_records == 7
    shuffled = [digest(run(tokenizer_dir, QUIRKS, shuffle=True, seed=s)) for s in (1, 1, 2)]
    assert shuffled[0] == shuffled[1] != shuffled[2]
    assert shuffled[0] != digest(run(tokenizer_dir, QUIRKS))


def test_hub_name_reads_the_local_cache_only(monkeypatch, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(DataError, match=r"'someone/chats' is neither .* local Hugging Face cache"):
        open_source("someone/chats")
    revision = "0" * 40
    repo = tmp_path / "hub" / "datasets--someone--chats"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    data = repo / "snapshots" / revision / "data"
    data.mkdir(parents=True)
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    pq.write_table(pa.Table.from_pylist(rows), data / "train-00000-of-00001.parquet")
    source = open_source("someone/chats")
    assert source.kind == "hub" and source.count() == 1
    assert [r[1] for r in source.stream()] == rows
    with pytest.raises(DataError, match="no parquet/JSON file of split 'test'"):
        open_source("someone/chats", split="test")


@pytest.mark.slow
def test_100k_generated_conversations_same_output_with_two_workers(tokenizer_dir, tmp_path):
    from benchmarks.tokenize import generate

    data = tmp_path / "100k.jsonl"
    quirks = generate(data, 100_000)
    one = run(tokenizer_dir, data, budget=0.05, workers=1, seq_length=2048)
    two = run(tokenizer_dir, data, budget=0.05, workers=2, seq_length=2048)
    assert digest(one) == digest(two) and one.tally.manifest() == two.tally.manifest()
    assert one.tally.leading_dropped_conversations == quirks["assistant_first"]
    assert one.tally.skips["no_turns"] == quirks["no_turns"]


def test_as_generated_gives_the_same_samples_for_a_template_without_reasoning(tokenizer_dir):
    # The tiny targets' template shows no reasoning and renders history as it was generated:
    # every reply is already in the whole render after its own prompt (windows included).
    template, as_generated = run(tokenizer_dir, QUIRKS), run(tokenizer_dir, QUIRKS, reasoning="as_generated")
    assert digest(as_generated) == digest(template)
    manifest = as_generated.tally.manifest()
    assert manifest["reasoning_trained"] == {"setting": "as_generated", "replies": 0, "tokens": 0}
    extra = manifest["as_generated"]
    assert (extra["extra_samples"], extra["extra_prefix_tokens"], extra["overhead_fraction"]) == (0, 0, 0.0)
    assert extra["samples"] == len(template.offsets) - 1 and extra["replies_as_template"]["count"] == 0


@pytest.mark.slow
def test_as_generated_keeps_the_embedded_runs_samples(tmp_path):
    """EXP=tiny and EXP=tiny-trained tokenize the embedded set with tiny-llama's tokenizer."""
    from draftline.tiny.embedded import write_conversations

    tiny_tokenizer.build_tokenizer(tmp_path / "tok")  # tiny-llama's: the default corpus
    data = tmp_path / "conversations.jsonl"
    write_conversations(data)
    template = run(tmp_path / "tok", data, budget=0, seq_length=512)
    assert digest(run(tmp_path / "tok", data, budget=0, seq_length=512, reasoning="as_generated")) == \
        digest(template)
