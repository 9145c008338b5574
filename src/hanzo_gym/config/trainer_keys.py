"""Hugging Face Trainer's spellings that Axolotl passes through and users' configs carry: when to save and to
evaluate (`save_strategy`, `eval_strategy` and its older name `evaluation_strategy`), which metric picks the
best checkpoint, where runs are reported (`report_to`, `logging_dir`), resuming (`auto_resume_from_checkpoints`)
and how long a process waits for the others (`ddp_timeout`). The strategies resolve to Axolotl's own keys here, with HF's meaning (its `IntervalStrategy` and
defaults); loops/tail.py reads only those."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PrivateAttr

from hanzo_gym.config.feature import Feature

Strategy = Literal["no", "steps", "epoch"]
TRACKERS = ("wandb", "tensorboard", "mlflow")
HF_DEFAULT_SAVE_STEPS = 500  # TrainingArguments.save_steps


class TrainerKeys(Feature):
    save_strategy: Literal["no", "steps", "epoch", "best"] | None = None
    eval_strategy: Strategy | None = None
    evaluation_strategy: Strategy | None = None  # HF's name of eval_strategy before transformers 4.46
    # the metric that picks the best checkpoint and stops early: the eval loss unless it names a bench metric
    # (do_bench_eval's); HF's spelling, `eval_` in front or not
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None  # HF's default: False for a metric whose name ends in `loss`
    # HF's integrations: each tracker named turns on the tracker's use_ key
    report_to: Literal["none", "all", *TRACKERS] | list[Literal["none", "all", *TRACKERS]] | None = None
    logging_dir: str | None = None  # HF's TensorBoard folder
    auto_resume_from_checkpoints: bool | None = None  # Axolotl: resume from output_dir's newest checkpoint
    # HF's seed of the data samplers (each epoch's order); `seed` when unset
    data_seed: int | None = Field(None, ge=0, le=2**32 - 1)
    ddp_timeout: float = Field(
        1800, gt=0
    )  # seconds a collective waits for the other processes (HF's default)

    _unevaluated: list[str] = PrivateAttr(default_factory=list)

    @property
    def sampler_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed

    @property
    def evaluates(self) -> bool:
        """False for `eval_strategy: no`: the held-out examples are kept out of training but never scored."""
        return (self.eval_strategy or self.evaluation_strategy) != "no"

    @property
    def best_metric(self) -> str:
        """metric_for_best_model as the eval row names it: `eval/loss`, `eval/bench_total_accuracy`."""
        return "eval/" + (self.metric_for_best_model or "loss").removeprefix("eval_").removeprefix("eval/")

    @property
    def best_is_greater(self) -> bool:
        if self.greater_is_better is not None:
            return self.greater_is_better
        return not self.best_metric.endswith("loss")

    def check(self) -> None:
        self._check_best_metric()
        if self.eval_strategy and self.evaluation_strategy and self.eval_strategy != self.evaluation_strategy:
            raise ValueError(
                f"eval_strategy: {self.eval_strategy} and evaluation_strategy (its older name): "
                f"{self.evaluation_strategy} disagree; give eval_strategy only"
            )
        self._resolve_save_strategy()
        self._resolve_eval_strategy()
        self._resolve_report_to()
        if self.auto_resume_from_checkpoints and self.resume_from_checkpoint is None:
            self.resume_from_checkpoint = True
        # what they measure is never run, in Axolotl too
        written = [
            key
            for key in ("do_causal_lm_eval", "eval_causal_lm_metrics", "do_bench_eval", "bench_dataset")
            if getattr(self, key)
        ]
        if not self.evaluates and written:
            self.do_causal_lm_eval = self.do_bench_eval = False
            self.eval_causal_lm_metrics = self.bench_dataset = None
            self._unevaluated.append(
                f"{', '.join(written)}: changes nothing here: eval_strategy: no turns evaluations off"
            )
        needs_evals = [
            key for key in ("early_stopping_patience", "load_best_model_at_end") if getattr(self, key)
        ]
        if not self.evaluates and needs_evals:
            raise ValueError(
                f"{needs_evals[0]} acts on evaluations, which eval_strategy: no turns off; remove one"
            )

    def notes(self) -> list[str]:
        return list(self._unevaluated)

    def _check_best_metric(self) -> None:
        if self.metric_for_best_model is None:
            return
        name = self.best_metric.removeprefix("eval/")
        if name == "loss":
            return
        bench = name in ("bench_loss", "bench_total_accuracy", "bench_average_accuracy") or name.startswith(
            "bench_accuracy_"
        )
        if not bench:
            raise ValueError(
                f"metric_for_best_model: `{self.metric_for_best_model}` is not a metric evaluations compute here; "
                "use eval_loss, or with do_bench_eval eval_bench_total_accuracy, eval_bench_average_accuracy, "
                "eval_bench_loss or eval_bench_accuracy_<group>"
            )
        if not self.do_bench_eval:
            raise ValueError(
                f"metric_for_best_model: `{self.metric_for_best_model}` is measured by do_bench_eval: set "
                "do_bench_eval: true or pick eval_loss"
            )

    def _resolve_save_strategy(self) -> None:
        if self.save_strategy == "best":
            raise ValueError(
                "save_strategy: best saves whenever HF's metric_for_best_model improves, which is not supported "
                "yet; use `load_best_model_at_end: true` with save_steps a multiple of eval_steps"
            )
        self._resolve_strategy(
            "save_strategy", self.save_strategy, "save_steps", "saves_per_epoch", HF_DEFAULT_SAVE_STEPS
        )

    def _resolve_eval_strategy(self) -> None:
        written = "eval_strategy" if self.eval_strategy else "evaluation_strategy"
        strategy = self.eval_strategy or self.evaluation_strategy
        # HF: eval_steps defaults to logging_steps
        self._resolve_strategy(written, strategy, "eval_steps", "evals_per_epoch", self.logging_steps)

    def _resolve_strategy(
        self, written: str, strategy: str | None, steps_key: str, per_epoch_key: str, default_steps: float
    ) -> None:
        """HF's `no` / `steps` / `epoch` as Axolotl's step or per-epoch count; either count beside a strategy other
        than `steps` is a mismatch (Axolotl's rule)."""
        if strategy is None:
            return
        steps, per_epoch = getattr(self, steps_key), getattr(self, per_epoch_key)
        if strategy != "steps" and (steps is not None or per_epoch is not None):
            cadence = steps_key if steps is not None else per_epoch_key
            raise ValueError(
                f"{written}: {strategy} and `{cadence}` disagree; set {written}: steps or remove {cadence}"
            )
        if strategy == "epoch":
            setattr(self, per_epoch_key, 1)
        elif strategy == "steps" and steps is None and per_epoch is None:
            setattr(self, steps_key, default_steps)

    def _resolve_report_to(self) -> None:
        named = self.report_to if isinstance(self.report_to, list) else [self.report_to]
        if "all" in named:
            raise ValueError(
                "report_to: all reports to every integration installed; name the trackers (wandb, tensorboard, "
                "mlflow) or set use_wandb / use_tensorboard / use_mlflow"
            )
        for tracker in TRACKERS:
            if tracker in named:
                setattr(self, f"use_{tracker}", True)
        if self.logging_dir is not None and not self.use_tensorboard:
            raise ValueError(
                "logging_dir is HF's TensorBoard folder, and nothing logs to TensorBoard: set use_tensorboard: true "
                "(or report_to: tensorboard), or remove logging_dir"
            )
