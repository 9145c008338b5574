"""Tiny random causal LMs built from a config: fast stand-ins for real checkpoints in unit tests."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
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
    if kind == "mixtral":  # four experts of which each token takes two
        return MixtralConfig(head_dim=8, num_local_experts=4, num_experts_per_tok=2, **common)
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
    if kind == "llama4":  # Llama 4's text model, every layer an MoE block of four experts and a shared one
        from transformers import Llama4TextConfig

        common.update(intermediate_size=32)
        return Llama4TextConfig(
            head_dim=8,
            intermediate_size_mlp=64,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=1,
            attention_chunk_size=64,
            **common,
        )
    if kind == "gpt_oss":  # sides of 32 and more: MXFP4 stores blocks of 32 values
        from transformers import GptOssConfig

        common.update(hidden_size=64, intermediate_size=32, max_position_embeddings=256)
        return GptOssConfig(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=64,
            **common,
        )
    raise ValueError(kind)


# MXFP4's element format (OCP Microscaling, FP4 E2M1): the value of each 4-bit code
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def save_mxfp4_gpt_oss(directory, seed: int = 0, **overrides) -> dict[str, torch.Tensor]:
    """A tiny random gpt-oss saved as gpt-oss is published: each expert tensor as MXFP4 blocks (two 4-bit codes a
    byte, low nibble first, 32 values a block) and E8M0 scales (a power of two, exponent bias 127), stored
    transposed (one row per output). Returns the values the experts hold, decoded here from the format's
    definition."""
    import json

    from safetensors.torch import load_file, save_file

    model = tiny_model("gpt_oss", seed=seed, **overrides)
    model.save_pretrained(directory)
    state = load_file(directory / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    values = {}
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = state.pop(key).shape
        codes = torch.randint(0, 16, (experts, outputs, inputs), generator=generator)
        exponents = torch.randint(120, 130, (experts, outputs, inputs // 32), generator=generator)
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
        state[f"{key}_blocks"] = packed.reshape(experts, outputs, inputs // 32, 16)
        state[f"{key}_scales"] = exponents.to(torch.uint8)
        scale = torch.pow(2.0, (exponents - 127).float()).repeat_interleave(32, dim=-1)
        values[key] = (torch.tensor(FP4_VALUES)[codes] * scale).transpose(1, 2)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (directory / "config.json").write_text(json.dumps(config))
    return values


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
    peft_model = attach_lora(
        model, r=4, alpha=8, dropout=0.0, target_modules="all-linear", base_model_name="tiny"
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * b_scale)
    return Engine(peft_model)
