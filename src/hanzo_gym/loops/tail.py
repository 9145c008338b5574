"""What every training loop does around its optimizer steps, written once: resume from a checkpoint, keep the
logging window, log a row every `logging_steps`, evaluate, save checkpoints.

A loop computes its step and hands the step's values to `LoopTail.finish_step`, with a function that turns
the window into the logged row (SFT divides summed NLL by summed tokens; GRPO averages every metric over the
window's steps, as TRL does). The window travels inside checkpoints, so a resumed run logs the rows an
uninterrupted one would.

The tail also stops a run whose numbers stop being finite (`TrainingDiverged`), before a NaN is logged or
saved: an adapter of NaNs loads fine and answers nonsense.

Axolotl's loss watchdog (`loss_watchdog_threshold`, `loss_watchdog_patience`, default 3) is its callback's rule:
at the end of every step, before that step's row is logged (HF logs after the step-end callbacks), the newest
logged row's `loss` is compared with the threshold (an eval row has none: that step neither counts nor
resets); each step it is above counts, a step where it is not resets the count, and at `patience` the run
stops there as a finished run (its last row logged, evaluated, the adapter written). The count starts afresh
on resume.

Early stopping and the best checkpoint are HF's rules, which Axolotl's `early_stopping_patience` and
`load_best_model_at_end` turn on, over `metric_for_best_model` (the eval loss unless it names another, lower
is better unless `greater_is_better`): after each evaluation of the trained model (not the step-0 score of the
base model, which HF never takes), a metric no better than the best so far counts, a better one resets the count;
at `patience` the run stops there as a finished run. The best checkpoint is the newest save whose step had the
best metric seen at that save; when saves fall on evaluations (save steps a multiple of eval steps) and
either key is set, the run ends with that checkpoint's weights as its final adapter, and `save_total_limit`
never removes it. Count, best metric and best checkpoint travel inside checkpoints.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hanzo_gym.clock import duration
from hanzo_gym.config import Config
from hanzo_gym.config.feature import steps_of
from hanzo_gym.engine import Engine
from hanzo_gym.engine.state_files import load_engine_state
from hanzo_gym.errors import GymError
from hanzo_gym.loops.checkpoint import TrainerPosition, starting_position, write_checkpoint
from hanzo_gym.loops.run_dir import Progress, RunDir

# What a value of a step is called in the message (SFT hands over the window's summed NLL as `nll`).
_SHOWN_AS = {"nll": "loss"}


class TrainingDiverged(GymError):
    """A step's loss, gradient norm or score is not a finite number: the run stops without writing the
    adapter (an earlier run in output_dir stays, see `RunDir`)."""

    def __init__(self, step: int, values: dict[str, float], cfg: Config):
        shown = ", ".join(f"{_SHOWN_AS.get(key, key)} {value}" for key, value in values.items())
        super().__init__(
            f"step {step}: training diverged ({shown}); stopped without writing the adapter. Lower "
            f"learning_rate (now {cfg.learning_rate:g}) or lora_alpha (now {cfg.lora_alpha:g}), or look for "
            "an extreme example in this step's data"
        )


def check_finite(values: dict[str, float], step: int, cfg: Config) -> None:
    bad = {key: value for key, value in values.items() if not math.isfinite(value)}
    if bad:
        raise TrainingDiverged(step, bad, cfg)


def check_finite_adapter(engine: Engine, step: int, cfg: Config) -> None:
    """The adapter's weights before they are saved: an update can overflow them although the step's loss and
    gradient norm were finite."""
    if not all(bool(parameter.isfinite().all()) for parameter in engine.trainable):
        raise TrainingDiverged(step, {"adapter weights": math.nan}, cfg)


def _every(steps: float | None, per_epoch: int | None, total: int, epochs: int) -> int | None:
    """A cadence in steps: as given (a fraction of the run's steps as HF reads it), or Axolotl's count per epoch,
    which it passes to HF as the fraction 1 / (count × epochs) of the run and HF turns into ceil(total ×
    fraction) steps."""
    if steps is not None or per_epoch is None:
        return steps_of(steps, total)
    return max(1, math.ceil(total / (per_epoch * epochs)))


def planned_steps(cfg: Config, steps_per_epoch: int) -> tuple[int, int]:
    """(optimizer steps, epochs to run) of a loop with `steps_per_epoch` steps an epoch. `max_steps` overrides
    `num_epochs` as in HF's Trainer, to which Axolotl passes both: the run is max_steps long, fewer steps than
    num_epochs would take or more, and loops over the data (each epoch in its own order) as often as that needs;
    the schedule spans max_steps."""
    if cfg.max_steps is None:
        # HF: ceil(num_train_epochs × steps per epoch) steps, over ceil(num_train_epochs) epochs
        return math.ceil(cfg.num_epochs * steps_per_epoch), math.ceil(cfg.num_epochs)
    return cfg.max_steps, -(-cfg.max_steps // max(steps_per_epoch, 1))


def collect_garbage() -> None:
    """Axolotl's `gc_collect_steps`: Python's collector, then the CUDA allocator's cached blocks back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class StepWindow:
    """The steps since the last logged row: each value's running sum, how many steps gave it, and the
    values of the newest step."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)

    def add(self, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
            self.counts[key] = self.counts.get(key, 0) + 1
        self.last = dict(values)

    def means(self) -> dict[str, float]:
        return {key: total / self.counts[key] for key, total in self.sums.items()}

    @classmethod
    def restore(cls, saved: dict) -> StepWindow:
        if saved and "sums" not in saved:  # an SFT checkpoint from before the shared tail: its sums alone
            return cls(sums=dict(saved), counts=dict.fromkeys(saved, 1))
        return cls(**saved)


@dataclass
class StepPlace:
    """Where a finished step sits: `index` of `steps_in_epoch` steps in epoch `epoch` (0-based)."""

    epoch: int
    index: int
    steps_in_epoch: int

    @property
    def progress(self) -> float:
        return round(self.epoch + (self.index + 1) / self.steps_in_epoch, 4)

    @property
    def ends_epoch(self) -> bool:
        return self.index == self.steps_in_epoch - 1

    @property
    def following(self) -> tuple[int, int]:
        """(epoch, index) of the step after this one."""
        return (self.epoch + 1, 0) if self.ends_epoch else (self.epoch, self.index + 1)


@dataclass
class BestCheckpoint:
    """HF's TrainerState best_metric / best_global_step / best_model_checkpoint, and its early-stopping count."""

    metric: float | None = None  # the best value of metric_for_best_model so far
    step: int | None = None  # where it was measured
    checkpoint_step: int | None = None  # the newest saved checkpoint at such a step
    checkpoint_metric: float | None = None  # its value there
    patience_count: int = 0  # evaluations in a row without a better value

    @classmethod
    def restore(cls, saved: dict) -> BestCheckpoint:
        """From a checkpoint's record; one written when only the eval loss was compared calls it `loss`."""
        older = {"loss": "metric", "checkpoint_loss": "checkpoint_metric"}
        return cls(**{older.get(key, key): value for key, value in saved.items()})

    def evaluated(self, step: int, value: float, greater_is_better: bool) -> None:
        better = self.metric is None or (value > self.metric if greater_is_better else value < self.metric)
        if better:
            self.metric, self.step, self.patience_count = value, step, 0
        else:
            self.patience_count += 1

    def saved(self, step: int) -> None:
        if self.step == step:
            self.checkpoint_step, self.checkpoint_metric = step, self.metric


class LoopTail:
    """`evaluate(step)` scores the held-out data (None: nothing held out); `row(window)` makes the logged row's
    metrics; `line(row)` the printed line."""

    def __init__(
        self,
        engine: Engine,
        cfg: Config,
        run: RunDir,
        plan: dict,
        total: int,
        resume_from: Path | None,
        evaluate: Callable[[int], dict[str, float]] | None,
        row: Callable[[StepWindow], dict[str, float]],
        line: Callable[[dict], str],
    ):
        self.engine, self.cfg, self.run, self.plan, self.total = engine, cfg, run, plan, total
        self._evaluate = evaluate if cfg.evaluates else None  # eval_strategy: no
        self._row, self._line = row, line
        self.position = starting_position(engine, run, plan, resume_from)
        # Only now, with a checkpoint to resume from accepted: a refused resume leaves run_config.json as it was.
        run.write_config(cfg.model_dump(mode="json"))
        self.step = self.position.step
        self.window = StepWindow.restore(self.position.log_window)
        self.progress = Progress(total, self.step)
        self.say = self.progress.say
        self.started = time.perf_counter()
        self.log_every = steps_of(cfg.logging_steps, total)
        self.eval_every = _every(cfg.eval_steps, cfg.evals_per_epoch, total, cfg.num_epochs)
        self.save_every = _every(cfg.save_steps, cfg.saves_per_epoch, total, cfg.num_epochs)
        self.last_eval: dict[str, float] | None = None
        self.stopped = False  # the loss watchdog or early stopping ended the run early
        self.best = BestCheckpoint.restore(self.position.best)
        self.keeps_best = bool(
            (cfg.load_best_model_at_end or cfg.early_stopping_patience)
            and self.eval_every
            and self.save_every
            and self.save_every % self.eval_every == 0
        )
        if cfg.load_best_model_at_end and not self.keeps_best:
            raise GymError(
                f"load_best_model_at_end: checkpoints every {self.save_every} steps do not fall on evaluations "
                f"every {self.eval_every}; make the save interval a multiple of the eval interval"
            )
        self._logged_loss: float | None = None  # the newest logged row's `loss`, for the watchdog
        self._violations = 0
        if self._evaluate is not None and self.step == 0:
            self.say("eval step 0: scoring the model before training on the validation set …")
            self.evaluate(0.0)  # the base model's score: the number training has to beat

    @property
    def done(self) -> bool:
        return self.stopped or self.step >= self.total

    def _watch_loss(self) -> None:
        threshold = self.cfg.loss_watchdog_threshold
        if threshold is None or self._logged_loss is None:
            return
        if self._logged_loss <= threshold:
            self._violations = 0
            return
        self._violations += 1
        patience = self.cfg.loss_watchdog_patience or 3
        if self._violations >= patience:
            self.stopped = True
            self.say(
                f"step {self.step}: loss {self._logged_loss:.4f} above loss_watchdog_threshold {threshold:g} for "
                f"{patience} steps: stopping the run here (Axolotl's loss watchdog)"
            )

    def first_index(self, epoch: int) -> int:
        """Where `epoch` starts: mid-epoch when the run resumed into it."""
        return self.position.window if epoch == self.position.epoch else 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def _time_left(self) -> str:
        """At this process's pace so far (evaluations and saves included): how long the rest takes."""
        done = self.step - self.position.step
        if self.done or done <= 0:
            return ""
        return f" · {duration(self.elapsed() / done * (self.total - self.step))} left"

    def evaluate(self, epoch_progress: float) -> dict[str, float]:
        result = self._evaluate(self.step)
        check_finite(result, self.step, self.cfg)
        self.run.log({"step": self.step, "epoch": epoch_progress, **result, "elapsed_s": self.elapsed()})
        scores = " ".join(f"{key} {value:.4f}" for key, value in result.items())
        self.say(f"eval step {self.step} epoch {epoch_progress:.2f} {scores}")
        self.last_eval = result
        self._logged_loss = None  # the newest row is now an eval row, which HF's watchdog passes over
        if self.step > 0 and self.cfg.best_metric in result:
            self._stop_early(result[self.cfg.best_metric])
        return result

    def _stop_early(self, value: float) -> None:
        cfg = self.cfg
        self.best.evaluated(self.step, value, cfg.best_is_greater)
        patience = cfg.early_stopping_patience
        if patience is not None and self.best.patience_count >= patience and not self.done:
            self.stopped = True
            self.say(
                f"step {self.step}: {cfg.best_metric} {value:.4f} not {'above' if cfg.best_is_greater else 'below'} "
                f"the best {self.best.metric:.4f} (step {self.best.step}) for {patience} evaluations: stopping the "
                "run here (early_stopping_patience)"
            )

    def finish_step(self, values: dict[str, float], place: StepPlace) -> None:
        """Count the step, add its values to the window, and log, evaluate and save as the config says."""
        cfg = self.cfg
        self.step += 1
        check_finite(values, self.step, cfg)
        self.progress.advance()
        self.window.add(values)
        self._watch_loss()
        if cfg.collect_every and self.step % cfg.collect_every == 0:
            collect_garbage()
        logged = self.step % self.log_every == 0 or self.done
        if logged:
            self._log_window(place)
        periodic = self.eval_every and self.step % self.eval_every == 0
        if self._evaluate is not None and (periodic or place.ends_epoch or self.done):
            self.evaluate(place.progress)
            if self.stopped and not logged:  # early stopping ended the run here: its last steps get their row
                self._log_window(place)
        if self.save_every and self.step % self.save_every == 0:
            check_finite_adapter(self.engine, self.step, cfg)
            epoch, index = place.following
            self.best.saved(self.step)
            mark = TrainerPosition(
                self.step, epoch, index, self.plan, log_window=asdict(self.window), best=asdict(self.best)
            )
            path = self.run.save_checkpoint(
                self.step,
                place.progress,
                lambda d: write_checkpoint(d, self.engine, mark),
                cfg.save_total_limit,
                spare=self.best.checkpoint_step if self.keeps_best else None,
                size=self.engine.trainable_parameter_count * 12,  # fp32 weights and AdamW's two moments
            )
            self.say(f"saved {path}")

    def _log_window(self, place: StepPlace) -> None:
        row = {"step": self.step, "epoch": place.progress, **self._row(self.window)}
        self._logged_loss = row.get("loss", self._logged_loss)
        row["elapsed_s"] = self.elapsed()
        self.run.log(row)
        self.say(self._line(row) + self._time_left())
        self.window = StepWindow()

    def close(self) -> None:
        """The end of the loop: with the best checkpoint kept, its weights become the run's final ones."""
        self.progress.close()
        step = self.best.checkpoint_step
        if self.keeps_best and step is not None and step != self.step:
            load_engine_state(self.engine, self.run.checkpoint_path(step))
            self.say(
                f"loaded checkpoint-{step} ({self.cfg.best_metric} {self.best.checkpoint_metric:.4f}, the best at a "
                "save) as the final weights (load_best_model_at_end)"
            )
