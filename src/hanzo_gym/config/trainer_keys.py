"""Hugging Face Trainer's spellings that Axolotl passes through and users' configs carry: when to save and to
evaluate (`save_strategy`, `eval_strategy` and its older name `evaluation_strategy`) and the data loader's
settings. The strategies resolve to Axolotl's own keys here, with HF's meaning (its `IntervalStrategy` and
defaults); loops/tail.py reads only those."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hanzo_gym.config.feature import Feature

Strategy = Literal["no", "steps", "epoch"]
HF_DEFAULT_SAVE_STEPS = 500  # TrainingArguments.save_steps


class TrainerKeys(Feature):
    save_strategy: Literal["no", "steps", "epoch", "best"] | None = None
    eval_strategy: Strategy | None = None
    evaluation_strategy: Strategy | None = None  # HF's name of eval_strategy before transformers 4.46
    dataloader_num_workers: int | None = Field(None, ge=0)
    dataloader_pin_memory: bool | None = None
    dataloader_prefetch_factor: int | None = Field(None, ge=1)

    @property
    def evaluates(self) -> bool:
        """False for `eval_strategy: no`: the held-out examples are kept out of training but never scored."""
        return (self.eval_strategy or self.evaluation_strategy) != "no"

    def check(self) -> None:
        if self.eval_strategy and self.evaluation_strategy and self.eval_strategy != self.evaluation_strategy:
            raise ValueError(
                f"eval_strategy: {self.eval_strategy} and evaluation_strategy (its older name): "
                f"{self.evaluation_strategy} disagree; give eval_strategy only"
            )
        self._resolve_save_strategy()
        self._resolve_eval_strategy()
        needs_evals = [
            key
            for key in ("early_stopping_patience", "load_best_model_at_end", "do_causal_lm_eval")
            if getattr(self, key)
        ]
        if not self.evaluates and needs_evals:
            raise ValueError(
                f"{needs_evals[0]} acts on evaluations, which eval_strategy: no turns off; remove one"
            )

    def _resolve_save_strategy(self) -> None:
        strategy = self.save_strategy
        if strategy is None:
            return
        if strategy == "best":
            raise ValueError(
                "save_strategy: best saves whenever HF's metric_for_best_model improves, which is not supported "
                "yet; use `load_best_model_at_end: true` with save_steps a multiple of eval_steps"
            )
        # Axolotl's rule: save_steps (or saves_per_epoch) with any strategy but `steps` is a mismatch
        cadence = "save_steps" if self.save_steps is not None else "saves_per_epoch"
        if strategy != "steps" and (self.save_steps is not None or self.saves_per_epoch is not None):
            raise ValueError(
                f"save_strategy: {strategy} and `{cadence}` disagree; set save_strategy: steps or remove {cadence}"
            )
        if strategy == "epoch":
            self.saves_per_epoch = 1
        elif strategy == "steps" and self.save_steps is None and self.saves_per_epoch is None:
            self.save_steps = HF_DEFAULT_SAVE_STEPS

    def _resolve_eval_strategy(self) -> None:
        strategy = self.eval_strategy or self.evaluation_strategy
        if strategy is None:
            return
        written = "eval_strategy" if self.eval_strategy else "evaluation_strategy"
        cadence = "eval_steps" if self.eval_steps is not None else "evals_per_epoch"
        if strategy != "steps" and (self.eval_steps is not None or self.evals_per_epoch is not None):
            raise ValueError(
                f"{written}: {strategy} and `{cadence}` disagree; set {written}: steps or remove {cadence}"
            )
        if strategy == "epoch":
            self.evals_per_epoch = 1
        elif strategy == "steps" and self.eval_steps is None and self.evals_per_epoch is None:
            self.eval_steps = self.logging_steps  # HF: eval_steps defaults to logging_steps

    def notes(self) -> list[str]:
        loader = [
            key
            for key in (
                "dataloader_num_workers",
                "dataloader_pin_memory",
                "dataloader_prefetch_factor",
            )
            if getattr(self, key) is not None
        ]
        if not loader:
            return []
        return [
            (
                f"{', '.join(loader)}: HF's data-loader settings change nothing here: the tokenized examples are "
                "batched in the training process, with no loader workers"
            )
        ]
