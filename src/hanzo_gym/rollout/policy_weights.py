"""The policy as vLLM takes it: the adapter folded into the base weights, under the base model's own
parameter names (what a checkpoint of the merged model would hold), or the adapter as a PEFT folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer

from hanzo_gym.model.lora import adapter_weights, write_adapter


@torch.no_grad()
def merged_weights(model: PeftModel, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every base-model parameter with W + scale·B·A folded in where the adapter is, in
    `dtype`, computed one layer at a time; the training model is not modified. Tied weights appear once."""
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
        plain = _without_wrappers(name)
        layer = adapted.get(plain)
        if layer is not None:
            merged = param.float() + layer.get_delta_weight(adapter).float()
            yield plain, merged.to(dtype)
        else:
            yield plain, param.detach().to(dtype)


def _without_wrappers(name: str) -> str:
    """A parameter's path without PEFT's `base_layer` hops (one per wrapper; LoRA on two parameters of one
    module nests two)."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


def write_policy_adapter(model: PeftModel, directory: Path) -> Path:
    """The live adapter as a PEFT folder vLLM loads (a LoRARequest or `/v1/load_lora_adapter`)."""
    adapter = model.active_adapter
    write_adapter(directory, model.peft_config[adapter], adapter_weights(model, adapter))
    return directory
