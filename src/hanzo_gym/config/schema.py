"""The run config: Axolotl-shaped YAML, every key declared once with its default and its check.

`Config` holds the keys every run has; each feature's keys and rules live in a module of their own (a `Feature`,
config/feature.py), which `Config` inherits. Unknown keys and bad values fail at load with the key's path, its YAML
line and the nearest valid name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from hanzo_gym.config.adapter_keys import AdapterKeys
from hanzo_gym.config.axolotl_keys import (
    NOT_YET,
    OTHER_OPTIMIZERS,
    OTHER_SCHEDULERS,
    VALUES_NOT_YET,
    asks_for_nothing,
    close_misspelling,
    known_path,
)
from hanzo_gym.config.axolotl_schema_keys import AXOLOTL_DATASET_KEYS, AXOLOTL_KEYS, AXOLOTL_TRL_KEYS
from hanzo_gym.config.batching_keys import BatchingKeys
from hanzo_gym.config.checkpoint_keys import CheckpointKeys
from hanzo_gym.config.dataset_keys import DatasetConfig, DatasetKeys
from hanzo_gym.config.embedding_noise_keys import EmbeddingNoiseKeys
from hanzo_gym.config.eval_keys import EvalKeys
from hanzo_gym.config.feature import StepsOrFraction, StrictKeys, check_features
from hanzo_gym.config.grpo_keys import GrpoKeys
from hanzo_gym.config.hub_keys import HubKeys
from hanzo_gym.config.inert_keys import InertKeys
from hanzo_gym.config.kernel_keys import KernelKeys
from hanzo_gym.config.loraplus_keys import LoraPlusKeys
from hanzo_gym.config.memory_keys import MemoryKeys
from hanzo_gym.config.model_overrides_keys import ModelOverridesKeys
from hanzo_gym.config.model_quantization_keys import ModelQuantizationKeys
from hanzo_gym.config.older_axolotl_keys import OlderAxolotlKeys
from hanzo_gym.config.peft_keys import PeftKeys
from hanzo_gym.config.precision_keys import PrecisionKeys
from hanzo_gym.config.preference_keys import PreferenceKeys
from hanzo_gym.config.schedule_keys import ScheduleKeys
from hanzo_gym.config.sharding_keys import ShardingKeys
from hanzo_gym.config.tokenizer_keys import TokenizerKeys
from hanzo_gym.config.tracking import TrackingKeys
from hanzo_gym.config.trainer_keys import TrainerKeys
from hanzo_gym.config.vllm_keys import VllmKeys
from hanzo_gym.config.watchdog_keys import WatchdogKeys
from hanzo_gym.config.yaml_source import dotted, load_yaml_file
from hanzo_gym.errors import ConfigError

__all__ = ["Config", "DatasetConfig", "load_config", "parse_config"]

# torch, numpy and Python's `random` all take seeds up to 2**32 - 1 (numpy's legacy seeding allows no more).
MAX_SEED = 2**32 - 1


class Config(
    StrictKeys,
    # the features, each a group of Axolotl keys with its rules; their checks run in this order
    # first: HF's save and eval strategies and older Axolotl's names become today's keys, which later checks read
    TrainerKeys,
    OlderAxolotlKeys,
    InertKeys,
    KernelKeys,
    MemoryKeys,
    PrecisionKeys,
    ModelQuantizationKeys,
    ModelOverridesKeys,
    DatasetKeys,
    AdapterKeys,
    LoraPlusKeys,
    ScheduleKeys,
    CheckpointKeys,
    PreferenceKeys,
    VllmKeys,
    PeftKeys,
    BatchingKeys,
    ShardingKeys,
    EvalKeys,
    WatchdogKeys,
    TokenizerKeys,
    EmbeddingNoiseKeys,
    GrpoKeys,
    TrackingKeys,
    HubKeys,
):
    base_model: str
    revision_of_model: str | None = None  # a branch, tag or commit of a hub base_model
    trust_remote_code: bool = False  # let transformers run the model repository's own Python code
    model_type: str | None = None  # Axolotl's model class, checked against what base_model loads as
    output_dir: str
    sequence_len: int = Field(2048, gt=1)
    # SFT examples longer than sequence_len: dropped (Axolotl's default), cut to it, or an error
    excess_length_strategy: Literal["drop", "truncate", "raise"] = "drop"
    train_on_inputs: bool = False
    rl: Literal["grpo", "dpo", "ipo", "orpo", "simpo", "kto"] | None = None

    micro_batch_size: int = Field(1, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    # a fraction ends the last epoch part-way, as in HF's Trainer (Axolotl's num_epochs is a float)
    num_epochs: int | float = Field(1, gt=0)
    max_steps: int | None = Field(None, ge=1)
    optimizer: Literal[
        "adamw_torch",
        "adamw_torch_fused",
        "adamw_bnb_8bit",
        "adamw_8bit",
        "paged_adamw_8bit",
        "paged_adamw_32bit",
        "adamw_torch_4bit",
        "adamw_torch_8bit",
        "adamw_hf",  # transformers' own AdamW, removed in transformers 5: run as adamw_torch (OlderAxolotlKeys)
    ] = "adamw_torch_fused"
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_epsilon: float = Field(1e-8, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, ge=0)
    logging_steps: StepsOrFraction = 10
    seed: int = Field(42, ge=0, le=MAX_SEED)
    # Axolotl's `strict`: whether command-line overrides may add keys the YAML lacks. hanzo-gym takes no
    # overrides (the YAML is the whole config) and reads unknown keys the same either way, so both values load.
    strict: bool = False
    # DDP's search for parameters without a gradient (so that it does not wait for them). hanzo-gym's data
    # parallelism reduces every trainable gradient in one flat all-reduce, a missing one as zeros, so no rank
    # ever waits on an unused parameter: both values run the same.
    ddp_find_unused_parameters: bool | None = None
    # transformers' low-memory loading: the only way transformers 5 loads, so both values load the same
    low_cpu_mem_usage: bool | None = None

    # what loading the file read otherwise than it is written: a key given twice with two values (read as the
    # last, config/yaml_source.py), a key neither hanzo-gym nor Axolotl reads (left out)
    _load_notes: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _cross_key_rules(self) -> Config:
        check_features(self)
        return self

    def notes(self) -> list[str]:
        return list(self._load_notes)


def _model_at(loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The pydantic model that holds the keys at `loc` (a path of keys and list indices)."""
    model: type[BaseModel] = Config
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        inner = pydantic_model_in(field.annotation)
        if inner is None:
            return None
        model = inner
    return model


def pydantic_model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field's annotation holds (`DatasetConfig` in `list[DatasetConfig] | None`), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = pydantic_model_in(arg)
        if found is not None:
            return found
    return None


def _dotted(loc: tuple[str | int, ...]) -> str:
    return dotted(loc) or "(top level)"


def _line_of(lines: dict, loc: tuple) -> int | None:
    while loc:
        if loc in lines:
            return lines[loc]
        loc = loc[:-1]
    return lines.get(())


_LISTED_KEYS = 40  # the most valid keys an unknown key's message lists (the top level has hundreds)
_DATASETS_REQUIRED = "`datasets` is required: list at least one dataset, each with its `path` and `type`"


# the names pydantic gives the members of a union in an error's path (`gradient_checkpointing.bool`)
_TYPE_TAGS = {"bool", "int", "float", "str", "list", "dict", "set", "tuple", "none", "bytes"}


def _is_key(part: str | int) -> bool:
    """A key or index the user wrote, not a tag pydantic adds to an error's path ('literal[...]',
    'function-after[...]', 'constrained-int', a union member's type)."""
    return isinstance(part, int) or not ("[" in part or "-" in part or part in _TYPE_TAGS)


def _merge_union_errors(errors: list[dict]) -> list[dict]:
    """One error per key: a value that fits no member of a union fails once for each, under the same key."""
    merged: dict[tuple, dict] = {}
    for error in errors:
        loc = tuple(p for p in error["loc"] if _is_key(p))
        first = merged.get(loc)
        if first is None or error["type"] == "extra_forbidden" or first["type"] == "extra_forbidden":
            merged.setdefault(loc if first is None else (*loc, len(merged)), {**error, "loc": loc})
            continue
        also = error["msg"].removeprefix("Value error, ").removeprefix("Input should be ")
        merged[loc] = {**first, "type": "union", "msg": f"{first['msg']} or {also}"}
    return list(merged.values())


def _describe(error: dict, source: str, lines: dict) -> tuple[int, str]:
    """(line, message) of one pydantic error."""
    loc = tuple(p for p in error["loc"] if _is_key(p))
    line = (_line_of(lines, loc) if loc else None) or 0
    where = f"{source}:{line}" if line else source
    key = _dotted(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        name = str(loc[-1])
        model = _model_at(loc[:-1])
        valid = sorted(model.model_fields) if model else []
        close = close_misspelling(name, valid)
        if close:
            hint = f" did you mean `{close}`?"
        elif len(valid) > _LISTED_KEYS:
            hint = " it is not a key hanzo-gym reads; docs/config.md lists them"
        else:
            hint = f" valid keys here: {', '.join(valid)}"
        return line, f"{where}: unknown key `{key}`;{hint}"
    if kind == "missing":
        return line, f"{where}: `{key}` is required"
    value = error.get("input")
    message = error["msg"].removeprefix("Value error, ")
    if kind == "literal_error":
        allowed = error.get("ctx", {}).get("expected", "")
        words = [w.strip(" '") for w in allowed.replace(" or ", ",").split(",") if w.strip(" '")]
        close = close_misspelling(str(value), words)
        hint = f"; did you mean `{close}`?" if close else ""
        return line, f"{where}: `{key}` is {value!r}; allowed: {allowed}{hint}"
    if kind == "finite_number":
        return line, f"{where}: `{key}` = {value!r}: use a finite number"
    if not loc:
        return line, f"{where}: {message}"
    if isinstance(
        value, dict | list
    ):  # a rule of a whole entry: its message names the keys; the entry is long
        return line, f"{where}: `{key}`: {message}"
    return line, f"{where}: `{key}` = {value!r}: {message}"


def _without_empty_values(value: Any, loc: tuple[str | int, ...] = ()) -> Any:
    """Axolotl reads `key:` (no value) as unset, and config templates write `key: ""` for the same: drop the
    null- and empty-string-valued keys we declare, at every depth, so their defaults apply. An unknown key stays,
    empty or not, and fails as unknown."""
    if isinstance(value, dict):
        model = _model_at(loc)
        declared = model.model_fields if model else {}
        return {
            k: _without_empty_values(v, (*loc, k))
            for k, v in value.items()
            if not ((v is None or v == "") and k in declared)
        }
    if isinstance(value, list):
        return [_without_empty_values(item, (*loc, i)) for i, item in enumerate(value)]
    return value


def _refuse_known_axolotl_keys(
    data: Any, loc: tuple[str | int, ...], source: str, lines: dict, refusals: list[tuple[int, str]]
) -> Any:
    """`data` without the Axolotl keys we do not implement yet; a refusal sentence for each one that asks for
    something (a key that asks for Axolotl's default, like `deepspeed:` or `fsdp: []`, just drops out)."""
    if isinstance(data, list):
        return [
            _refuse_known_axolotl_keys(item, (*loc, i), source, lines, refusals)
            for i, item in enumerate(data)
        ]
    if not isinstance(data, dict):
        return data
    kept = {}
    for key, value in data.items():
        here = (*loc, key)
        known = NOT_YET.get(known_path(here))
        if known is None:
            kept[key] = _refuse_known_axolotl_keys(value, here, source, lines, refusals)
        elif not asks_for_nothing(value):
            what, instead = known
            line = _line_of(lines, here) or 0
            refusals.append(
                (
                    line,
                    f"{source}:{line}: Axolotl's `{_dotted(here)}` ({what}) is not supported yet; {instead}",
                )
            )
    return kept


def _refuse_values(data: dict, source: str, lines: dict, refusals: list[tuple[int, str]]) -> set[str]:
    """Refusals for values we do not implement yet (`adapter: full`, `rl: dpo`, `optimizer: sgd`); the keys
    they name, whose validation errors would only repeat the refusal."""
    refused = set()
    for key, value in data.items():
        sentence = _value_refusal(key, value)
        if sentence is not None:
            line = _line_of(lines, (key,)) or 0
            refusals.append((line, f"{source}:{line}: {sentence}"))
            refused.add(key)
    return refused


def _value_refusal(key: str, value: Any) -> str | None:
    try:
        sentence = VALUES_NOT_YET.get((key, value))
    except TypeError:  # an unhashable value (a list or mapping): validation says what is wrong with it
        return None
    if sentence is not None:
        return sentence
    if key == "optimizer" and value in OTHER_OPTIMIZERS:
        return (
            f"Axolotl's `optimizer: {value}` (an update rule other than AdamW) is not supported yet; use "
            "adamw_torch_fused, adamw_torch, adamw_bnb_8bit / adamw_8bit, paged_adamw_8bit, paged_adamw_32bit or "
            "adamw_torch_4bit / adamw_torch_8bit"
        )
    if key == "lr_scheduler" and value in OTHER_SCHEDULERS:
        return (
            f"Axolotl's `lr_scheduler: {value}` is not supported yet; use cosine, cosine_with_min_lr (with "
            "cosine_min_lr_ratio), cosine_with_restarts, linear, constant, constant_with_warmup, polynomial or inverse_sqrt"
        )
    return None


def parse_config(data: Any, source: str = "<config>", lines: dict | None = None) -> Config:
    """Validate already-parsed YAML data; errors name `source` and, when known, the line. Every problem of
    the file is reported at once, in line order, in one ConfigError."""
    lines = lines or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of config keys at the top level")
    refusals: list[tuple[int, str]] = []
    data = _refuse_known_axolotl_keys(_without_empty_values(data), (), source, lines, refusals)
    data, foreign = _without_foreign_keys(data, source, lines, refusals)
    refused_keys = _refuse_values(data, source, lines, refusals)
    # said here, with the file's other problems (DatasetKeys.check says it for a Config made in code)
    if not data.get("datasets") and not data.get("pretraining_dataset"):
        refusals.append((0, f"{source}: {_DATASETS_REQUIRED}"))
    data = {key: value for key, value in data.items() if key not in refused_keys}
    problems = list(refusals)
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        for error in _merge_union_errors(exc.errors()):
            if error["loc"] and error["loc"][0] in refused_keys:
                continue  # `adapter: full` was refused above; "adapter is required" would only repeat it
            problems.append(_describe(error, source, lines))
        config = None
    if problems:  # once each: a rule the checks repeat (`datasets` is required) is said once
        messages = dict.fromkeys(message for _, message in sorted(problems, key=lambda p: p[0]))
        raise ConfigError("\n".join(messages))
    config._load_notes = [
        *(
            f"{repeated.describe(source)}: the last value, {repeated.kept}, is read, as YAML readers (and so "
            "Axolotl) read it"
            for repeated in getattr(lines, "repeated", ())
        ),
        *foreign,
    ]
    return config


def _without_foreign_keys(
    data: dict, source: str, lines: dict, refusals: list[tuple[int, str]]
) -> tuple[dict, list[str]]:
    """`data` without the keys that are neither hanzo-gym's nor Axolotl's (a fork's, a launcher's, a script's
    own), at the top level, in a dataset and under `trl`, where Axolotl's schema ignores them, with the line that
    says so for each; a refusal for a key of Axolotl's that is not read here yet. A key near one of ours is a
    misspelling, and is left for validation to refuse (with its did-you-mean where there is one candidate); one
    near a key of Axolotl's is refused naming it."""
    notes: list[str] = []
    kept = _known_keys_of(data, (), AXOLOTL_KEYS, source, lines, refusals, notes)
    for key in ("datasets", "test_datasets"):
        if isinstance(kept.get(key), list):
            kept[key] = [
                _known_keys_of(entry, (key, index), AXOLOTL_DATASET_KEYS, source, lines, refusals, notes)
                if isinstance(entry, dict)
                else entry
                for index, entry in enumerate(kept[key])
            ]
    if isinstance(kept.get("trl"), dict):
        kept["trl"] = _known_keys_of(kept["trl"], ("trl",), AXOLOTL_TRL_KEYS, source, lines, refusals, notes)
    return kept, notes


def _known_keys_of(
    mapping: dict,
    loc: tuple[str | int, ...],
    axolotls: frozenset[str],
    source: str,
    lines: dict,
    refusals: list[tuple[int, str]],
    notes: list[str],
) -> dict:
    """One mapping of the config (at `loc`) without its foreign keys; `axolotls`: the keys Axolotl reads there."""
    model = _model_at(loc)
    if model is None:
        return mapping
    ours = sorted(model.model_fields)
    kept = {}
    for key, value in mapping.items():
        # near one of ours: a misspelling, or the start of keys of ours (cut short)
        if (
            key in model.model_fields
            or key in getattr(model, "OLDER_NAMES", ())
            or close_misspelling(key, ours)
            or any(o.startswith(key) for o in ours)
        ):
            kept[key] = value
            continue
        line = _line_of(lines, (*loc, key)) or 0
        where, name = (f"{source}:{line}" if line else source), _dotted((*loc, key))
        near_axolotls = close_misspelling(key, sorted(axolotls))
        if key in axolotls:
            refusals.append((line, f"{where}: Axolotl's `{name}` is not supported yet; remove it"))
        elif near_axolotls:
            refusals.append(
                (
                    line,
                    (
                        f"{where}: unknown key `{name}`; did you mean Axolotl's `{near_axolotls}`, which hanzo-gym "
                        "does not read yet?"
                    ),
                )
            )
        else:
            notes.append(
                f"{where}: `{name}` is no key of Axolotl 0.19's, which ignores it, and so does this run"
            )
    return kept


def load_config(path: str | Path) -> Config:
    data, lines = load_yaml_file(path)
    return parse_config(data, str(path), lines)
