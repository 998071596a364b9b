"""regenerate with ``tokenize.reasoning=as_generated`` (issue 43, draftline/regenerate/turns.py):
a thinking target's replies, each generated after the prompt the server renders, split by vLLM's
own reasoning parser for the family, come out as the samples tokenize makes of the same replies
from data.

The target here is scripted: for reply k it writes the family's documented output for
test_reasoning_as_generated's record (reasoning, end of thinking, text, calls, end of turn),
so the data's replies and the target's are the same text and the samples must be the same.
The reasoning parsers are vLLM's (kimi_k2, qwen3, deepseek_r1).
"""

import copy

import pytest
from chat_families import family_tokenizer
from test_reasoning_as_generated import REASONING, REPLIES, record
from test_tool_traces import marked

from draftline.regenerate import turns
from draftline.tokenize.windows import encode_windows
from draftline.tokenize.conversations import normalize
from draftline.tiny import builders, tokenizer

PARSERS = {"kimi": "kimi_k2", "qwen3": "qwen3", "deepseek_r1": "deepseek_r1"}
STOP = {"kimi": "<|im_end|>", "qwen3": "<|im_end|>", "deepseek_r1": "<｜end▁of▁sentence｜>"}
# what each reply's prompt holds last, to tell which reply the scripted target is asked for
CUES = {1: "What is 2 + 3?", 3: "Book a table", 5: '{"ok": true}', 7: "Thanks!"}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    base = tokenizer.build_tokenizer(tmp_path_factory.mktemp("tok") / "base")
    return {name: family_tokenizer(base, name) for name in PARSERS}


def scripted(tok, family: str, messages: list[dict], calls: list[int]):
    """The target: after a prompt, the family's output of the reply the prompt asks for."""
    def generate(prompts: list[list[int]], caps: list[int]) -> list[tuple[list[int], bool]]:
        out = []
        for prompt in prompts:
            text = tok.decode(prompt)
            calls.append(text)
            k = max(k for k, cue in CUES.items() if cue in text)
            m = messages[k]
            reply = REPLIES[family](m.get("reasoning_content") or "", m["content"], bool(m.get("tool_calls")))
            reply = reply[: reply.index(STOP[family]) + len(STOP[family])]  # the target stops there
            ids = tok(text + reply, add_special_tokens=False)["input_ids"][len(prompt):]
            out.append((ids, True))
        return out
    return generate


def pairs(ids: list[list[int]], masks: list[list[int]]) -> list[tuple[tuple, tuple]]:
    """Every trained reply as ``(its prompt ids, its ids)``: what the samples say was generated where."""
    out = []
    for sample, mask in zip(ids, masks, strict=True):
        i = 0
        while i < len(mask):
            if mask[i]:
                j = i
                while j < len(mask) and mask[j]:
                    j += 1
                out.append((tuple(sample[:i]), tuple(sample[i:j])))
                i = j
            else:
                i += 1
    return sorted(out)


def run(tok, family, messages, tools, generate, parser=None):
    split = turns.ReplySplitter(tok, PARSERS[family] if parser is None else parser,
                                [tok.convert_tokens_to_ids(STOP[family])], None)
    rec = {"where": "record 0", "messages": messages, "tools": tools}
    return turns.regenerate([rec], tok, generate, split, 4096, None)


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_each_target_reply_is_trained_after_the_prompt_the_server_renders_from_the_split_history(families, family):
    tok = families[family]
    normalized = normalize(record())
    messages, tools = normalized.messages, normalized.tools
    prompts: list[str] = []
    ids, masks, conversations, stats, examples = run(tok, family, messages, tools,
                                                     scripted(tok, family, messages, prompts))
    shown = "\n\n".join(marked(tok, i, m) for i, m in zip(ids, masks))
    assert (stats.replies, stats.stopped, stats.tool_stops, stats.dropped_turns) == (4, 4, 0, 0)
    # every reply's reasoning split off by the family's parser
    assert stats.with_reasoning == 4
    history = conversations[0]["messages"]
    replies = [k for k, m in enumerate(history) if m["role"] == "assistant"]
    assert [history[k]["reasoning_content"].strip() for k in replies] == [REASONING[k] for k in (1, 3, 5, 7)]
    assert all("</think>" not in history[k]["content"] for k in replies)
    # each reply trained after apply_chat_template(its history as regenerated, generation
    # prompt), masked exactly on what the target wrote
    want = []
    for k in replies:
        prompt = tok.apply_chat_template(history[:k], tools=tools, add_generation_prompt=True)
        m = messages[k]
        text = REPLIES[family](m["reasoning_content"], m["content"], bool(m.get("tool_calls")))
        text = text[: text.index(STOP[family]) + len(STOP[family])]
        full = tok(tok.decode(prompt) + text, add_special_tokens=False)["input_ids"]
        want.append((tuple(prompt), tuple(full[len(prompt):])))
    assert pairs(ids, masks) == sorted(want), shown
    # no earlier reasoning in a later prompt beyond what the template keeps (Kimi and Qwen3:
    # the call's, while its result is read)
    kept = {"kimi": {5: [3]}, "qwen3": {5: [3]}, "deepseek_r1": {}}[family]
    for k, text in zip((1, 3, 5, 7), prompts, strict=True):
        assert [j for j in (1, 3, 5) if j < k and REASONING[j] in text] == kept.get(k, []), (k, text)
    if family == "deepseek_r1":
        # R1's content keeps the "\n\n" after </think>, which its template shows as is: the
        # server's history is not the data's, and the record does not render back (counted)
        assert (stats.rerendered, stats.rerender_differs) == (1, 3), examples
        return
    # the records render back to the ids generated: tokenize trains them the same way.  Kimi's
    # split gives back the data's messages, so the data's samples too; Qwen3's text keeps the
    # "\n\n" after </think>, which its template shows in finished turns: later prompts differ.
    assert (stats.rerendered, stats.rerender_differs) == (4, 0), examples
    others = [encode_windows(tok, history, 4096, tools=tools, reasoning="as_generated")]
    if family == "kimi":
        others.append(encode_windows(tok, messages, 4096, tools=tools, reasoning="as_generated"))
    stop = tok.convert_tokens_to_ids(STOP[family])
    for other in others:  # tokenize's reply goes on to the template's end of turn (Qwen3: "\n")
        theirs = pairs([s.input_ids for s in other.samples], [s.loss_mask for s in other.samples])
        assert pairs(ids, masks) == sorted((p, r[: r.index(stop) + 1]) for p, r in theirs)


def test_a_call_other_than_the_data_s_ends_the_conversation_after_it(families):
    tok = families["kimi"]
    normalized = normalize(record())
    messages, tools = normalized.messages, normalized.tools
    target = copy.deepcopy(messages)
    target[3]["reasoning_content"] = "They want a table; book it."  # another reply than the data's
    ids, masks, conversations, stats, _ = run(tok, "kimi", messages, tools, scripted(tok, "kimi", target, []))
    assert (stats.replies, stats.tool_stops, stats.dropped_turns) == (2, 1, 2)
    last = conversations[0]["messages"][-1]
    assert last["role"] == "assistant" and last["reasoning_content"] == "They want a table; book it."
    # the target's call is trained as it wrote it, after its own prompt, and nothing after it
    prompt = tok.apply_chat_template(messages[:3], tools=tools, add_generation_prompt=True)
    assert any(s[: len(prompt)] == prompt and m[len(prompt):] == [1] * (len(s) - len(prompt))
               for s, m in zip(ids, masks))
    assert not any('{"ok": true}' in tok.decode(s) for s in ids)


def test_without_the_parser_reasoning_stays_in_the_history_and_the_records_say_so(families):
    # the break the parser prevents: the whole output as text, reasoning and all, so a later
    # prompt carries reasoning the server strips
    tok = families["kimi"]
    normalized = normalize(record())
    messages, tools = normalized.messages, normalized.tools
    prompts: list[str] = []
    ids, masks, _, stats, _ = run(tok, "kimi", messages, tools, scripted(tok, "kimi", messages, prompts), parser="")
    assert REASONING[1] in prompts[1]
    data = encode_windows(tok, messages, 4096, tools=tools, reasoning="as_generated")
    assert pairs(ids, masks) != pairs([s.input_ids for s in data.samples], [s.loss_mask for s in data.samples])
    assert stats.with_reasoning == 0


def test_an_unknown_parser_names_vllm_s():
    with pytest.raises(ValueError, match="kimi_k2"):
        turns.ReplySplitter(None, "kimi", [0], None)


def test_samples_share_where_a_reply_starts_a_later_one():
    pieces = [([1, 2], [3, 4]), ([9], [8]), ([1, 2, 3, 4, 5], [6])]
    assert turns._merge(pieces) == [([9, 8], [0, 1]), ([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1])]


def test_a_prompt_with_no_room_is_counted_not_generated(families):
    tok = families["qwen3"]
    normalized = normalize(record())
    split = turns.ReplySplitter(tok, "qwen3", [tok.convert_tokens_to_ids("<|im_end|>")], None)
    rec = {"where": "record 0", "messages": normalized.messages, "tools": normalized.tools}
    ids, _, conversations, stats, examples = turns.regenerate(
        [rec], tok, scripted(tok, "qwen3", normalized.messages, []), split, 12, None)
    assert (ids, conversations, stats.no_room, stats.dropped_turns) == ([], [], 1, 4)
    assert "record 0: turn 1" in examples["no_room"][0]


@pytest.mark.vllm
@pytest.mark.long  # about 20 s on 2 cores: two vLLM engines
def test_the_vllm_engine_regenerates_each_reply_after_the_servers_prompt(tmp_path, monkeypatch):
    """A random Llama with the Kimi thinking template on the real vLLM CPU engine: every
    trained reply is the engine's greedy continuation of the prompt rendered from the history
    regenerated before it.  A random target never writes its end of turn, so a token of its own
    first reply stands in as the stop token, and conversations go on past their first reply."""
    from transformers import AutoTokenizer

    from draftline.engine import EngineOptions
    from draftline.regenerate import greedy

    model_dir = builders.build_tiny_llama(tmp_path / "m", num_layers=2, chat="kimi")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    records = [{"where": f"r{i}", "messages": [
        {"role": "user", "content": question}, {"role": "assistant", "content": "A."},
        {"role": "user", "content": "And then?"}, {"role": "assistant", "content": "B."}]}
        for i, question in enumerate(("What is `abc`?", "Explain `json.dumps`."))]
    first = tok.apply_chat_template(records[0]["messages"][:1], add_generation_prompt=True)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    options = EngineOptions(target=str(model_dir), dtype="float32", max_model_len=512,
                            max_num_seqs=4, gpu_memory_utilization=0.5)
    probe = greedy.VllmReplies(options, [tok.eos_token_id], max_num_batched_tokens=256)
    try:
        stop = probe([first], [12])[0][0][4]
    finally:
        probe.shutdown()
    engine = greedy.VllmReplies(options, [stop], max_num_batched_tokens=256)
    try:
        split = turns.ReplySplitter(tok, "kimi_k2", [stop], None)
        ids, masks, conversations, stats, _ = turns.regenerate(records, tok, engine, split, 400, 12)
        trained = pairs(ids, masks)
        again = engine([list(p) for p, _ in trained], [12] * len(trained))
    finally:
        engine.shutdown()
    assert stats.stopped >= 1 and any(
        sum(m["role"] == "assistant" for m in c["messages"]) == 2 for c in conversations), stats
    assert [tuple(reply) for reply, _ in again] == [reply for _, reply in trained]
    # the records hold the target's replies (split), never the data's
    assert all(m["content"] not in ("A.", "B.") for c in conversations for m in c["messages"]
               if m["role"] == "assistant")
    prompts = set()
    for c in conversations:
        history = c["messages"]
        for k in (1, 3):
            if k < len(history):  # the second reply's prompt holds the first as the target wrote it, split
                prompts.add(tuple(tok.apply_chat_template(history[:k], add_generation_prompt=True)))
    assert prompts <= {p for p, _ in trained} and len(prompts) >= 2  # a capped reply has no record
