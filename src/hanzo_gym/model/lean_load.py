"""Loading a checkpoint into another dtype without the whole file resident at once.

transformers reads safetensors through a memory map. When a tensor's stored dtype is the model's, the tensor is
a view of the mapped pages and nothing is copied; when it is not (an fp32 checkpoint loaded as bf16, the common
case for the de-quantized GGUF models and for many hub checkpoints), every tensor is converted from the mapped
pages, and those pages stay resident until the file is closed after the last tensor: the load peaks at the fp32
file plus the bf16 model (measured on SmolLM2-135M: 1.18 GB, where the bf16 model is 0.27 GB). Reading each
tensor with pread(2) instead leaves only the tensor being converted in memory (0.67 GB), at about twice the load
time of a mapped read (0.56 s against 0.29 s), which is small next to any training run.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import modeling_utils

_SAFETENSORS_FLOATS = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_TORCH_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


def stored_float_dtypes(path: Path) -> set[str]:
    """The safetensors names (F32, BF16, ...) of the floating-point dtypes stored in one file, from its header."""
    with path.open("rb") as file:
        (header_size,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(header_size))
    dtypes = {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}
    return dtypes & _SAFETENSORS_FLOATS


def converts_on_load(model_dir: Path, dtype: torch.dtype) -> bool:
    """Whether loading model_dir's safetensors as `dtype` converts any floating-point tensor."""
    target = _TORCH_NAMES.get(dtype)
    try:
        return any(stored_float_dtypes(path) - {target} for path in model_dir.glob("*.safetensors"))
    except (OSError, ValueError, struct.error):  # an unreadable header: from_pretrained names the damage
        return False


@contextlib.contextmanager
def reading_tensors_by_pread(model_dir: Path, dtype: torch.dtype) -> Iterator[None]:
    """Within the block transformers opens safetensors files with the pread backend when loading model_dir as
    `dtype` converts tensors; otherwise (or on a transformers without the hook) the mapped read, unchanged."""
    original = getattr(modeling_utils, "safe_open", None)
    if original is None or not converts_on_load(model_dir, dtype):
        yield
        return

    def safe_open_by_pread(filename, framework, device="cpu", *, backend="mmap"):
        return original(
            filename, framework=framework, device=device, backend="pread" if backend == "mmap" else backend
        )

    modeling_utils.safe_open = safe_open_by_pread
    try:
        yield
    finally:
        modeling_utils.safe_open = original
