"""A conversation's training samples under ``tokenize.reasoning``: the one entry point.

``template`` trains what the chat template renders for each window of the conversation,
``preserve`` the same with the template's own switch to keep every reply's reasoning
(:func:`draftline.tokenize.chat.template_windows`), ``as_generated`` each reply as the target
generates it, after its own prompt (:func:`draftline.tokenize.generated.generated_windows`).
"""

from __future__ import annotations

from typing import Any, Sequence

from draftline.tokenize import chat, generated
from draftline.tokenize.spans import SampleLabel, Template

__all__ = ["encode_windows"]


def encode_windows(
    tokenizer: Any, messages: Sequence[dict], max_length: int, sample: SampleLabel = None, *,
    tools: Sequence[dict] | None = None, template: Template = None, reasoning: str = "template",
) -> chat.Windows:
    """Encode a conversation as one sample, or, when it is longer than ``max_length``, as
    several samples split at exchange boundaries (the windows of
    :func:`draftline.tokenize.chat.template_windows`), with ``reasoning`` as above.
    ``tools`` and ``template`` as for :func:`draftline.tokenize.chat.encode_conversation`.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    setting = generated.check_setting(reasoning)
    if setting == "as_generated":
        return generated.generated_windows(tokenizer, messages, max_length, sample, tools, template)
    if setting == "preserve":
        template = {**(template or {}), **generated.PRESERVE}
    return chat.template_windows(tokenizer, messages, max_length, sample, tools=tools, template=template)
