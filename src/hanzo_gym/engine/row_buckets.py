"""Packed rows padded to one of a few lengths where the decoder runs in bf16 or fp16 on a CPU.

The kernels that run it there keep what they build for every shape they meet: oneDNN caches a matmul primitive
per shape (a row's length M is one dimension of every matmul, forward and backward), and torch's CPU attention
keeps its kernels per sequence length (measured, for 200 lengths: 1.7 MB per length of one bf16 linear, 4.5 MB of
sdpa; in fp32 nothing). A run whose rows vary in length grew by about 10 MB a step this way (SmolLM2-135M in bf16,
DPO pairs: 1.11 GB to 1.49 GB over 40 steps) and spent the time of building them. Rounding a row up to the next
multiple of an eighth of its power of two (at most 12.5 % padding, eight lengths per doubling) bounds both. The
pad tokens form a datum of their own that no real token attends to and whose hidden states are dropped; real
positions score as unpadded, up to the rounding of the attention kernel a lone datum then takes (masked, not
causal).
"""

from __future__ import annotations

import torch

MIN_STEP = 16  # short rows round to a multiple of this


def bucket_length(length: int) -> int:
    """`length` rounded up to a multiple of an eighth of the power of two at or below it (of 16 at least)."""
    step = max(MIN_STEP, (1 << (max(length, 1).bit_length() - 1)) // 8)
    return -(-length // step) * step


def pads_rows(decoder: torch.nn.Module, device: torch.device, autocast_dtype: torch.dtype | None) -> bool:
    """Whether this decoder runs on a CPU in bf16 or fp16 (its weights, or autocast over them)."""
    if device.type != "cpu":
        return False
    low = (torch.bfloat16, torch.float16)
    return autocast_dtype in low or any(p.dtype in low for p in decoder.parameters())
