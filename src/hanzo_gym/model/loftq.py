"""LoftQ (Axolotl's `peft.loftq_config`): a LoRA adapter started so that the quantized base plus the adapter is
close to the full-precision base, as PEFT's `init_lora_weights="loftq"` does it.

Each adapted linear layer's weight W is rounded through bitsandbytes' NF4 (blocks of 64, fp32 scales) or int8
(per row) format and the layer keeps the rounded Q in place of W; the adapter starts at the rank-r SVD of the
residual W − Q (B = U·√S, A = √S·Vᴴ), so that Q + B·A ≈ W. As in PEFT, the adapter's alpha / r scaling is not
divided out of B·A, and one alternation is made (Axolotl exposes no `loftq_iter`).

PEFT 0.21 runs this on CUDA or XPU only; bitsandbytes quantizes on the CPU too, so here it runs wherever the
model is. The trained adapter belongs to Q, not W: resuming, continuing (`lora_model_dir`) and `gym merge`
round the base the same way, and adapter_config.json records `init_lora_weights: loftq` and the bits, as PEFT
writes them (PEFT itself re-rounds the base when it loads such an adapter).
"""

from __future__ import annotations

import dataclasses

import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora import Linear as LoraLinear
from peft.utils.loftq_utils import _low_rank_decomposition

from hanzo_gym.errors import ModelError

LOFTQ_BITS = (4, 8)


@torch.no_grad()
def rounded_weight(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """W rounded through bitsandbytes' NF4 (4 bits) or int8 (8 bits) format and back, in fp32: the Q a LoftQ
    layer keeps. Rounding Q again gives Q exactly, so a 4-bit base loaded later holds the same values."""
    import bitsandbytes.functional as bnb

    weight = weight.detach().to(torch.float32)
    if bits == 4:
        packed, state = bnb.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=False)
        return bnb.dequantize_4bit(packed, state)
    if bits == 8:  # as bitsandbytes' Int8Params (an 8-bit base's layers) quantize: from the fp16 values
        rows, scales, _ = bnb.int8_vectorwise_quant(weight.to(torch.float16))
        return bnb.int8_vectorwise_dequant(rows, scales).to(torch.float32)
    raise ModelError(f"peft.loftq_config.loftq_bits {bits}: LoftQ rounds to 4 or 8 bits")


def loftq_layers(model: PeftModel, adapter: str = "default") -> dict[str, LoraLinear]:
    layers = {
        path: m for path, m in model.named_modules() if isinstance(m, LoraLinear) and adapter in m.lora_A
    }
    if not layers:
        raise ModelError(
            "peft.loftq_config: the adapter adapts no linear layer, so LoftQ has nothing to start"
        )
    return layers


@torch.no_grad()
def round_base(model: PeftModel, bits: int, adapter: str = "default") -> None:
    """Every layer the adapter adapts keeps its weight rounded (Q), in the weight's own dtype: the base a LoftQ
    adapter was trained on."""
    for layer in loftq_layers(model, adapter).values():
        base = layer.get_base_layer()
        base.weight.data = rounded_weight(base.weight, bits).to(base.weight.dtype)


@torch.no_grad()
def start_loftq(model: PeftModel, bits: int, adapter: str = "default") -> None:
    """PEFT's LoftQ initialisation on a freshly attached adapter: Q in place of each adapted weight, A and B
    from the SVD of W − Q, and the adapter's config marked as PEFT marks it."""
    for layer in loftq_layers(model, adapter).values():
        base = layer.get_base_layer()
        weight = base.weight.detach().to(torch.float32)
        rounded = rounded_weight(weight, bits)
        factors = _low_rank_decomposition(weight - rounded, reduced_rank=layer.r[adapter])
        a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        a.data = factors["R"].to(a.dtype).contiguous()
        b.data = factors["L"].to(b.dtype).contiguous()
        base.weight.data = rounded.to(base.weight.dtype)
    mark_loftq(model.peft_config[adapter], bits)


def mark_loftq(config: LoraConfig, bits: int) -> None:
    """adapter_config.json's record of a LoftQ start, in PEFT's fields."""
    config.init_lora_weights = "loftq"
    config.loftq_config = {"loftq_bits": bits, "loftq_iter": 1}


def loftq_bits(config: LoraConfig) -> int | None:
    """The bits of a LoftQ adapter's base (None for any other adapter)."""
    if config.init_lora_weights != "loftq":
        return None
    bits = (config.loftq_config or {}).get("loftq_bits", 4)
    iterations = (config.loftq_config or {}).get("loftq_iter", 1)
    if bits not in LOFTQ_BITS or iterations != 1:
        raise ModelError(
            f"a LoftQ adapter with loftq_bits {bits} and loftq_iter {iterations}: its base cannot be rounded "
            "again here (4 or 8 bits, one iteration)"
        )
    return bits


def without_loftq_start(config: LoraConfig) -> LoraConfig:
    """A copy of a LoftQ adapter's config that PEFT loads without re-running LoftQ (which needs CUDA in PEFT
    0.21); the caller rounds the base itself."""
    return dataclasses.replace(config, init_lora_weights=True, loftq_config={})
