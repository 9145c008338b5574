"""A feature of the run config: one group of Axolotl keys, declared and checked in one module.

A feature is a pydantic model that `Config` inherits (so that its keys sit at the top level, as in Axolotl); its
`check` holds the rules between its keys and the rest of the config, raising ValueError with the sentence to show.
`Config` runs every feature's `check` once its keys are parsed, in the order of its bases. A new feature is a
new module with one such class, added to `Config`'s bases; nothing else in the schema changes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictKeys(BaseModel):
    """A mapping of keys in the config: an unknown key, a value of the wrong type or `.inf` / `.nan` for a float
    fails at load, naming the key and its line."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, allow_inf_nan=False)


class Feature(BaseModel):
    def check(self) -> None:
        """The rules of this feature's keys against the whole config (`self` is the `Config`)."""


def check_features(cfg: Feature) -> None:
    """Every feature's own `check`, in the order of `cfg`'s bases."""
    for feature in type(cfg).__mro__:
        own = vars(feature).get("check")
        if own is not None and feature is not Feature:
            own(cfg)


def zero_means_unset(value: object) -> object:
    """Axolotl tests its per-epoch counts for truth: 0 asks for nothing, as if the key were absent."""
    return None if value == 0 and not isinstance(value, bool) else value
