"""The design YAML of `gym synth`: strict schema, every error naming the key and its line.

Top-level keys: `model` or `models`, `seed`, `random_seed`, `rows`, `max_attempts`, `output`, `columns`,
`validators`. A column is `name` plus exactly one of `sampler`, `llm`, `expression`; a sampler's parameters sit
beside `sampler:` in the same mapping, as in the original gym.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hanzo_gym.config.yaml_source import load_yaml_file
from hanzo_gym.errors import ConfigError
from hanzo_gym.synth.columns import LLM_COLUMNS, Column, ExpressionColumn, SamplerColumn
from hanzo_gym.synth.expressions import Condition
from hanzo_gym.synth.llm import ModelSettings
from hanzo_gym.synth.samplers import SAMPLERS, Sampler
from hanzo_gym.synth.validators import Validator

Loc = tuple[str | int, ...]
OUTPUT_SUFFIXES = (".jsonl", ".parquet")
COLUMN_KINDS = ("sampler", "llm", "expression")
SAMPLER_COLUMN_KEYS = ("name", "sampler", "drop", "conditional_params")
DEFAULT_MODEL_ALIAS = "default"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, allow_inf_nan=False)


class SeedSettings(_Strict):
    path: str
    sampling: Literal["ordered", "shuffle"] = "ordered"
    split: str | None = None


class DesignKeys(_Strict):
    model: ModelSettings | None = None
    models: dict[str, ModelSettings] = {}
    seed: SeedSettings | None = None
    random_seed: int | None = Field(None, ge=0)
    rows: int = Field(10, ge=1)
    max_attempts: int | None = Field(None, ge=1)
    output: str | None = None
    columns: list[Any] = Field(min_length=1)
    validators: list[Any] = []

    @field_validator("output")
    @classmethod
    def _known_format(cls, output: str | None) -> str | None:
        if output is not None and Path(output).suffix not in OUTPUT_SUFFIXES:
            raise ValueError(f"output `{output}`: use a .jsonl or .parquet path")
        return output

    @model_validator(mode="after")
    def _one_way_to_name_models(self) -> DesignKeys:
        if self.model is not None and self.models:
            raise ValueError("give `model` (one model) or `models` (named models), not both")
        return self

    @property
    def attempt_budget(self) -> int:
        """Row attempts allowed in total: `max_attempts`, by default three per requested row."""
        return self.max_attempts if self.max_attempts is not None else 3 * self.rows

    def model_settings(self) -> dict[str, ModelSettings]:
        return {DEFAULT_MODEL_ALIAS: self.model} if self.model is not None else dict(self.models)


@dataclass
class Design:
    source: str
    keys: DesignKeys
    columns: list[Column]
    validators: list[Validator]
    lines: dict[Loc, int]
    data: dict[str, Any]

    def where(self, loc: Loc) -> str:
        line = line_of(self.lines, loc)
        return f"{self.source}:{line}" if line else self.source


def line_of(lines: dict[Loc, int], loc: Loc) -> int | None:
    while loc:
        if loc in lines:
            return lines[loc]
        loc = loc[:-1]
    return lines.get(())


def _dotted(loc: Loc) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`?" if close else f"valid keys here: {', '.join(valid)}"


class ErrorList:
    """Collects messages so one load reports every problem it can find, each with its line."""

    def __init__(self, source: str, lines: dict[Loc, int]):
        self.source, self.lines, self.messages = source, lines, []

    def add(self, loc: Loc, message: str, label: str = "") -> None:
        line = line_of(self.lines, loc)
        where = f"{self.source}:{line}" if line else self.source
        self.messages.append((line or 0, f"{where}: {label + ': ' if label else ''}{message}"))

    def add_validation(
        self,
        exc: ValidationError,
        base: Loc,
        label: str,
        valid_keys: list[str],
        written_as: dict[str, str] | None = None,
    ) -> None:
        """`written_as`: our key → the alias the design used for it, so messages and lines name what was written."""
        for error in exc.errors():
            # Pydantic adds tags such as 'function-after[...]' to loc: keep real keys and indices only.
            inner = tuple(p for p in error["loc"] if isinstance(p, int) or "[" not in p)
            if inner and written_as and inner[0] in written_as:
                inner = (written_as[inner[0]], *inner[1:])
            self.add(base + inner, _explain(error, inner, valid_keys), label)

    def raise_if_any(self) -> None:
        if self.messages:
            self.messages.sort(key=lambda item: item[0])
            raise ConfigError("\n".join(message for _, message in self.messages))


def _explain(error: dict, loc: Loc, valid_keys: list[str]) -> str:
    key = _dotted(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"unknown key `{key}`; {_suggest(str(loc[-1]), valid_keys if len(loc) == 1 else [])}"
    if kind == "missing":
        return f"`{key}` is required"
    message = error["msg"].removeprefix("Value error, ")
    if kind == "literal_error":
        return f"`{key}` is {error.get('input')!r}; allowed: {error.get('ctx', {}).get('expected', '')}"
    if kind == "finite_number":
        message = "use a finite number"
    if not loc:
        return message
    return f"`{key}` = {error.get('input')!r}: {message}"


def _column_label(raw: Any, index: int) -> str:
    name = raw.get("name") if isinstance(raw, dict) else None
    return f"column `{name}`" if isinstance(name, str) else f"columns[{index}]"


def _parse_sampler_column(raw: dict, base: Loc, label: str, errors: ErrorList) -> SamplerColumn | None:
    kind = raw["sampler"]
    cls = SAMPLERS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        close = difflib.get_close_matches(str(kind), list(SAMPLERS), n=1)
        hint = f"did you mean `{close[0]}`? " if close else ""
        errors.add(
            (*base, "sampler"), f"unknown sampler `{kind}`; {hint}use one of {', '.join(SAMPLERS)}", label
        )
        return None
    valid_keys = sorted({*SAMPLER_COLUMN_KEYS, *cls.model_fields, *cls.ALIASES})
    params = {k: v for k, v in raw.items() if k not in SAMPLER_COLUMN_KEYS}
    drop = raw.get("drop", False)
    if not isinstance(drop, bool):
        errors.add((*base, "drop"), f"`drop` = {drop!r}: use true or false", label)
    sampler = _validate_sampler(cls, params, base, label, valid_keys, errors)
    conditional: list[tuple[Condition, Sampler]] = []
    overrides_by_condition = raw.get("conditional_params", {})
    if not isinstance(overrides_by_condition, dict):
        errors.add(
            (*base, "conditional_params"), "`conditional_params` maps a condition to parameters", label
        )
        overrides_by_condition = {}
    for condition_text, overrides in overrides_by_condition.items():
        at = (*base, "conditional_params", condition_text)
        try:
            condition = Condition(str(condition_text))
        except ConfigError as exc:
            errors.add(at, f"condition: {exc}", label)
            continue
        if not isinstance(overrides, dict):
            errors.add(at, f"condition `{condition_text}` needs a mapping of {kind} parameters", label)
            continue
        # Each side may use Data Designer's names: make both ours before the overrides replace base values.
        merged = {**_canonical_params(cls, params)[0], **_canonical_params(cls, overrides)[0]}
        conditional_sampler = _validate_sampler(cls, merged, at, label, valid_keys, errors)
        if conditional_sampler is not None:
            conditional.append((condition, conditional_sampler))
    if sampler is None:
        return None
    return SamplerColumn(name=raw["name"], sampler=sampler, conditional=conditional, drop=drop is True)


def _canonical_params(cls: type[Sampler], params: dict) -> tuple[dict, dict[str, str], list[str]]:
    """Data Designer's parameter names → ours; also our key → alias written, and problems (both names given)."""
    renamed: dict = {}
    written_as: dict[str, str] = {}
    problems: list[str] = []
    for key, value in params.items():
        ours = cls.ALIASES.get(key) if isinstance(key, str) else None
        if ours is None:
            renamed[key] = value
            continue
        if ours in params:
            problems.append(f"`{key}` is Data Designer's name for `{ours}`: give one of them, not both")
            continue
        renamed[ours] = value
        written_as[ours] = key
    return renamed, written_as, problems


def _validate_sampler(
    cls: type[Sampler], params: dict, base: Loc, label: str, valid_keys: list[str], errors: ErrorList
) -> Sampler | None:
    params, written_as, problems = _canonical_params(cls, params)
    for problem in problems:
        errors.add(base, problem, label)
    try:
        sampler = cls.model_validate(params)
    except ValidationError as exc:
        errors.add_validation(exc, base, label, valid_keys, written_as)
        return None
    return None if problems else sampler


def _parse_column(raw: Any, index: int, errors: ErrorList) -> Column | None:
    base: Loc = ("columns", index)
    label = _column_label(raw, index)
    if not isinstance(raw, dict):
        errors.add(base, "a column is a mapping with `name` and one of sampler, llm, expression", label)
        return None
    if not isinstance(raw.get("name"), str) or not raw["name"]:
        errors.add(base, "`name` is required (a non-empty string)", label)
        return None
    kinds = [kind for kind in COLUMN_KINDS if kind in raw]
    if len(kinds) != 1:
        errors.add(base, "give one of sampler, llm, expression", label)
        return None
    if kinds[0] == "sampler":
        return _parse_sampler_column(raw, base, label, errors)
    if kinds[0] == "llm":
        cls = LLM_COLUMNS.get(raw["llm"]) if isinstance(raw["llm"], str) else None
        if cls is None:
            errors.add(
                (*base, "llm"), f"unknown llm kind `{raw['llm']}`; use one of {', '.join(LLM_COLUMNS)}", label
            )
            return None
    else:
        cls = ExpressionColumn
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        errors.add_validation(exc, base, label, sorted(cls.model_fields))
        return None


def _parse_validator(raw: Any, index: int, errors: ErrorList) -> Validator | None:
    base: Loc = ("validators", index)
    try:
        return Validator.model_validate(raw)
    except ValidationError as exc:
        errors.add_validation(exc, base, f"validators[{index}]", sorted(Validator.model_fields))
        return None


def parse_design(data: Any, source: str = "<design>", lines: dict[Loc, int] | None = None) -> Design:
    """Validate parsed YAML; errors name `source`, the key and, when known, its line."""
    lines = lines or {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: expected a mapping of design keys (columns, rows, output, …) at the top level"
        )
    errors = ErrorList(source, lines)
    keys = None
    try:
        keys = DesignKeys.model_validate(data)
    except ValidationError as exc:
        errors.add_validation(exc, (), "", sorted(DesignKeys.model_fields))
    # Columns and validators are checked even when a top-level key is wrong, so one load reports everything.
    raw_columns = data.get("columns") if isinstance(data.get("columns"), list) else []
    raw_validators = data.get("validators") if isinstance(data.get("validators"), list) else []
    columns = [_parse_column(raw, i, errors) for i, raw in enumerate(raw_columns)]
    validators = [_parse_validator(raw, i, errors) for i, raw in enumerate(raw_validators)]
    errors.raise_if_any()
    return Design(source, keys, columns, validators, lines, data)


def load_design(path: str | Path) -> Design:
    data, lines = load_yaml_file(path)
    if lines.repeated:  # a design is this tool's own format: nothing older to read as YAML readers do
        raise ConfigError(
            "\n".join(f"{repeated.describe(str(path))} with different values; keep one" for repeated in lines.repeated)
        )
    return parse_design(data, str(path), lines)
