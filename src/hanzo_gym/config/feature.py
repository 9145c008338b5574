"""A feature of the run config: one group of Axolotl keys, declared and checked in one module.

A feature is a pydantic model that `Config` inherits (so that its keys sit at the top level, as in Axolotl); its
`check` holds the rules between its keys and the rest of the config, raising ValueError with the sentence to show.
`Config` runs every feature's `check` once its keys are parsed, in the order of its bases. A new feature is a
new module with one such class, added to `Config`'s bases; nothing else in the schema changes. A feature's
`notes` are the lines the run says at its start about its keys: an older spelling and what it became, a key
accepted that changes nothing here and why.
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


class StrictKeys(BaseModel):
    """A mapping of keys in the config: an unknown key, a value of the wrong type or `.inf` / `.nan` for a float
    fails at load, naming the key and its line."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, allow_inf_nan=False)


class Feature(BaseModel):
    def check(self) -> None:
        """The rules of this feature's keys against the whole config (`self` is the `Config`)."""

    def notes(self) -> list[str]:
        """What the run says at its start about this feature's keys as written (`self` is the `Config`)."""
        return []


def _own(cfg: Feature, name: str) -> list:
    """Each feature's own method `name`, in the order of `cfg`'s bases."""
    return [
        vars(feature)[name]
        for feature in type(cfg).__mro__
        if feature is not Feature and name in vars(feature)
    ]


def check_features(cfg: Feature) -> None:
    """Every feature's own `check`, in the order of `cfg`'s bases."""
    for check in _own(cfg, "check"):
        check(cfg)


def feature_notes(cfg: Feature) -> list[str]:
    """Every feature's `notes`, in the order of `cfg`'s bases."""
    return [line for notes in _own(cfg, "notes") for line in notes(cfg)]


# HF Trainer's step counts (`logging_steps`, `eval_steps`, `save_steps`): a whole number of steps, or a number
# below 1, which is that fraction of the run's steps.
def _steps_or_fraction(value: float) -> float:
    if isinstance(value, bool) or not (
        (isinstance(value, int) and value >= 1) or (isinstance(value, float) and 0 < value < 1)
    ):
        raise ValueError(
            "give a whole number of steps (1 or more) or a fraction of the run below 1, e.g. 0.1"
        )
    return value


StepsOrFraction = Annotated[int | float, AfterValidator(_steps_or_fraction)]


def steps_of(value: float | None, total: int) -> int | None:
    """A `StepsOrFraction` in steps: HF's ceil(total × fraction) for a fraction."""
    if value is None or isinstance(value, int):
        return value
    return max(1, math.ceil(total * value))


def zero_means_unset(value: object) -> object:
    """Axolotl tests its per-epoch counts for truth: 0 asks for nothing, as if the key were absent."""
    return None if value == 0 and not isinstance(value, bool) else value
