"""Sampler columns: each kind is a strict pydantic model of its parameters plus a `draw` from a seeded generator.

Every draw takes the row's own numpy Generator, so a row's values depend only on (random_seed, attempt index),
not on how many rows run at once.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, date, datetime, timedelta
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from hanzo_gym.errors import GymError


class SamplerError(GymError):
    """A draw that cannot succeed for this row (a truncated gaussian that keeps missing): the row fails."""


def value_key(value: Any) -> str:
    """How a parent value is matched against subcategory keys: strings bare, anything else as JSON text."""
    return value if isinstance(value, str) else json.dumps(value)


class Sampler(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)
    kind: ClassVar[str]

    def references(self) -> set[str]:
        """Columns this sampler reads from the row."""
        return set()

    def draw(self, rng: np.random.Generator, row: dict) -> Any:
        raise NotImplementedError


def _round(value: float, decimal_places: int | None) -> float:
    return value if decimal_places is None else round(value, decimal_places)


class CategorySampler(Sampler):
    kind: ClassVar[str] = "category"
    values: list[Any]
    weights: list[float] | None = None

    @field_validator("values")
    @classmethod
    def _not_empty(cls, values: list[Any]) -> list[Any]:
        if not values:
            raise ValueError("category needs at least one value")
        return values

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
    parent: str
    values: dict[Any, list[Any]]

    @field_validator("values")
    @classmethod
    def _keys_as_text(cls, values: dict[Any, list[Any]]) -> dict[str, list[Any]]:
        empty = [value_key(k) for k, v in values.items() if not v]
        if empty:
            raise ValueError(f"no values listed for parent value(s) {empty}")
        return {value_key(k): v for k, v in values.items()}

    def references(self) -> set[str]:
        return {self.parent}

    def draw(self, rng: np.random.Generator, row: dict) -> Any:
        choices = self.values[value_key(row[self.parent])]
        return choices[int(rng.integers(len(choices)))]


class UniformSampler(Sampler):
    kind: ClassVar[str] = "uniform"
    low: float
    high: float
    integer: bool = False
    decimal_places: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> UniformSampler:
        if not self.high > self.low:
            raise ValueError("uniform needs high > low")
        if self.integer and math.ceil(self.low) > math.floor(self.high):
            raise ValueError(f"uniform: no integer lies between low {self.low} and high {self.high}")
        return self

    def draw(self, rng: np.random.Generator, row: dict) -> Any:
        if self.integer:
            # Inclusive at both ends: `low: 1, high: 6, integer: true` is a die.
            return int(rng.integers(math.ceil(self.low), math.floor(self.high) + 1))
        return _round(float(rng.uniform(self.low, self.high)), self.decimal_places)


class GaussianSampler(Sampler):
    kind: ClassVar[str] = "gaussian"
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


class BernoulliSampler(Sampler):
    kind: ClassVar[str] = "bernoulli"
    p: float = Field(ge=0, le=1)

    def draw(self, rng: np.random.Generator, row: dict) -> Any:
        return int(rng.random() < self.p)


class BinomialSampler(Sampler):
    kind: ClassVar[str] = "binomial"
    n: int = Field(ge=0)
    p: float = Field(ge=0, le=1)

    def draw(self, rng: np.random.Generator, row: dict) -> Any:
        return int(rng.binomial(self.n, self.p))


class PoissonSampler(Sampler):
    kind: ClassVar[str] = "poisson"
    mean: float = Field(ge=0)

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
    # YAML already turns an unquoted 2024-01-01 into a date, and 2024-01-01 10:00:00 into a datetime.
    if isinstance(value, datetime):
        return value.replace(tzinfo=None)
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day)
    if isinstance(value, str):
        for pattern in _DATETIME_INPUTS:
            try:
                return datetime.strptime(value.strip(), pattern)
            except ValueError:
                continue
    raise ValueError(f"{value!r} is not a date; write YYYY-MM-DD, YYYY-MM-DDTHH:MM:SS or YYYY-MM-DD HH:MM:SS")


def _check_format(fmt: str) -> str:
    probe = datetime(2001, 2, 3, 4, 5, 6)
    try:
        rendered = probe.strftime(fmt)
    except ValueError:
        rendered = None
    if rendered is None or "%" not in fmt or rendered == fmt:
        raise ValueError(f"bad datetime format `{fmt}`")
    return fmt


class DatetimeSampler(Sampler):
    kind: ClassVar[str] = "datetime"
    model_config = ConfigDict(extra="forbid", strict=False, validate_default=True)
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
        if not self.start < self.end:
            raise ValueError("datetime needs start < end")
        return self

    def draw(self, rng: np.random.Generator, row: dict) -> Any:
        start = self.start.replace(tzinfo=UTC)
        seconds = int((self.end - self.start).total_seconds())
        offset = int(rng.integers(seconds))
        offset -= offset % _UNIT_SECONDS[self.unit]
        return (start + timedelta(seconds=offset)).strftime(self.format)


class TimedeltaSampler(Sampler):
    """A datetime a whole number of `unit`s in [min, max) after the `reference` datetime column."""

    kind: ClassVar[str] = "timedelta"
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
