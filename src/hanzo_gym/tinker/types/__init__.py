"""Tinker's request and response types. Shared with the rest of hanzo-gym where the meaning is the same:
ModelInput (what the renderers build), SamplingParams, SampledSequence and AdamParams are the engine's own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from hanzo_gym.engine import AdamParams
from hanzo_gym.engine import Datum as EngineDatum
from hanzo_gym.errors import GymError
from hanzo_gym.model_input import EncodedTextChunk, ModelInput
from hanzo_gym.sampling import SampledSequence, SamplingParams
from hanzo_gym.tinker.types.tensor_data import TensorData

LossFnType = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]
ModelInputChunk = EncodedTextChunk
_INTEGER_INPUTS = {"target_tokens"}


@dataclass
class Datum:
    """`model_input[t]` predicts `loss_fn_inputs["target_tokens"][t]`; every input has the model input's length.
    Values may be TensorData, torch tensors, numpy arrays or lists (target_tokens become int64, the rest
    float32)."""

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model_input, ModelInput):
            raise GymError(f"Datum.model_input must be a ModelInput, not {type(self.model_input).__name__}")
        self.loss_fn_inputs = {
            key: TensorData.coerce(value, "int64" if key in _INTEGER_INPUTS else "float32")
            for key, value in self.loss_fn_inputs.items()
        }

    def to_engine(self, index: int) -> EngineDatum:
        length = self.model_input.length
        inputs = {}
        for key, value in self.loss_fn_inputs.items():
            tensor = value.to_torch()
            if tensor.shape != (length,):
                raise GymError(
                    f"datum {index}: loss_fn_inputs[`{key}`] has shape {tuple(tensor.shape)}, but model_input "
                    f"has {length} tokens; every input is aligned with model_input (target t = token t+1)"
                )
            inputs[key] = tensor
        return EngineDatum(self.model_input.to_ints(), inputs)


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
