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

from draftline import tiny
from draftline.chat import (
    ChatTemplateError,
    EmptyLossMaskError,
    assistant_char_spans,
    encode_conversation,
    tokenize_conversation,
)
from draftline.conversations import DataError, load_conversations
from draftline.embedded import write_conversations

END = tiny.END
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
        bos_token=tiny.BOS,
        eos_token=tiny.EOS,
        pad_token=tiny.PAD,
        unk_token=None,
        additional_special_tokens=tiny.SPECIAL_TOKENS[3:],
    )
    slow.chat_template = tiny.CHAT_TEMPLATE
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
    fast = tiny.build_tokenizer(root / "fast")
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
    assert rest.endswith(tiny.ASSISTANT) and tok.decode(ids, skip_special_tokens=False).startswith(tiny.BOS)


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
    template = tiny.CHAT_TEMPLATE.replace(
        "{{- message['content'] + '<|end|>' -}}",
        "{%- if loop.last -%}{{- '<think></think>' -}}{%- endif -%}{{- message['content'] + '<|end|>' -}}",
    )
    tok = with_template(fast, template)
    full, spans = assistant_char_spans(tok, CONVERSATION)
    assert full.startswith(tiny.BOS) and fast.chat_template == tiny.CHAT_TEMPLATE
    assert [full[a:b] for a, b in spans] == [
        CONVERSATION[2]["content"] + END,
        "<think></think>" + CONVERSATION[4]["content"] + END,
    ]
    ids, mask = tokenize_conversation(tok, CONVERSATION, 4096)
    assert masked_runs(tok, ids, mask) == [full[a:b] for a, b in spans]


def test_generation_prompt_differing_from_history_is_excluded(fast):
    # The prompt opens a think block that history never shows: the span starts
    # where prompt and history diverge, right after the role header.
    template = tiny.CHAT_TEMPLATE.replace(
        "{{- '<|assistant|>' -}}{%- endif -%}", "{{- '<|assistant|><think>' -}}{%- endif -%}"
    )
    tok = with_template(fast, template)
    ids, mask = tokenize_conversation(tok, CONVERSATION, 4096)
    assistant = [m["content"] + END for m in CONVERSATION if m["role"] == "assistant"]
    assert masked_runs(tok, ids, mask) == assistant
