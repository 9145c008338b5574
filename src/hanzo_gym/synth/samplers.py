"""Sampler columns: each kind is a strict pydantic model of its parameters plus a `draw` from a seeded generator.

Every draw takes the row's own numpy Generator, so a row's values depend only on (random_seed, attempt index),
not on how many rows run at once. Every float parameter must be finite. `ALIASES` lists Data Designer's names
for parameters that are called differently here; a design may use either name.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, date, datetime, timedelta
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from hanzo_gym.errors import GymError
from hanzo_gym.synth.values import NotJSON, json_value

_INT_LIMIT = 2**62  # integer parameters numpy can draw with (int64), with room for `high + 1`
_POISSON_MAX_MEAN = 1e18  # numpy refuses larger means


class SamplerError(GymError):
    """A draw that cannot succeed for this row (a truncated gaussian that keeps missing): the row fails."""


def value_key(value: Any) -> str:
    """How a parent value is matched against subcategory keys: strings bare, anything else as JSON text."""
    return value if isinstance(value, str) else json.dumps(value)


class Sampler(BaseModel):
    # allow_inf_nan=False: `.inf` or `.nan` for any float parameter is a load error naming the key.
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, allow_inf_nan=False)
    kind: ClassVar[str]
    # Data Designer's name for a parameter → ours; a design may use either (not both).
    ALIASES: ClassVar[dict[str, str]] = {}

    def sample(self, rng: np.random.Generator, row: dict) -> Any:
        """The cell value: the draw, then any `convert_to`."""
        return self.draw(rng, row)

    def references(self) -> set[str]:
        """Columns this sampler reads from the row."""
        return set()

    def draw(self, rng: np.random.Generator, row: dict) -> Any:
        raise NotImplementedError


def _round(value: float, decimal_places: int | None) -> float:
    return value if decimal_places is None else round(value, decimal_places)


def _json_values(values: list[Any]) -> list[Any]:
    # A value written in the design (an unquoted YAML date, say) is stored as JSON (ISO text) from the start.
    try:
        return [json_value(v) for v in values]
    except NotJSON as exc:
        raise ValueError(str(exc)) from None


class _Numeric(Sampler):
    """Data Designer's `convert_to: int | float | str` for numeric samplers (int truncates toward zero)."""

    convert_to: Literal["int", "float", "str"] | None = None

    def sample(self, rng: np.random.Generator, row: dict) -> Any:
        value = self.draw(rng, row)
        if self.convert_to == "int":
            return int(value)
        if self.convert_to == "float":
            return float(value)
        if self.convert_to == "str":
            return str(value)
        return value


class CategorySampler(Sampler):
    kind: ClassVar[str] = "category"
    values: list[Any]
    weights: list[float] | None = None

    @field_validator("values")
    @classmethod
    def _not_empty(cls, values: list[Any]) -> list[Any]:
        if not values:
            raise ValueError("category needs at least one value")
        return _json_values(values)

    @model_validator(mode="after")
    def _weights_fit(self) -> CategorySampler:
        if self.weights is None:
            return self
        if len(self.weights) != len(self.values):
            raise ValueError(f"{len(self.weights)} weights for {len(self.values)} values")
        if any(not math.isfinite(w) or w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise ValueError("weights must be non-negative and sum to more than zero")
        return self

    def draw(self, rng: np.random.Generator, row: dict) -> Any:
        if self.weights is None:
            return self.values[int(rng.integers(len(self.values)))]
        probabilities = np.asarray(self.weights, dtype=np.float64)
        return self.values[int(rng.choice(len(self.values), p=probabilities / probabilities.sum()))]


class SubcategorySampler(Sampler):
    kind: ClassVar[str] = "subcategory"
    ALIASES: ClassVar[dict[str, str]] = {"category": "parent"}
    parent: str
    values: dict[Any, list[Any]]

    @field_validator("values")
    @classmethod
    def _keys_as_text(cls, values: dict[Any, list[Any]]) -> dict[str, list[Any]]:
        keys = _json_values(list(values))
        empty = [value_key(k) for k, v in zip(keys, values.values(), strict=True) if not v]
        if empty:
            raise ValueError(f"no values listed for parent value(s) {empty}")
        return {value_key(k): _json_values(v) for k, v in zip(keys, values.values(), strict=True)}

    def references(self) -> set[str]:
        return {self.parent}

    def draw(self, rng: np.random.Generator, row: dict) -> Any:
        choices = self.values[value_key(row[self.parent])]
        return choices[int(rng.integers(len(choices)))]


class UniformSampler(_Numeric):
    """`integer: true` (or Data Designer's `convert_to: int`) draws an int in [ceil(low), floor(high)], both
    ends included; Data Designer truncates a float draw in [low, high), which never gives `high`."""

    kind: ClassVar[str] = "uniform"
    low: float
    high: float
    integer: bool = False
    decimal_places: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> UniformSampler:
        if self.convert_to == "int":
            self.integer = True
        if not self.high > self.low:
            raise ValueError("uniform needs high > low")
        if not math.isfinite(self.high - self.low):
            raise ValueError("uniform: high - low is too large to draw from")
        if self.integer and max(abs(self.low), abs(self.high)) > _INT_LIMIT:
            raise ValueError(f"uniform: integer bounds must lie within ±2**62 (±{_INT_LIMIT})")
        if self.integer and math.ceil(self.low) > math.floor(self.high):
            raise ValueError(f"uniform: no integer lies between low {self.low} and high {self.high}")
        return self

    def draw(self, rng: np.random.Generator, row: dict) -> Any:
        if self.integer:
            # Inclusive at both ends: `low: 1, high: 6, integer: true` is a die.
            return int(rng.integers(math.ceil(self.low), math.floor(self.high) + 1))
        return _round(float(rng.uniform(self.low, self.high)), self.decimal_places)


class GaussianSampler(_Numeric):
    kind: ClassVar[str] = "gaussian"
    ALIASES: ClassVar[dict[str, str]] = {"stddev": "std"}
    mean: float
    std: float
    min: float | None = None
    max: float | None = None
    decimal_places: int | None = Field(None, ge=0)
    MAX_DRAWS: ClassVar[int] = 1000

    @model_validator(mode="after")
    def _sane(self) -> GaussianSampler:
        if not self.std > 0:
            raise ValueError("gaussian needs std > 0")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError("gaussian needs min <= max")
        return self

    def draw(self, rng: np.random.Generator, row: dict) -> Any:
        low = -math.inf if self.min is None else self.min
        high = math.inf if self.max is None else self.max
        for _ in range(self.MAX_DRAWS):
            value = float(rng.normal(self.mean, self.std))
            if low <= value <= high:
                return _round(value, self.decimal_places)
        raise SamplerError(f"gaussian: {self.MAX_DRAWS} draws fell outside min..=max")


class BernoulliSampler(_Numeric):
    kind: ClassVar[str] = "bernoulli"
    p: float = Field(ge=0, le=1)

    def draw(self, rng: np.random.Generator, row: dict) -> Any:
        return int(rng.random() < self.p)


class BinomialSampler(_Numeric):
    kind: ClassVar[str] = "binomial"
    n: int = Field(ge=0, le=_INT_LIMIT)
    p: float = Field(ge=0, le=1)

    def draw(self, rng: np.random.Generator, row: dict) -> Any:
        return int(rng.binomial(self.n, self.p))


class PoissonSampler(_Numeric):
    kind: ClassVar[str] = "poisson"
    mean: float = Field(ge=0, le=_POISSON_MAX_MEAN)

    def draw(self, rng: np.random.Generator, row: dict) -> Any:
        return int(rng.poisson(self.mean))


class UuidSampler(Sampler):
    kind: ClassVar[str] = "uuid"
    prefix: str = ""
    short_form: bool = False
    uppercase: bool = False

    def draw(self, rng: np.random.Generator, row: dict) -> Any:
        raw = bytearray(rng.bytes(16))
        raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
        raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
        text = raw.hex()[: 8 if self.short_form else 32]
        return self.prefix + (text.upper() if self.uppercase else text)


_DATETIME_INPUTS = ("%Y-%m-%d", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "D": 86400}


def _parse_instant(value: Any) -> datetime:
    # YAML already turns an unquoted 2024-01-01 into a date, and 2024-01-01 10:00:00 into a datetime (with its
    # timezone when it has an offset). A timezone is kept.
    if isinstance(value, datetime):
        return value
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day)
    if isinstance(value, str):
        for pattern in _DATETIME_INPUTS:
            try:
                return datetime.strptime(value.strip(), pattern)
            except ValueError:
                continue
        try:
            return datetime.fromisoformat(value.strip())  # with an offset: 2024-01-01T10:00:00+02:00, …Z
        except ValueError:
            pass
    raise ValueError(
        f"{value!r} is not a date; write YYYY-MM-DD, YYYY-MM-DDTHH:MM:SS or YYYY-MM-DD HH:MM:SS, optionally "
        "with a UTC offset (+02:00 or Z)"
    )


def _check_format(fmt: str) -> str:
    probe = datetime(2001, 2, 3, 4, 5, 6)
    try:
        rendered = probe.strftime(fmt)
    except ValueError:
        rendered = None
    if rendered is None or "%" not in fmt or rendered == fmt:
        raise ValueError(f"bad datetime format `{fmt}`")
    return fmt


# Instants whose every field differs (and an afternoon hour), to see what a format keeps when read back.
_PROBES = (datetime(2001, 2, 3, 16, 17, 18, tzinfo=UTC), datetime(1987, 11, 29, 9, 8, 7, tzinfo=UTC))


def reference_format_problem(fmt: str) -> str | None:
    """Why text written with `fmt` cannot be read back into the instant it shows (for a timedelta), or None.

    Read back, the date must be the same and each time field either the same or dropped (zero): `%B` alone
    (no year or day) or `%I` without `%p` would put the timedelta on a wrong base.
    """
    for probe in _PROBES:
        text = probe.strftime(fmt)
        try:
            back = datetime.strptime(text, fmt)
        except ValueError as exc:
            return f"its text ({text!r}) cannot be read back: {exc}"
        same_date = (back.year, back.month, back.day) == (probe.year, probe.month, probe.day)
        fields = zip(
            (back.hour, back.minute, back.second), (probe.hour, probe.minute, probe.second), strict=True
        )
        if not same_date or any(got not in (0, want) for got, want in fields):
            return f"{text!r} reads back as {back.replace(tzinfo=None).isoformat()}, not the instant written"
    return None


class DatetimeSampler(Sampler):
    kind: ClassVar[str] = "datetime"
    model_config = ConfigDict(extra="forbid", strict=False, validate_default=True, allow_inf_nan=False)
    ALIASES: ClassVar[dict[str, str]] = {"convert_to": "format"}
    start: datetime
    end: datetime
    format: str = "%Y-%m-%dT%H:%M:%S"
    unit: Literal["D", "h", "m", "s"] = "s"

    @field_validator("start", "end", mode="before")
    @classmethod
    def _instant(cls, value: Any) -> datetime:
        return _parse_instant(value)

    @field_validator("format")
    @classmethod
    def _format(cls, fmt: str) -> str:
        return _check_format(fmt)

    @model_validator(mode="after")
    def _ordered(self) -> DatetimeSampler:
        if (self.start.tzinfo is None) != (self.end.tzinfo is None):
            raise ValueError("datetime: give `start` and `end` both with a UTC offset or both without")
        if not self.start < self.end:
            raise ValueError("datetime needs start < end")
        return self

    def draw(self, rng: np.random.Generator, row: dict) -> Any:
        # Without an offset the instants are UTC (`%z` shows +0000); with one, values are in start's offset.
        start = self.start if self.start.tzinfo is not None else self.start.replace(tzinfo=UTC)
        seconds = int((self.end - self.start).total_seconds())
        offset = int(rng.integers(seconds))
        offset -= offset % _UNIT_SECONDS[self.unit]
        return (start + timedelta(seconds=offset)).strftime(self.format)


class TimedeltaSampler(Sampler):
    """A datetime a whole number of `unit`s in [min, max) after the `reference` datetime column."""

    kind: ClassVar[str] = "timedelta"
    ALIASES: ClassVar[dict[str, str]] = {
        "reference_column_name": "reference",
        "dt_min": "min",
        "dt_max": "max",
        "convert_to": "format",
    }
    reference: str
    min: int = Field(ge=0)
    max: int
    unit: Literal["D", "h", "m", "s"] = "D"
    format: str | None = None
    # Set by the plan from the reference column, so the reference value can be parsed back.
    _reference_format: str = PrivateAttr("%Y-%m-%dT%H:%M:%S")

    @field_validator("format")
    @classmethod
    def _format(cls, fmt: str | None) -> str | None:
        return None if fmt is None else _check_format(fmt)

    @model_validator(mode="after")
    def _ordered(self) -> TimedeltaSampler:
        if not self.max > self.min:
            raise ValueError("timedelta needs max > min")
        return self

    def references(self) -> set[str]:
        return {self.reference}

    def draw(self, rng: np.random.Generator, row: dict) -> Any:
        try:
            base = datetime.strptime(str(row[self.reference]), self._reference_format)
        except ValueError as exc:
            raise SamplerError(f"timedelta: reference `{self.reference}`: {exc}") from None
        units = int(rng.integers(self.min, self.max))
        moved = base + timedelta(seconds=units * _UNIT_SECONDS[self.unit])
        return moved.strftime(self.format or self._reference_format)


SAMPLERS: dict[str, type[Sampler]] = {
    cls.kind: cls
    for cls in (
        CategorySampler,
        SubcategorySampler,
        UniformSampler,
        GaussianSampler,
        BernoulliSampler,
        BinomialSampler,
        PoissonSampler,
        UuidSampler,
        DatetimeSampler,
        TimedeltaSampler,
    )
}
