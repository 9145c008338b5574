"""Tiny random causal LMs built from a config: fast stand-ins for real checkpoints in unit tests."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

VOCAB = 96


def tiny_config(kind: str = "llama", **overrides):
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    common.update(overrides)
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "qwen3":
        return Qwen3Config(head_dim=8, **common)
    if kind == "qwen2":
        return Qwen2Config(**common)
    if kind == "mistral":
        return MistralConfig(head_dim=8, **common)
    if kind == "qwen3_moe":  # four experts of which each token takes two; stored as 3-D expert tensors
        return Qwen3MoeConfig(
            head_dim=8, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, **common
        )
    if kind == "gemma4_moe":  # Gemma 4's multimodal class with only its text model, every layer an MoE block
        from transformers import Gemma4Config, Gemma4TextConfig

        text = Gemma4TextConfig(
            head_dim=8,
            global_head_dim=8,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=16,
            vocab_size_per_layer_input=common["vocab_size"],
            hidden_size_per_layer_input=8,
            layer_types=["sliding_attention", "full_attention"],
            **common,
        )
        return Gemma4Config(text_config=text)
    raise ValueError(kind)


def tiny_model(kind: str = "llama", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32)


def tiny_lora_engine(dtype: torch.dtype, b_scale: float = 0.05):
    """An engine over the tiny llama (wide initialisation) in `dtype` with an adapter whose B is not zero: the
    same weights whatever the dtype."""
    from hanzo_gym.engine import Engine
    from hanzo_gym.model.lora import attach_lora

    model = tiny_model("llama", initializer_range=0.2).to(dtype)
    torch.manual_seed(0)
    peft_model = attach_lora(model, 4, 8, 0.0, "all-linear", "tiny")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * b_scale)
    return Engine(peft_model)
