"""Dataset strategies (`datasets[].type`): one row becomes one Example of input ids and labels.

- `chat_template`: the conversation rendered by the run's renderer (`chat_template` setting); the content of
  trained turns (and their end-of-turn token, per `train_on_eos`) is labelled.
- `alpaca`, `alpaca:<style>` or a `type:` mapping: the instruction (and input) in the format's prompt
  (renderers/instruction_formats.py), then the output; the output and eos are labelled.
- `input_output`: the row's `segments` as they are, each labelled or not by its own `label`; nothing added.
- `completion`: raw text plus eos, everything labelled, cut into pieces of sequence_len tokens (Axolotl's
  completion strategy: the text read up to 64 × sequence_len tokens, the eos added when the text ends within
  them, then chunked).
- `pretrain`: Axolotl's pretraining text (`pretraining_dataset`), everything labelled. Packed (sample_packing),
  its windows of sequence_len - 1 tokens that overlap by min(256, (sequence_len - 1) // 2), each with the
  tokenizer's special tokens and an eos; unpacked, as Axolotl's unpacked stream reads it, the text with its
  special tokens cut to sequence_len - 2 tokens, no eos added.
- no `type`: rows tokenized already, their `input_ids` and `labels` taken as they are.

Truncation and dropping are the caller's job (`dataset.py`): these functions return the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from hanzo_gym.config import DatasetConfig
from hanzo_gym.data.example import Example
from hanzo_gym.errors import ConfigError, DataError
from hanzo_gym.records import IGNORE_INDEX
from hanzo_gym.renderers.base import Renderer, RendererError, axolotl_labels, axolotl_trained
from hanzo_gym.renderers.chat_templates import resolve_renderer
from hanzo_gym.renderers.instruction_formats import Composed, FieldSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hanzo_gym.data.sources import Row

ROLE_ALIASES = {"human": "user", "gpt": "assistant"}


@dataclass
class StrategyContext:
    """What every strategy needs besides the row: the tokenizer, run-wide settings, the chat renderer."""

    tokenizer: PreTrainedTokenizerBase
    train_on_inputs: bool = False
    # The resolved renderer, or a `chat_template` setting (a name, `tokenizer_default`, inline Jinja) that is
    # resolved on first use.
    chat_template: Renderer | str | None = None
    eot_tokens: list[str] | None = None  # Axolotl's end-of-turn tokens, for a setting resolved here
    sequence_len: int = 2048  # the length completion and pretrain texts are cut to
    sample_packing: bool = False  # how pretrain text is read (packed windows, or each text cut short)

    @cached_property
    def renderer(self) -> Renderer:
        if isinstance(self.chat_template, Renderer):
            return self.chat_template
        return resolve_renderer(self.chat_template, self.tokenizer, self.eot_tokens)

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


def row_to_examples(row: Row, ds: DatasetConfig, ctx: StrategyContext) -> list[Example]:
    """The Examples of `row` under the dataset's strategy: one (untruncated), or a long text's pieces."""
    if ds.type == "completion":
        return completion_examples(row, ds, ctx)
    if ds.type == "pretrain":
        return pretrain_examples(row, ds, ctx)
    return [row_to_example(row, ds, ctx)]


def row_to_example(row: Row, ds: DatasetConfig, ctx: StrategyContext) -> Example:
    """The Example for `row` under a strategy that makes one (untruncated)."""
    if ds.type == "chat_template":
        return chat_template_example(row, ds, ctx)
    if ds.instruction_format is not None:
        return instruction_example(row, ds, ctx)
    if ds.type == "input_output":
        return segments_example(row, ctx)
    if ds.type is None:
        return tokenized_example(row)
    raise DataError(f"dataset type {ds.type}: a row may make several examples; read it with row_to_examples")


# --- chat_template ---


def canonical_role(role: str) -> str:
    return ROLE_ALIASES.get(role, role)


def role_names(ds: DatasetConfig) -> dict[str, str]:
    """A row's role name → the canonical role, from Axolotl's `roles` mapping (identity when absent)."""
    inverse = ds.roles or {
        "user": ["user"],
        "assistant": ["assistant"],
        "system": ["system"],
        "tool": ["tool"],
    }
    return {source: target for target, sources in inverse.items() for source in sources}


def chat_messages(row: Row, ds: DatasetConfig) -> list[dict[str, Any]]:
    """The row's turns as template messages: mapped `role`/`content`, canonical roles, and the row's `system`
    field prepended as a system turn unless the conversation starts with one (a leading system turn is left
    out with `drop_system_message`, as in Axolotl). A turn's reasoning (`field_thinking`) goes to the template
    under the name it reads (`template_thinking_key`). Other keys pass through."""
    where = _where(row)
    turns = row.data.get(ds.field_messages)
    if not isinstance(turns, list):
        field = ds.field_messages
        raise DataError(f"{where}: row has no `{field}` list (field_messages = `{field}`)")
    mapping = ds.mappings
    names = role_names(ds) if ds.roles else None  # Axolotl's `roles`: only the names it maps
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
        if names is not None and role not in names:
            raise DataError(
                f"{where}: message {number} has role {role!r}, which `roles` does not map (known: {', '.join(names)})"
            )
        content = _message_text(turn.get(mapping.content), f"{where}: message {number}", mapping.content)
        message = {key: value for key, value in turn.items() if key not in (mapping.role, mapping.content)}
        message.update(role=names[role] if names is not None else canonical_role(role), content=content)
        if ds.field_thinking != ds.template_thinking_key and ds.field_thinking in message:
            message[ds.template_thinking_key] = message.pop(ds.field_thinking)
        messages.append(message)
    system = row.data.get("system")
    if isinstance(system, str) and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": system})
    if ds.drop_system_message and messages and messages[0]["role"] == "system":
        messages = messages[1:]
    return messages


def chat_template_example(row: Row, ds: DatasetConfig, ctx: StrategyContext) -> Example:
    """The rendered conversation, labelled by Axolotl's roles_to_train / train_on_eos / train_on_inputs."""
    messages = chat_messages(row, ds)
    if not messages:
        return Example([], [])
    roles = {canonical_role(role) for role in ds.roles_to_train}
    try:
        conversation = ctx.renderer.render(messages)
        ctx.renderer.check_targets(messages, axolotl_trained(messages, roles, ctx.train_on_inputs))
    except RendererError as exc:
        raise DataError(f"{_where(row)}: {exc}") from None
    labels = axolotl_labels(conversation, messages, roles, ds.train_on_eos, ctx.train_on_inputs)
    return Example(conversation.tokens(), labels)


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


# --- alpaca and other instruction formats ---


def instruction_prompt(row: Row, ds: DatasetConfig) -> tuple[str, str]:
    """The row's prompt text in the dataset's instruction format, and its output."""
    instruction_field, input_field, output_field = ds.instruction_fields
    instruction = _text_of(row, instruction_field, "field_instruction")
    output = _text_of(row, output_field, "field_output")
    input_text = row.data.get(input_field) if input_field else None
    form = ds.instruction_format
    row_system = None
    if form.field_system is not None:
        # Axolotl's user-defined format: the row's own system text when the row has the field
        row_system = row.data.get(form.field_system, form.system)
        row_system = row_system if isinstance(row_system, str) else ""
    prompt = form.prompt(instruction, input_text if isinstance(input_text, str) else "", row_system)
    return prompt, output


def instruction_example(row: Row, ds: DatasetConfig, ctx: StrategyContext) -> Example:
    """As Axolotl tokenizes instruction prompts: the prompt with the tokenizer's special tokens, then the output
    without its BOS and ending with eos."""
    prompt, output = instruction_prompt(row, ds)
    prompt_ids = ctx.encode(prompt, add_special_tokens=True)
    response_ids = ctx.encode(output, add_special_tokens=True)
    bos_id = ctx.tokenizer.bos_token_id
    if bos_id is not None and response_ids[:1] == [bos_id]:
        response_ids = response_ids[1:]
    response_ids = _ending_with(response_ids, ctx.eos_id)
    prompt_labels = list(prompt_ids) if ctx.train_on_inputs else [IGNORE_INDEX] * len(prompt_ids)
    return Example(prompt_ids + response_ids, prompt_labels + response_ids)


def _text_of(row: Row, spec: FieldSpec, key: str) -> str:
    """A row field's text, or a text Axolotl's strategy composes of several."""
    if isinstance(spec, Composed):
        return spec.template.format(**{name: row.string(name, key) for name in spec.fields})
    return row.string(spec, key)


# --- input_output ---


def segments_example(row: Row, ctx: StrategyContext) -> Example:
    """Axolotl's template-free format: each segment's text tokenized alone (no special tokens), labelled when
    its `label` is true or `train_on_inputs` is set."""
    segments = row.data.get("segments")
    if not isinstance(segments, list):
        raise DataError(f"{_where(row)}: row has no `segments` list (type: input_output)")
    ids: list[int] = []
    labels: list[int] = []
    for number, segment in enumerate(segments, start=1):
        if not (isinstance(segment, dict) and isinstance(segment.get("text"), str)):
            raise DataError(f"{_where(row)}: segment {number} has no `text` string")
        label = segment.get("label")
        if not isinstance(label, bool):
            raise DataError(f"{_where(row)}: segment {number} has no `label` true/false (train on it or not)")
        tokens = ctx.encode(segment["text"])
        ids += tokens
        labels += tokens if label or ctx.train_on_inputs else [IGNORE_INDEX] * len(tokens)
    return Example(ids, labels)


# --- tokenized rows (no `type`) ---


def tokenized_example(row: Row) -> Example:
    """A row tokenized already: its `input_ids` and `labels` as they are (-100: not trained), as Axolotl uses a
    dataset that has them; positions its `attention_mask` marks 0 (padding) are left out."""
    ids, labels = row.data.get("input_ids"), row.data.get("labels")
    for name, value in (("input_ids", ids), ("labels", labels)):
        if not (
            isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            raise DataError(
                f"{_where(row)}: a dataset without `type` holds tokenized rows: `{name}` must be a list of "
                "integers (give the dataset a `type` to have its rows rendered)"
            )
    mask = row.data.get("attention_mask")
    if not isinstance(mask, list):
        mask = [1] * len(ids)
    if not len(ids) == len(labels) == len(mask):
        raise DataError(
            f"{_where(row)}: input_ids, labels and attention_mask have {len(ids)}, {len(labels)} and {len(mask)} "
            "entries; they must be as long"
        )
    kept = [index for index, keep in enumerate(mask) if keep]
    return Example([ids[i] for i in kept], [labels[i] for i in kept])


# --- completion ---


# Axolotl's completion strategy reads a text up to this many times sequence_len tokens
COMPLETION_READ_LIMIT = 64


def completion_examples(row: Row, ds: DatasetConfig, ctx: StrategyContext) -> list[Example]:
    """Axolotl's completion: the text read up to 64 × sequence_len tokens (special tokens included), the eos
    added when it ends within them, and the tokens cut into pieces of sequence_len, each trained whole."""
    text = row.string(ds.field, "field")
    limit = COMPLETION_READ_LIMIT * ctx.sequence_len
    ids = ctx.tokenizer(text, truncation=True, max_length=limit)["input_ids"]
    if ids and ids[-1] != ctx.eos_id and len(ids) < limit:
        ids = [*ids, ctx.eos_id]
    # an empty text is one example with nothing in it, which the caller counts as dropped
    return [Example(piece, list(piece)) for piece in _pieces(ids, ctx.sequence_len) or [[]]]


def pretrain_examples(row: Row, ds: DatasetConfig, ctx: StrategyContext) -> list[Example]:
    """Axolotl's pretraining text: packed, the tokenizer's own overflowing windows of sequence_len - 1 tokens (its
    special tokens in each), overlapping by min(256, (sequence_len - 1) // 2), each ending with an eos; unpacked,
    the text cut to sequence_len - 2 tokens (Axolotl's encode_streaming, without concatenation)."""
    text = row.string(ds.field, "text_column")
    if not ctx.sample_packing:
        ids = ctx.tokenizer(text, truncation=True, max_length=ctx.sequence_len - 2, add_special_tokens=True)
        return [Example(ids["input_ids"], list(ids["input_ids"]))]
    width = ctx.sequence_len - 1
    windows = ctx.tokenizer(
        text,
        truncation=True,
        max_length=width,
        add_special_tokens=True,
        return_overflowing_tokens=True,
        stride=min(256, (width - 1) // 2),
    )["input_ids"]
    windows = windows if windows and isinstance(windows[0], list) else [windows]
    return [Example([*ids, ctx.eos_id], [*ids, ctx.eos_id]) for ids in windows if ids]


def _pieces(ids: list[int], length: int) -> list[list[int]]:
    return [ids[start : start + length] for start in range(0, len(ids), length)]


# --- shared ---


def _where(row: Row) -> str:
    return f"{row.file} row {row.line}"


def _ending_with(ids: list[int], token: int) -> list[int]:
    return ids if ids[-1:] == [token] else [*ids, token]
