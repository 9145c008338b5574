"""Time as people read it in a log line: durations (`40 s`, `2 min 20 s`, `1 h 5 min`) and the pace of a long
phase."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


def duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def paced(items: Sequence[T], what: str, every: float = 15.0) -> Iterator[T]:
    """`items`, one by one, with a line every `every` seconds while they last (`what`: 40 of 900, 1 min left), so
    that a long quiet phase such as tokenizing a large dataset never looks like a hang, on a terminal as in a
    log. Under torchrun rank 0 alone speaks."""
    speaks = os.environ.get("RANK", "0") == "0"
    started = last = time.monotonic()
    for done, item in enumerate(items):
        now = time.monotonic()
        if speaks and done and now - last >= every:
            last = now
            left = (now - started) / done * (len(items) - done)
            print(f"{what}: {done} of {len(items)}, {duration(left)} left", flush=True)
        yield item
