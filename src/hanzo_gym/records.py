"""The plain records every layer passes around, with Tinker's names and defaults: token inputs (`ModelInput`),
loss inputs (`TensorData`), training examples (`Datum`), optimizer settings (`AdamParams`) and sampling
(`SamplingParams`, `SampledSequence`).

This module imports no torch, so config, data, renderers and rewards can build and check these records without
loading it; a torch tensor handed in is recognised once torch is already loaded, and converted lazily.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from hanzo_gym.errors import GymError

if TYPE_CHECKING:
    import torch

# The label of a position that is not trained (the ignore_index of torch's cross entropy, as HF writes it).
IGNORE_INDEX = -100

DType = Literal["int64", "float32"]
_NUMPY = {"int64": np.int64, "float32": np.float32}
_INTEGER_INPUTS = {"target_tokens"}


@dataclass(frozen=True)
class EncodedTextChunk:
    tokens: Sequence[int]
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class ModelInput:
    """Tinker's token container: a list of chunks; text-only for now."""

    chunks: list[EncodedTextChunk] = field(default_factory=list)

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        return cls([EncodedTextChunk(list(tokens))])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls([])

    def to_ints(self) -> list[int]:
        return [token for chunk in self.chunks for token in chunk.tokens]

    @property
    def length(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    def append(self, chunk: EncodedTextChunk) -> ModelInput:
        return ModelInput([*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        return self.append(EncodedTextChunk([token]))


def _torch():
    import torch

    return torch


def _is_torch_tensor(value: object) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only if torch was loaded by whoever made it
    return torch is not None and isinstance(value, torch.Tensor)


@dataclass
class TensorData:
    """Tinker's TensorData: a flat list plus dtype and shape, convertible to and from numpy and torch."""

    data: list[int] | list[float]
    dtype: DType
    shape: list[int] | None = None

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        dtype = _dtype_name(str(array.dtype))
        return cls(array.astype(_NUMPY[dtype]).reshape(-1).tolist(), dtype, list(array.shape))

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        torch = _torch()
        tensor = tensor.detach().cpu()
        dtype = _dtype_name(str(tensor.dtype).removeprefix("torch."))
        wanted = torch.int64 if dtype == "int64" else torch.float32
        return cls(tensor.to(wanted).reshape(-1).tolist(), dtype, list(tensor.shape))

    @classmethod
    def coerce(cls, value: TensorData | torch.Tensor | np.ndarray | Sequence, dtype: DType) -> TensorData:
        """What Datum does with a loss input given as a tensor, an array or a list."""
        if isinstance(value, TensorData):
            return value
        if _is_torch_tensor(value):
            torch = _torch()
            return cls.from_torch(value.to(torch.int64 if dtype == "int64" else torch.float32))
        if isinstance(value, np.ndarray):
            return cls.from_numpy(value.astype(_NUMPY[dtype]))
        array = np.asarray(list(value), dtype=_NUMPY[dtype])
        return cls(array.reshape(-1).tolist(), dtype, list(array.shape))

    def to_numpy(self) -> np.ndarray:
        array = np.asarray(self.data, dtype=_NUMPY[self.dtype])
        return array.reshape(self.shape) if self.shape is not None else array

    def to_torch(self) -> torch.Tensor:
        torch = _torch()
        tensor = torch.tensor(self.data, dtype=torch.int64 if self.dtype == "int64" else torch.float32)
        return tensor.reshape(self.shape) if self.shape is not None else tensor

    def tolist(self) -> list:
        return self.to_numpy().tolist()


def _dtype_name(name: str) -> DType:
    # Integers widen to int64 and floats (bf16 and fp16 included) to float32, as Tinker sends them.
    if name.startswith(("int", "uint", "bool")):
        return "int64"
    if name.startswith(("float", "bfloat")):
        return "float32"
    raise GymError(f"TensorData holds integers or floats, not {name}")


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

    def __len__(self) -> int:
        return self.model_input.length

    @classmethod
    def from_tokens(cls, tokens: Sequence[int], **loss_fn_inputs: Any) -> Datum:
        return cls(ModelInput.from_ints(tokens), loss_fn_inputs)


@dataclass
class AdamParams:
    """Tinker's defaults. `grad_clip_norm` 0 disables clipping; weight decay is decoupled (AdamW)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class SamplingParams:
    """Tinker's sampling parameters and defaults. `temperature` 0 is greedy decoding."""

    max_tokens: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | Sequence[int] | None = None  # EOS ends a sample too, unless stop is `[]`
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


@dataclass
class SampledSequence:
    tokens: list[int]  # the completion, including the stop token that ended it
    logprobs: list[float]  # raw model log-probabilities of those tokens (not temperature-adjusted)
    stop_reason: Literal["stop", "length"]
