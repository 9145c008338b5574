"""The decoder stack of a causal LM: the layers whose last hidden states the output layer reads."""

from __future__ import annotations

import torch


def decoder_of(causal_lm: torch.nn.Module) -> torch.nn.Module:
    """transformers' get_decoder(), except where it answers with the causal LM itself: Llama4ForCausalLM names its
    base model prefix `language_model` but keeps the decoder at `.model`, so get_decoder() finds neither."""
    decoder = causal_lm.get_decoder()
    if decoder is causal_lm and isinstance(getattr(causal_lm, "model", None), torch.nn.Module):
        return causal_lm.model
    return decoder
