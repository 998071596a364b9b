"""Assistant-only loss masks for fast and slow (offset-less) tokenizers.

The slow tokenizer is transformers' pure-Python ``GPT2Tokenizer`` built from the
vocab and merges of tiny.py's fast byte-level BPE, so both tokenize identically
and their masks must agree position by position.  ``CharTokenizer`` is a
minimal slow tokenizer whose multi-character pieces can straddle message
boundaries, to drive the fallback paths.
"""

import copy
import json
from pathlib import Path

import pytest
from transformers import GPT2Tokenizer, PreTrainedTokenizer, PreTrainedTokenizerFast

from draftline.tiny import tokenizer as tiny_tokenizer
from draftline.tokenize.chat import (
    ChatTemplateError,
    EmptyLossMaskError,
    assistant_char_spans,
    encode_conversation,
    tokenize_conversation,
)
from draftline.tiny.embedded import write_conversations
from draftline.errors import DataError
from draftline.tokenize.conversations import load_conversations

END = tiny_tokenizer.END
CONVERSATION = [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "What does `json.dumps` do?"},
    {"role": "assistant", "content": "Serialize obj to a JSON formatted str."},
    {"role": "user", "content": "And `json.loads`?\n"},
    {"role": "assistant", "content": "  Deserialize s (a str, bytes or bytearray) to a Python object. ✓\n"},
]


# --------------------------------------------------------------------------- tokenizers


def slow_twin(fast_dir: Path, out_dir: Path) -> GPT2Tokenizer:
    """The pure-Python GPT-2 BPE with the same vocab, merges, specials and template."""
    model = json.loads((fast_dir / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    out_dir.mkdir()
    (out_dir / "vocab.json").write_text(json.dumps(model["vocab"]), encoding="utf-8")
    merges = ["#version: 0.2"] + [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    (out_dir / "merges.txt").write_text("\n".join(merges) + "\n", encoding="utf-8")
    slow = GPT2Tokenizer(
        str(out_dir / "vocab.json"),
        str(out_dir / "merges.txt"),
        bos_token=tiny_tokenizer.BOS,
        eos_token=tiny_tokenizer.EOS,
        pad_token=tiny_tokenizer.PAD,
        unk_token=None,
        additional_special_tokens=tiny_tokenizer.SPECIAL_TOKENS[3:],
    )
    slow.chat_template = tiny_tokenizer.CHAT_TEMPLATE
    return slow


class CharTokenizer(PreTrainedTokenizer):
    """Greedy longest match over ``pieces``, else single characters; no offsets.

    ``prefix_space`` prepends a space to every encoded chunk, like SentencePiece's
    dummy prefix, which makes separately encoded segments decode differently.
    """

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, pieces=(), prefix_space=False, **kwargs):
        tokens = ["<unk>", *(chr(c) for c in range(32, 127)), "\n", *pieces]
        self._vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
        self._by_id = {i: t for t, i in self._vocab.items()}
        self._pieces = sorted(pieces, key=len, reverse=True)
        self._prefix_space = prefix_space
        super().__init__(unk_token="<unk>", **kwargs)

    @property
    def vocab_size(self):
        return len(self._vocab)

    def get_vocab(self):
        return dict(self._vocab)

    def _tokenize(self, text, **kwargs):
        text = " " + text if self._prefix_space else text
        out, i = [], 0
        while i < len(text):
            piece = next((p for p in self._pieces if text.startswith(p, i)), text[i])
            out.append(piece)
            i += len(piece)
        return out

    def _convert_token_to_id(self, token):
        return self._vocab.get(token, 0)

    def _convert_id_to_token(self, index):
        return self._by_id.get(index, "<unk>")

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)


# Plain-text template: boundaries are not special tokens, so ": " and "\nu"
# pieces merge across them ("assistant:" | " Hi" and "...\n" | "user:").
PLAIN_TEMPLATE = (
    "{%- for m in messages -%}{{ m['role'] + ':' + m['content'] + '\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}assistant:{%- endif -%}"
)
PLAIN_CONVERSATION = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": " Hello there"},
    {"role": "user", "content": "More"},
    {"role": "assistant", "content": " Bye"},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    fast = tiny_tokenizer.build_tokenizer(root / "fast")
    return fast, slow_twin(root / "fast", root / "slow")


@pytest.fixture(scope="module")
def fast(tokenizers):
    return tokenizers[0]


@pytest.fixture(scope="module")
def default_conversations(tmp_path_factory):
    path = tmp_path_factory.mktemp("conv") / "c.jsonl"
    write_conversations(path, max_bytes=60_000)
    return load_conversations(path)[0]


def with_template(base: PreTrainedTokenizerFast, template: str) -> PreTrainedTokenizerFast:
    """A copy of ``base`` (special tokens included) with another chat template."""
    tok = copy.deepcopy(base)
    tok.chat_template = template
    return tok


def masked_runs(tokenizer, ids, mask) -> list[str]:
    """Decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for token, bit in zip(ids + [None], mask + [0]):
        if bit:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current, skip_special_tokens=False))
            current = []
    return runs


def unmasked_text(tokenizer, ids, mask) -> str:
    return tokenizer.decode([t for t, m in zip(ids, mask) if not m], skip_special_tokens=False)


# --------------------------------------------------------------------------- the two tokenizers


def test_slow_twin_is_really_slow(tokenizers):
    _, slow = tokenizers
    assert not isinstance(slow, PreTrainedTokenizerFast) and not slow.is_fast
    with pytest.raises(NotImplementedError):
        slow("x", return_offsets_mapping=True)


@pytest.mark.parametrize("which", ["fast", "slow"])
def test_mask_covers_exactly_assistant_content_and_end(tokenizers, which):
    tok = tokenizers[0 if which == "fast" else 1]
    ids, mask = tokenize_conversation(tok, CONVERSATION, max_length=4096)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assistant = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert masked_runs(tok, ids, mask) == [text + END for text in assistant]
    rest = unmasked_text(tok, ids, mask)
    for message in CONVERSATION:
        if message["role"] != "assistant":
            assert message["content"] in rest
    assert rest.endswith(tiny_tokenizer.ASSISTANT) and tok.decode(ids, skip_special_tokens=False).startswith(tiny_tokenizer.BOS)


def test_fast_and_slow_agree_with_each_other_and_with_generation_blocks(tokenizers, default_conversations):
    fast, slow = tokenizers
    for index, messages in enumerate([CONVERSATION, *default_conversations[:40]]):
        got_fast = encode_conversation(fast, messages, 100_000, sample=index)
        got_slow = encode_conversation(slow, messages, 100_000, sample=index)
        assert got_fast.strategy == got_slow.strategy == "prefix"
        assert got_slow.input_ids == got_fast.input_ids, index
        assert got_slow.loss_mask == got_fast.loss_mask, index
        # tiny.py's template marks assistant turns with {% generation %}; HF's own
        # mask (fast tokenizers only) must agree with ours.
        ref = fast.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        assert ref["input_ids"] == got_fast.input_ids and ref["assistant_masks"] == got_fast.loss_mask


# --------------------------------------------------------------------------- truncation, empty masks


def test_truncation_is_counted(fast):
    full = encode_conversation(fast, CONVERSATION, 4096)
    cut = encode_conversation(fast, CONVERSATION, len(full.input_ids) - 5)
    assert full.num_truncated == 0 and cut.num_truncated == 5
    assert cut.input_ids == full.input_ids[:-5] and cut.loss_mask == full.loss_mask[:-5]


def test_truncating_away_every_assistant_token_raises(fast):
    first_masked = encode_conversation(fast, CONVERSATION, 4096).loss_mask.index(1)
    with pytest.raises(EmptyLossMaskError, match=r"sample 17: no assistant tokens after truncating"):
        tokenize_conversation(fast, CONVERSATION, first_masked, sample=17)
    assert issubclass(EmptyLossMaskError, DataError)  # skippable under a loader-style budget


def test_conversation_without_assistant_turn_raises(fast):
    with pytest.raises(EmptyLossMaskError, match="sample 3: no assistant tokens"):
        tokenize_conversation(fast, CONVERSATION[:2], 4096, sample=3)


def test_bad_arguments_raise(fast):
    with pytest.raises(ValueError, match="max_length"):
        tokenize_conversation(fast, CONVERSATION, 0)
    with pytest.raises(ChatTemplateError, match="no messages"):
        tokenize_conversation(fast, [], 10)


def test_template_failure_names_the_sample(fast):
    messages = [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]
    expected = r"sample row-9: chat template failed on messages\[:2\].*unsupported role: tool"
    with pytest.raises(ChatTemplateError, match=expected):
        tokenize_conversation(fast, messages, 100, sample="row-9")


# --------------------------------------------------------------------------- fallbacks


def test_boundary_merges_fall_back_to_segments():
    tok = CharTokenizer(pieces=[": ", "\nu"])
    tok.chat_template = PLAIN_TEMPLATE
    encoded = encode_conversation(tok, PLAIN_CONVERSATION, 1000)
    assert encoded.strategy == "segments"
    ids, mask = encoded.input_ids, encoded.loss_mask
    assert masked_runs(tok, ids, mask) == [" Hello there\n", " Bye\n"]
    assert tok.decode(ids) == "user:Hi\nassistant: Hello there\nuser:More\nassistant: Bye\n"


def test_plain_template_without_merges_uses_prefix():
    tok = CharTokenizer()
    tok.chat_template = PLAIN_TEMPLATE
    encoded = encode_conversation(tok, PLAIN_CONVERSATION, 1000)
    assert encoded.strategy == "prefix"
    assert masked_runs(tok, encoded.input_ids, encoded.loss_mask) == [" Hello there\n", " Bye\n"]


def test_unrecoverable_tokenizer_raises_naming_the_sample():
    tok = CharTokenizer(pieces=[": "], prefix_space=True)
    tok.chat_template = PLAIN_TEMPLATE
    with pytest.raises(ChatTemplateError, match=r"sample 5: token ids are not a prefix.*first difference"):
        tokenize_conversation(tok, PLAIN_CONVERSATION, 1000, sample=5)


def test_history_rewriting_template_is_masked_by_content_search(fast):
    # Only the *last* assistant turn gets an empty think block, as reasoning
    # templates do; earlier renders are then not prefixes of the full one.
    template = tiny_tokenizer.CHAT_TEMPLATE.replace(
        "{{- message['content'] + '<|end|>' -}}",
        "{%- if loop.last -%}{{- '<think></think>' -}}{%- endif -%}{{- message['content'] + '<|end|>' -}}",
    )
    tok = with_template(fast, template)
    full, spans = assistant_char_spans(tok, CONVERSATION)
    assert full.startswith(tiny_tokenizer.BOS) and fast.chat_template == tiny_tokenizer.CHAT_TEMPLATE
    assert [full[a:b] for a, b in spans] == [
        CONVERSATION[2]["content"] + END,
        "<think></think>" + CONVERSATION[4]["content"] + END,
    ]
    ids, mask = tokenize_conversation(tok, CONVERSATION, 4096)
    assert masked_runs(tok, ids, mask) == [full[a:b] for a, b in spans]


def test_generation_prompt_differing_from_history_is_excluded(fast):
    # The prompt opens a think block that history never shows: the span starts
    # where prompt and history diverge, right after the role header.
    template = tiny_tokenizer.CHAT_TEMPLATE.replace(
        "{{- '<|assistant|>' -}}{%- endif -%}", "{{- '<|assistant|><think>' -}}{%- endif -%}"
    )
    tok = with_template(fast, template)
    ids, mask = tokenize_conversation(tok, CONVERSATION, 4096)
    assistant = [m["content"] + END for m in CONVERSATION if m["role"] == "assistant"]
    assert masked_runs(tok, ids, mask) == assistant


# --------------------------------------------------------------------------- exact behaviour (issue 11)
# Mutation testing (make mutation) showed the tests above check masks through decoded runs and
# error messages through prefixes; these pin exact spans, masks, windows and messages, and reach
# the private helpers whose wrong answers the fallbacks would otherwise hide (a broken offsets
# shortcut falls back to the prefix strategy and gives the same masks, only slower).

import re

from draftline.tokenize import chat
from draftline.tokenize.windows import encode_windows


def exact(message: str) -> str:
    """A ``pytest.raises(match=...)`` pattern for exactly ``message``."""
    return "^" + re.escape(message) + "$"


def char_tokenizer(template: str, **kwargs) -> CharTokenizer:
    tok = CharTokenizer(**kwargs)
    tok.chat_template = template
    return tok


def turns(*pairs) -> list[dict]:
    return [{"role": role, "content": content} for role, content in pairs]


# ---- labels and error messages


def test_error_messages_name_the_sample_or_the_conversation(fast):
    with pytest.raises(ChatTemplateError, match=exact("conversation: no messages")):
        assistant_char_spans(fast, [])
    with pytest.raises(ChatTemplateError, match=exact("sample 7: no messages")):
        assistant_char_spans(fast, [], sample=7)
    messages = turns(("system", "s"), ("assistant", "a"), ("user", "u"), ("assistant", "b"))
    with pytest.raises(ChatTemplateError, match=exact(
            "sample 2: the conversation starts with an assistant turn; chat templates need a user turn "
            "before the first reply (the loader drops leading assistant turns)")):
        assistant_char_spans(fast, messages, sample=2)
    tool = turns(("tool", "x"), ("assistant", "y"))
    with pytest.raises(ChatTemplateError, match=exact(
            "sample row-9: chat template failed on messages[:2] (add_generation_prompt=False): "
            "TemplateError: unsupported role: tool")):
        tokenize_conversation(fast, tool, 100, sample="row-9")
    with pytest.raises(ChatTemplateError, match=exact(
            "sample 4: chat template failed on messages[:2] (add_generation_prompt=False): "
            "TemplateError: unsupported role: tool")):
        encode_windows(fast, tool, 100, sample=4)


def test_only_system_turns_give_no_spans(fast):
    full, spans = assistant_char_spans(fast, turns(("system", "s")))
    assert (full, spans) == (tiny_tokenizer.BOS + tiny_tokenizer.SYSTEM + "s" + END, [])


class ListRenderingTokenizer(CharTokenizer):
    """A tokenizer whose ``apply_chat_template`` ignores ``tokenize=False``."""

    def apply_chat_template(self, conversation, **kwargs):
        return [1, 2, 3]


def test_a_template_that_returns_ids_is_refused():
    with pytest.raises(ChatTemplateError, match=exact("sample 2: apply_chat_template returned list")):
        assistant_char_spans(ListRenderingTokenizer(), PLAIN_CONVERSATION, sample=2)


def test_empty_mask_messages_say_whether_truncation_did_it(fast):
    with pytest.raises(EmptyLossMaskError, match=exact("sample 3: no assistant tokens (max_length=4096)")):
        encode_conversation(fast, CONVERSATION[:2], 4096, sample=3)
    whole = encode_conversation(fast, CONVERSATION, 4096)
    first = whole.loss_mask.index(1)
    dropped = len(whole.input_ids) - first
    with pytest.raises(EmptyLossMaskError, match=exact(
            f"sample 17: no assistant tokens after truncating {dropped} of {len(whole.input_ids)} "
            f"tokens (max_length={first})")):
        encode_conversation(fast, CONVERSATION, first, sample=17)
    # max_length=1 is valid (only the BOS token fits), not a ValueError.
    with pytest.raises(EmptyLossMaskError, match=exact(
            f"sample 0: no assistant tokens after truncating {len(whole.input_ids) - 1} of "
            f"{len(whole.input_ids)} tokens (max_length=1)")):
        encode_conversation(fast, CONVERSATION, 1, sample=0)
    with pytest.raises(ValueError, match=exact("max_length must be >= 1, got 0")):
        encode_conversation(fast, CONVERSATION, 0)


def test_truncation_keeps_exactly_max_length_tokens(fast):
    whole = encode_conversation(fast, CONVERSATION, 4096)
    n = len(whole.input_ids)
    assert encode_conversation(fast, CONVERSATION, n) == whole
    cut = encode_conversation(fast, CONVERSATION, n - 1)
    assert (cut.input_ids, cut.loss_mask, cut.num_truncated) == (whole.input_ids[:-1], whole.loss_mask[:-1], 1)


def test_unrecoverable_message_is_exact():
    # Both quotes are 30 characters from the first difference. The rendered text is 61
    # characters and the decoded one 65, so no slice counted from the end (e.g. [at:at - 30],
    # which is [0:30] for a 60-character text) gives the same quote by accident.
    tok = char_tokenizer(PLAIN_TEMPLATE, pieces=[": "], prefix_space=True)
    messages = PLAIN_CONVERSATION[:3] + turns(("assistant", " Bye now!"))
    with pytest.raises(ChatTemplateError, match=exact(
            "sample 5: token ids are not a prefix across message boundaries and the segment-wise "
            "encoding does not decode back either; first difference at character 0: expected "
            "'user:Hi\\nassistant: Hello there', got ' user:Hi\\nassistant:  Hello the'")):
        tokenize_conversation(tok, messages, 1000, sample=5)


# ---- segments: accepted when the ids decode like the whole text's ids


def test_segments_accept_a_lossy_decode_that_the_whole_encoding_shares():
    # "é" is not in CharTokenizer's vocabulary: both encodings decode it as <unk>, so the
    # segment-wise ids differ from the text but not from what its own ids decode to.
    tok = char_tokenizer(PLAIN_TEMPLATE, pieces=[": ", "\nu"])
    messages = turns(("user", "Hi"), ("assistant", " Café"), ("user", "More"), ("assistant", " Bye"))
    encoded = encode_conversation(tok, messages, 1000)
    assert encoded.strategy == "segments"
    assert masked_runs(tok, encoded.input_ids, encoded.loss_mask) == [" Caf<unk>\n", " Bye\n"]
    assert tok.decode(encoded.input_ids) == "user:Hi\nassistant: Caf<unk>\nuser:More\nassistant: Bye\n"


def test_decode_keeps_special_tokens_and_spaces(fast):
    text = tiny_tokenizer.BOS + "a , b . c" + END
    assert chat._decode(fast, fast(text, add_special_tokens=False)["input_ids"]) == text
    tidy = CharTokenizer(clean_up_tokenization_spaces=True)  # a tokenizer that tidies by default
    assert tidy.decode(tidy("a , b .")["input_ids"]) == "a, b."
    assert chat._decode(tidy, tidy("a , b .", add_special_tokens=False)["input_ids"]) == "a , b ."


@pytest.mark.parametrize("which", ["fast", "slow", "segments"])
def test_long_texts_raise_no_length_warning(tokenizers, which):
    # Conversations are tokenized whole and cut later; the tokenizer's model_max_length warning
    # would be noise (verbose=False).
    key = "sequence-length-is-longer-than-the-specified-maximum"
    if which == "segments":
        tok, messages = char_tokenizer(PLAIN_TEMPLATE, pieces=[": ", "\nu"]), PLAIN_CONVERSATION
    else:
        tok, messages = copy.deepcopy(tokenizers[0 if which == "fast" else 1]), CONVERSATION
    tok.model_max_length = 8
    encode_conversation(tok, messages, 4096)
    assert key not in tok.deprecation_warnings
    tok("x " * 20)  # the same tokenizer does warn when asked to
    assert tok.deprecation_warnings.get(key) is True


# ---- the offsets shortcut


def test_offset_boundary():
    starts, ends = [0, 2, 5], [2, 5, 7]  # tokens [0,2) [2,5) [5,7) of a 7-character text
    assert [chat._offset_boundary(starts, ends, pos, 7) for pos in range(8)] == [0, None, 1, None, None, 2, None, 3]
    # offsets trimmed around a space: [0,2) " " [3,5): neither side of the gap is a boundary
    assert [chat._offset_boundary([0, 3], [2, 5], pos, 5) for pos in (2, 3)] == [None, None]


def test_fast_tokenizer_masks_by_offsets_without_prefix_encodes(fast, monkeypatch):
    expected = encode_conversation(fast, CONVERSATION, 4096)
    full, spans = assistant_char_spans(fast, CONVERSATION)
    by_offsets = chat._mask_by_offsets(fast, full, spans)
    assert by_offsets == chat._mask_by_prefix(fast, full, spans) == (expected.input_ids, expected.loss_mask)
    assert spans[-1][1] == len(full)  # the last span ends at the end of the text
    # A boundary inside a token ("<|system|>" is one token) makes the shortcut give up.
    assert chat._mask_by_offsets(fast, full, [(0, len(tiny_tokenizer.BOS) + 3)]) is None
    assert chat._mask_by_offsets(fast, full, [(len(tiny_tokenizer.BOS) + 3, len(full))]) is None
    # An empty span at either end of the text (a reply that renders to nothing) is a clean boundary.
    nothing = (expected.input_ids, [0] * len(expected.input_ids))
    assert chat._mask_by_offsets(fast, full, [(len(full), len(full))]) == nothing
    assert chat._mask_by_offsets(fast, full, [(0, 0)]) == nothing

    def no_prefix(*args):
        raise AssertionError("the prefix strategy ran for a fast tokenizer")

    monkeypatch.setattr(chat, "_mask_by_prefix", no_prefix)
    assert encode_conversation(fast, CONVERSATION, 4096) == expected


def test_offsets_shortcut_can_be_turned_off(tokenizers, monkeypatch):
    fast, slow = tokenizers
    full, spans = assistant_char_spans(slow, CONVERSATION)
    assert chat._mask_by_offsets(slow, full, spans) is None  # no offsets in slow tokenizers
    expected = encode_conversation(fast, CONVERSATION, 4096)

    def no_offsets(*args):
        raise AssertionError("the offsets shortcut ran while USE_OFFSETS is False")

    monkeypatch.setattr(chat, "USE_OFFSETS", False)
    monkeypatch.setattr(chat, "_mask_by_offsets", no_offsets)
    assert encode_conversation(fast, CONVERSATION, 4096) == expected


# ---- spans with templates that rewrite history, drop text or lack a generation prompt


def test_content_search_starts_after_the_history_and_takes_the_first_hit(fast):
    # The reply "OK" also occurs in the user turns before and after it, and the render of
    # messages[:3] (reasoning on its last turn) is not a prefix of the whole conversation.
    tok = with_template(fast, tiny_tokenizer.CHAT_TEMPLATE.replace(
        "{{- message['content'] + '<|end|>' -}}",
        "{%- if loop.last -%}{{- '<think></think>' -}}{%- endif -%}{{- message['content'] + '<|end|>' -}}"))
    messages = turns(("system", "Be brief."), ("user", "Reply OK!"), ("assistant", "OK"),
                     ("user", "Again: OK!"), ("assistant", "OK"))
    full, spans = assistant_char_spans(tok, messages)
    first = full.index(tiny_tokenizer.ASSISTANT) + len(tiny_tokenizer.ASSISTANT)
    second = full.rindex(tiny_tokenizer.ASSISTANT) + len(tiny_tokenizer.ASSISTANT)
    assert spans == [(first, first + len("OK" + END)), (second, len(full))]
    assert full[second:] == "<think></think>OK" + END


def test_a_prefix_span_reaching_back_into_the_previous_reply_is_searched_for(fast):
    # Two replies in a row under a reasoning template: the prompt render of messages[:2] shows
    # the first reply with its think block, so the second reply's prefix span would start at
    # the first reply's content; the search after the first span finds the right one.
    tok = with_template(fast, tiny_tokenizer.CHAT_TEMPLATE.replace(
        "{{- message['content'] + '<|end|>' -}}",
        "{%- if loop.last -%}{{- '<think></think>' -}}{%- endif -%}{{- message['content'] + '<|end|>' -}}"))
    messages = turns(("user", "q"), ("assistant", "OK"), ("assistant", "OK"))
    full, spans = assistant_char_spans(tok, messages)
    assert full == tiny_tokenizer.BOS + tiny_tokenizer.USER + "q" + END + tiny_tokenizer.ASSISTANT + "OK" + END + tiny_tokenizer.ASSISTANT \
        + "<think></think>OK" + END
    first = full.index("OK")
    # The second reply's span starts after its generation prompt, so it keeps the think block
    # the template puts there (issue 31: everything after the prompt is what the target writes).
    second = len(full) - len("<think></think>OK" + END)
    assert spans == [(first, first + len("OK" + END)), (second, len(full))]

def test_generation_prompt_overlapping_the_reply_is_searched_from_the_history(fast):
    # The prompt opens "<think>" and the reply starts with its own "<think>": the prefix boundary
    # is unreliable, the search must start before the prompt's text.
    tok = with_template(fast, tiny_tokenizer.CHAT_TEMPLATE.replace(
        "{{- '<|assistant|>' -}}{%- endif -%}", "{{- '<|assistant|><think>' -}}{%- endif -%}"))
    messages = turns(("user", "q"), ("assistant", "<think>x</think>y"))
    full, spans = assistant_char_spans(tok, messages)
    assert [full[a:b] for a, b in spans] == ["<think>x</think>y" + END]


def test_reply_missing_from_the_render_names_the_sample(fast):
    # This template drops the content of every reply but the last from history.
    tok = with_template(fast, tiny_tokenizer.CHAT_TEMPLATE.replace(
        "{{- message['content'] + '<|end|>' -}}",
        "{%- if loop.last -%}{{- message['content'] -}}{%- endif -%}{{- '<|end|>' -}}"))
    reply = "A reply long enough that the message quotes only its first sixty characters."
    messages = turns(("user", "q"), ("assistant", reply), ("user", "r"), ("assistant", "s"))
    history = tok.apply_chat_template(messages[:1], tokenize=False)
    with pytest.raises(ChatTemplateError, match=exact(
            f"sample 3: assistant message 1 does not occur in the rendered text after offset "
            f"{len(history)}; content starts {reply[:60]!r}")):
        assistant_char_spans(tok, messages, sample=3)


# Templates that raise on some prefix renders but not on the whole conversation.
ENDS_WITH_USER = ("{%- if messages[-1]['role'] == 'assistant' -%}"
                  "{{- raise_exception('must end with a user turn') -}}{%- endif -%}")
NO_PROMPT = "{%- if add_generation_prompt -%}{{- raise_exception('no generation prompt') -}}{%- endif -%}"
PROMPT_NEEDED = ("{%- if not add_generation_prompt and messages[-1]['role'] == 'user' "
                 "and messages|length < 3 -%}{{- raise_exception('prompt needed') -}}{%- endif -%}")


@pytest.mark.parametrize("guard, expected", [
    (ENDS_WITH_USER, "messages[:2] (add_generation_prompt=False): TemplateError: must end with a user turn"),
    (NO_PROMPT, "messages[:1] (add_generation_prompt=True): TemplateError: no generation prompt"),
    (PROMPT_NEEDED, "messages[:1] (add_generation_prompt=False): TemplateError: prompt needed"),
])
def test_failing_prefix_renders_name_the_sample(fast, guard, expected):
    template = guard + tiny_tokenizer.CHAT_TEMPLATE
    messages = turns(("user", "q"), ("assistant", "a"), ("user", "r"))
    if guard == PROMPT_NEEDED:  # reached through the content search (history is rewritten)
        template = guard + tiny_tokenizer.CHAT_TEMPLATE.replace(
            "{{- message['content'] + '<|end|>' -}}",
            "{%- if loop.last -%}{{- '<think></think>' -}}{%- endif -%}{{- message['content'] + '<|end|>' -}}")
        messages = turns(("user", "q"), ("assistant", "a"), ("user", "r"), ("assistant", "b"))
    tok = with_template(fast, template)
    tok.apply_chat_template(messages, tokenize=False)  # the whole conversation renders
    with pytest.raises(ChatTemplateError, match=exact(f"sample 9: chat template failed on {expected}")):
        assistant_char_spans(tok, messages, sample=9)


# Only assistant turns are rendered, so a reply can sit at offset 0.
UPPER_LAST = ("{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}"
              "{%- if loop.last -%}{{ m['content'] | upper }}{%- else -%}{{ m['content'] }}{%- endif -%}"
              "{%- endif -%}{%- endfor -%}")
MARK_EARLIER = ("{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}"
                "{%- if not loop.last -%}>{%- endif -%}{{ m['content'] + '\n' }}"
                "{%- endif -%}{%- endfor -%}")
HEADER_WITHOUT_PROMPT = ("{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}A:{%- endif -%}"
                         "{{ m['content'] + '\n' }}{%- endfor -%}")


@pytest.mark.parametrize("template, replies, full, spans", [
    # found by search at offset 0; the history render has no end-of-turn text after it
    (UPPER_LAST, ("ab", "XXXX"), "abXXXX", [(0, 2), (2, 6)]),
    (UPPER_LAST, ("ab", "BB"), "abBB", [(0, 2), (2, 4)]),
    # prefix strategy at offset 0
    (UPPER_LAST, ("AB",), "AB", [(0, 2)]),
    # the render of messages[:2] starts with the reply: its end-of-turn "\n" is kept
    (MARK_EARLIER, ("r", "t"), ">r\nt\n", [(1, 3), (3, 5)]),
    # no generation prompt: the "A:" header is the reply's; consecutive replies abut
    (HEADER_WITHOUT_PROMPT, ("a", "b"), "u\nA:a\nA:b\n", [(2, 6), (6, 10)]),
])
def test_spans_of_unusual_templates(template, replies, full, spans):
    tok = char_tokenizer(template)
    if template == HEADER_WITHOUT_PROMPT:
        messages = turns(("user", "u"), ("assistant", replies[0]), ("assistant", replies[1]))
    else:
        messages = turns(*[pair for reply in replies for pair in (("user", "q"), ("assistant", reply))])
    assert assistant_char_spans(tok, messages) == (full, spans)


# ---- exchanges and windows


def test_exchanges():
    messages = turns(("system", "a"), ("system", "b"), ("user", "c"), ("assistant", "d"), ("user", "e"),
                     ("user", "f"), ("assistant", "g"), ("assistant", "h"), ("user", "i"))
    assert chat._exchanges(messages) == (2, [(2, 4), (4, 8)])
    assert chat._exchanges(messages[1:]) == (1, [(1, 3), (3, 7)])
    assert chat._exchanges(messages[2:]) == (0, [(0, 2), (2, 6)])
    assert chat._exchanges(turns(("system", "a"))) == (1, [])
    assert chat._exchanges([]) == (0, [])


LONG_CONVERSATION = turns(
    ("system", "Be terse."),
    ("user", "Explain, at some length, what a tokenizer's merges file is for."),
    ("assistant", "It lists byte-pair merges in priority order; the tokenizer applies them greedily."),
    ("user", "Short?"), ("assistant", "Yes."),
    ("user", "And vocab.json?"), ("assistant", "Maps each token to its id."),
    ("user", "Both needed?"), ("assistant", "Yes, for BPE."),
    ("user", "Thanks."), ("assistant", "You're welcome."),
    ("user", "one more question left unanswered"),
)
LONG_EXCHANGES = [(1, 3), (3, 5), (5, 7), (7, 9), (9, 11)]


def reference_windows(tok, max_length):
    """Greedy windows by linear scan: from each start, the most whole exchanges that fit."""
    def window(i, j):
        return LONG_CONVERSATION[:1] + LONG_CONVERSATION[LONG_EXCHANGES[i][0]:LONG_EXCHANGES[j - 1][1]]

    samples, i = [], 0
    while i < len(LONG_EXCHANGES):
        fitting = [j for j in range(i + 1, len(LONG_EXCHANGES) + 1)
                   if len(encode_conversation(tok, window(i, j), 10**6).input_ids) <= max_length]
        if fitting:
            samples.append(encode_conversation(tok, window(i, max(fitting)), 10**6))
            i = max(fitting)
            continue
        try:
            samples.append(encode_conversation(tok, window(i, i + 1), max_length))
        except EmptyLossMaskError:
            pass
        i += 1
    return samples


def test_windows_are_the_longest_runs_of_exchanges_that_fit(fast):
    whole = encode_conversation(fast, LONG_CONVERSATION, 10**6)
    total = sum(whole.loss_mask)
    # Exactly fitting: one sample, the trailing user turn included.
    fits = encode_windows(fast, LONG_CONVERSATION, len(whole.input_ids))
    assert fits == chat.Windows([whole], total, total)

    def window_length(i, j):
        messages = LONG_CONVERSATION[:1] + LONG_CONVERSATION[LONG_EXCHANGES[i][0]:LONG_EXCHANGES[j - 1][1]]
        return len(encode_conversation(fast, messages, 10**6).input_ids)

    lengths = {window_length(i, j) for i in range(5) for j in range(i + 1, 6)}
    limits = sorted({n + d for n in lengths for d in (-1, 0)} - {len(whole.input_ids)})
    assert len(limits) > 20
    for max_length in limits:
        expected = reference_windows(fast, max_length)
        got = encode_windows(fast, LONG_CONVERSATION, max_length, sample=1)
        assert got.samples == expected, max_length
        assert got.num_assistant_tokens == total
        assert got.num_kept_tokens == sum(sum(s.loss_mask) for s in expected)
        assert all(s.strategy == "prefix" and len(s.input_ids) <= max_length for s in got.samples)


def test_windows_without_any_reply_raise(fast):
    n = len(encode_conversation(fast, LONG_CONVERSATION, 10**6).input_ids)
    with pytest.raises(EmptyLossMaskError, match=exact(
            f"sample 3: no assistant tokens within max_length=1: every exchange's prompt alone is "
            f"longer ({n} tokens in all)")):
        encode_windows(fast, LONG_CONVERSATION, 1, sample=3)
    with pytest.raises(ValueError, match=exact("max_length must be >= 1, got 0")):
        encode_windows(fast, LONG_CONVERSATION, 0)


def test_a_window_that_fails_to_render_names_the_sample(fast):
    # Renders fine from the first user turn, refuses a window that starts at a later one.
    tok = with_template(fast, "{%- if messages[1]['content'] == 'Short?' -%}"
                              "{{- raise_exception('window') -}}{%- endif -%}" + tiny_tokenizer.CHAT_TEMPLATE)
    first = len(encode_conversation(tok, LONG_CONVERSATION[:3], 10**6).input_ids)  # exchange 1 alone
    with pytest.raises(ChatTemplateError, match=r"^sample 6: chat template failed on messages\[:\d+\] "
                                                r"\(add_generation_prompt=False\): TemplateError: window$"):
        encode_windows(tok, LONG_CONVERSATION, first, sample=6)
