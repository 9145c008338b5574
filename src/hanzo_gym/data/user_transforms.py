"""Axolotl's dataset transforms of the user's own, `datasets[].type: module.function` (GRPO prompts).

As Axolotl loads them: `module.function(cfg, dataset_idx=i)` returns a row transform, or a (transform, map
options) pair; the transform takes a row (and `tokenizer=` when its signature has that parameter) and returns
the row's new fields, which are merged over the old ones as `datasets.Dataset.map` does, after dropping the
columns the options' `remove_columns` names (`"__all__"`: every original one). The result is TRL's prompt
format: `prompt` as a message list (rendered with the run's chat template) or a string (used as it is), with
the other fields (`answer`, …) passed on to the reward functions. `module` is imported from sys.path or the
working directory, as reward modules are.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hanzo_gym.data.sources import Row
from hanzo_gym.errors import ConfigError, DataError
from hanzo_gym.rewards.user_code import import_user_module

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hanzo_gym.config import Config

RowTransform = Callable[[Row], Row]


def load_user_transform(cfg: Config, index: int, tokenizer: PreTrainedTokenizerBase) -> RowTransform:
    """The row transform `cfg.datasets[index].type` names; ConfigError naming the entry when it cannot load."""
    name = cfg.datasets[index].type
    what = f"datasets[{index}].type `{name}`"
    module_name, _, function_name = name.rpartition(".")
    factory = getattr(import_user_module(what, module_name), function_name, None)
    if not callable(factory):
        raise ConfigError(f"{what}: {module_name}.{function_name} is not a function")
    try:
        made = factory(cfg, dataset_idx=index)
    except Exception as error:
        raise ConfigError(f"{what}: calling it raised {type(error).__name__}: {error}") from error
    transform, options = made if isinstance(made, tuple) else (made, {})
    if not callable(transform):
        raise ConfigError(f"{what}: returned {type(transform).__name__}, not a row transform")
    if "tokenizer" in inspect.signature(transform).parameters:
        plain = transform

        def transform(row: dict) -> Any:
            return plain(row, tokenizer=tokenizer)

    removed = (options or {}).get("remove_columns", [])
    removed = [removed] if isinstance(removed, str) and removed != "__all__" else removed

    def apply(row: Row) -> Row:
        try:
            new = transform(dict(row.data))
        except Exception as error:
            raise DataError(
                f"{row.file} row {row.line}: {what} raised {type(error).__name__}: {error}"
            ) from error
        if not isinstance(new, dict):
            raise DataError(f"{row.file} row {row.line}: {what} returned {type(new).__name__}, not a dict")
        kept = {} if removed == "__all__" else {k: v for k, v in row.data.items() if k not in removed}
        return Row({**kept, **new}, row.file, row.line)

    return apply
