"""Axolotl's dataset code of the user's own, `datasets[].type: module.function`.

GRPO prompts and preference rows go through a row transform. As Axolotl loads them: `module.function(cfg,
dataset_idx=i)` returns a row transform, or a (transform, map options) pair; the transform takes a row (and
`tokenizer=` when its signature has that parameter) and returns the row's new fields, which are merged over the
old ones as `datasets.Dataset.map` does, after dropping the columns the options' `remove_columns` names
(`"__all__"`: every original one). The result is TRL's prompt format: `prompt` as a message list (rendered
with the run's chat template) or a string (used as it is), with the other fields (`answer`, …) passed on to the reward functions; preference rows take TRL's prompt / chosen /
rejected (KTO: prompt / completion / label) shape.

SFT rows go through a prompt strategy of the user's, as Axolotl loads one: `type: package.module` calls the
module's `load(tokenizer, cfg, ds_cfg=entry)`, `type: package.module.load_name` (or `.load`) that function; the
strategy it returns tokenizes each row with `tokenize_prompt(row)`, returning `input_ids` and `labels` (-100 on
the tokens not trained), as an Axolotl PromptTokenizingStrategy does.

Modules are imported from sys.path or the working directory, as reward modules are.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hanzo_gym.data.example import Example
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


def strategy_function_name(dataset_type: str) -> tuple[str, str]:
    """(module, function) of an SFT strategy's name, by Axolotl's rule: a last part `load` or `load_*` is the
    function, otherwise the whole name is the module and the function is its `load`."""
    module_name, _, last = dataset_type.rpartition(".")
    if last == "load" or last.startswith("load_"):
        return module_name, last
    return dataset_type, "load"


def user_code_module(cfg: Config, index: int) -> str:
    """The module a dataset's `type: module.function` imports (SFT strategies and row transforms differ)."""
    name = cfg.datasets[index].type
    return strategy_function_name(name)[0] if cfg.rl is None else name.rpartition(".")[0]


class DatasetEntry(dict):
    """The dataset's config entry as Axolotl hands it to a strategy: a dict whose keys read as attributes too,
    a missing one as None."""

    def __getattr__(self, name: str) -> Any:
        return self.get(name)


def load_user_strategy(
    cfg: Config, index: int, tokenizer: PreTrainedTokenizerBase
) -> Callable[[Row], Example]:
    """Row → Example through the SFT prompt strategy `cfg.datasets[index].type` names."""
    ds = cfg.datasets[index]
    what = (
        f"datasets[{index}].type `{ds.type}` (an SFT prompt strategy: package.module, whose load() is called, "
        "or package.module.load_name)"
    )
    module_name, function_name = strategy_function_name(ds.type)
    loader = getattr(import_user_module(what, module_name), function_name, None)
    if not callable(loader):
        raise ConfigError(
            f"{what}: {module_name} has no function {function_name} (an SFT strategy module defines "
            "`load(tokenizer, cfg, ds_cfg)` returning an object with `tokenize_prompt(row)`)"
        )
    keywords = (
        {"ds_cfg": DatasetEntry(ds.model_dump())} if "ds_cfg" in inspect.signature(loader).parameters else {}
    )
    try:
        strategy = loader(tokenizer, cfg, **keywords)
    except Exception as error:
        raise ConfigError(
            f"{what}: calling {function_name} raised {type(error).__name__}: {error}"
        ) from error
    if not callable(getattr(strategy, "tokenize_prompt", None)):
        raise ConfigError(
            f"{what}: {function_name} returned {type(strategy).__name__}, which has no tokenize_prompt"
        )

    def to_example(row: Row) -> Example:
        where = f"{row.file} row {row.line}: {what}"
        try:
            tokenized = strategy.tokenize_prompt(dict(row.data))
        except Exception as error:
            raise DataError(f"{where} raised {type(error).__name__}: {error}") from error
        input_ids, labels = (
            tokenized.get(key) if hasattr(tokenized, "get") else None for key in ("input_ids", "labels")
        )
        if not (_int_list(input_ids) and _int_list(labels) and len(input_ids) == len(labels)):
            raise DataError(
                f"{where}: tokenize_prompt gave no `input_ids` and `labels`, two lists of ints of one length"
            )
        return Example(list(input_ids), list(labels))

    return to_example


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    )
