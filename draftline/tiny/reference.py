"""Reference hidden states: a tiny (or any HF causal-LM) target run with transformers.

``hf_hidden_states`` runs a built model with transformers and returns its
``output_hidden_states`` tuple.  Convention (transformers 4.57, both Llama and
DeepseekV3, via ``utils.generic.check_model_inputs``): with ``L`` decoder
layers the tuple has ``L + 1`` entries; entry ``k < L`` is the input of
decoder layer ``k`` (entry 0 = token embeddings, entry ``k`` = output of layer
``k - 1``), and entry ``L`` is the final hidden state *after* the final
RMSNorm (the raw output of the last layer is replaced by ``last_hidden_state``).
"""

from __future__ import annotations

from draftline.tiny.kimi_k25 import is_kimi_k25, load_hf_kimi_k25_language_model

__all__ = ["hf_hidden_states", "load_hf_model"]


def hf_hidden_states(model_dir, token_ids: list[int]) -> tuple:
    """Run a model with transformers (float32, CPU, eager attention).

    ``model_dir`` is a model directory (loaded here) or an already loaded HF
    causal LM (used as is; pass one to avoid reloading for many sequences).
    Returns ``output_hidden_states`` for the single sequence ``token_ids`` as a
    tuple of ``num_layers + 1`` float32 tensors of shape ``[len(token_ids),
    hidden_size]`` (batch dimension removed).  Entry ``k < num_layers`` is the
    input of decoder layer ``k`` (entry 0 = token embeddings); entry
    ``num_layers`` is the final hidden state after the final norm (what
    ``lm_head`` consumes), not the raw output of the last layer.
    """
    import torch

    model = model_dir
    if not isinstance(model, torch.nn.Module):
        model = load_hf_model(model_dir)
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return tuple(h[0].detach().clone() for h in out.hidden_states)


def load_hf_model(model_dir):
    """Load ``model_dir`` with transformers: float32, CPU, eager attention, eval mode.

    A Kimi-K2.5 directory (model_type ``kimi_k25``) loads as its text model, a plain
    ``DeepseekV3ForCausalLM`` (:func:`load_hf_kimi_k25_language_model`).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if is_kimi_k25(model_dir):
        return load_hf_kimi_k25_language_model(model_dir)
    return AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager", device_map=None
    ).eval()
