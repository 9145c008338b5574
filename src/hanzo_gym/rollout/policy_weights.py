"""The policy as vLLM takes it: the adapter folded into the base weights, under the base model's own
parameter names (what a checkpoint of the merged model would hold), or the adapter as a PEFT folder. A
quantized base is handed over dequantized: the values the trainer's layers compute with."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer

from hanzo_gym.model.lora import adapter_weights, write_adapter


@torch.no_grad()
def merged_weights(
    model: PeftModel, dtype: torch.dtype, fold_adapter: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every base-model parameter with W + scale·B·A folded in where the adapter is (or the
    base alone, `fold_adapter=False`), in `dtype`, computed one layer at a time; the training model is not
    modified. A quantized base (4-bit NF4, 8-bit rows, quantized experts) is given as the values its layers
    compute with, dequantized, which is the policy being trained. Tied weights appear once."""
    base = model.get_base_model()
    adapter = model.active_adapter
    # the path of each adapted tensor as the base model names it → its LoRA layer
    adapted = {
        _without_wrappers(f"{name}.{getattr(module, 'parameter_name', 'weight')}"): module
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer)
    }
    for name, param in base.named_parameters():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        if ".parametrizations." in f".{owner}" and leaf == "original":  # a quantized expert stack
            owner, _, tensor = owner.rpartition(".parametrizations.")
            name = f"{owner}.{tensor}"
            param = getattr(base.get_submodule(owner), tensor)
        plain = _without_wrappers(name)
        value = _dequantized(param, base.get_submodule(owner))
        layer = adapted.get(plain) if fold_adapter else None
        if layer is not None:
            value = value.float() + layer.get_delta_weight(adapter).float()
        yield plain, value.to(dtype)


def _dequantized(param: torch.Tensor, owner: torch.nn.Module) -> torch.Tensor:
    """What a bitsandbytes weight computes as: NF4 blocks or int8 rows (LLM.int8()'s) dequantized. An 8-bit
    layer's row scales move from its weight to its `state` at its first forward."""
    kind = type(param).__name__
    if kind not in ("Params4bit", "Int8Params"):
        return param.detach()
    import bitsandbytes.functional as bnb_functional

    if kind == "Params4bit":
        return bnb_functional.dequantize_4bit(param.data, param.quant_state)
    scales = param.SCB if param.SCB is not None else owner.state.SCB
    return bnb_functional.int8_vectorwise_dequant(param.data, scales)


def _without_wrappers(name: str) -> str:
    """A parameter's path without PEFT's `base_layer` hops (one per wrapper; LoRA on two parameters of one
    module nests two)."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


def write_policy_adapter(model: PeftModel, directory: Path) -> Path:
    """The live adapter as a PEFT folder vLLM loads (a LoRARequest or `/v1/load_lora_adapter`)."""
    adapter = model.active_adapter
    write_adapter(directory, model.peft_config[adapter], adapter_weights(model, adapter))
    return directory
