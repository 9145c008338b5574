"""Axolotl's `quantize_moe_experts`: a mixture-of-experts model's expert weights quantized as they load, to NF4
beside a 4-bit base (load_in_4bit) or to int8 rows beside an 8-bit one (load_in_8bit).

transformers 5 stores each MoE layer's experts as 3-D parameters (`experts.gate_up_proj`, `experts.down_proj`:
one slice per expert), which bitsandbytes' quantized loading does not reach, since it replaces linear layers
only. In a large MoE model those tensors are most of the weights, so a QLoRA run would hold them in 16 bits.
Each one is quantized the moment transformers sets it, as Axolotl does, so the full-precision experts are never
all in memory at once; a parametrization dequantizes a layer's experts when the layer runs (once per forward,
cached), so the frozen experts compute what the dequantized weights compute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.nn.utils import parametrize
from transformers import core_model_loading


def is_expert_parameter(name: str, value: torch.Tensor) -> bool:
    """An MoE layer's stacked expert weights: Axolotl's rule, a 3-D (or higher) tensor named for experts."""
    return value.ndim >= 3 and "expert" in name.lower()


class Int8Rows(torch.nn.Module):
    """An int8 tensor with one absmax scale per row of its last dimension (LLM.int8()'s vector-wise
    quantization, without outlier columns), dequantized to `dtype`."""

    def __init__(self, row_stats: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("row_stats", row_stats)
        self.dtype = dtype

    @torch.no_grad()
    def forward(self, quantized: torch.Tensor) -> torch.Tensor:
        from bitsandbytes.functional import int8_vectorwise_dequant

        rows = int8_vectorwise_dequant(quantized.reshape(-1, quantized.shape[-1]), self.row_stats)
        return rows.reshape(quantized.shape).to(self.dtype)


def quantize_to_int8_rows(module: torch.nn.Module, name: str) -> None:
    """Replace `module.<name>` by its int8 rows and their scales, read back through Int8Rows."""
    from bitsandbytes.functional import int8_vectorwise_quant

    weight = getattr(module, name).detach()
    # bitsandbytes quantizes from fp16, as Axolotl calls it
    int8, row_stats, _ = int8_vectorwise_quant(weight.reshape(-1, weight.shape[-1]).to(torch.float16))
    setattr(module, name, torch.nn.Parameter(int8.reshape(weight.shape), requires_grad=False))
    parametrize.register_parametrization(module, name, Int8Rows(row_stats, weight.dtype), unsafe=True)
    if not getattr(module, "_dequantized_once_per_forward", False):
        # The experts' forward reads the tensor once per expert: dequantize it once per call instead.
        module.register_forward_pre_hook(_open_cache)
        module.register_forward_hook(_close_cache, always_call=True)
        module._dequantized_once_per_forward = True


def _open_cache(module: torch.nn.Module, inputs: tuple) -> None:
    module._parametrization_cache = parametrize.cached()
    module._parametrization_cache.__enter__()


def _close_cache(module: torch.nn.Module, inputs: tuple, output: object) -> None:
    cache = module.__dict__.pop("_parametrization_cache", None)
    if cache is not None:
        cache.__exit__(None, None, None)


@contextlib.contextmanager
def quantizing_experts_on_load(bits: int = 4) -> Iterator[list[str]]:
    """While open, every expert parameter transformers loads is replaced by its quantized form right after it is
    set: NF4 double quantized (as QLoRA's linear layers are) for `bits=4`, int8 rows for `bits=8`; yields the
    names quantized so far."""
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    quantized: list[str] = []
    set_param = core_model_loading.set_param_for_module

    def set_and_quantize(model, target_name, param_value, *args, **kwargs):
        set_param(model, target_name, param_value, *args, **kwargs)
        if is_expert_parameter(target_name, param_value):
            path, _, name = target_name.rpartition(".")
            module = model.get_submodule(path) if path else model
            if bits == 4:
                replace_parameter_4bit(module, name, compress_statistics=True, quant_type="nf4")
            else:
                quantize_to_int8_rows(module, name)
            quantized.append(target_name)

    # transformers looks the function up in its module at every call, so this reaches its loader.
    core_model_loading.set_param_for_module = set_and_quantize
    try:
        yield quantized
    finally:
        core_model_loading.set_param_for_module = set_param
