"""Tinker's request and response types. Shared with the rest of hanzo-gym where the meaning is the same:
Datum, ModelInput (what the renderers build), TensorData, SamplingParams, SampledSequence and AdamParams are
the records of `hanzo_gym.records`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from hanzo_gym.records import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ModelInput,
    SampledSequence,
    SamplingParams,
    TensorData,
)

if TYPE_CHECKING:
    import torch

LossFnType = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]
ModelInputChunk = EncodedTextChunk


@dataclass
class ForwardBackwardOutput:
    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]  # per datum, in input order: {"logprobs": …}
    metrics: dict[str, float]  # names are `name:reduction`; "loss:sum" is always there


@dataclass
class OptimStepResponse:
    metrics: dict[str, float] | None = None


@dataclass
class SampleResponse:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclass
class SaveWeightsResponse:
    path: str


@dataclass
class SaveWeightsForSamplerResponse:
    path: str


@dataclass
class LoadWeightsResponse:
    path: str


@dataclass
class ModelData:
    arch: str
    model_name: str
    tokenizer_id: str


@dataclass
class GetInfoResponse:
    model_data: ModelData
    model_id: str
    is_lora: bool
    lora_rank: int
    model_name: str


@dataclass
class SupportedModel:
    model_name: str


@dataclass
class GetServerCapabilitiesResponse:
    supported_models: list[SupportedModel]


def logprobs_output(logprobs: list[torch.Tensor]) -> list[dict[str, TensorData]]:
    return [{"logprobs": TensorData.from_torch(lp)} for lp in logprobs]


__all__ = [
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "GetInfoResponse",
    "GetServerCapabilitiesResponse",
    "LoadWeightsResponse",
    "LossFnType",
    "ModelData",
    "ModelInput",
    "ModelInputChunk",
    "OptimStepResponse",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse",
    "SupportedModel",
    "TensorData",
]
