"""Tinker's TensorData: a flat list plus dtype and shape, convertible to and from numpy and torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from hanzo_gym.errors import GymError

DType = Literal["int64", "float32"]
_TORCH = {"int64": torch.int64, "float32": torch.float32}
_NUMPY = {"int64": np.int64, "float32": np.float32}


@dataclass
class TensorData:
    data: list[int] | list[float]
    dtype: DType
    shape: list[int] | None = None

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        dtype = _dtype_name(str(array.dtype))
        return cls(array.astype(_NUMPY[dtype]).reshape(-1).tolist(), dtype, list(array.shape))

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        tensor = tensor.detach().cpu()
        dtype = _dtype_name(str(tensor.dtype).removeprefix("torch."))
        return cls(tensor.to(_TORCH[dtype]).reshape(-1).tolist(), dtype, list(tensor.shape))

    @classmethod
    def coerce(cls, value: TensorData | torch.Tensor | np.ndarray | Sequence, dtype: DType) -> TensorData:
        """What Datum does with a loss input given as a tensor, an array or a list."""
        if isinstance(value, TensorData):
            return value
        if isinstance(value, torch.Tensor):
            return cls.from_torch(value.to(_TORCH[dtype]))
        if isinstance(value, np.ndarray):
            return cls.from_numpy(value.astype(_NUMPY[dtype]))
        array = np.asarray(list(value), dtype=_NUMPY[dtype])
        return cls(array.reshape(-1).tolist(), dtype, list(array.shape))

    def to_numpy(self) -> np.ndarray:
        array = np.asarray(self.data, dtype=_NUMPY[self.dtype])
        return array.reshape(self.shape) if self.shape is not None else array

    def to_torch(self) -> torch.Tensor:
        tensor = torch.tensor(self.data, dtype=_TORCH[self.dtype])
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
