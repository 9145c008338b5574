"""Axolotl's experiment-tracking keys: Weights & Biases, TensorBoard and MLflow.

The keys and when each tracker is on follow Axolotl, which sets them as environment variables for Hugging Face's
callbacks: W&B logs when `wandb_project` is set (or `use_wandb: true`) unless `wandb_mode: disabled`; MLflow when
`mlflow_experiment_name` is set (or `use_mlflow: true`); TensorBoard with `use_tensorboard: true`. A key of a
tracker that is off would do nothing, so it is refused, as is a tracker whose library is not installed (the
message names the extra to install). The loggers themselves are `hanzo_gym.loops.trackers`; this module loads
none of them.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import PrivateAttr

from hanzo_gym.config.feature import Feature

# tracker → (the module it needs, the extra that installs it, its name in messages)
TRACKER_LIBRARIES = {
    "wandb": ("wandb", "wandb", "Weights & Biases"),
    "tensorboard": ("tensorboard", "tensorboard", "TensorBoard"),
    "mlflow": ("mlflow", "mlflow", "MLflow"),
}
_WANDB_ONLY_WHEN_ON = (
    "wandb_entity",
    "wandb_name",
    "wandb_run_id",
    "wandb_mode",
    "wandb_watch",
    "wandb_log_model",
)


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module set to None in sys.modules
        return False


class TrackingKeys(Feature):
    use_wandb: bool = False
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_name: str | None = None
    wandb_run_id: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    wandb_watch: Literal["gradients", "parameters", "all", "false", False] | None = None
    # transformers' WANDB_LOG_MODEL, which Axolotl sets from this key: any other text is read as "false"
    wandb_log_model: Literal["checkpoint", "end", "false", False] | str | None = None
    use_tensorboard: bool = False
    use_mlflow: bool = False
    mlflow_tracking_uri: str | None = None
    mlflow_experiment_name: str | None = None
    mlflow_run_name: str | None = None

    _unread_log_model: str | None = PrivateAttr(None)

    @property
    def wandb_on(self) -> bool:
        return bool(self.wandb_project or self.use_wandb) and self.wandb_mode != "disabled"

    @property
    def mlflow_on(self) -> bool:
        return bool(self.mlflow_experiment_name or self.use_mlflow)

    @property
    def trackers(self) -> list[str]:
        """The trackers this config logs to, in a fixed order."""
        on = {"wandb": self.wandb_on, "tensorboard": self.use_tensorboard, "mlflow": self.mlflow_on}
        return [name for name, wanted in on.items() if wanted]

    def check(self) -> None:
        if self.wandb_log_model not in (None, False, "checkpoint", "end", "false"):
            self._unread_log_model, self.wandb_log_model = self.wandb_log_model, "false"
        asked = bool(self.wandb_project or self.use_wandb)
        # `wandb_mode: disabled` asks for no logging, which is what a config without wandb_project gets
        idle = [
            key
            for key in _WANDB_ONLY_WHEN_ON
            if getattr(self, key) not in (None, False, "false")
            and (key, getattr(self, key)) != ("wandb_mode", "disabled")
        ]
        if not asked and idle:
            raise ValueError(
                f"{', '.join(f'`{key}`' for key in idle)} set without `wandb_project`: W&B logs only when "
                "`wandb_project` is set (or `use_wandb: true`); set it or remove these keys"
            )
        if self.wandb_mode == "disabled":
            extra = [
                key
                for key in ("wandb_watch", "wandb_log_model")
                if getattr(self, key) not in (None, False, "false")
            ]
            if extra:
                raise ValueError(
                    f"wandb_mode: disabled turns W&B off, so {', '.join(extra)} would do nothing"
                )
        if self.mlflow_tracking_uri and not self.mlflow_on:
            raise ValueError(
                "`mlflow_tracking_uri` set without `mlflow_experiment_name` or `use_mlflow: true`: MLflow logs "
                "only with one of them; set it or remove the key"
            )
        if self.mlflow_run_name and not self.mlflow_on:
            raise ValueError("`mlflow_run_name` set without `mlflow_experiment_name` or `use_mlflow: true`")
        missing = [name for name in self.trackers if not installed(TRACKER_LIBRARIES[name][0])]
        if missing:
            raise ValueError(
                "; ".join(
                    f"{TRACKER_LIBRARIES[name][2]} logging is asked for but `{TRACKER_LIBRARIES[name][0]}` is not "
                    f"installed: pip install 'hanzo-gym[{TRACKER_LIBRARIES[name][1]}]'"
                    for name in missing
                )
            )

    def notes(self) -> list[str]:
        if self._unread_log_model is None:
            return []
        return [
            (
                f"wandb_log_model: {self._unread_log_model!r} is none of checkpoint, end, false: transformers' W&B "
                "callback reads it as false (no model is uploaded to W&B), and so does this run"
            )
        ]
