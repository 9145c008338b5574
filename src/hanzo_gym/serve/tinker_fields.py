"""The numbers and lists a Tinker client sends, read with their type and range checked before anything is
allocated: a field that is wrong is a user error naming the field, what it must be and what came, never a
traceback or a number quietly rounded (a LoRA `rank` of 1.5 is refused, not trained at rank 1)."""

from __future__ import annotations

import math
from typing import Any

from hanzo_gym.errors import GymError

MISSING = object()


class WireError(GymError):
    """A request the server cannot take as sent: the SDK gets it as a user error."""


def integer(
    fields: dict,
    name: str,
    default: Any = MISSING,
    low: int | None = None,
    high: int | None = None,
    where: str = "",
) -> Any:
    """`fields[name]` as an int within [low, high]; `default` when it is absent or null (MISSING: required)."""
    value = fields.get(name)
    if value is None:
        if default is MISSING:
            raise WireError(f"the request needs `{where}{name}`")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not _within(value, low, high):
        raise WireError(f"`{where}{name}` must be an integer{_range(low, high)}, not {_shown(value)}")
    return value


def number(
    fields: dict,
    name: str,
    default: float,
    low: float | None = None,
    high: float | None = None,
    above: bool = False,
    where: str = "",
) -> float:
    """`fields[name]` as a finite float within [low, high] (above low where `above`); `default` when absent."""
    value = fields.get(name)
    if value is None:
        return default
    valid = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not valid or not _within(value, low, high) or (above and low is not None and value <= low):
        bound = f" above {low:g}" + (f" and at most {high:g}" if high is not None else "") if above else ""
        raise WireError(
            f"`{where}{name}` must be a finite number{bound or _range(low, high)}, not {_shown(value)}"
        )
    return float(value)


def flag(fields: dict, name: str, default: bool, where: str = "") -> bool:
    value = fields.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise WireError(f"`{where}{name}` must be true or false, not {_shown(value)}")
    return value


def stop_sequences(value: Any) -> str | list[str] | list[int] | None:
    """Tinker's `stop`: null (the model's end of sequence), one string, a list of strings or of token ids."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) <= 64:
        if all(isinstance(item, str) for item in value):
            return value
        if all(isinstance(item, int) and not isinstance(item, bool) and item >= 0 for item in value):
            return value
    raise WireError(
        f"`sampling_params.stop` must be a string, a list of at most 64 strings or of token ids, not {_shown(value)}"
    )


def _within(value: float, low: float | None, high: float | None) -> bool:
    return (low is None or value >= low) and (high is None or value <= high)


def _range(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f" from {low:g} to {high:g}"
    if low is not None:
        return f" of at least {low:g}"
    return f" of at most {high:g}" if high is not None else ""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
