"""Dataset strategies (`datasets[].type`): one row becomes one Example of input ids and labels.

- `chat_template`: the conversation rendered through the chat template; the content of trained turns (and
  their end-of-turn token, per `train_on_eos`) is labelled.
- `alpaca`: the fixed Alpaca prompt, then the output; the output and eos are labelled.
- `completion`: raw text plus eos; everything is labelled.

Truncation and dropping are the caller's job (`dataset.py`): these functions return the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from hanzo_gym.config import DatasetConfig
from hanzo_gym.data.chat_templates import render_chat
from hanzo_gym.data.example import IGNORE_INDEX, Example
from hanzo_gym.errors import ConfigError, DataError

if TYPE_CHECKING:
    from hanzo_gym.data.sources import Row

ROLE_ALIASES = {"human": "user", "gpt": "assistant"}

# Tokens that close a turn in common chat formats. The tokenizer's eos alone is not enough: Llama 3's eos is
# `<|end_of_text|>` but its turns end with `<|eot_id|>`.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
)
# How far after a turn's content its end-of-turn token may sit (e.g. Llama 3 trims trailing text before it).
END_TOKEN_WINDOW = 3
# How many tokens of template text may sit between the assistant header and the content (Qwen3's `<think>\n`
# is 2); bounds the search for the header so that it never reaches back into an earlier turn.
MAX_OPENER_TOKENS = 8
# What a chat template raises on a conversation it cannot render (raise_exception, an undefined field, `+` on
# a non-string).
TEMPLATE_ERRORS = (TemplateError, TypeError)

DUMMY_TEXT = "dummy_message"
# Message keys whose text the model generates as part of its turn: left out of the dummy turn so that what the
# template renders from them counts as the turn's content (and is trained).
GENERATED_KEYS = ("reasoning_content", "reasoning", "thinking", "tool_calls")

ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


@dataclass
class StrategyContext:
    """What every strategy needs besides the row: the tokenizer, run-wide settings, the resolved template."""

    tokenizer: PreTrainedTokenizerBase
    train_on_inputs: bool = False
    chat_template: str | None = None

    @cached_property
    def end_of_turn_ids(self) -> frozenset[int]:
        # Added (control) tokens only: Qwen's BPE also has `</s>` as ordinary text, which ends nothing.
        added = self.tokenizer.get_added_vocab()
        ids = {added[token] for token in END_OF_TURN_TOKENS if token in added}
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    @cached_property
    def eos_id(self) -> int:
        if self.tokenizer.eos_token_id is None:
            raise ConfigError(
                "the tokenizer has no eos_token (alpaca and completion end each example with it); "
                "use a tokenizer whose tokenizer_config.json sets eos_token"
            )
        return self.tokenizer.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        assert self.chat_template is not None, "resolve the chat template before the chat_template strategy"
        return render_chat(self.tokenizer, messages, self.chat_template, add_generation_prompt)


def row_to_example(row: Row, ds: DatasetConfig, ctx: StrategyContext) -> Example:
    """The Example for `row` under the dataset's strategy (untruncated)."""
    if ds.type == "chat_template":
        return chat_template_example(row, ds, ctx)
    if ds.type == "alpaca":
        return alpaca_example(row, ds, ctx)
    return completion_example(row, ds, ctx)


# --- chat_template ---


def canonical_role(role: str) -> str:
    return ROLE_ALIASES.get(role, role)


def chat_messages(row: Row, ds: DatasetConfig) -> list[dict[str, Any]]:
    """The row's turns as template messages: mapped `role`/`content`, canonical roles, and the row's `system`
    field prepended as a system turn unless the conversation starts with one. Other keys pass through."""
    where = _where(row)
    turns = row.data.get(ds.field_messages)
    if not isinstance(turns, list):
        field = ds.field_messages
        raise DataError(f"{where}: row has no `{field}` list (field_messages = `{field}`)")
    mapping = ds.mappings
    messages = []
    for number, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            raise DataError(f"{where}: message {number} is not an object")
        role = turn.get(mapping.role)
        if not isinstance(role, str):
            raise DataError(
                f"{where}: message {number} has no `role` string "
                f"(message_property_mappings.role = `{mapping.role}`)"
            )
        content = _message_text(turn.get(mapping.content), f"{where}: message {number}", mapping.content)
        message = {key: value for key, value in turn.items() if key not in (mapping.role, mapping.content)}
        message.update(role=canonical_role(role), content=content)
        messages.append(message)
    system = row.data.get("system")
    if isinstance(system, str) and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def chat_template_example(row: Row, ds: DatasetConfig, ctx: StrategyContext) -> Example:
    messages = chat_messages(row, ds)
    if not messages:
        return Example([], [])
    try:
        return _label_conversation(messages, ds, ctx)
    except TEMPLATE_ERRORS as exc:
        raise DataError(f"{_where(row)}: chat template failed: {exc}") from None


def _label_conversation(messages: list[dict[str, Any]], ds: DatasetConfig, ctx: StrategyContext) -> Example:
    ids = ctx.encode(ctx.render(messages))
    labels = [IGNORE_INDEX] * len(ids)
    trained_roles = {canonical_role(role) for role in ds.roles_to_train}
    last_end_token = None
    for index, message in enumerate(messages):
        trained = ctx.train_on_inputs or message["role"] in trained_roles
        if not trained and ds.train_on_eos != "all":
            continue
        span = _content_span(messages, index, ids, ctx)
        if span is None:
            continue
        start, end = span
        if trained:
            labels[start:end] = ids[start:end]
        end_token = _end_token_position(ids, end, ctx.end_of_turn_ids)
        if end_token is None:
            continue
        if trained:
            last_end_token = end_token
        if ds.train_on_eos == "all" or (ds.train_on_eos == "turn" and trained):
            labels[end_token] = ids[end_token]
    if ds.train_on_eos == "last" and last_end_token is not None:
        labels[last_end_token] = ids[last_end_token]
    return Example(ids, labels)


def _content_span(
    messages: list[dict[str, Any]], index: int, ids: list[int], ctx: StrategyContext
) -> tuple[int, int] | None:
    """Token range [start, end) of turn `index` inside the full conversation's `ids`.

    Found by rendering the FULL conversation again with only this turn's content swapped for a dummy: the
    range where the two token sequences differ is what the template emitted for this turn in context.
    (Rendering prefixes instead mislabels Qwen3, whose last assistant turn of a prefix gets a `<think>` block
    that the same turn lacks in the full conversation.)
    """
    message = messages[index]
    dummy = {key: value for key, value in message.items() if key not in GENERATED_KEYS}
    dummy["content"] = _dummy_for(message["content"])
    other = ctx.encode(ctx.render([*messages[:index], dummy, *messages[index + 1 :]]))
    prefix = _common_prefix(ids, other)
    if prefix == len(ids) == len(other):
        return None
    suffix = _common_prefix(ids[::-1], other[::-1], limit=min(len(ids), len(other)) - prefix)
    start, end = prefix, len(ids) - suffix
    if message["role"] == "assistant":
        start = _after_assistant_header(messages, index, ids, start, ctx)
    return start, end


def _after_assistant_header(
    messages: list[dict[str, Any]], index: int, ids: list[int], start: int, ctx: StrategyContext
) -> int:
    """Move `start` back over text the template puts between the assistant header and the content (Qwen3's
    `<think>` opener): the model generates it after the generation prompt, so it belongs to the turn."""
    if index == 0:
        return start
    try:
        with_prompt = ctx.render(messages[:index], add_generation_prompt=True)
        without_prompt = ctx.render(messages[:index])
    except TEMPLATE_ERRORS:  # a template that cannot render this prefix: keep the content span
        return start
    if not with_prompt.startswith(without_prompt):
        return start
    header = ctx.encode(with_prompt[len(without_prompt) :])
    if not header:
        return start
    position = start
    while position >= max(len(header), start - MAX_OPENER_TOKENS):
        if ids[position - len(header) : position] == header:
            return position
        if ids[position - 1] in ctx.end_of_turn_ids:  # reached the previous turn: no header for this one
            break
        position -= 1
    return start


def _dummy_for(content: str) -> str:
    # First and last characters unlike the content's (templates often strip it), so that no content token is
    # mistaken for template text shared by both renderings: content "[[x" and dummy "[[dummy" share "[[".
    text = content.strip()
    opener = "<" if text.startswith("[") else "["
    closer = ">" if text.endswith("]") else "]"
    return f"{opener}{opener}{DUMMY_TEXT}{closer}{closer}"


def _end_token_position(ids: list[int], end: int, end_ids: frozenset[int]) -> int | None:
    for position in range(end, min(end + END_TOKEN_WINDOW + 1, len(ids))):
        if ids[position] in end_ids:
            return position
    return None


def _common_prefix(a: list[int], b: list[int], limit: int | None = None) -> int:
    limit = min(len(a), len(b)) if limit is None else limit
    for position in range(limit):
        if a[position] != b[position]:
            return position
    return limit


def _message_text(value: Any, where: str, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(part, dict) for part in value):
        kinds = [part.get("type") for part in value]
        other = next((kind for kind in kinds if kind != "text"), None)
        if other is not None:
            raise DataError(f"{where} has a `{other}` content part: hanzo-gym is text-only for now")
        texts = [part.get("text") for part in value]
        if all(isinstance(text, str) for text in texts):
            return "".join(texts)
    raise DataError(f"{where} has no `content` string (message_property_mappings.content = `{field}`)")


# --- alpaca ---


def alpaca_prompt(instruction: str, input_text: str = "") -> str:
    if input_text:
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    return ALPACA_PROMPT.format(instruction=instruction)


def alpaca_example(row: Row, ds: DatasetConfig, ctx: StrategyContext) -> Example:
    instruction = _required_string(row, ds.field_instruction, "field_instruction")
    output = _required_string(row, ds.field_output, "field_output")
    input_text = row.data.get(ds.field_input)
    prompt = alpaca_prompt(instruction, input_text if isinstance(input_text, str) else "")
    prompt_ids = ctx.encode(prompt, add_special_tokens=True)
    response_ids = ctx.encode(output, add_special_tokens=True)
    bos_id = ctx.tokenizer.bos_token_id
    if bos_id is not None and response_ids[:1] == [bos_id]:
        response_ids = response_ids[1:]
    response_ids = _ending_with(response_ids, ctx.eos_id)
    prompt_labels = list(prompt_ids) if ctx.train_on_inputs else [IGNORE_INDEX] * len(prompt_ids)
    return Example(prompt_ids + response_ids, prompt_labels + response_ids)


# --- completion ---


def completion_example(row: Row, ds: DatasetConfig, ctx: StrategyContext) -> Example:
    text = _required_string(row, ds.field, "field")
    ids = _ending_with(ctx.encode(text, add_special_tokens=True), ctx.eos_id)
    return Example(ids, list(ids))


# --- shared ---


def _where(row: Row) -> str:
    return f"{row.file} row {row.line}"


def _required_string(row: Row, name: str, setting: str) -> str:
    value = row.data.get(name)
    if not isinstance(value, str):
        raise DataError(f"{_where(row)}: row has no `{name}` string ({setting} = `{name}`)")
    return value


def _ending_with(ids: list[int], token: int) -> list[int]:
    return ids if ids[-1:] == [token] else [*ids, token]
