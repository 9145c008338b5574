"""Learning-rate schedules, with Hugging Face's formulas (the ones Axolotl trains with).

`lr_at(step, …)` is the rate optimizer step `step` (0-based) uses, which is what HF's `LambdaLR` gives that
step: warmup rises linearly from 0 (step 0 trains at lr 0, the last warmup step just below the peak), then
the decay runs over the remaining steps. `constant` has no warmup in HF; `constant_with_warmup` has.
`polynomial` decays linearly (HF's power 1.0) to HF's absolute end rate 1e-7; `inverse_sqrt` decays as
1 / sqrt(step / timescale) after warmup, with HF's timescale (the warmup steps, or 10,000 without warmup).
Axolotl's `lr_quadratic_warmup` squares the warmup's fraction (its cosine schedule with quadratic warmup).
`cosine_with_restarts` is HF's cosine with hard restarts with its default of one cycle (no restart within the run;
the rate is 0 from the last step on, where `cosine` would rise again).
"""

from __future__ import annotations

import math

from hanzo_gym.config import Config
from hanzo_gym.records import AdamParams

# HF's defaults for the schedules Axolotl names without arguments (get_scheduler without scheduler kwargs).
POLYNOMIAL_END_LR = 1e-7
POLYNOMIAL_POWER = 1.0
INVERSE_SQRT_TIMESCALE = 10_000
RESTART_CYCLES = 1


def lr_factor(
    step: int,
    total_steps: int,
    warmup_steps: int,
    kind: str,
    min_lr_ratio: float = 0.0,
    peak: float = 1.0,
    quadratic_warmup: bool = False,
) -> float:
    """The multiplier of the peak learning rate at 0-based optimizer step `step` of `total_steps`."""
    if kind == "constant":
        return 1.0
    if step < warmup_steps:
        fraction = step / max(1, warmup_steps)
        return fraction**2 if quadratic_warmup else fraction
    if kind == "constant_with_warmup":
        return 1.0
    if kind == "linear":
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    if kind == "inverse_sqrt":
        timescale = warmup_steps or INVERSE_SQRT_TIMESCALE
        return 1.0 / math.sqrt((step + timescale - warmup_steps) / timescale)
    if kind == "polynomial":
        end = POLYNOMIAL_END_LR / peak
        if step >= total_steps:  # HF: past the end (and at it: nothing of the decay remains) the end rate
            return end
        remaining = 1 - (step - warmup_steps) / (total_steps - warmup_steps)
        return (1 - end) * remaining**POLYNOMIAL_POWER + end
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if kind in ("cosine", "cosine_with_min_lr"):
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return max(0.0, cosine * (1.0 - min_lr_ratio) + min_lr_ratio)
    if kind == "cosine_with_restarts":  # HF's hard restarts, its one cycle: 0 from the end on
        if progress >= 1.0:
            return 0.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((RESTART_CYCLES * progress) % 1.0))))
    raise ValueError(f"unknown lr_scheduler {kind!r}")


def lr_at(
    step: int,
    total_steps: int,
    peak: float,
    warmup_steps: int,
    kind: str,
    min_lr_ratio: float = 0.0,
    quadratic_warmup: bool = False,
) -> float:
    """The learning rate for 0-based optimizer step `step` of `total_steps`."""
    return peak * lr_factor(step, total_steps, warmup_steps, kind, min_lr_ratio, peak, quadratic_warmup)


def adam_params(cfg: Config, step: int, total_steps: int) -> AdamParams:
    """The optimizer settings of optimizer step `step`: the scheduled learning rate, the config's weight decay,
    clip norm and AdamW moments (`adam_beta1` / `adam_beta2` / `adam_epsilon`, HF's 0.9 / 0.999 / 1e-8 unless
    set) rather than Tinker's RL defaults."""
    return AdamParams(
        learning_rate=lr_at(
            step,
            total_steps,
            cfg.learning_rate,
            cfg.warmup(total_steps),
            cfg.lr_scheduler,
            cfg.cosine_min_lr_ratio or 0.0,
            cfg.lr_quadratic_warmup,
        ),
        beta1=cfg.adam_beta1,
        beta2=cfg.adam_beta2,
        eps=cfg.adam_epsilon,
        weight_decay=cfg.weight_decay,
        grad_clip_norm=cfg.max_grad_norm,
    )
