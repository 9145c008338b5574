"""Tinker's client API, running in-process on hanzo-gym's engine: `from hanzo_gym import tinker` in place of
`import tinker`, and the same code trains locally."""

from hanzo_gym.tinker import types
from hanzo_gym.tinker.futures import APIFuture
from hanzo_gym.tinker.sampling_client import SamplingClient
from hanzo_gym.tinker.service_client import ServiceClient
from hanzo_gym.tinker.training_client import TrainingClient
from hanzo_gym.tinker.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    ModelInput,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    TensorData,
)

__all__ = [
    "APIFuture",
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "ModelInput",
    "SampleResponse",
    "SampledSequence",
    "SamplingClient",
    "SamplingParams",
    "ServiceClient",
    "TensorData",
    "TrainingClient",
    "types",
]
