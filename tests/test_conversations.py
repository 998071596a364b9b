"""Loading ShareGPT/OpenAI conversations from JSON/JSONL, skip budgets (the embedded set: test_embedded)."""

import json
from pathlib import Path

import pytest

from draftline.tokenize.conversations import (
    DataError,
    Skipped,
    load_conversations,
)

SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi?"},
        {"from": "gpt", "value": "Hello."},
        {"from": "user", "value": "And?"},
        {"from": "assistant", "value": "Bye."},
    ]
}
OPENAI = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
GOOD_LINE = json.dumps(OPENAI)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --------------------------------------------------------------------------- good input


def test_sharegpt_jsonl_roles_are_normalised(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", [json.dumps(SHAREGPT), "", json.dumps(OPENAI)])
    conversations, skipped = load_conversations(path, max_skipped=0)
    assert skipped == []
    assert [m["role"] for m in conversations[0]] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in conversations[0]][1:3] == ["Hi?", "Hello."]
    assert conversations[1] == OPENAI["messages"]


def test_json_list_and_layout_sniffing_ignore_the_extension(tmp_path):
    as_list = tmp_path / "list.jsonl"
    as_list.write_text("\n  " + json.dumps([OPENAI, SHAREGPT], indent=2), encoding="utf-8")
    as_lines = write_lines(tmp_path / "lines.json", [GOOD_LINE, GOOD_LINE])
    assert len(load_conversations(as_list)[0]) == 2
    assert len(load_conversations(as_lines)[0]) == 2


# --------------------------------------------------------------------------- bad input, no budget

BAD_RECORDS = {
    "malformed JSON": '{"messages": [',
    "unknown role 'bot'": json.dumps({"messages": [{"role": "bot", "content": "x"}]}),
    "no assistant turn": json.dumps({"messages": [{"role": "user", "content": "x"}]}),
    "empty text": json.dumps(
        {"conversations": [{"from": "human", "value": " \n"}, {"from": "gpt", "value": "a"}]}
    ),
    "neither text nor tool calls": json.dumps(
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": " \n"}]}
    ),
    "not an object": json.dumps(["user", "x"]),
    "exactly one of": json.dumps({"messages": [], "conversations": []}),
    "not a string": json.dumps({"messages": [{"role": "assistant", "content": ["x"]}]}),
    "lacks 'from'": json.dumps({"conversations": [{"speaker": "gpt", "value": "x"}]}),
}


@pytest.mark.parametrize("reason", sorted(BAD_RECORDS))
def test_each_bad_jsonl_record_names_file_and_line(tmp_path, reason):
    path = write_lines(tmp_path / "bad.jsonl", [GOOD_LINE, "", BAD_RECORDS[reason], GOOD_LINE])
    with pytest.raises(DataError) as info:
        load_conversations(path, max_skipped=0)
    message = str(info.value)
    assert f"{path}:3: " in message and reason in message
    assert "1 bad record(s)" in message


def test_bad_json_list_item_names_its_index(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([OPENAI, OPENAI, {"messages": [{"role": "bot", "content": "x"}]}]))
    with pytest.raises(DataError, match=r"bad\.json\[2\]: turn 0 has unknown role 'bot'"):
        load_conversations(path)


def test_unparseable_json_list_names_line_and_column(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("[\n" + GOOD_LINE + ",\n  {oops}\n]")
    with pytest.raises(DataError, match=r"broken\.json:3:4: malformed JSON"):
        load_conversations(path, max_skipped=10)


def test_pretty_printed_object_is_read_as_jsonl_and_rejected(tmp_path):
    # Only a JSON list is a whole-file dataset; anything else is JSONL, where
    # an object spread over several lines is malformed line by line.
    path = tmp_path / "obj.json"
    path.write_text(json.dumps(OPENAI, indent=1))
    with pytest.raises(DataError, match=r"obj\.json:1: malformed JSON"):
        load_conversations(path)


def test_non_utf8_line_is_a_bad_record(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD_LINE.encode() + b"\n" + '{"x": "caf\xe9"}'.encode("latin-1") + b"\n")
    conversations, skipped = load_conversations(path, max_skipped=1)
    assert len(conversations) == 1
    assert skipped[0].where == f"{path}:2" and skipped[0].reason == "not_utf8"
    assert "not UTF-8" in skipped[0].detail


# --------------------------------------------------------------------------- skip budget


def test_skips_within_budget_are_reported(tmp_path):
    lines = [GOOD_LINE, BAD_RECORDS["malformed JSON"], GOOD_LINE, BAD_RECORDS["empty text"]]
    path = write_lines(tmp_path / "d.jsonl", lines)
    conversations, skipped = load_conversations(path, max_skipped=2)
    assert len(conversations) == 2
    assert [s.where for s in skipped] == [f"{path}:2", f"{path}:4"]
    assert isinstance(skipped[0], Skipped) and str(skipped[0]).startswith(f"{path}:2: malformed JSON")
    assert [s.reason for s in skipped] == ["malformed_json", "empty_text"]
    assert "empty text" in skipped[1].detail


def test_exceeding_the_budget_quotes_count_and_first_reasons(tmp_path):
    bad = [BAD_RECORDS[k] for k in sorted(BAD_RECORDS)]  # 9 bad records
    path = write_lines(tmp_path / "d.jsonl", [GOOD_LINE, *bad])
    with pytest.raises(DataError) as info:
        load_conversations(path, max_skipped=8)
    message = str(info.value)
    assert "9 bad record(s), more than max_skipped=8" in message
    assert f"{path}:2: " in message and f"{path}:6: " in message
    assert f"{path}:7: " not in message and "... and 4 more" in message


def test_empty_file_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no conversations loaded \(0 record"):
        load_conversations(path, max_skipped=5)


def test_all_records_skipped_is_an_error(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [BAD_RECORDS["no assistant turn"]])
    with pytest.raises(DataError, match=r"no conversations loaded \(1 record"):
        load_conversations(path, max_skipped=5)


def test_negative_budget_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="max_skipped"):
        load_conversations(write_lines(tmp_path / "d.jsonl", [GOOD_LINE]), max_skipped=-1)
