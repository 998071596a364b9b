"""vLLM's own config parser on a saved draft, in this process (no engine, no weights): what
training checks right after it saves (``check_vllm_parse``), so a draft that vLLM would serve
with other aux layers or another vocabulary fails the run that made it. Evaluate's full check
(parser and loader in a child process) is ``draftline.evaluate.in_vllm.check_vllm_load``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

VLLM_ARCHITECTURE = "Eagle3LlamaForCausalLM"  # what vLLM 0.16 serves a speculators Eagle3 save as


def check_reading(seen: dict, aux_layer_ids: Sequence[int], draft_vocab_size: int,
                  draft_dir: str | Path) -> dict:
    """``seen`` (``read_with_vllm``'s fields) against what the draft was built with.

    Compared, not only parsed: vLLM serving other aux layers or another vocabulary size
    would load without complaint and propose from the wrong features or ids.
    """
    expected = {
        "architectures": [VLLM_ARCHITECTURE],
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_layer_ids],
        "draft_vocab_size": int(draft_vocab_size),
    }
    if seen != expected:
        raise ValueError(f"vLLM reads {draft_dir} as {seen}, expected {expected}")
    return seen


# pragma: no mutate start  (vLLM's parser: test_training and the vLLM tier run it, `make mutation` does not)
def read_with_vllm(draft_dir: str | Path) -> dict:
    """What vLLM's own config parser reads from ``draft_dir``: the fields that decide what it serves.

    vLLM 0.16 reads a speculators Eagle3 save through ``SpeculatorsConfig``: it starts from
    ``transformer_layer_config``, sets ``architectures = ["Eagle3LlamaForCausalLM"]`` and
    copies the top-level ``draft_vocab_size``, ``norm_before_residual``,
    ``target_hidden_size`` and ``eagle_aux_hidden_state_layer_ids``.
    """
    from vllm.transformers_utils.config import get_config  # heavy import, only here

    config = get_config(str(draft_dir), trust_remote_code=False)
    return {
        "architectures": list(config.architectures or []),
        "eagle_aux_hidden_state_layer_ids": list(
            getattr(config, "eagle_aux_hidden_state_layer_ids", None) or []),
        "draft_vocab_size": getattr(config, "draft_vocab_size", None),
    }
# pragma: no mutate end


def check_vllm_parse(draft_dir: str | Path, aux_layer_ids: Sequence[int],
                     draft_vocab_size: int) -> dict:
    """vLLM's parser on ``draft_dir`` in this process (no engine, no weights), checked
    against the aux layers and vocabulary size the draft was built with; returns what it read."""
    return check_reading(read_with_vllm(draft_dir), aux_layer_ids, draft_vocab_size, draft_dir)
