"""From config to training data: every dataset's rows tokenized by its strategy, fitted to `sequence_len`,
combined, shuffled with the run's seed and split into train and validation examples.

An example longer than `sequence_len` is handled as Axolotl's `excess_length_strategy` says: `drop` (its
default) leaves it out, `truncate` keeps its first `sequence_len` tokens, `raise` stops with the dataset and row.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from hanzo_gym.clock import paced
from hanzo_gym.config import Config, DatasetConfig
from hanzo_gym.config.dataset_types import is_user_transform
from hanzo_gym.data.deduplicate import without_duplicates
from hanzo_gym.data.example import Example
from hanzo_gym.data.sources import Row, read_rows
from hanzo_gym.data.strategies import StrategyContext, row_to_examples
from hanzo_gym.data.user_transforms import load_user_strategy
from hanzo_gym.errors import DataError
from hanzo_gym.renderers.chat_templates import resolve_renderer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Item = TypeVar("Item")


@dataclass
class DatasetStats:
    """What tokenizing one dataset (or all of them: path `total`) gave; counts are of kept examples except
    `truncated` (kept, cut to sequence_len), `too_long` (dropped: longer than sequence_len) and `dropped`
    (too short or nothing to train)."""

    path: str
    examples: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    truncated: int = 0
    dropped: int = 0
    too_long: int = 0


@dataclass
class LoadedData:
    train: list[Example]
    val: list[Example]
    stats: list[DatasetStats]  # one per dataset, in config order, then the total
    duplicates: int = 0  # left out by dataset_exact_deduplication


def load_examples(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> LoadedData:
    needs_template = any(ds.type == "chat_template" for ds in (*cfg.datasets, *(cfg.test_datasets or [])))
    ctx = StrategyContext(
        tokenizer=tokenizer,
        train_on_inputs=cfg.train_on_inputs,
        sequence_len=cfg.sequence_len,
        sample_packing=cfg.sample_packing,
        chat_template=resolve_renderer(cfg.chat_template, tokenizer, cfg.eot_tokens)
        if needs_template
        else None,
    )
    stats: list[DatasetStats] = []

    def examples_of(datasets: list[DatasetConfig]) -> list[Example]:
        examples: list[Example] = []
        for index, ds in enumerate(datasets):
            rows = read_rows(ds.path, split=ds.split, data_files=ds.data_files, name=ds.name)
            # a transform of the user's names its entry of `datasets` (test_datasets hold none)
            strategy = load_user_strategy(cfg, index, tokenizer) if is_user_transform(ds.type) else None
            kept, ds_stats = examples_from_rows(
                paced(rows, f"tokenizing {ds.path}"),
                ds,
                ctx,
                cfg.sequence_len,
                cfg.excess_length_strategy,
                to_example=strategy,
            )
            examples.extend(kept)
            stats.append(ds_stats)
        return examples

    examples = examples_of(cfg.datasets)
    held_out = examples_of(cfg.test_datasets) if cfg.test_datasets else None
    stats.append(total_stats(stats))
    train, val, duplicates = dedupe_shuffle_split(examples, cfg, held_out)
    return LoadedData(train, val, stats, duplicates)


def examples_from_rows(
    rows: Iterable[Row],
    ds: DatasetConfig,
    ctx: StrategyContext,
    sequence_len: int,
    excess_length: str = "drop",
    to_example: Callable[[Row], Example] | None = None,
) -> tuple[list[Example], DatasetStats]:
    """Each row's Example (by the dataset's strategy, or `to_example`: one of the user's); one longer than
    `sequence_len` dropped, truncated or refused (`excess_length`, see the module's docstring); examples shorter
    than 2 tokens or with no trained token are dropped."""
    stats = DatasetStats(ds.path)
    kept = []
    for row in rows:
        for example in [to_example(row)] if to_example else row_to_examples(row, ds, ctx):
            fitted = _fitted(example, row, sequence_len, excess_length, stats)
            if fitted is not None:
                kept.append(fitted)
                stats.examples += 1
                stats.tokens += len(fitted)
                stats.trained_tokens += fitted.trained_tokens
    return kept, stats


def _fitted(
    example: Example, row: Row, sequence_len: int, excess_length: str, stats: DatasetStats
) -> Example | None:
    """`example` within sequence_len as `excess_length` says (None: dropped, counted in `stats`)."""
    if len(example) > sequence_len:
        if excess_length == "raise":
            raise DataError(
                f"{row.file} row {row.line} is {len(example)} tokens, longer than sequence_len {sequence_len} "
                "(excess_length_strategy: raise); raise sequence_len, or use `drop` or `truncate`"
            )
        if excess_length == "drop":
            stats.too_long += 1
            return None
        example = Example(example.input_ids[:sequence_len], example.labels[:sequence_len])
        stats.truncated += 1
    if len(example) < 2 or example.trained_tokens == 0:
        stats.dropped += 1
        return None
    return example


def dedupe_shuffle_split(
    items: list[Item], cfg: Config, held_out: list[Item] | None = None
) -> tuple[list[Item], list[Item], int]:
    """Training's and validation's items (SFT examples, RL prompts or preference pairs), and how many exact
    duplicates were left out. Duplicates go first (`dataset_exact_deduplication`), so neither split repeats an
    item; then the shuffle with `seed` (unless `shuffles_at_load` is off); validation is the last
    `val_set_size` items, or `held_out` (the items of test_datasets), shuffled the same way, as Axolotl does."""
    duplicates = 0
    if cfg.dataset_exact_deduplication:
        items, duplicates = without_duplicates(items)
        if held_out is not None:  # nor an evaluation row equal to a training one
            kept, _ = without_duplicates([*items, *held_out])
            duplicates += len(items) + len(held_out) - len(kept)
            held_out = kept[len(items) :]
    items = list(items)  # the caller's list keeps its order
    if cfg.shuffles_at_load:
        random.Random(cfg.seed).shuffle(items)
    if held_out is not None:
        held_out = list(held_out)
        if cfg.shuffles_at_load:
            random.Random(cfg.seed).shuffle(held_out)
        return items, held_out, duplicates
    train_count = len(items) - validation_count(cfg.val_set_size, len(items))
    return items[:train_count], items[train_count:], duplicates


def validation_count(val_set_size: float, n: int) -> int:
    """`val_set_size` ≤ 1 is a fraction of `n` (rounded up), above 1 a count; never more than `n`."""
    if val_set_size <= 1:
        # round first: 0.1 * 30 is 3.0000000000000004 in floating point, which must not ceil to 4
        count = math.ceil(round(val_set_size * n, 9))
    else:
        count = int(val_set_size)
    return min(count, n)


def format_stats(stats: list[DatasetStats]) -> str:
    return "\n".join(
        f"{s.path}: {s.examples} examples, {s.tokens} tokens, {s.trained_tokens} trained, "
        f"{s.truncated} truncated, {s.too_long} dropped as longer than sequence_len, {s.dropped} dropped "
        "as too short or with nothing to train"
        for s in stats
    )


def total_stats(stats: list[DatasetStats]) -> DatasetStats:
    return DatasetStats(
        path="total",
        examples=sum(s.examples for s in stats),
        tokens=sum(s.tokens for s in stats),
        trained_tokens=sum(s.trained_tokens for s in stats),
        truncated=sum(s.truncated for s in stats),
        dropped=sum(s.dropped for s in stats),
        too_long=sum(s.too_long for s in stats),
    )


def excess_length_note(cfg: Config, stats: list[DatasetStats], what: str = "examples") -> str | None:
    """The line `gym train` prints when examples (or preference `pairs`) were longer than sequence_len (None
    when none were)."""
    total = stats[-1]
    if total.too_long:
        return (
            f"dropped {total.too_long} {what} longer than sequence_len {cfg.sequence_len} "
            "(excess_length_strategy: drop; `truncate` keeps their first sequence_len tokens)"
        )
    if total.truncated:
        return (
            f"truncated {total.truncated} {what} longer than sequence_len {cfg.sequence_len} to it "
            "(excess_length_strategy: truncate)"
        )
    return None
