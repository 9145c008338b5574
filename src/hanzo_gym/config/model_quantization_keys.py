"""Axolotl's `model_quantization_config`: a base whose checkpoint is stored quantized by transformers' own formats.
`Mxfp4Config` with `dequantize: true` is how Axolotl's gpt-oss examples load that model's MXFP4 experts: dequantized
as they load, to the run's dtype, so that LoRA trains over plain weights."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class ModelQuantizationKeys(BaseModel):
    """The keys of `Config` (a base class of it, so they sit at the top level as in Axolotl)."""

    model_quantization_config: Literal["Mxfp4Config", "FineGrainedFP8Config"] | None = None
    model_quantization_config_kwargs: dict[str, Any] | None = None
    # Axolotl's: no move of the loaded model to the GPU before FSDP shards it
    experimental_skip_move_to_device: bool | None = None


def check_model_quantization(cfg: ModelQuantizationKeys, load_in_4bit: bool, load_in_8bit: bool) -> None:
    """ValueError with the sentence to show."""
    kind, kwargs = cfg.model_quantization_config, cfg.model_quantization_config_kwargs
    if kind is None:
        if kwargs:
            raise ValueError(
                "model_quantization_config_kwargs set without model_quantization_config: add Mxfp4Config or remove it"
            )
        return
    if kind == "FineGrainedFP8Config":
        raise ValueError(
            "Axolotl's `model_quantization_config: FineGrainedFP8Config` (a base stored in block-scaled FP8) is not "
            "supported yet; load a bf16 checkpoint of the model"
        )
    if load_in_4bit or load_in_8bit:
        raise ValueError(
            "model_quantization_config and load_in_4bit / load_in_8bit quantize the base two ways (Axolotl refuses "
            "them together too): give one of them"
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
            "model_quantization_config: Mxfp4Config without `dequantize: true` keeps the experts in MXFP4, which "
            "only Triton kernels on a GPU compute with and LoRA cannot train over; set "
            "model_quantization_config_kwargs: {dequantize: true}, as Axolotl's gpt-oss examples do"
        )


def model_quantization(cfg: ModelQuantizationKeys) -> dict | None:
    """What load_causal_lm is given: the Mxfp4Config arguments, or None."""
    return dict(cfg.model_quantization_config_kwargs or {}) if cfg.model_quantization_config else None
