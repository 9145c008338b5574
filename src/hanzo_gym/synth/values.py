"""Cell values are JSON values: what a column produces is converted once, where it is produced.

Dates and datetimes become ISO 8601 text; tuples, ranges, dict views and the generators Jinja filters return
(`map`, `select`) become lists; numpy scalars become Python numbers. Anything else — a set (no order), bytes,
NaN or infinity, an arbitrary object — is refused with `NotJSON`, which fails the column (or the load, for a
value written in the design). Preview and file then print the same values with the same encoder (`row_json`).
"""

from __future__ import annotations

import json
import math
import types
from collections.abc import ItemsView, KeysView, ValuesView
from datetime import date, datetime, time
from typing import Any

import numpy as np

_AS_LIST = (list, tuple, range, KeysView, ValuesView, ItemsView, types.GeneratorType)


class NotJSON(ValueError):
    """A value with no JSON form."""


def json_value(value: Any) -> Any:
    """`value` as JSON types (str, int, float, bool, None, list, dict with text keys); raises NotJSON."""
    if value is None or isinstance(value, bool | str):
        return str(value) if isinstance(value, str) and type(value) is not str else value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise NotJSON(f"{value!r} is not a finite number (JSON has no NaN or infinity)")
        return float(value)
    if isinstance(value, np.generic):
        return json_value(value.item())
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, dict):
        return {_json_key(k): json_value(v) for k, v in value.items()}
    if isinstance(value, _AS_LIST):
        return [json_value(v) for v in value]
    if isinstance(value, set | frozenset):
        raise NotJSON(f"{_describe(value)} has no order, so it has no JSON form; sort it (`| sort`) first")
    raise NotJSON(f"{_describe(value)} has no JSON form")


def _json_key(key: Any) -> str:
    if isinstance(key, str):
        return str(key)
    if key is None or isinstance(key, bool | int | float):
        return json.dumps(json_value(key))  # what json.dumps does with such keys: 1 → "1", True → "true"
    if isinstance(key, datetime | date | time):
        return key.isoformat()
    raise NotJSON(f"a mapping key {_describe(key)} is not text")


def _describe(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 80 else text[:80] + "…"
    return f"{text} (a {type(value).__name__})"


def row_json(row: dict, indent: int | None = None) -> str:
    """The one encoder for rows: the output file (compact) and `--preview` (indented)."""
    separators = None if indent is not None else (",", ":")
    return json.dumps(row, ensure_ascii=False, indent=indent, separators=separators, allow_nan=False)
