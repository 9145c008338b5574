"""Axolotl's `unfrozen_parameters`: full fine-tuning of the parameters whose names match, the rest frozen, each
entry read as Axolotl reads it (config/parameter_patterns.py). Frozen parameters take no gradient and no optimizer
state, which is the memory this saves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hanzo_gym.config.parameter_patterns import name_pattern
from hanzo_gym.errors import ModelError

if TYPE_CHECKING:
    import torch


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
