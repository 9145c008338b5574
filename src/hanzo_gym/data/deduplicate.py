"""Axolotl's `dataset_exact_deduplication`: exact duplicates left out before the train/validation split, so
neither split repeats an item and validation holds none of training's."""

from __future__ import annotations

import hashlib
from dataclasses import astuple
from typing import Any, TypeVar

Item = TypeVar("Item")


def without_duplicates(items: list[Item]) -> tuple[list[Item], int]:
    """The first of each set of equal items, in their order, and how many were left out. Items are the tokenized
    dataclasses (an example's tokens and labels, a pair's prompt and completions, a prompt's tokens, messages
    and columns): equal rows tokenize equally, so this is Axolotl's hash of each tokenized row."""
    seen: set[bytes] = set()
    kept = []
    for item in items:
        digest = hashlib.sha256(repr(_plain(astuple(item))).encode()).digest()
        if digest not in seen:
            seen.add(digest)
            kept.append(item)
    return kept, len(items) - len(kept)


def _plain(value: Any) -> Any:
    """Dicts in a canonical key order, so `{"a", "b"}` and `{"b", "a"}` columns count as the same."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), _plain(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value
