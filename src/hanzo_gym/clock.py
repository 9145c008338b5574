"""Durations as people read them in a log line: `40 s`, `2 min 20 s`, `1 h 5 min`."""

from __future__ import annotations


def duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"
