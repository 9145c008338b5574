"""Axolotl's loss watchdog: stop when the newest logged loss stays above a threshold for `patience` logged steps
(loops/tail.py acts on it)."""

from __future__ import annotations

from pydantic import Field

from hanzo_gym.config.feature import Feature


class WatchdogKeys(Feature):
    loss_watchdog_threshold: float | None = None
    loss_watchdog_patience: int | None = Field(None, ge=1)  # Axolotl's default: 3

    def check(self) -> None:
        if self.loss_watchdog_patience is not None and self.loss_watchdog_threshold is None:
            raise ValueError(
                "loss_watchdog_patience needs `loss_watchdog_threshold` (the loss that counts as too high)"
            )
        if self.rl == "grpo" and self.loss_watchdog_threshold is not None:
            raise ValueError(
                "loss_watchdog_threshold watches a loss that falls as training works (SFT, DPO and its family), "
                "not rl: grpo's"
            )
