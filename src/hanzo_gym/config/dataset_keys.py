"""The datasets a run reads and how they are kept: each entry of `datasets` (its path, split, type and the row
fields it reads; a `type:` mapping is a prompt format of the user's), the held-out share, the prepared copy and
exact deduplication. data/ acts on them."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, PrivateAttr, Tag, field_validator, model_validator

from hanzo_gym.config.axolotl_keys import close_misspelling
from hanzo_gym.config.dataset_types import (
    DATASET_TYPES,
    SHAREGPT_TYPES,
    is_axolotl_strategy,
    is_user_transform,
)
from hanzo_gym.config.feature import Feature, StrictKeys
from hanzo_gym.config.preference_keys import PAIR_METHODS
from hanzo_gym.config.tokenizer_keys import known_chat_template
from hanzo_gym.errors import DataError
from hanzo_gym.renderers.chat_templates import fastchat_chatml, fastchat_llama3
from hanzo_gym.renderers.instruction_formats import ALPACA_STYLES, AXOLOTL_STRATEGIES, InstructionFormat

# older Axolotl's FastChat conversation templates → the chat template that renders them the same
FASTCHAT_TEMPLATES = {
    "chatml": "fastchat_chatml",
    "qwen-7b-chat": "fastchat_chatml",
    "llama3": "fastchat_llama3",
    "llama-3": "fastchat_llama3",
    "alpaca": "fastchat_alpaca",
    "vicuna_v1.1": "fastchat_vicuna",
}
# FastChat's conversation → the top-level chat_template older Axolotl gave `default_system_message` with, which
# then replaced that conversation's system message
SYSTEM_MESSAGE_OF = {
    "fastchat_chatml": ("chatml", fastchat_chatml),
    "fastchat_llama3": ("llama3", fastchat_llama3),
}
# the extensions data/sources.py reads
DATA_EXTENSIONS = (".jsonl", ".json", ".parquet")
# what users write as a dataset's `type` when they mean its file format
FILE_FORMATS = ("json", "jsonl", "parquet", "csv", "arrow", "text")


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
    type: (
        Annotated[
            # the tags hold brackets so that error paths leave them out (_describe)
            Annotated[str, Tag("str[type]")] | Annotated[DatasetTypeMapping, Tag("mapping[type]")],
            Discriminator(
                lambda value: "mapping[type]" if isinstance(value, dict | DatasetTypeMapping) else "str[type]"
            ),
        ]
        | None
    ) = None  # none: the rows are tokenized already (`input_ids` and `labels`), as Axolotl reads them
    split: str | None = None
    data_files: list[str] | None = None  # one file may be given as a string, as Axolotl allows
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
    # the chat template of this dataset's conversations: the run's, as one run renders with one (DatasetKeys)
    chat_template: str | None = None
    # the file format Axolotl hands `load_dataset` (json reads .json and .jsonl); here it must agree with `path`
    ds_type: Literal["json", "parquet", "csv", "arrow", "text"] | None = None
    # older Axolotl's ShareGPT keys: a FastChat template name, and the `from` values of the user's and the
    # model's turns when not human / gpt
    conversation: str | None = None
    field_human: str | None = None
    field_model: str | None = None

    # Axolotl's switch for datasets with a loading script: none runs here, the files are read
    trust_remote_code: bool | None = None
    # not an Axolotl key, which Axolotl ignores with a warning (`split` is)
    train_on_split: str | None = None

    _notes: list[str] = PrivateAttr(default_factory=list)
    # older Axolotl's template for a sharegpt dataset without `conversation`, where the run names none
    _default_template: str | None = PrivateAttr(None)
    _known_chat_template = field_validator("chat_template")(known_chat_template)

    # keys read before validation, as the ones they became
    OLDER_NAMES: ClassVar[tuple[str, ...]] = ("message_field_role", "message_field_content")

    @model_validator(mode="before")
    @classmethod
    def _old_message_field_names(cls, data: Any) -> Any:
        """`message_field_role` / `message_field_content`: Axolotl's older names of the two mappings."""
        if not isinstance(data, dict) or not set(cls.OLDER_NAMES) & set(data):
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
        if value in FILE_FORMATS:
            raise ValueError(
                f"`{value}` is a file format, read from `path` (or `ds_type`); `type` is the rows' format: "
                "chat_template, alpaca, completion, input_output, a `type:` mapping, or none for tokenized rows"
            )
        misspelt = isinstance(value, str) and close_misspelling(value, list(DATASET_TYPES)) is not None
        if (
            isinstance(value, str)
            and value not in DATASET_TYPES
            and is_axolotl_strategy(value)
            and not misspelt
        ):
            raise ValueError(
                f"`{value}` names a strategy of Axolotl's `{value.split('.', 1)[0]}` prompt-strategy module, whose "
                "strategies are read here only as docs/config.md's dataset types list them; give the rows' format as a "
                "`type:` mapping (field_instruction, field_output, format, …) or use chat_template"
            )
        if isinstance(value, str) and value not in DATASET_TYPES:
            close = close_misspelling(value, list(DATASET_TYPES))
            if close is None and is_user_transform(value):
                # Axolotl's `module.function`: a transform of the user's (data/user_transforms.py)
                return value
            hint = f"did you mean `{close}`? " if close else ""
            raise ValueError(
                f"unknown dataset type; {hint}SFT and GRPO read chat_template, alpaca (alpaca:chat, alpaca:chatml, "
                "alpaca:phi), input_output and pretrain (SFT) or completion, or a `type:` mapping of your own format; preference "
                "training (rl: dpo, ipo, orpo, simpo, kto) reads chat_template.default, chat_template.argilla_chat, "
                "chat_template.argilla, passthrough, chatml.<variant> or llama3.<variant>"
            )
        return value

    @field_validator("data_files", mode="before")
    @classmethod
    def _one_data_file(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

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

    @model_validator(mode="after")
    def _older_types(self) -> DatasetConfig:
        """Older Axolotl's `sharegpt` and `oasst` as the types they became, and what else they read."""
        sharegpt_keys = [key for key in ("conversation", "field_human", "field_model") if getattr(self, key)]
        if sharegpt_keys and self.type not in SHAREGPT_TYPES:
            raise ValueError(
                f"{sharegpt_keys[0]} is a key of older Axolotl's `type: sharegpt`, not of {self.type}"
            )
        if self.type in SHAREGPT_TYPES:
            self._as_chat_template()
        elif self.type == "oasst":
            self.type, self.field_instruction, self.field_output = "alpaca", "INSTRUCTION", "RESPONSE"
            self._notes.append(
                f"{self.path}: type: oasst is type: alpaca with field_instruction: INSTRUCTION, "
                "field_output: RESPONSE"
            )
        if self.ds_type is not None:
            self._check_ds_type()
        return self

    def _as_chat_template(self) -> None:
        written = self.type
        if self.conversation is not None:
            template = FASTCHAT_TEMPLATES.get(self.conversation)
            if template is None:
                raise ValueError(
                    f"conversation: {self.conversation} (a FastChat template of older Axolotl) has no chat template "
                    f"here; use type: chat_template with chat_template: {', '.join(sorted(set(FASTCHAT_TEMPLATES.values())))} "
                    "or your tokenizer's (tokenizer_default)"
                )
            if self.chat_template not in (None, template):
                raise ValueError(
                    f"conversation: {self.conversation} and chat_template: {self.chat_template} disagree; give one"
                )
            self.chat_template = template
        elif self.chat_template is None:
            self._default_template = FASTCHAT_TEMPLATES[
                "vicuna_v1.1"
            ]  # FastChat's default, as older Axolotl's
        role, content = ("role", "content") if written == "sharegpt.load_role" else ("from", "value")
        self.type = "chat_template"
        if "field_messages" not in self.model_fields_set:
            self.field_messages = "conversations"
        if self.message_property_mappings is None:
            self.message_property_mappings = MessagePropertyMappings(role=role, content=content)
        if self.roles is None:
            self.roles = {
                "user": list(dict.fromkeys(["human", "user", *filter(None, [self.field_human])])),
                "assistant": list(dict.fromkeys(["gpt", "assistant", *filter(None, [self.field_model])])),
                "system": ["system"],
            }
        spelled = [
            f"field_messages: {self.field_messages}",
            f"message_property_mappings: {{role: {self.mappings.role}, content: {self.mappings.content}}}",
            "roles: {" + ", ".join(f"{k}: [{', '.join(v)}]" for k, v in self.roles.items()) + "}",
        ]
        if self.chat_template:
            spelled.append(f"chat_template: {self.chat_template}")
        self._notes.append(f"{self.path}: type: {written} is type: chat_template with {', '.join(spelled)}")

    def _check_ds_type(self) -> None:
        suffixes = {"json": (".json", ".jsonl"), "parquet": (".parquet",)}.get(self.ds_type)
        if suffixes is None:
            raise ValueError(
                f"ds_type: {self.ds_type} files are not read yet; convert them to .jsonl or .parquet"
            )
        suffix = Path(self.path).suffix.lower()
        if suffix in DATA_EXTENSIONS and suffix not in suffixes:
            raise ValueError(f"ds_type: {self.ds_type} and path {self.path} disagree; remove ds_type")

    @property
    def notes(self) -> list[str]:
        """The lines saying what an older Axolotl dataset type became, and which keys change nothing."""
        ignored = (
            [
                f"{self.path}: trust_remote_code changes nothing: no dataset loading script runs, the data files are read"
            ]
            if self.trust_remote_code
            else []
        )
        if self.train_on_split is not None:
            ignored.append(
                f"{self.path}: train_on_split is not an Axolotl key and is ignored, as Axolotl ignores it; the split "
                f"read is `split` ({self.split or 'train'})"
            )
        return [*self._notes, *ignored]

    @property
    def mappings(self) -> MessagePropertyMappings:
        return self.message_property_mappings or MessagePropertyMappings()

    @property
    def instruction_format(self) -> InstructionFormat | None:
        """The instruction prompt of `alpaca`, `alpaca:<style>` or a `type:` mapping; None for other types."""
        if isinstance(self.type, DatasetTypeMapping):
            return self.type.instruction_format
        if self.type is None:
            return None
        if self.type in AXOLOTL_STRATEGIES:
            return AXOLOTL_STRATEGIES[self.type][0]
        if self.type == "alpaca" or self.type.startswith("alpaca:"):
            return ALPACA_STYLES[self.type.partition(":")[2] or "instruct"]
        return None

    @property
    def instruction_fields(self) -> tuple[str, str, str]:
        """The row fields of the instruction, the input and the output."""
        if isinstance(self.type, str) and self.type in AXOLOTL_STRATEGIES:
            return AXOLOTL_STRATEGIES[self.type][1]
        own = self.type if isinstance(self.type, DatasetTypeMapping) else None
        if own is None:
            return self.field_instruction, self.field_input, self.field_output
        return (
            own.field_instruction or "instruction",
            own.field_input or "input",
            own.field_output or "output",
        )


class PretrainingDataset(StrictKeys):
    """An entry of Axolotl's `pretraining_dataset`: raw text it streams (its first entry only) and trains on in
    packed windows; read here as a dataset of that text, of `type` pretrain (Axolotl's overlapping windows) or
    completion (cut into sequence_len pieces)."""

    path: str
    name: str | None = None
    split: str = "train"
    text_column: str = "text"
    type: Literal["pretrain", "completion"] = "pretrain"
    data_files: str | list[str] | None = None  # one file, or a list (the dataset reads either)
    trust_remote_code: bool = False
    skip: int | None = Field(None, ge=0)

    def as_dataset(self, kind: str) -> DatasetConfig:
        return DatasetConfig(
            path=self.path,
            name=self.name,
            split=self.split,
            type=kind,
            field=self.text_column,
            data_files=self.data_files,
            trust_remote_code=self.trust_remote_code,
        )


class DatasetKeys(Feature):
    # required unless pretraining_dataset gives the text to train on (check)
    datasets: list[DatasetConfig] = Field(default_factory=list)
    # Axolotl's streamed pretraining text: one path, or entries of which Axolotl reads the first
    pretraining_dataset: str | list[PretrainingDataset] | None = None
    # Axolotl's unpacked pretraining stream with its texts concatenated into rows (not supported yet)
    pretraining_sample_concatenation: bool | None = None
    val_set_size: float = Field(0.0, ge=0)
    # Axolotl's evaluation datasets, read as `datasets` are: the held-out set instead of val_set_size's share
    test_datasets: list[DatasetConfig] | None = None
    # older Axolotl's system message of `type: sharegpt`'s chatml and llama3 conversations (SYSTEM_MESSAGE_OF)
    default_system_message: str | None = None

    _run_notes: list[str] = PrivateAttr(default_factory=list)
    dataset_prepared_path: str | None = None  # a folder keeping the tokenized datasets (data/prepared.py)
    # Axolotl's: tokenize as training reads the data, no prepared copy kept; the same examples
    skip_prepare_dataset: bool = False
    # leave out exact duplicates (equal tokens and labels), the first one kept; validation rows equal to a
    # training row go too
    dataset_exact_deduplication: bool = False

    @property
    def holds_out(self) -> bool:
        """Whether the run has a held-out set to evaluate: val_set_size's share or test_datasets."""
        return self.val_set_size > 0 or bool(self.test_datasets)

    def check(self) -> None:
        if self.pretraining_dataset:
            self._read_pretraining_dataset()
        if not self.datasets:
            raise ValueError(
                "`datasets` is required: list at least one dataset, each with its `path` and `type`"
            )
        if self.test_datasets and self.val_set_size:
            raise ValueError(
                f"test_datasets are the held-out set, and val_set_size {self.val_set_size} holds out another; "
                "give one (Axolotl's rule)"
            )
        for index, ds in enumerate(self.test_datasets or []):
            if is_user_transform(ds.type):
                raise ValueError(
                    f"test_datasets[{index}].type `{ds.type}`: a transform of your own is read for `datasets` "
                    "only; give the evaluation rows in a format a dataset type reads"
                )
        if self.skip_prepare_dataset and self.dataset_prepared_path:
            raise ValueError(
                "skip_prepare_dataset: true keeps no prepared copy of the datasets, and dataset_prepared_path names "
                "a folder for one: give one of them"
            )
        self._check_tokenized_rows()
        self._check_type_mappings()
        self._one_chat_template()

    def _one_chat_template(self) -> None:
        """A dataset's own chat template is the run's: one run renders every conversation with one template."""
        every = (*self.datasets, *(self.test_datasets or []))
        own = {ds.chat_template for ds in every if ds.chat_template is not None}
        if len(own) > 1:
            raise ValueError(
                f"datasets give chat templates {', '.join(sorted(own))}; a run renders with one: set the "
                "top-level chat_template"
            )
        written, system_message_used = self.chat_template, False
        if own:
            template = own.pop()
            family, with_system = SYSTEM_MESSAGE_OF.get(template, (None, None))
            # older Axolotl's top-level `chat_template: chatml` beside `conversation: chatml` is one choice
            if written not in (None, template, family):
                raise ValueError(
                    f"chat_template: {written} and a dataset's chat_template: {template} disagree; give one"
                )
            self.chat_template = template
            if with_system and written == family and self.default_system_message is not None:
                self.chat_template, system_message_used = with_system(self.default_system_message), True
                self._run_notes.append(
                    f"default_system_message: the system message of FastChat's {family} conversation, as older "
                    f"Axolotl set it with chat_template: {family}, where a conversation has no system turn"
                )
        defaults = {ds._default_template for ds in every if ds._default_template}
        if self.chat_template is None and defaults:
            self.chat_template = defaults.pop()
            self._run_notes.append(
                f"chat_template: {self.chat_template}: FastChat's vicuna_v1.1 conversation, which older Axolotl's "
                "`type: sharegpt` rendered with when no `conversation` is given; set chat_template to choose another"
            )
        if self.default_system_message is not None and not system_message_used:
            self._run_notes.append(
                "default_system_message: changes nothing here: older Axolotl gave it to `type: sharegpt`'s chatml "
                "and llama3 conversations with the top-level chat_template of that name, and no dataset here is one"
            )

    def notes(self) -> list[str]:
        every = (*self.datasets, *(self.test_datasets or []))
        return [*(line for ds in every for line in ds.notes), *self._run_notes]

    def _read_pretraining_dataset(self) -> None:
        """Axolotl's `pretraining_dataset` as the run's one dataset: the text trains in packed windows for
        max_steps (Axolotl streams it, so max_steps is the run's length), and only test_datasets evaluate."""
        entries = self.pretraining_dataset
        entries = [PretrainingDataset(path=entries)] if isinstance(entries, str) else entries
        if len(entries) > 1:
            raise ValueError(
                f"pretraining_dataset lists {len(entries)} datasets, and Axolotl trains on the first only: give one "
                "(or list them under `datasets` with type: completion)"
            )
        if self.datasets:
            raise ValueError(
                "pretraining_dataset and datasets: Axolotl trains on pretraining_dataset only and reads datasets not "
                "at all; give one of them"
            )
        if self.max_steps is None:
            raise ValueError(
                "pretraining_dataset needs max_steps: Axolotl streams the text, so the run's length (and its lr "
                "schedule) is max_steps (Axolotl's rule)"
            )
        if not self.sample_packing and self.pretraining_sample_concatenation:
            raise ValueError(
                "pretraining_sample_concatenation: true (Axolotl's unpacked stream of texts concatenated into "
                "sequence_len rows, attending across documents) is not supported yet; set sample_packing: true"
            )
        (entry,) = entries
        if entry.skip:
            raise ValueError(
                f"pretraining_dataset.skip: {entry.skip} (leaving out the first rows of the stream) is not supported "
                "yet; remove it"
            )
        # unpacked, Axolotl's stream reads every text alike, whatever the entry's type
        kind = entry.type if self.sample_packing else "pretrain"
        self.datasets = [entry.as_dataset(kind)]
        read = (
            "in packed windows"
            if self.sample_packing
            else f"cut to sequence_len - 2 = {self.sequence_len - 2} tokens"
        )
        self._run_notes.append(
            f"pretraining_dataset: {entry.path} trains as a dataset of type {kind} (its `{entry.text_column}` text "
            f"{read}), read whole rather than streamed, for max_steps"
        )
        if self.val_set_size:
            self._run_notes.append(
                f"val_set_size: {self.val_set_size} changes nothing with pretraining_dataset: Axolotl holds no part "
                "of streamed text out, and evaluates on test_datasets only"
            )
            self.val_set_size = 0.0

    def _check_tokenized_rows(self) -> None:
        """A dataset without `type` holds tokenized SFT examples; other kinds of runs read rows to render."""
        for index, ds in enumerate(self.datasets):
            if ds.type is None and self.rl is not None:
                raise ValueError(
                    f"datasets[{index}] has no `type`, which means its rows are tokenized SFT examples (input_ids, "
                    f"labels); rl: {self.rl} renders its own rows: give the dataset's type"
                )

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
