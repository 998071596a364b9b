"""Tool calls, tool results, declared tools and reasoning, rendered by family-style templates
(tests/chat_families.py) and masked exactly as the target generates them (issue 31).

Each family's expected render is written out below as literal pieces, each marked as generated
by the target or not; the token-level oracle marks a token when its characters (found by
decoding growing prefixes of the ids, not by the code under test) lie inside a generated piece.
"""

import copy
import json

import pytest
from chat_families import family_tokenizer

from draftline.tiny import tokenizer
from draftline.tokenize.chat import encode_conversation
from draftline.tokenize.windows import encode_windows
from draftline.tokenize.conversations import DEFAULT_ROLES, normalize
from draftline.tokenize.encode import Budget, TokenizeSettings, tokenize_source
from draftline.tokenize.sources import open_source
from draftline.tokenize.spans import UnfaithfulRender

TOOLS = [{"type": "function", "function": {
    "name": "book_table", "description": "Book a restaurant table.",
    "parameters": {"type": "object", "properties": {
        "people": {"type": "integer", "description": "Party size"}, "time": {"type": "string"}},
        "required": ["people", "time"]}}}]
CALL = {"id": "functions.book_table:0", "type": "function",
        "function": {"name": "book_table", "arguments": json.dumps({"people": 2, "time": "19:00"})}}
ARGS = '{"people": 2, "time": "19:00"}'


def record(reply: str = "Booking it now.") -> dict:
    """An OpenAI-style record: think, say something, call a tool, read the result, answer."""
    return {"tools": json.dumps(TOOLS), "messages": [
        {"role": "user", "content": "Book a table for two at 7pm."},
        {"role": "assistant", "reasoning_content": "They want a booking.", "content": reply,
         "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "functions.book_table:0", "content": '{"ok": true}'},
        {"role": "assistant", "reasoning_content": "It worked.", "content": "Booked for two at 19:00."}]}


KIMI_TOOLS = ("<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n"
              "// Book a restaurant table.\ntype book_table = (_: {\n// Party size\npeople: number,\n"
              "time: string,\n}) => any;\n}<|im_end|>")
KIMI_CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.book_table:0"
             f"<|tool_call_argument_begin|>{ARGS}<|tool_call_end|><|tool_calls_section_end|><|im_end|>")
KIMI_HEAD = "<|im_assistant|>assistant<|im_middle|>"
KIMI_RESULT = '<|im_system|>tool<|im_middle|>## Return of functions.book_table:0\n{"ok": true}<|im_end|>'
KIMI_USER = "<|im_user|>user<|im_middle|>Book a table for two at 7pm.<|im_end|>"


def kimi(first_think: str, last_think: str) -> list[tuple[str, int]]:
    return [(KIMI_TOOLS + KIMI_USER + KIMI_HEAD, 0),
            (f"<think>{first_think}</think>Booking it now." + KIMI_CALL, 1),
            (KIMI_RESULT + KIMI_HEAD, 0),
            (f"<think>{last_think}</think>Booked for two at 19:00.<|im_end|>", 1)]


QWEN3_SYSTEM = ("<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the "
                f"user query.\n\n<tools>\n{json.dumps(TOOLS[0])}\n</tools>\n\nReturn each call as JSON "
                "inside <tool_call></tool_call> tags.<|im_end|>\n")
QWEN3 = [
    (QWEN3_SYSTEM + "<|im_start|>user\nBook a table for two at 7pm.<|im_end|>\n<|im_start|>assistant\n", 0),
    ('<think>\nThey want a booking.\n</think>\n\n<tool_call>\n{"name": "book_table", "arguments": '
     f'{ARGS}}}\n</tool_call><|im_end|>\n', 1),
    ('<|im_start|>user\n<tool_response>\n{"ok": true}\n</tool_response><|im_end|>\n<|im_start|>assistant\n', 0),
    ("<think>\nIt worked.\n</think>\n\nBooked for two at 19:00.<|im_end|>\n", 1),
]
LLAMA_HEAD = "<|start_header_id|>assistant<|end_header_id|>\n\n"
LLAMA31 = [
    ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
     "Cutting Knowledge Date: December 2023\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
     "Given the following functions, respond with a JSON for a function call with its proper arguments "
     f"that best answers the given prompt.\n\n{json.dumps(TOOLS[0], indent=4)}\n\n"
     "Book a table for two at 7pm.<|eot_id|>" + LLAMA_HEAD, 0),
    (f'{{"name": "book_table", "parameters": {ARGS}}}<|eot_id|>', 1),
    ('<|start_header_id|>ipython<|end_header_id|>\n\n{"ok": true}<|eot_id|>' + LLAMA_HEAD, 0),
    ("Booked for two at 19:00.<|eot_id|>", 1),
]
CASES = {  # family, reply text, template arguments -> expected pieces
    # Kimi keeps reasoning only after the last reply without calls: none, in a finished trace.
    "kimi": ("kimi", "Booking it now.", {}, kimi("", "")),
    "kimi-preserve": ("kimi", "Booking it now.", {"preserve_thinking": True},
                      kimi("They want a booking.", "It worked.")),
    "qwen3": ("qwen3", "", {}, QWEN3),
    "llama31": ("llama31", "", {}, LLAMA31),  # the template shows a call instead of the text
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tokenizer.build_tokenizer(tmp_path_factory.mktemp("tok") / "base")


@pytest.fixture(scope="module")
def families(base):
    return {name: family_tokenizer(base, name) for name in ("kimi", "qwen3", "llama31")}


def oracle(tok, ids: list[int], pieces: list[tuple[str, int]]) -> list[int]:
    """1 for each token whose characters lie in a generated piece (tokens never straddle one)."""
    text = "".join(piece for piece, _ in pieces)
    generated, at = [], 0
    for piece, bit in pieces:
        generated += [bit] * len(piece)
        at += len(piece)
    ends = [len(tok.decode(ids[: i + 1])) for i in range(len(ids))]
    assert tok.decode(ids) == text
    mask = []
    for start, end in zip([0] + ends[:-1], ends):
        bits = set(generated[start:end])
        assert len(bits) == 1, f"a token straddles a piece boundary at {start}"
        mask.append(bits.pop())
    return mask


def marked(tok, ids, mask) -> str:
    """The render with ``[[...]]`` around masked runs (for reading a failure)."""
    out, inside = [], False
    for token, bit in zip(ids, mask):
        if bit != inside:
            out.append("[[" if bit else "]]")
            inside = bool(bit)
        out.append(tok.decode([token]))
    return "".join(out) + ("]]" if inside else "")


@pytest.mark.parametrize("case", sorted(CASES))
def test_ids_are_the_templates_render_and_the_mask_is_what_the_target_generates(families, case):
    family, reply, arguments, pieces = CASES[case]
    tok = families[family]
    normalized = normalize(record(reply))
    encoded = encode_conversation(tok, normalized.messages, 4096, tools=normalized.tools,
                                  template=arguments)
    rendered = tok.apply_chat_template(normalized.messages, tools=normalized.tools, **arguments)
    assert encoded.input_ids == rendered
    expected = oracle(tok, rendered, pieces)
    assert encoded.loss_mask == expected, marked(tok, encoded.input_ids, encoded.loss_mask)
    # the tool result (and the next reply's header) is what regenerate must not pass with a new call
    marks = [i for i, bit in enumerate(encoded.tool_results) if bit]
    assert tok.decode([encoded.input_ids[i] for i in marks]) == pieces[2][0]


def test_tools_reach_the_template_and_kimi_reasoning_is_counted(families):
    tok = families["kimi"]
    normalized = normalize(record())
    without = encode_conversation(tok, normalized.messages, 4096)
    with_tools = encode_windows(tok, normalized.messages, 4096, tools=normalized.tools)
    assert len(with_tools.samples[0].input_ids) > len(without.input_ids)
    assert (with_tools.num_reasoning, with_tools.num_reasoning_dropped) == (2, 2)
    kept = encode_windows(tok, normalized.messages, 4096, tools=normalized.tools,
                          template={"preserve_thinking": True})
    assert (kept.num_reasoning, kept.num_reasoning_dropped) == (2, 0)


def test_inline_think_renders_like_reasoning_content(families):
    tok = families["kimi"]
    inline = record()
    reply = inline["messages"][1]
    del reply["reasoning_content"]
    reply["content"] = "<think>They want a booking.</think>Booking it now."
    normalized = normalize(inline)
    assert normalized.fixes == {"inline_think": 1}
    expected = normalize(record())
    template = {"preserve_thinking": True}
    assert encode_conversation(tok, normalized.messages, 4096, tools=normalized.tools, template=template) \
        == encode_conversation(tok, expected.messages, 4096, tools=expected.tools, template=template)


@pytest.mark.parametrize("family, change, reason", [
    ("kimi", "no_tools_in_template", "tools_not_rendered"),
    ("kimi", "no_calls_in_template", "tool_call_not_rendered"),
    ("llama31", "text_beside_call", "reply_not_rendered"),
])
def test_a_render_that_leaves_part_of_the_record_out_is_a_named_skip(families, family, change, reason):
    tok = copy.deepcopy(families[family])
    normalized = normalize(record())  # its first reply has text beside its call
    if change == "no_tools_in_template":
        tok.chat_template = tok.chat_template.replace("{% if tools %}", "{% if false %}")
    if change == "no_calls_in_template":
        tok.chat_template = tok.chat_template.replace("{% if m.get('tool_calls') %}<|tool_calls",
                                                      "{% if false %}<|tool_calls")
    with pytest.raises(UnfaithfulRender) as info:
        encode_conversation(tok, normalized.messages, 4096, tools=normalized.tools)
    assert info.value.reason == reason


# --------------------------------------------------------------------------- the mixed file


def mixed_records() -> list[dict]:
    plain = {"messages": [{"role": "user", "content": "Name a prime."},
                          {"role": "assistant", "content": "Seven."}]}
    thinking = {"messages": [{"role": "user", "content": "Is 91 prime?"},
                             {"role": "assistant", "content": "<think>7 times 13.</think>No: 7 x 13."}]}
    declared_only = {"tools": TOOLS, "messages": [{"role": "user", "content": "Hi."},
                                                  {"role": "assistant", "content": "Hello."}]}
    call_pending = {"tools": TOOLS, "messages": record()["messages"][:2]}
    sharegpt = {"tools": json.dumps([TOOLS[0]["function"]]), "conversations": [
        {"from": "human", "value": "Book for two at 7pm."},
        {"from": "function_call", "value": json.dumps({"name": "book_table", "arguments": {"people": 2}})},
        {"from": "observation", "value": '{"ok": true}'},
        {"from": "gpt", "value": "Done."}]}
    empty = {"messages": [{"role": "user", "content": "Anything?"}, {"role": "assistant", "content": ""}]}
    doubled = {"messages": [{"role": "user", "content": "Why?"},
                            {"role": "assistant", "content": "<think>a</think>b<think>c</think>d"}]}
    return [plain, record(), thinking, declared_only, call_pending, sharegpt, empty, doubled]


def test_mixed_file_skip_table_and_kept_fraction(families, tmp_path):
    model = tmp_path / "kimi"
    families["kimi"].save_pretrained(str(model))
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in mixed_records()))
    result = tokenize_source(open_source(data), TokenizeSettings(
        model_dir=str(model), seq_length=4096, roles=DEFAULT_ROLES, budget=Budget(3)))
    manifest = result.tally.manifest()
    # ShareGPT calls carry no id, and Kimi's call section names the tool only through its id
    assert {k: v["count"] for k, v in manifest["skipped"].items()} == {
        "empty_reply": 1, "inline_think": 1, "tool_call_not_rendered": 1}
    assert manifest["num_conversations"] == 5 and manifest["assistant_tokens_kept_fraction"] == 1.0
    assert manifest["normalized"] == {"inline_think": 1}
    # Kimi keeps reasoning only after the last reply without calls: records 2 (two replies) and 3
    # (one) are finished, so all three are dropped; record 5's call awaits its result: kept.
    assert manifest["reasoning"] == {"replies": 4, "dropped_by_template": 3}
    assert manifest["num_samples_with_tool_results"] == 1
    assert result.tool_results is not None and len(result.tool_results) == len(result.input_ids)


def test_exchanges_keep_a_call_with_its_results():
    from draftline.tokenize import chat

    roles = ["system", "user", "assistant", "tool", "tool", "assistant", "user", "assistant", "tool"]
    messages = [{"role": role, "content": role} for role in roles]
    # the trailing result has no reply after it: the last exchange ends at its call
    assert chat._exchanges(messages) == (1, [(1, 6), (6, 8)])
