"""Learning-rate schedules: linear warmup, then cosine, linear or constant to the end of training."""

from __future__ import annotations

import math

from hanzo_gym.config import Config
from hanzo_gym.records import AdamParams


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


def adam_params(cfg: Config, step: int, total_steps: int) -> AdamParams:
    """The optimizer settings of optimizer step `step`: the scheduled learning rate, the config's weight decay
    and clip norm, and AdamW's usual moments (β 0.9 / 0.999, ε 1e-8) rather than Tinker's RL defaults."""
    return AdamParams(
        learning_rate=lr_at(step, total_steps, cfg.learning_rate, cfg.warmup(total_steps), cfg.lr_scheduler),
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=cfg.weight_decay,
        grad_clip_norm=cfg.max_grad_norm,
    )
