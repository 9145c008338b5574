"""Axolotl's `unfrozen_parameters`: full fine-tuning of the parameters whose names match, the rest frozen.

Each entry is read as Axolotl reads it: a regular expression matched from the start of the parameter's name,
in which every `.` not followed by `+` is a literal dot (so `model.layers.1[0-9]+.mlp` means what it looks
like). Frozen parameters take no gradient and no optimizer state, which is the memory this saves.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from hanzo_gym.errors import ModelError

if TYPE_CHECKING:  # the config layer reads the patterns without importing torch
    import torch

# Axolotl's `name[start:end]` suffix: only those rows of the parameter train.
ROW_RANGE = re.compile(r"^(.+)\[([0-9]*)(?::([0-9]*))?\]$")


def name_pattern(entry: str) -> re.Pattern[str]:
    """The regular expression Axolotl makes of an entry; re.error when it is not one."""
    return re.compile(re.sub(r"\.(?!\+)", r"\\.", entry))


def train_only_matching(model: torch.nn.Module, entries: list[str]) -> None:
    """Set requires_grad on exactly the parameters a name of which some entry matches. A matrix shared by two
    modules (tied input and output embeddings) answers to both names, so `lm_head` trains a tied embedding.
    An entry that matches nothing fails, naming it (a typo would otherwise train less than asked)."""
    patterns = {entry: name_pattern(entry) for entry in entries}
    trained: set[int] = set()
    unmatched = set(entries)
    names = list(model.named_parameters(remove_duplicate=False))
    for name, param in names:
        hits = {entry for entry, pattern in patterns.items() if pattern.match(name)}
        if hits:
            trained.add(id(param))
            unmatched -= hits
    if unmatched:
        example = names[len(names) // 2][0] if names else "?"
        raise ModelError(
            f"unfrozen_parameters: {', '.join(f'`{e}`' for e in sorted(unmatched))} matches no parameter of the "
            f"model (its names look like `{example}`): fix or remove it"
        )
    for _, param in names:
        param.requires_grad_(id(param) in trained)
