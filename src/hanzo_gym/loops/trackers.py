"""Experiment trackers: every row of metrics.jsonl also goes to Weights & Biases, TensorBoard and MLflow, under
the same metric names, at the row's `step`.

One interface, one implementation per library (each imported only when its tracker is on; the config already
checked that it is installed, `hanzo_gym.config.tracking`): `start(cfg, model)` once before training,
`log(row, step)` for every row, `checkpoint(path, step, epoch)` after a checkpoint is saved,
`final(write)` with the final adapter (`write(directory)` puts it into a folder), `table(name, records, step)`
with rows of text (an evaluation's completions, `eval_predictions`; GRPO's sampled ones, `completions`: a W&B
table, an MLflow table artifact `<name>/step_<n>.json`, TensorBoard text `<name>`), `finish(failed)` at the end.
Only the main process logs: `open_trackers` returns no trackers on the other ranks, and the run directory, which
calls them, writes nothing there either.

What each follows (Axolotl hands these keys to Hugging Face's callbacks, whose behaviour is copied here):
W&B: `wandb.init(project, entity, name, id, mode)` with the resolved config, one history row per metrics row
with `step` as its x axis; `wandb_watch` gradients / parameters
/ all is `wandb.watch(model, log=…, log_freq=max(100, logging_steps))`; `wandb_log_model: checkpoint` logs each
checkpoint folder as a `model` artifact (aliases `epoch_<e>`, `checkpoint_global_step_<n>`), `end` the final
adapter (alias `final_model`). TensorBoard: event files in `output_dir/runs/<date>_<host>` (HF's default logging
dir; `logging_dir`, then `TENSORBOARD_LOGGING_DIR`, override it), the config as text `config`. MLflow: the tracking URI and the
experiment when given (else MLflow's own defaults and `MLFLOW_*` variables), a run named `mlflow_run_name`, the
config as params, each row as metrics (a character MLflow refuses in a name becomes `_`, as HF does).
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import tempfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from hanzo_gym.config import Config
from hanzo_gym.config.tracking import TRACKER_LIBRARIES
from hanzo_gym.engine.distributed import is_main
from hanzo_gym.errors import GymError


class Tracker:
    """The interface; the base methods do nothing."""

    name = "tracker"

    def start(self, cfg: Config, model: Any) -> None:
        pass

    def log(self, row: dict[str, float], step: int) -> None:
        pass

    def checkpoint(self, path: Path, step: int, epoch: float) -> None:
        pass

    def final(self, write: Callable[[Path], None]) -> None:
        pass

    def table(self, name: str, records: list[dict], step: int) -> None:
        pass

    def finish(self, failed: bool = False) -> None:
        pass


# The W&B names of the tables: Axolotl's for its eval predictions, TRL's for GRPO's completions
WANDB_TABLES = {"eval_predictions": "Eval - Predictions vs Ground Truth", "completions": "completions"}


def _columns(records: list[dict]) -> list[str]:
    return list(dict.fromkeys(key for record in records for key in record))


def _import(name: str) -> Any:
    module, extra, shown = TRACKER_LIBRARIES[name]
    try:
        return __import__(module)
    except ImportError as exc:
        raise GymError(
            f"{shown} logging is asked for but `{module}` does not import ({exc}): "
            f"pip install 'hanzo-gym[{extra}]'"
        ) from None


class WandbTracker(Tracker):
    name = "wandb"

    def start(self, cfg: Config, model: Any) -> None:
        self.wandb = _import("wandb")
        self.log_model = cfg.wandb_log_model if cfg.wandb_log_model not in (None, False, "false") else None
        self.named = cfg.wandb_name is not None or cfg.wandb_run_id is not None
        settings = {"project": cfg.wandb_project or os.environ.get("WANDB_PROJECT", "huggingface")}
        if cfg.wandb_entity:
            settings["entity"] = cfg.wandb_entity
        name = cfg.wandb_name or cfg.wandb_run_id  # Axolotl names the run after its id when no name is given
        if name:
            settings["name"] = name
        if cfg.wandb_run_id:
            settings.update(id=cfg.wandb_run_id, resume="allow")
        if cfg.wandb_mode:
            settings["mode"] = cfg.wandb_mode
        self.run = self.wandb.init(config=cfg.model_dump(mode="json"), **settings)
        # Each row its own history row, on the x axis `step` (as HF puts every log on `train/global_step`):
        # an eval row at the step of a training row does not overwrite its `elapsed_s`, and a resumed run
        # may log a step again.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        if cfg.wandb_watch not in (None, False, "false"):
            self.run.watch(model, log=cfg.wandb_watch, log_freq=max(100, int(cfg.logging_steps)))
        mode = f" ({cfg.wandb_mode})" if cfg.wandb_mode else ""
        print(f"W&B: run {self.run.name} in project {settings['project']}{mode}", flush=True)

    def log(self, row: dict[str, float], step: int) -> None:
        self.run.log({"step": step, **row})

    def _artifact_name(self) -> str:
        # HF's name: the run's id unless the run was named
        return f"model-{self.run.name if self.named else self.run.id}"

    def checkpoint(self, path: Path, step: int, epoch: float) -> None:
        if self.log_model != "checkpoint":
            return
        artifact = self.wandb.Artifact(name=self._artifact_name(), type="model", metadata={"step": step})
        artifact.add_dir(str(path))
        self.run.log_artifact(
            artifact, aliases=[f"epoch_{round(epoch, 2)}", f"checkpoint_global_step_{step}"]
        )

    def final(self, write: Callable[[Path], None]) -> None:
        if self.log_model is None:
            return
        artifact = self.wandb.Artifact(
            name=self._artifact_name(), type="model", metadata={"final_model": True}
        )
        with tempfile.TemporaryDirectory() as folder:
            write(Path(folder))
            artifact.add_dir(folder)  # copies the files now, before the folder goes
            self.run.log_artifact(artifact, aliases=["final_model"])

    def table(self, name: str, records: list[dict], step: int) -> None:
        columns = _columns(records)
        rows = [[record.get(column) for column in columns] for record in records]
        self.run.log(
            {"step": step, WANDB_TABLES.get(name, name): self.wandb.Table(columns=columns, data=rows)}
        )

    def finish(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def tensorboard_dir(cfg: Config) -> Path:
    """HF's `logging_dir` when given, else its default, which Axolotl keeps: output_dir/runs/<Mon
    DD_HH-MM-SS>_<host>."""
    if cfg.logging_dir:
        return Path(cfg.logging_dir).expanduser()
    if os.environ.get("TENSORBOARD_LOGGING_DIR"):
        return Path(os.environ["TENSORBOARD_LOGGING_DIR"]).expanduser()
    stamp = datetime.now().strftime("%b%d_%H-%M-%S")
    return Path(cfg.output_dir) / "runs" / f"{stamp}_{socket.gethostname()}"


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def start(self, cfg: Config, model: Any) -> None:
        _import("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.directory = tensorboard_dir(cfg)
        self.writer = SummaryWriter(log_dir=str(self.directory))
        self.writer.add_text("config", json.dumps(cfg.model_dump(mode="json"), indent=2))
        print(f"TensorBoard: logging to {self.directory}", flush=True)

    def log(self, row: dict[str, float], step: int) -> None:
        for key, value in row.items():
            self.writer.add_scalar(key, value, step)

    def table(self, name: str, records: list[dict], step: int) -> None:
        columns = _columns(records)
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for record in records:
            cells = (str(record.get(column)).replace("|", "\\|").replace("\n", "<br>") for column in columns)
            lines.append("| " + " | ".join(cells) + " |")
        self.writer.add_text(name, "\n".join(lines), step)

    def finish(self, failed: bool = False) -> None:
        self.writer.flush()
        self.writer.close()


_MLFLOW_NAME = re.compile(r"[^0-9A-Za-z_\-. :/]")


def _params(cfg: Config, limit: int) -> dict[str, str]:
    """The resolved config as MLflow params: nested values as JSON; values past MLflow's length limit are left
    out, as HF leaves them out."""
    params = {}
    for key, value in cfg.model_dump(mode="json").items():
        text = value if isinstance(value, str) else json.dumps(value)
        if len(text) <= limit:
            params[key] = text
    return params


class MlflowTracker(Tracker):
    name = "mlflow"

    def start(self, cfg: Config, model: Any) -> None:
        mlflow = self.mlflow = _import("mlflow")
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        try:
            if cfg.mlflow_tracking_uri:
                mlflow.set_tracking_uri(cfg.mlflow_tracking_uri)
            experiment = cfg.mlflow_experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME")
            if experiment:
                mlflow.set_experiment(experiment)
            self.run = mlflow.start_run(run_name=cfg.mlflow_run_name)
        except (mlflow.exceptions.MlflowException, ImportError, OSError) as exc:
            raise GymError(f"MLflow could not start a run at {mlflow.get_tracking_uri()}: {exc}") from None
        items = list(_params(cfg, MAX_PARAM_VAL_LENGTH).items())
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            mlflow.log_params(dict(items[start : start + MAX_PARAMS_TAGS_PER_BATCH]))
        print(f"MLflow: run {self.run.info.run_id} at {mlflow.get_tracking_uri()}", flush=True)

    def log(self, row: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({_MLFLOW_NAME.sub("_", key): value for key, value in row.items()}, step=step)

    def table(self, name: str, records: list[dict], step: int) -> None:
        data = {column: [record.get(column) for record in records] for column in _columns(records)}
        self.mlflow.log_table(data=data, artifact_file=f"{name}/step_{step}.json")

    def finish(self, failed: bool = False) -> None:
        self.mlflow.end_run(status="FAILED" if failed else "FINISHED")


_KINDS: dict[str, type[Tracker]] = {
    "wandb": WandbTracker,
    "tensorboard": TensorBoardTracker,
    "mlflow": MlflowTracker,
}


class Trackers:
    """The trackers of one run, called together. `log(row)` sends a metrics.jsonl row's numbers (all but `step`,
    which is the x axis) to each."""

    def __init__(self, trackers: list[Tracker] | None = None):
        self.trackers = list(trackers or [])

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def log(self, row: dict) -> None:
        if not self.trackers:
            return
        step = int(row.get("step", 0))
        numbers = {
            key: float(value)
            for key, value in row.items()
            if key != "step" and isinstance(value, int | float) and math.isfinite(value)
        }
        for tracker in self.trackers:
            tracker.log(numbers, step)

    def checkpoint(self, path: Path, step: int, epoch: float) -> None:
        for tracker in self.trackers:
            tracker.checkpoint(path, step, epoch)

    def final(self, write: Callable[[Path], None]) -> None:
        for tracker in self.trackers:
            tracker.final(write)

    def table(self, name: str, records: list[dict], step: int) -> None:
        for tracker in self.trackers:
            tracker.table(name, records, step)

    def finish(self, failed: bool = False) -> None:
        """Finish every tracker, even when one of them fails (the first failure is raised after)."""
        trackers, self.trackers = self.trackers, []
        first: BaseException | None = None
        for tracker in trackers:
            try:
                tracker.finish(failed)
            except Exception as exc:  # noqa: BLE001 - the others still finish
                first = first or exc
        if first is not None and not failed:
            raise first


def open_trackers(cfg: Config, model: Any) -> Trackers:
    """Start the trackers the config asks for (none on a process other than the main one). A tracker that fails
    to start finishes those already started."""
    if not is_main():
        return Trackers()
    started = Trackers()
    try:
        for name in cfg.trackers:
            tracker = _KINDS[name]()
            tracker.start(cfg, model)
            started.trackers.append(tracker)
    except BaseException:
        started.finish(failed=True)
        raise
    return started
