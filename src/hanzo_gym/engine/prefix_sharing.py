"""One row for datums that start alike: a run of datums sharing a prefix (a GRPO group: one prompt, many
completions) puts the prefix in the row once and each datum's own suffix after it. A mask lets every suffix see
the shared prefix and itself, never another suffix, so each token's hidden state is what the datum alone would
give, and the decoder's work on the prefix is done once instead of once per datum."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIN_SHARED_TOKENS = 16  # below this the saving does not pay for a custom attention mask


@dataclass
class SharedLayout:
    tokens: torch.Tensor  # [T] the row
    positions: torch.Tensor  # [T] each token's position within its own datum
    mask: torch.Tensor  # [T, T] True where row token i may attend to row token j
    index: torch.Tensor  # [Σ datum lengths] row index of every datum token, datums concatenated


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def shared_layout(
    inputs: Sequence[Sequence[int]], device: torch.device, owners: Sequence[object] | None = None
) -> SharedLayout | None:
    """The prefix-sharing row for these datum inputs, or None when no two consecutive datums share enough.
    With `owners` (one per datum: the adapter it goes through, say), only datums of the same owner share."""
    runs: list[tuple[int, list[int]]] = []  # (shared length, datum indices)
    for i, tokens in enumerate(inputs):
        if runs and (owners is None or owners[i] == owners[i - 1]):
            shared, members = runs[-1]
            common = min(shared, _common_prefix(inputs[members[0]], tokens))
            if common >= MIN_SHARED_TOKENS:
                runs[-1] = (common, [*members, i])
                continue
        runs.append((len(tokens), [i]))
    if all(len(members) == 1 for _, members in runs):
        return None
    tokens, positions, groups, owners = [], [], [], []
    index: list[list[int]] = [[] for _ in inputs]
    for group, (shared, members) in enumerate(runs):
        if len(members) == 1:
            shared = 0
        start = len(tokens)
        tokens += inputs[members[0]][:shared]
        positions += range(shared)
        groups += [group] * shared
        owners += [-1] * shared
        prefix = list(range(start, start + shared))
        for member in members:
            own = inputs[member][shared:]
            start = len(tokens)
            tokens += own
            positions += range(shared, shared + len(own))
            groups += [group] * len(own)
            owners += [member] * len(own)
            index[member] = prefix + list(range(start, start + len(own)))
    group_t = torch.tensor(groups, device=device)
    owner_t = torch.tensor(owners, device=device)
    order = torch.arange(len(tokens), device=device)
    mask = (
        (group_t[:, None] == group_t[None, :])
        & (order[None, :] <= order[:, None])
        & ((owner_t[None, :] == -1) | (owner_t[None, :] == owner_t[:, None]))
    )
    return SharedLayout(
        tokens=torch.tensor(tokens, device=device),
        positions=torch.tensor(positions, device=device),
        mask=mask,
        index=torch.tensor([i for datum in index for i in datum], device=device),
    )
