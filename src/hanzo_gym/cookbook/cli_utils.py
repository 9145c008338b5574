"""Command-line overrides for the example scripts' dataclass configs, in chz's `key=value` style."""

from __future__ import annotations

import dataclasses
import typing
from typing import TypeVar

T = TypeVar("T")


def config_from_argv(config_class: type[T], argv: list[str]) -> T:
    """`config_class(**overrides)` from arguments like `batches=20 learning_rate=3e-4`."""
    hints = typing.get_type_hints(config_class)
    names = [f.name for f in dataclasses.fields(config_class)]
    overrides = {}
    for argument in argv:
        key, sep, value = argument.partition("=")
        if not sep or key not in names:
            raise SystemExit(f"{argument!r}: write key=value with a key among {', '.join(names)}")
        try:
            overrides[key] = hints[key](value)
        except ValueError:
            raise SystemExit(f"{key}={value}: not a valid {hints[key].__name__}") from None
    return config_class(**overrides)
