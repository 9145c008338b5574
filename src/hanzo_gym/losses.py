"""Token-level loss functions over packed datums.

Each takes the policy's log-probabilities of the target tokens (all datums concatenated, `[N]`) and the
matching concatenated loss inputs, and returns a scalar SUM: normalisation is the caller's, carried in the
weights (Tinker's convention), so gradient accumulation and multi-process sums need no special cases.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], dict], torch.Tensor]


def cross_entropy(logprobs_N: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    return -(logprobs_N * inputs["weights"]).sum()


LOSS_FNS: dict[str, LossFn] = {"cross_entropy": cross_entropy}

# The loss inputs each loss needs besides `target_tokens`.
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {"cross_entropy": ("weights",)}
