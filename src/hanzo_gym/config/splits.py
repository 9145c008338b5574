"""The grammar of a dataset's `split`: `name` or `name[lo:hi]`, each bound empty, a row index or a percent (`10%`).
The config checks it at load; the data sources select rows with it."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from hanzo_gym.errors import DataError

_SPLIT_RE = re.compile(r"(?P<name>[^\[\]:\s]+)(?:\[(?P<lo>[^\[\]:]*):(?P<hi>[^\[\]:]*)\])?")
_INDEX_RE = re.compile(r"[0-9]+")
_PERCENT_RE = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)%")


@dataclass(frozen=True)
class Split:
    """A split name plus a slice; each bound is None (open), an int row index or a float percent."""

    name: str
    lo: int | float | None = None
    hi: int | float | None = None

    @staticmethod
    def parse(spec: str) -> Split:
        match = _SPLIT_RE.fullmatch(spec.strip())
        if match is None:
            raise DataError(
                f"bad split `{spec}`: expected name or name[lo:hi], e.g. train, train[:1000] or "
                "train[10%:90%] (steps and negative indices are not supported)"
            )
        return Split(match["name"], _parse_bound(spec, match["lo"]), _parse_bound(spec, match["hi"]))

    def bounds(self, n: int) -> tuple[int, int]:
        """The half-open row range this slice selects from n rows; a slice with hi < lo is empty."""
        lo = _resolve_bound(self.lo, n, default=0)
        hi = _resolve_bound(self.hi, n, default=n)
        return lo, max(lo, hi)


def _parse_bound(spec: str, text: str | None) -> int | float | None:
    text = (text or "").strip()
    if not text:
        return None
    if _INDEX_RE.fullmatch(text):
        return int(text)
    if _PERCENT_RE.fullmatch(text):
        return float(text[:-1])
    if text.endswith("%"):
        raise DataError(
            f"bad split `{spec}`: `{text}` is not a percent; use a non-negative number like 10% or 12.5%"
        )
    raise DataError(
        f"bad split `{spec}`: `{text}` is not a row index; use a non-negative integer like 100 or a percent "
        "like 10% (negative indices are not supported)"
    )


def _resolve_bound(bound: float | None, n: int, default: int) -> int:
    if bound is None:
        return default
    if isinstance(bound, float):
        # Exact decimal arithmetic: with floats, 2.3% of 50000 rows floors to 1149 instead of 1150.
        bound = math.floor(Fraction(repr(bound)) * n / 100)
    return max(0, min(bound, n))
