"""Axolotl's `quantize_moe_experts`: a mixture-of-experts model's expert weights in 4-bit NF4 as they load.

transformers 5 stores each MoE layer's experts as 3-D parameters (`experts.gate_up_proj`, `experts.down_proj`:
one slice per expert), which bitsandbytes' 4-bit loading does not reach, since it replaces linear layers only.
In a large MoE model those tensors are most of the weights, so a QLoRA run would hold them in 16 bits. Each
one is quantized the moment transformers sets it, as Axolotl does, so the full-precision experts are never all
in memory at once; bitsandbytes' parametrization dequantizes a layer's experts when the layer runs (once per
forward, cached), so the frozen experts compute what the dequantized NF4 weights compute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import core_model_loading


def is_expert_parameter(name: str, value: torch.Tensor) -> bool:
    """An MoE layer's stacked expert weights: Axolotl's rule, a 3-D (or higher) tensor named for experts."""
    return value.ndim >= 3 and "expert" in name.lower()


@contextlib.contextmanager
def quantizing_experts_on_load() -> Iterator[list[str]]:
    """While open, every expert parameter transformers loads is replaced by its NF4 form (double quantized,
    as QLoRA's linear layers are) right after it is set; yields the names quantized so far."""
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    quantized: list[str] = []
    set_param = core_model_loading.set_param_for_module

    def set_and_quantize(model, target_name, param_value, *args, **kwargs):
        set_param(model, target_name, param_value, *args, **kwargs)
        if is_expert_parameter(target_name, param_value):
            path, _, name = target_name.rpartition(".")
            module = model.get_submodule(path) if path else model
            replace_parameter_4bit(module, name, compress_statistics=True, quant_type="nf4")
            quantized.append(target_name)

    # transformers looks the function up in its module at every call, so this reaches its loader.
    core_model_loading.set_param_for_module = set_and_quantize
    try:
        yield quantized
    finally:
        core_model_loading.set_param_for_module = set_param
