"""The tiny targets' tokenizer: a byte-level BPE trained in-process, and their chat.

Nothing is downloaded: the BPE is trained on the committed corpus of Python standard-library
docstrings (draftline.tiny.embedded), so the same arguments give byte-identical files on every
interpreter (for a fixed tokenizers / transformers stack).  A tiny target's chat is ``plain``
(:data:`CHAT_TEMPLATE`) or ``kimi`` (Kimi-K2.5's thinking template, draftline.tiny.templates);
the builders (draftline.tiny.builders, draftline.tiny.kimi_k25) write its tokenizer files and
generation config with :func:`write_tokenizer` and :func:`write_generation_config`.
"""

from __future__ import annotations

from pathlib import Path

from draftline.pipeline.artifacts import atomic_dir

__all__ = [
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "default_corpus",
    "build_tokenizer",
    "write_tokenizer",
    "write_generation_config",
]

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
# Order fixes the ids: <|bos|>=0, <|eos|>=1, <|pad|>=2, <|system|>=3,
# <|user|>=4, <|assistant|>=5, <|end|>=6.
SPECIAL_TOKENS = [BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, END]

# Renders ``<|bos|><|role|>content<|end|>...`` and, with
# ``add_generation_prompt``, a trailing ``<|assistant|>``.  Assistant turns are
# wrapped in ``{% generation %}`` so ``return_assistant_tokens_mask=True`` works.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('unsupported role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|assistant|>' -}}"
    "{%- generation -%}{{- message['content'] + '<|end|>' -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def default_corpus() -> list[str]:
    """The tokenizer's training text: the committed stdlib-docstring corpus
    (draftline.tiny.embedded), identical on every interpreter."""
    from draftline.tiny import embedded

    return embedded.tokenizer_corpus()


def _train_bpe(corpus: list[str] | None, vocab_size: int):
    """Train the byte-level BPE (a ``tokenizers.Tokenizer``); deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if corpus is None:
        corpus = default_corpus()
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(SPECIAL_TOKENS) + len(byte_alphabet):
        raise ValueError(
            f"vocab_size={vocab_size} is below the {len(SPECIAL_TOKENS) + len(byte_alphabet)} "
            "special + byte tokens of a byte-level BPE"
        )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=sorted(byte_alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    # Plain encodes (add_special_tokens=True) start with <|bos|>, like Llama.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A $B:1",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    return tok


def _chat(chat: str) -> tuple[list[str], str, str]:
    """``(extra special tokens, chat template, end-of-turn token)`` of a tiny target's chat:
    ``plain`` (:data:`CHAT_TEMPLATE`) or ``kimi`` (Kimi-K2.5's thinking template,
    draftline.tiny.templates)."""
    if chat == "plain":
        return [], CHAT_TEMPLATE, END
    if chat == "kimi":
        from draftline.tiny.templates import KIMI_END_OF_TURN, KIMI_SPECIALS, KIMI_TEMPLATE

        return list(KIMI_SPECIALS), KIMI_TEMPLATE, KIMI_END_OF_TURN
    raise ValueError(f"chat={chat!r}: a tiny target's chat is plain or kimi")


def write_tokenizer(out_dir: Path, corpus: list[str] | None, vocab_size: int, chat: str = "plain"):
    """The BPE, with ``chat``'s special tokens within ``vocab_size`` (the BPE learns fewer merges)."""
    from transformers import PreTrainedTokenizerFast

    extra, template, _ = _chat(chat)
    tok = _train_bpe(corpus, vocab_size - len(extra))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT, END, *extra],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    fast.chat_template = template
    fast.save_pretrained(str(out_dir))
    return fast


def write_generation_config(model, tokenizer, chat: str = "plain") -> None:
    """eos: the tokenizer's and the chat's end of turn (where a reply ends)."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(_chat(chat)[2])],
        pad_token_id=tokenizer.pad_token_id,
    )

def build_tokenizer(out_dir, corpus: list[str] | None = None, vocab_size: int = 512):
    """Train a byte-level BPE in-process and save it (HF format) to ``out_dir``.

    Special tokens (ids 0-6): ``<|bos|> <|eos|> <|pad|> <|system|> <|user|>
    <|assistant|> <|end|>``.  Encoding with special tokens prepends ``<|bos|>``.
    The chat template renders ``<|bos|><|role|>content<|end|>...`` (roles
    system/user/assistant) plus ``<|assistant|>`` for ``add_generation_prompt``.
    ``corpus=None`` uses :func:`default_corpus` (which reaches ``vocab_size``
    512); a small custom corpus may yield fewer tokens.  Returns the
    ``PreTrainedTokenizerFast`` loaded back from ``out_dir``.
    """
    from transformers import PreTrainedTokenizerFast

    with atomic_dir(out_dir) as tmp:
        write_tokenizer(tmp, corpus, vocab_size)
    return PreTrainedTokenizerFast.from_pretrained(str(out_dir))
