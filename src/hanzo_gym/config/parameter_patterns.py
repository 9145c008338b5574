"""How Axolotl reads an `unfrozen_parameters` entry: a regular expression matched from the start of a parameter's
name, in which every `.` not followed by `+` is a literal dot (so `model.layers.1[0-9]+.mlp` means what it
looks like), with an optional `[start:end]` suffix naming rows of the parameter."""

from __future__ import annotations

import re

ROW_RANGE = re.compile(r"^(.+)\[([0-9]*)(?::([0-9]*))?\]$")


def name_pattern(entry: str) -> re.Pattern[str]:
    """The regular expression Axolotl makes of an entry; re.error when it is not one."""
    return re.compile(re.sub(r"\.(?!\+)", r"\\.", entry))
