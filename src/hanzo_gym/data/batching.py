"""Which examples go into each micro-batch, and how a micro-batch becomes engine datums."""

from __future__ import annotations

import random

from hanzo_gym.data.example import IGNORE_INDEX, Example
from hanzo_gym.records import Datum, ModelInput


def epoch_order(n_examples: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n_examples))
    random.Random(seed + epoch).shuffle(order)
    return order


def micro_batches(
    lengths: list[int], order: list[int], micro_batch_size: int, pack_to: int | None = None
) -> list[list[int]]:
    """Group example indices into micro-batches of `micro_batch_size` rows.

    Without `pack_to` a row is one example. With it (sample packing) a row holds consecutive examples while
    their total length fits in `pack_to` tokens, so a micro-batch carries about micro_batch_size·pack_to tokens.
    """
    rows: list[list[int]] = []
    if pack_to is None:
        rows = [[i] for i in order]
    else:
        current: list[int] = []
        used = 0
        for i in order:
            if current and used + lengths[i] > pack_to:
                rows.append(current)
                current, used = [], 0
            current.append(i)
            used += lengths[i]
        if current:
            rows.append(current)
    return [
        [i for row in rows[start : start + micro_batch_size] for i in row]
        for start in range(0, len(rows), micro_batch_size)
    ]


def supervised_datum(example: Example, weight_per_token: float) -> Datum:
    """Next-token datum: input tokens 0..T-2 predict tokens 1..T-1; trained targets carry `weight_per_token`."""
    return Datum(
        model_input=ModelInput.from_ints(example.input_ids[:-1]),
        loss_fn_inputs={
            "target_tokens": example.input_ids[1:],
            "weights": [0.0 if label == IGNORE_INDEX else weight_per_token for label in example.labels[1:]],
        },
    )
