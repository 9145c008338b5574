"""Axolotl's `debug: true`: the first training item as the model sees it, printed before training (`gym train`)
or after preprocessing (`gym preprocess`), as Axolotl's check_dataset_labels prints it: each token's text with
`(label, id)`, the label -100 on a token that is not trained; then the length and the count of trained tokens.
A preference pair shows its prompt and both completions (KTO: the completion and its label), a GRPO prompt its
tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hanzo_gym.data.example import Example
from hanzo_gym.data.preference import KtoExample, PreferencePair
from hanzo_gym.data.prompts import Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _tokens(ids: list[int], tokenizer: PreTrainedTokenizerBase, labels: list[int] | None = None) -> str:
    labels = labels if labels is not None else ids
    return " ".join(f"{tokenizer.decode([token])}({label}, {token})" for token, label in zip(ids, labels))


def describe_item(item: object, tokenizer: PreTrainedTokenizerBase) -> str:
    if isinstance(item, Example):
        trained = item.trained_tokens
        return (
            f"{_tokens(item.input_ids, tokenizer, item.labels)}\n"
            f"Total input len: {len(item)}\nCount of labels: {trained}"
        )
    if isinstance(item, PreferencePair):
        return (
            f"INPUT PROMPT: {_tokens(item.prompt, tokenizer)}\nCHOSEN RESPONSE: {_tokens(item.chosen, tokenizer)}\n"
            f"REJECTED RESPONSE: {_tokens(item.rejected, tokenizer)}"
        )
    if isinstance(item, KtoExample):
        return (
            f"INPUT PROMPT: {_tokens(item.prompt, tokenizer)}\nCOMPLETION RESPONSE: "
            f"{_tokens(item.completion, tokenizer)}\nLABEL: {'desirable' if item.desirable else 'undesirable'}"
        )
    if isinstance(item, Prompt):
        return f"INPUT PROMPT: {_tokens(item.tokens, tokenizer)}\nANSWER: {item.answer!r}"
    raise TypeError(f"no description of {type(item).__name__}")
