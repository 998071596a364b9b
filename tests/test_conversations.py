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


# --------------------------------------------------------------------------- tool traces (issue 31)
from draftline.tokenize.conversations import RecordSkip, normalize

BOOK = {"name": "book_table", "parameters": {"type": "object", "properties": {}}}
CALL = {"type": "function", "function": {"name": "book_table", "arguments": {"people": 2}}}


def test_sharegpt_calls_and_observations_become_openai_shape():
    record = {"tools": json.dumps([BOOK]), "conversations": [
        {"from": "human", "value": "Book it."}, {"from": "gpt", "value": "On it."},
        {"from": "function_call", "value": json.dumps({"name": "book_table", "arguments": {"people": 2}})},
        {"from": "observation", "value": "ok"}, {"from": "gpt", "value": "Done."}]}
    normalized = normalize(record)
    assert normalized.messages == [
        {"role": "user", "content": "Book it."},
        {"role": "assistant", "content": "On it.", "tool_calls": [CALL]},  # joined to the reply before
        {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "Done."}]
    assert normalized.tools == [{"type": "function", "function": BOOK}]


def test_openai_calls_keep_ids_and_string_arguments_are_parsed_like_vllm():
    record = {"tools": [{"type": "function", "function": BOOK}], "messages": [
        {"role": "user", "content": "Book it."},
        {"role": "assistant", "content": None, "reasoning": "Easy.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "book_table", "arguments": '{"people": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "book_table", "content": ""},
        {"role": "assistant", "content": "Done.", "function_call": {"name": "book_table", "arguments": ""}},
        {"role": "function", "name": "book_table", "content": "ok"},
        {"role": "assistant", "content": "Twice."}]}
    messages = normalize(record).messages
    assert messages[1] == {"role": "assistant", "content": "", "reasoning_content": "Easy.",
                           "tool_calls": [{"id": "c1", **CALL}]}
    assert messages[2] == {"role": "tool", "content": "", "tool_call_id": "c1", "name": "book_table"}
    assert messages[3]["tool_calls"] == [{"type": "function", "function": {"name": "book_table", "arguments": {}}}]
    assert messages[4] == {"role": "tool", "content": "ok", "name": "book_table"}


@pytest.mark.parametrize("content, reasoning, moved", [
    ("<think>\nplan\n</think>\n\nanswer", None, ("answer", "plan")),
    ("plan</think>answer", None, ("answer", "plan")),  # the prompt opened the block (Qwen3)
    ("plain answer", "plan", ("plain answer", "plan")),
])
def test_inline_reasoning_moves_to_reasoning_content(content, reasoning, moved):
    reply = {"role": "assistant", "content": content, **({"reasoning_content": reasoning} if reasoning else {})}
    normalized = normalize({"messages": [{"role": "user", "content": "q"}, reply]})
    assert (normalized.messages[1]["content"], normalized.messages[1]["reasoning_content"]) == moved
    assert normalized.fixes == ({"inline_think": 1} if reasoning is None else {})


@pytest.mark.parametrize("reply, tools, reason", [
    ({"content": "a<think>b</think>"}, None, "inline_think"),
    ({"content": "<think>b</think>a", "reasoning_content": "c"}, None, "inline_think"),
    ({"content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}, None, "bad_tool_call"),
    ({"content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}, None, "bad_tool_call"),
    ({"content": "a"}, "[{", "bad_tools"),
    ({"content": "a"}, [{"description": "no name"}], "bad_tools"),
    ({"content": " "}, None, "empty_reply"),
])
def test_tool_traces_that_cannot_be_mapped_are_named_skips(reply, tools, reason):
    record = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", **reply}]}
    if tools is not None:
        record["tools"] = tools
    with pytest.raises(RecordSkip) as info:
        normalize(record)
    assert info.value.reason == reason


def test_leading_tool_results_go_with_leading_replies():
    record = {"messages": [{"role": "system", "content": "s"}, {"role": "tool", "content": "late"},
                           {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                           {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"},
                           {"role": "assistant", "content": "b"}]}
    normalized = normalize(record)
    assert normalized.dropped_leading == 1
    assert [m["role"] for m in normalized.messages] == ["system", "user", "assistant", "tool", "tool", "assistant"]
