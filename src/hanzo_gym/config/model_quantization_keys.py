"""How the frozen base is stored: bitsandbytes' 4-bit NF4 (QLoRA, `load_in_4bit`, settings in `bnb_config_kwargs`)
or 8-bit LLM.int8() layers (`load_in_8bit`), an MoE model's stacked experts quantized too (`quantize_moe_experts`),
Llama 4's experts as linear layers (`llama4_linearized_experts`), and `model_quantization_config`: a checkpoint
stored quantized by transformers' own formats. `Mxfp4Config` with `dequantize: true` is how Axolotl's gpt-oss
examples load that model's MXFP4 experts: dequantized as they load, to the run's dtype, so that LoRA trains over
plain weights."""

from __future__ import annotations

from typing import Any, Literal

from hanzo_gym.config.feature import Feature, StrictKeys


class BnbConfigKwargs(StrictKeys):
    """Axolotl's `bnb_config_kwargs`: the 4-bit quantization settings a QLoRA base loads with (bitsandbytes')."""

    bnb_4bit_use_double_quant: bool = True  # quantize the per-block scales too (QLoRA's double quantization)
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = "nf4"


class ModelQuantizationKeys(Feature):
    # QLoRA: the frozen base in 4-bit NF4 (bitsandbytes), the adapter in full precision
    load_in_4bit: bool = False
    load_in_8bit: bool = False  # LoRA on a frozen base in bitsandbytes' 8-bit (LLM.int8()) layers
    quantize_moe_experts: bool = False  # an MoE model's stacked expert weights in NF4 / int8 too
    # Llama 4's routed experts as one linear layer per expert and projection (model/llama4_experts.py)
    llama4_linearized_experts: bool = False
    bnb_config_kwargs: BnbConfigKwargs | None = None
    model_quantization_config: Literal["Mxfp4Config", "FineGrainedFP8Config"] | None = None
    model_quantization_config_kwargs: dict[str, Any] | None = None
    # Axolotl's: no move of the loaded model to the GPU before FSDP shards it
    experimental_skip_move_to_device: bool | None = None

    @property
    def quantized_base(self) -> bool:
        return self.load_in_4bit or self.load_in_8bit

    @property
    def bnb_4bit_settings(self) -> dict[str, Any]:
        """The 4-bit settings bnb_config_kwargs changes from QLoRA's (NF4, double quantization)."""
        return self.bnb_config_kwargs.model_dump(exclude_defaults=True) if self.bnb_config_kwargs else {}

    def check(self) -> None:
        if self.quantize_moe_experts:
            if not self.quantized_base:
                raise ValueError(
                    "quantize_moe_experts quantizes a 4- or 8-bit base's experts too: it needs load_in_4bit "
                    "(`adapter: qlora`) or load_in_8bit (`adapter: lora`)"
                )
            if self.lora_target_linear:  # Axolotl's rule: a fused expert tensor is no linear layer to adapt
                raise ValueError(
                    "lora_target_linear does not go with quantize_moe_experts (Axolotl refuses it too); name the "
                    "modules in lora_target_modules"
                )
            if self.llama4_linearized_experts:
                raise ValueError(
                    "llama4_linearized_experts makes Llama 4's experts linear layers, which load_in_4bit / "
                    "load_in_8bit quantize already; remove quantize_moe_experts"
                )
        if self.bnb_config_kwargs is not None and not self.load_in_4bit:
            raise ValueError(
                "bnb_config_kwargs sets how a 4-bit base is quantized; it needs load_in_4bit (`adapter: qlora`)"
            )
        self._check_stored_quantization()

    def _check_stored_quantization(self) -> None:
        kind, kwargs = self.model_quantization_config, self.model_quantization_config_kwargs
        if kind is None:
            if kwargs:
                raise ValueError(
                    "model_quantization_config_kwargs set without model_quantization_config: add Mxfp4Config or "
                    "remove it"
                )
            return
        if kind == "FineGrainedFP8Config":
            raise ValueError(
                "Axolotl's `model_quantization_config: FineGrainedFP8Config` (a base stored in block-scaled FP8) is "
                "not supported yet; load a bf16 checkpoint of the model"
            )
        if self.quantized_base:
            raise ValueError(
                "model_quantization_config and load_in_4bit / load_in_8bit quantize the base two ways (Axolotl "
                "refuses them together too): give one of them"
            )
        import inspect

        from transformers import Mxfp4Config

        known = [name for name in inspect.signature(Mxfp4Config).parameters if name != "kwargs"]
        unknown = sorted(set(kwargs or {}) - set(known))
        if unknown:  # Mxfp4Config itself takes any keyword and ignores it
            raise ValueError(
                f"model_quantization_config_kwargs: {', '.join(unknown)} are not arguments of Mxfp4Config "
                f"({', '.join(known)})"
            )
        if not (kwargs or {}).get("dequantize"):
            raise ValueError(
                "model_quantization_config: Mxfp4Config without `dequantize: true` keeps the experts in MXFP4, "
                "which only Triton kernels on a GPU compute with and LoRA cannot train over; set "
                "model_quantization_config_kwargs: {dequantize: true}, as Axolotl's gpt-oss examples do"
            )


def model_quantization(cfg: ModelQuantizationKeys) -> dict | None:
    """What load_causal_lm is given: the Mxfp4Config arguments, or None."""
    return dict(cfg.model_quantization_config_kwargs or {}) if cfg.model_quantization_config else None
