"""The learning rate and its schedule, with Axolotl's names and its defaults for the warmup
(loops/schedule.py computes it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hanzo_gym.config.feature import Feature

# Axolotl's warmup when the config gives none: 3 % of the run, at most 100 steps.
DEFAULT_WARMUP_RATIO = 0.03
MAX_DEFAULT_WARMUP = 100


class ScheduleKeys(Feature):
    learning_rate: float = Field(2e-4, ge=0)
    lr_scheduler: Literal[
        "cosine",
        "linear",
        "constant",
        "constant_with_warmup",
        "cosine_with_min_lr",
        "polynomial",
        "inverse_sqrt",
        "cosine_with_restarts",
    ] = "cosine"
    cosine_min_lr_ratio: float | None = Field(None, ge=0, le=1)
    lr_quadratic_warmup: bool = False  # Axolotl's: the cosine schedule's warmup rises as (step / warmup)²
    warmup_steps: int | None = Field(None, ge=0)
    warmup_ratio: float | None = Field(None, ge=0, le=1)

    def warmup(self, total_steps: int) -> int:
        """Warmup steps as Axolotl hands them to HF: `warmup_steps`, else `warmup_ratio` of the run rounded
        down, else Axolotl's default of 3 % of the run (rounded down, at most 100); a warmup of 1 becomes 2, as
        Axolotl sets it."""
        if self.warmup_steps is not None:
            steps = self.warmup_steps
        elif self.warmup_ratio is not None:
            steps = int(self.warmup_ratio * total_steps)
        else:
            steps = min(int(DEFAULT_WARMUP_RATIO * total_steps), MAX_DEFAULT_WARMUP)
        return 2 if steps == 1 else steps

    def check(self) -> None:
        if self.lr_scheduler == "polynomial" and self.learning_rate <= 1e-7:
            raise ValueError(
                f"lr_scheduler: polynomial decays to HF's end rate 1e-7, which learning_rate {self.learning_rate} "
                "does not exceed; raise learning_rate or use another schedule"
            )
        if self.lr_scheduler == "cosine_with_min_lr" and self.cosine_min_lr_ratio is None:
            raise ValueError(
                "lr_scheduler: cosine_with_min_lr needs `cosine_min_lr_ratio` (the final lr as a fraction of "
                "learning_rate, e.g. 0.1)"
            )
        if self.lr_quadratic_warmup and (
            self.lr_scheduler != "cosine" or self.cosine_min_lr_ratio is not None
        ):
            raise ValueError(
                "lr_quadratic_warmup is Axolotl's cosine schedule with a quadratic warmup: it needs "
                "`lr_scheduler: cosine` without cosine_min_lr_ratio (with it, Axolotl drops the minimum); "
                "change or remove one of them"
            )
        if self.cosine_min_lr_ratio is not None and self.lr_scheduler not in ("cosine", "cosine_with_min_lr"):
            raise ValueError(
                f"cosine_min_lr_ratio applies to the cosine schedule, not lr_scheduler: {self.lr_scheduler}; "
                "remove it or use `lr_scheduler: cosine`"
            )
