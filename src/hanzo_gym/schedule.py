"""Learning-rate schedules: linear warmup, then cosine, linear or constant to the end of training."""

from __future__ import annotations

import math


def lr_at(step: int, total_steps: int, peak: float, warmup_steps: int, kind: str) -> float:
    """The learning rate for 0-based optimizer step `step` of `total_steps`."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "cosine":
        return peak * 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "linear":
        return peak * (1.0 - progress)
    if kind == "constant":
        return peak
    raise ValueError(f"unknown lr_scheduler {kind!r}")
