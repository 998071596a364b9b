"""``tokenize.reasoning: as_generated`` (issue 43): every reply of a thinking target trained as
the target generates it, after the prompt the server renders for it.

Kimi-, Qwen3- and DeepSeek-R1-style templates (tests/chat_families.py).  The expected reply of
each family is written out below from its documented output format; the expected prompt is the
template's own ``apply_chat_template(history, add_generation_prompt=True)``.  Neither comes from
the code under test.
"""

import copy
import json
from pathlib import Path

import pytest
import yaml
from chat_families import family_tokenizer
from test_tool_traces import marked, mixed_records

from draftline.cli import init
from draftline.tiny import tokenizer
from draftline.tokenize import generated
from draftline.tokenize.windows import encode_windows
from draftline.tokenize.conversations import DEFAULT_ROLES, normalize
from draftline.tokenize.encode import Budget, TokenizeSettings, tokenize_source
from draftline.tokenize.sources import open_source

TOOLS = [{"type": "function", "function": {
    "name": "book_table", "description": "Book a restaurant table.",
    "parameters": {"type": "object", "properties": {
        "people": {"type": "integer", "description": "Party size"}, "time": {"type": "string"}},
        "required": ["people", "time"]}}}]
CALL = {"id": "functions.book_table:0", "type": "function",
        "function": {"name": "book_table", "arguments": json.dumps({"people": 2, "time": "19:00"})}}
ARGS = '{"people": 2, "time": "19:00"}'
REASONING = {1: "Two plus three.", 3: "They want a booking.", 5: "It worked.", 7: "Say goodbye."}


def record(without: int | None = None) -> dict:
    """Three user turns, reasoning in every reply (but reply ``without``), one reply calling a
    tool, whose result the next reply reads."""
    def reply(k: int, content: str, **more) -> dict:
        thought = {} if k == without else {"reasoning_content": REASONING[k]}
        return {"role": "assistant", **thought, "content": content, **more}

    return {"tools": TOOLS, "messages": [
        {"role": "user", "content": "What is 2 + 3?"},
        reply(1, "5."),
        {"role": "user", "content": "Book a table for two at 7pm."},
        reply(3, "Booking it now.", tool_calls=[CALL]),
        {"role": "tool", "tool_call_id": "functions.book_table:0", "content": '{"ok": true}'},
        reply(5, "Booked for two at 19:00."),
        {"role": "user", "content": "Thanks!"},
        reply(7, "Enjoy your meal.")]}


def kimi_reply(thought: str, content: str, call: bool) -> str:
    calls = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.book_table:0"
             f"<|tool_call_argument_begin|>{ARGS}<|tool_call_end|><|tool_calls_section_end|>") if call else ""
    return f"<think>{thought}</think>{content}{calls}<|im_end|>"


def qwen3_reply(thought: str, content: str, call: bool) -> str:
    calls = f'\n<tool_call>\n{{"name": "book_table", "arguments": {ARGS}}}\n</tool_call>' if call else ""
    return f"<think>\n{thought}\n</think>\n\n{content}{calls}<|im_end|>\n"


def deepseek_r1_reply(thought: str, content: str, call: bool) -> str:
    # after the generation prompt's "<think>\n": the model writes its reasoning and closes the block
    calls = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>book_table\n"
             f"```json\n{ARGS}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>") if call else ""
    return f"{thought}\n</think>\n\n{content}{calls}<｜end▁of▁sentence｜>"


REPLIES = {"kimi": kimi_reply, "qwen3": qwen3_reply, "deepseek_r1": deepseek_r1_reply}
# Earlier reasoning each reply's prompt shows: the templates strip finished turns, but Kimi and
# Qwen3 keep the reasoning of the call whose result the reply after it reads.
VISIBLE = {"kimi": {5: [3]}, "qwen3": {5: [3]}, "deepseek_r1": {}}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tokenizer.build_tokenizer(tmp_path_factory.mktemp("tok") / "base")


@pytest.fixture(scope="module")
def families(base):
    names = ("kimi", "qwen3", "deepseek_r1", "deepseek_r1_own", "llama31")
    return {name: family_tokenizer(base, name) for name in names}


def expected(tok, family: str, messages: list[dict], tools: list[dict], k: int
             ) -> tuple[list[int], list[int]]:
    """``(prompt ids, reply ids)`` of reply ``k``: the template's prompt, then the family's reply."""
    prompt = tok.apply_chat_template(messages[:k], tools=tools, add_generation_prompt=True)
    text = tok.apply_chat_template(messages[:k], tools=tools, add_generation_prompt=True, tokenize=False)
    message = messages[k]
    reply = REPLIES[family](message.get("reasoning_content") or "", message["content"],
                            bool(message.get("tool_calls")))
    ids = tok(text + reply, add_special_tokens=False)["input_ids"]
    assert ids[: len(prompt)] == prompt  # specials at the boundary: the reply's ids follow the prompt's
    return prompt, ids[len(prompt) :]


VARIANTS = {"every": None, "first_without": 1, "after_tool_without": 5}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("family", sorted(REPLIES))
def test_each_reply_is_trained_after_its_own_prompt_and_nothing_else_is(families, family, variant):
    tok = families[family]
    normalized = normalize(record(VARIANTS[variant]))
    messages, tools = normalized.messages, normalized.tools
    windows = encode_windows(tok, messages, 4096, tools=tools, reasoning="as_generated")
    shown = "\n\n".join(marked(tok, s.input_ids, s.loss_mask) for s in windows.samples)
    replies = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    masks = [[0] * len(s.input_ids) for s in windows.samples]  # what each sample should train
    for k in replies:
        prompt, reply = expected(tok, family, messages, tools, k)
        n = len(prompt) + len(reply)
        # the one sample that trains reply k starts with its prompt and the reply (a later reply's
        # sample may go on after it, the whole render's among them)
        hosts = [i for i, s in enumerate(windows.samples)
                 if s.input_ids[:n] == prompt + reply and all(s.loss_mask[len(prompt) : n])]
        assert len(hosts) == 1, f"reply {k}:\n{shown}"
        masks[hosts[0]][len(prompt) : n] = [1] * len(reply)
        # no earlier reasoning in the prompt where the template strips it
        text = tok.decode(prompt)
        seen = [j for j in replies if j < k and messages[j].get("reasoning_content")
                and messages[j]["reasoning_content"] in text]
        assert seen == [j for j in VISIBLE[family].get(k, []) if messages[j].get("reasoning_content")], k
    # the mask is exactly the replies: nothing trained in a form the target did not write it
    assert [s.loss_mask for s in windows.samples] == masks, shown
    thoughts = [m["reasoning_content"] for m in messages if m.get("reasoning_content")]
    assert (windows.num_reasoning, windows.num_reasoning_dropped) == (len(thoughts), 0)
    assert windows.num_reasoning_tokens == sum(len(tok(t, add_special_tokens=False)["input_ids"])
                                               for t in thoughts)


# Samples and extra samples of record(): Kimi shows no reasoning in the whole render, so it is
# left out; the call and the reply reading its result share one sample (Kimi keeps the call's
# reasoning while its loop runs).  Qwen3 and the R1 style show the last reply as generated.
COUNTS = {"kimi": (3, 3, 0), "qwen3": (3, 2, 1), "deepseek_r1": (4, 3, 1)}  # samples, extra, reused


@pytest.mark.parametrize("family", sorted(COUNTS))
def test_extra_samples_and_their_prompts_are_counted(families, family):
    tok = families[family]
    normalized = normalize(record())
    windows = encode_windows(tok, normalized.messages, 4096, tools=normalized.tools, reasoning="as_generated")
    assert (len(windows.samples), windows.num_extra_samples, windows.num_reused) == COUNTS[family]
    extra = windows.samples[-windows.num_extra_samples:]
    assert windows.num_extra_prefix_tokens == sum(len(s.input_ids) - sum(s.loss_mask) for s in extra)
    assert windows.num_left_out == int(family == "kimi") and windows.as_template == []
    assert windows.num_assistant_tokens == windows.num_kept_tokens
    # a call's sample goes on through its result only where the next reply's prompt shows the call
    # as generated; there the result is marked as what regenerate must not run past
    marked_results = [tok.decode([t for t, bit in zip(s.input_ids, s.tool_results) if bit])
                      for s in windows.samples if any(s.tool_results)]
    assert len(marked_results) == int(family != "deepseek_r1")
    assert all('{"ok": true}' in text for text in marked_results)
    # the whole render trains the reasoning of the last reply at most (Kimi: of none)
    template = encode_windows(tok, normalized.messages, 4096, tools=normalized.tools)
    assert template.num_reasoning_dropped == (4 if family == "kimi" else 3)
    assert template.num_reasoning_tokens < windows.num_reasoning_tokens


def test_a_prompt_that_opens_a_think_block_history_never_shows_is_trained_as_the_template_shows_it(families):
    # DeepSeek's own rule: no render shows the reasoning, so no reply is established as generated
    tok = families["deepseek_r1_own"]
    normalized = normalize(record())
    got = encode_windows(tok, normalized.messages, 4096, tools=normalized.tools, reasoning="as_generated")
    template = encode_windows(tok, normalized.messages, 4096, tools=normalized.tools)
    assert got.samples == template.samples
    assert got.as_template == [1, 3, 5, 7]
    assert got.num_reasoning_dropped == 4 == template.num_reasoning_dropped
    assert got.num_extra_samples == 0


def test_a_template_without_reasoning_gives_the_same_samples(families):
    tok = families["llama31"]  # it shows no reasoning: the first reply's is left out everywhere
    plain = normalize(record()).messages[:3] + [{"role": "assistant", "content": "Which day?"}]
    assert encode_windows(tok, plain, 4096, reasoning="as_generated").samples == \
        encode_windows(tok, plain, 4096).samples


def test_preserve_is_the_templates_own_switch(families):
    tok = families["kimi"]
    normalized = normalize(record())
    got = encode_windows(tok, normalized.messages, 4096, tools=normalized.tools, reasoning="preserve")
    switch = encode_windows(tok, normalized.messages, 4096, tools=normalized.tools,
                            template={"preserve_thinking": True})
    assert got == switch and len(got.samples) == 1 and got.num_reasoning_dropped == 0
    # every later reply sees earlier reasoning the server strips: the first reply's, here
    assert REASONING[1] in tok.decode(got.samples[0].input_ids)


def test_long_conversations_keep_a_call_with_its_results(families):
    tok = families["qwen3"]
    messages = normalize(record()).messages
    loop = messages[2:6]  # ask, call, result, answer
    alone = encode_windows(tok, loop, 10**6, tools=TOOLS, reasoning="as_generated")
    limit = max(len(s.input_ids) for s in alone.samples) + 8  # one such exchange fits, two do not
    long = messages[:2] + [copy.deepcopy(m) for _ in range(3) for m in loop] + messages[6:]
    windows = encode_windows(tok, long, limit, tools=TOOLS, reasoning="as_generated")
    assert len(windows.samples) > 3 and not windows.dropped_exchanges
    assert windows.num_kept_tokens == windows.num_assistant_tokens  # nothing cut
    for sample in windows.samples:
        text = tok.decode(sample.input_ids)
        assert len(sample.input_ids) <= limit and text.startswith("<|im_start|>system\n# Tools")
        # every window starts at a user turn: a result never without the call before it
        assert text.count("<tool_call>") >= text.count("<tool_response>")
        assert text.find("<tool_response>") == -1 or text.find("<tool_call>") < text.find("<tool_response>")
        trained = tok.decode([t for t, bit in zip(sample.input_ids, sample.loss_mask) if bit])
        assert trained.endswith("<|im_end|>\n")


def test_reasoning_trained_before_and_after_on_a_mixed_file(families, tmp_path):
    model = tmp_path / "kimi"
    families["kimi"].save_pretrained(str(model))
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [*mixed_records(), record(), record(5)]))

    def run(reasoning):
        return tokenize_source(open_source(data), TokenizeSettings(
            model_dir=str(model), seq_length=4096, roles=DEFAULT_ROLES, budget=Budget(3), reasoning=reasoning))

    before, after = run("template"), run("as_generated")
    old, new = before.tally.manifest(), after.tally.manifest()
    assert old["reasoning"] == {"replies": 11, "dropped_by_template": 10}
    assert new["reasoning"] == {"replies": 11, "dropped_by_template": 0}
    assert old["reasoning_trained"]["setting"] == "template" and old["as_generated"] is None
    assert new["reasoning_trained"]["replies"] == 11
    assert new["reasoning_trained"]["tokens"] > old["reasoning_trained"]["tokens"]
    extra = new["as_generated"]
    assert extra["samples"] == len(after.offsets) - 1 and extra["tokens"] == len(after.input_ids)
    assert extra["overhead_fraction"] == round(extra["extra_prefix_tokens"] / extra["tokens"], 6)
    assert 0 < extra["overhead_fraction"] < 1 and extra["replies_as_template"]["count"] == 0
    assert new["num_conversations"] == old["num_conversations"] and new["num_skipped"] == old["num_skipped"]


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="tokenize.reasoning must be one of as_generated, template, "
                                         "preserve, got 'thinking'"):
        generated.check_setting("thinking")


def test_init_writes_as_generated_for_a_thinking_target(families, base):
    assert [generated.thinking_template(families[f]) for f in ("kimi", "qwen3", "deepseek_r1")] == [True] * 3
    assert not generated.thinking_template(families["llama31"]) and not generated.thinking_template(base)
    facts = init.describe("thinker", json.loads((Path(__file__).parent / "assets/qwen3-8b-shaped/config.json")
                                               .read_text()), [], 16 * 10**9, "its safetensors files")
    for on_gpu in (True, False):
        text = init.experiment_yaml(facts, on_gpu, thinking=True)
        assert yaml.safe_load(text)["tokenize"]["reasoning"] == "as_generated"
        assert "  # A thinking target: most of what it generates is reasoning" in text  # and why
        assert "reasoning" not in yaml.safe_load(init.experiment_yaml(facts, on_gpu))["tokenize"]
    # vLLM's parser for the family, which regenerate splits the target's replies with
    assert yaml.safe_load(init.model_yaml(facts, thinking=True))["reasoning_parser"] == "qwen3"
    assert yaml.safe_load(init.model_yaml(facts))["reasoning_parser"] is None


def test_make_init_on_a_thinking_target_composes_with_as_generated(families, tmp_path):
    import shutil

    from draftline.pipeline import config

    model = shutil.copytree(Path(__file__).parent / "assets/qwen3-8b-shaped", tmp_path / "thinker")
    families["qwen3"].save_pretrained(str(model))  # the Qwen3-style template in place of the plain one
    conf = tmp_path / "repo" / "conf"
    shutil.copytree(config.CONF_DIR, conf, ignore=shutil.ignore_patterns("local.yaml", "local.*.yaml"))
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(record()) + "\n")
    lines = init.init(str(model), str(data), "thinker", conf_dir=conf, on_gpu=False)
    assert any(line.endswith(": a thinking target, tokenize.reasoning=as_generated") for line in lines)
    composed = config.compose(["experiment=thinker"], conf_dir=conf)
    assert (composed.tokenize.reasoning, composed.regenerate.reasoning_parser) == ("as_generated", "qwen3")
