"""The datasets a run reads and how they are kept: each entry of `datasets` (its path, split, type and the row
fields it reads; a `type:` mapping is a prompt format of the user's), the held-out share, the prepared copy and
exact deduplication. data/ acts on them."""

from __future__ import annotations

import string
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from hanzo_gym.config.axolotl_keys import close_misspelling
from hanzo_gym.config.dataset_types import DATASET_TYPES, is_user_transform
from hanzo_gym.config.feature import Feature, StrictKeys
from hanzo_gym.config.preference_keys import PAIR_METHODS
from hanzo_gym.errors import DataError
from hanzo_gym.renderers.instruction_formats import ALPACA_STYLES, InstructionFormat


class MessagePropertyMappings(StrictKeys):
    role: str = "role"
    content: str = "content"


class DatasetTypeMapping(StrictKeys):
    """Axolotl's `type:` given as a mapping: a prompt format of the user's. SFT and GRPO read the instruction
    keys (Axolotl's user-defined instruction format, renderers/instruction_formats.py); `rl: dpo`, ipo, simpo read
    the pair keys and `rl: kto` the KTO keys (Axolotl's user-defined preference formats). Unset keys take
    Axolotl's defaults; a key of another kind of run is refused (Config)."""

    field_system: str = "system"
    # SFT and GRPO
    system_prompt: str | None = None
    field_instruction: str | None = None
    field_input: str | None = None
    field_output: str | None = None
    format: str | None = None
    no_input_format: str | None = None
    system_format: str | None = None
    # preference data: the prompt, then the pair (rl: dpo, ipo, simpo) or one completion and its label (rl: kto)
    field_prompt: str | None = None
    prompt_format: str | None = None
    field_chosen: str | None = None
    field_rejected: str | None = None
    chosen_format: str | None = None
    rejected_format: str | None = None
    field_completion: str | None = None
    field_label: str | None = None
    completion_format: str | None = None

    INSTRUCTION_KEYS: ClassVar = (
        "system_prompt",
        "field_instruction",
        "field_input",
        "field_output",
        "format",
        "no_input_format",
        "system_format",
    )
    PAIR_KEYS: ClassVar = (
        "field_prompt",
        "prompt_format",
        "field_chosen",
        "field_rejected",
        "chosen_format",
        "rejected_format",
    )
    KTO_KEYS: ClassVar = (
        "field_prompt",
        "prompt_format",
        "field_completion",
        "field_label",
        "completion_format",
    )

    # each format string and the placeholders it may hold
    PLACEHOLDERS: ClassVar = {
        "format": {"instruction", "input"},
        "no_input_format": {"instruction"},
        "system_format": {"system"},
        "prompt_format": {"prompt", "system"},
        "chosen_format": {"chosen"},
        "rejected_format": {"rejected"},
        "completion_format": {"completion"},
    }

    @model_validator(mode="after")
    def _placeholders_known(self) -> DatasetTypeMapping:
        for key, known in self.PLACEHOLDERS.items():
            text = getattr(self, key)
            if text is None:
                continue
            try:
                used = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
            except ValueError as error:
                raise ValueError(f"{key}: {error} (write a literal brace as {{{{ or }}}})") from None
            unknown = sorted(used - known)
            if unknown:
                raise ValueError(
                    f"{key}: {{{unknown[0]}}} is not filled; it may hold {', '.join(f'{{{n}}}' for n in sorted(known))}"
                )
        return self

    def foreign_keys(self, allowed: tuple[str, ...]) -> list[str]:
        """The keys set here that a run reading `allowed` does not read."""
        return sorted(self.model_fields_set - {"field_system", *allowed})

    @property
    def instruction_format(self) -> InstructionFormat:
        """Axolotl's user-defined instruction format, its defaults for the unset keys."""
        system = self.system_prompt or ""
        return InstructionFormat(
            self.format or "{instruction} {input} ",
            self.no_input_format or "{instruction} ",
            self.system_format or "{system}",
            system,
            system,
            self.field_system,
        )


class DatasetConfig(StrictKeys):
    path: str
    # SFT's types (`alpaca:<style>` too), a preference type (config/preference_keys.py) that an `rl: dpo`-family
    # run reads, a transform of the user's (`module.function`), or a format of the user's as a mapping
    type: Annotated[
        # the tags hold brackets so that error paths leave them out (_describe)
        Annotated[str, Tag("str[type]")] | Annotated[DatasetTypeMapping, Tag("mapping[type]")],
        Discriminator(
            lambda value: "mapping[type]" if isinstance(value, dict | DatasetTypeMapping) else "str[type]"
        ),
    ]
    split: str | None = None
    data_files: list[str] | None = None
    # a configuration of the dataset (its card's `configs`), as load_dataset(path, name)
    name: str | None = None
    field_messages: str = "messages"
    drop_system_message: bool = False  # leave out a conversation's leading system turn
    message_property_mappings: MessagePropertyMappings | None = None
    # a turn's reasoning: the message field that holds it, and the name the chat template reads it by
    field_thinking: str = "reasoning_content"
    template_thinking_key: str = "reasoning_content"
    roles_to_train: list[str] = Field(default_factory=lambda: ["assistant"])
    train_on_eos: Literal["turn", "last", "all", "none"] = "turn"
    field_instruction: str = "instruction"
    field_input: str = "input"
    field_output: str = "output"
    field: str = "text"
    field_chosen: str = "chosen"
    field_rejected: str = "rejected"
    # Axolotl's role mapping: the canonical role → the names rows use for it (e.g. assistant: [gpt, bot])
    roles: dict[str, list[str]] | None = None

    @model_validator(mode="before")
    @classmethod
    def _old_message_field_names(cls, data: Any) -> Any:
        """`message_field_role` / `message_field_content`: Axolotl's older names of the two mappings."""
        if not isinstance(data, dict) or not {"message_field_role", "message_field_content"} & set(data):
            return data
        data = dict(data)
        mappings = dict(data.get("message_property_mappings") or {})
        for old, key in (("message_field_role", "role"), ("message_field_content", "content")):
            if old not in data:
                continue
            value = data.pop(old)
            if mappings.get(key, value) != value:
                raise ValueError(
                    f"{old}: {value} and message_property_mappings.{key}: {mappings[key]} disagree; give one"
                )
            mappings[key] = value
        data["message_property_mappings"] = mappings
        return data

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str | DatasetTypeMapping) -> str | DatasetTypeMapping:
        if isinstance(value, str) and value.startswith("alpaca:"):
            style = value.partition(":")[2]
            if style not in ALPACA_STYLES:
                raise ValueError(f"`alpaca:{style}`: Axolotl's alpaca styles are {', '.join(ALPACA_STYLES)}")
            return value
        if isinstance(value, str) and value not in DATASET_TYPES:
            close = close_misspelling(value, list(DATASET_TYPES))
            if close is None and is_user_transform(value):
                # Axolotl's `module.function`: a transform of the user's (data/user_transforms.py)
                return value
            hint = f"did you mean `{close}`? " if close else ""
            raise ValueError(
                f"unknown dataset type; {hint}SFT and GRPO read chat_template, alpaca (alpaca:chat, alpaca:chatml, "
                "alpaca:phi), input_output (SFT) or completion, or a `type:` mapping of your own format; preference "
                "training (rl: dpo, ipo, orpo, simpo, kto) reads chat_template.default, chat_template.argilla_chat, "
                "chat_template.argilla, passthrough, chatml.<variant> or llama3.<variant>"
            )
        return value

    @field_validator("split")
    @classmethod
    def _split_parses(cls, value: str | None) -> str | None:
        if value is not None:
            from hanzo_gym.config.splits import Split

            try:
                Split.parse(value)
            except DataError as exc:  # the parser's message already says what is allowed
                raise ValueError(str(exc)) from None
        return value

    @property
    def mappings(self) -> MessagePropertyMappings:
        return self.message_property_mappings or MessagePropertyMappings()

    @property
    def instruction_format(self) -> InstructionFormat | None:
        """The instruction prompt of `alpaca`, `alpaca:<style>` or a `type:` mapping; None for other types."""
        if isinstance(self.type, DatasetTypeMapping):
            return self.type.instruction_format
        if self.type == "alpaca" or self.type.startswith("alpaca:"):
            return ALPACA_STYLES[self.type.partition(":")[2] or "instruct"]
        return None

    @property
    def instruction_fields(self) -> tuple[str, str, str]:
        """The row fields of the instruction, the input and the output."""
        own = self.type if isinstance(self.type, DatasetTypeMapping) else None
        if own is None:
            return self.field_instruction, self.field_input, self.field_output
        return (
            own.field_instruction or "instruction",
            own.field_input or "input",
            own.field_output or "output",
        )


class DatasetKeys(Feature):
    datasets: list[DatasetConfig] = Field(min_length=1)
    val_set_size: float = Field(0.0, ge=0)
    dataset_prepared_path: str | None = None  # a folder keeping the tokenized datasets (data/prepared.py)
    # Axolotl's: tokenize as training reads the data, no prepared copy kept; the same examples
    skip_prepare_dataset: bool = False
    # leave out exact duplicates (equal tokens and labels), the first one kept; validation rows equal to a
    # training row go too
    dataset_exact_deduplication: bool = False

    def check(self) -> None:
        if self.skip_prepare_dataset and self.dataset_prepared_path:
            raise ValueError(
                "skip_prepare_dataset: true keeps no prepared copy of the datasets, and dataset_prepared_path names "
                "a folder for one: give one of them"
            )
        self._check_type_mappings()

    def _check_type_mappings(self) -> None:
        """A `type:` mapping holds the keys of this run's kind of data only."""
        if self.rl == "kto":
            kind, allowed = "rl: kto", DatasetTypeMapping.KTO_KEYS
        elif self.rl in PAIR_METHODS:
            kind, allowed = f"rl: {self.rl}", DatasetTypeMapping.PAIR_KEYS
        else:
            kind, allowed = "SFT and GRPO", DatasetTypeMapping.INSTRUCTION_KEYS
        for index, ds in enumerate(self.datasets):
            foreign = ds.type.foreign_keys(allowed) if isinstance(ds.type, DatasetTypeMapping) else []
            if foreign:
                raise ValueError(
                    f"datasets[{index}].type: `{foreign[0]}` is not a key of the format {kind} reads "
                    f"({', '.join(allowed)}, field_system)"
                )
