"""Which examples go into each micro-batch, and how a micro-batch becomes engine datums."""

from __future__ import annotations

import random

from hanzo_gym.data.example import Example
from hanzo_gym.records import IGNORE_INDEX, Datum, ModelInput


def epoch_order(n_examples: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n_examples))
    random.Random(seed + epoch).shuffle(order)
    return order


def length_grouped_order(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[int]:
    """HF's `group_by_length` order (transformers' get_length_grouped_indices): the epoch's shuffled order
    cut into mega-batches of `mega · batch_size` examples (mega = min(n // (4 · batch_size), 50), at least 1),
    each sorted longest first, with the longest example of all swapped to the very front (an out-of-memory
    shows on the first step). `batch_size` is HF's: micro_batch_size × gradient_accumulation_steps. The
    shuffle is the epoch's own (seed, epoch), so a resumed run replays the same order."""
    mega = max(min(len(lengths) // (batch_size * 4), 50), 1)
    size = mega * batch_size
    order = epoch_order(len(lengths), seed, epoch)
    groups = [
        sorted(order[i : i + size], key=lambda j: lengths[j], reverse=True)
        for i in range(0, len(order), size)
    ]
    if groups:
        longest = max(
            range(len(groups)), key=lambda g: lengths[groups[g][0]]
        )  # the first of equals, as argmax
        groups[0][0], groups[longest][0] = groups[longest][0], groups[0][0]
    return [i for group in groups for i in group]


def micro_batches(
    lengths: list[int], order: list[int], micro_batch_size: int, pack_to: int | None = None
) -> list[list[int]]:
    """Group example indices into micro-batches of `micro_batch_size` rows.

    Without `pack_to` a row is one example. With it (sample packing) a row holds consecutive examples while
    their total length fits in `pack_to` tokens, so a micro-batch carries about micro_batch_size·pack_to tokens.
    """
    rows = packed_rows(lengths, order, pack_to)
    return [
        [i for row in rows[start : start + micro_batch_size] for i in row]
        for start in range(0, len(rows), micro_batch_size)
    ]


def packed_rows(lengths: list[int], order: list[int], pack_to: int | None) -> list[list[int]]:
    """The rows of `order`: one example each without `pack_to`; with it, consecutive examples while their total
    length fits. A micro-batch starts at a row boundary, so `packed_rows(lengths, batch, pack_to)` gives back
    the rows of a micro-batch."""
    if pack_to is None:
        return [[i] for i in order]
    rows: list[list[int]] = []
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
    return rows


def padding_datum(n_tokens: int, pad_id: int) -> Datum:
    """`pad_to_sequence_len`: `n_tokens` pad tokens trained on nothing (weight 0), placed after a row's
    datums to bring the row to sequence_len tokens, as a padded batch would. Positions restart at it, so
    nothing attends across it: the loss and the gradient are those of the batch without it."""
    return Datum(
        model_input=ModelInput.from_ints([pad_id] * n_tokens),
        loss_fn_inputs={"target_tokens": [pad_id] * n_tokens, "weights": [0.0] * n_tokens},
    )


def supervised_datum(example: Example, weight_per_token: float) -> Datum:
    """Next-token datum: input tokens 0..T-2 predict tokens 1..T-1; trained targets carry `weight_per_token`."""
    return Datum(
        model_input=ModelInput.from_ints(example.input_ids[:-1]),
        loss_fn_inputs={
            "target_tokens": example.input_ids[1:],
            "weights": [0.0 if label == IGNORE_INDEX else weight_per_token for label in example.labels[1:]],
        },
    )
