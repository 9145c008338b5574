"""Column kinds and how each fills its cell(s) of a row.

Every column has a `name`, may set `drop: true` (generated and usable by later columns, left out of the output),
and is exactly one of: a sampler, an expression, or an LLM column (`text`, `code`, `structured`, `judge`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import jsonschema
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from hanzo_gym.errors import ConfigError, GymError
from hanzo_gym.synth.expressions import Condition, RenderError, Template
from hanzo_gym.synth.extract import ParseFailed, extract_code, extract_json_object
from hanzo_gym.synth.llm import CallFailed, ChatClient
from hanzo_gym.synth.samplers import Sampler, SamplerError
from hanzo_gym.synth.values import NotJSON, json_value

DEFAULT_JUDGE_SYSTEM = "You are a strict, impartial judge. Score only against the rubric."


class ColumnFailed(GymError):
    """A column produced no usable value for this row; the row is counted as failed in that column."""

    def __init__(self, column: str, reason: str) -> None:
        super().__init__(f"column `{column}`: {reason}")
        self.column = column
        self.reason = reason


@dataclass
class RowContext:
    """What a column needs besides the row: the row's own random generator and the model clients."""

    rng: np.random.Generator
    clients: dict[str, ChatClient] = field(default_factory=dict)


def _compile(source: str | None) -> str | None:
    if source is not None:
        try:
            Template(source)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    return source


@dataclass
class SamplerColumn:
    name: str
    sampler: Sampler
    # (condition, sampler with the condition's parameters); the first condition that holds wins.
    conditional: list[tuple[Condition, Sampler]] = field(default_factory=list)
    drop: bool = False
    model: ClassVar[None] = None

    def references(self) -> set[str]:
        refs = set(self.sampler.references())
        for condition, sampler in self.conditional:
            refs |= condition.variables | sampler.references()
        return refs

    def output_keys(self) -> list[str]:
        return [self.name]

    async def fill(self, row: dict, ctx: RowContext) -> None:
        sampler = self.sampler
        try:
            for condition, conditional_sampler in self.conditional:
                if condition.holds(row):
                    sampler = conditional_sampler
                    break
            row[self.name] = json_value(sampler.sample(ctx.rng, row))
        except (SamplerError, RenderError) as exc:
            raise ColumnFailed(self.name, str(exc)) from None
        except NotJSON as exc:
            raise ColumnFailed(self.name, f"the value is not JSON: {exc}") from None


class _ColumnModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, allow_inf_nan=False)
    name: str
    drop: bool = False

    def output_keys(self) -> list[str]:
        return [self.name]


def _cast(value: Any, dtype: str) -> Any:
    # Data Designer's casting rules, so designs ported from it keep their meaning.
    if dtype == "str":
        return (
            value
            if isinstance(value, str)
            else json.dumps(json_value(value))
            if isinstance(value, dict | list | tuple)
            else str(value)
        )
    if dtype == "float":
        return float(value)
    if dtype == "int":
        return int(float(value))
    if isinstance(value, bool):
        return value
    try:
        return bool(int(float(value)))
    except (TypeError, ValueError):
        return str(value).strip().lower() == "true"


class ExpressionColumn(_ColumnModel):
    model: ClassVar[None] = None
    expression: str
    dtype: Literal["int", "float", "str", "bool"] | None = None
    _template: Template = PrivateAttr()

    @field_validator("expression")
    @classmethod
    def _template_compiles(cls, source: str) -> str:
        return _compile(source)

    def model_post_init(self, context: Any) -> None:
        self._template = Template(self.expression)

    def references(self) -> set[str]:
        return set(self._template.variables)

    async def fill(self, row: dict, ctx: RowContext) -> None:
        try:
            value = self._template.evaluate(row)
            row[self.name] = json_value(value if self.dtype is None else _cast(value, self.dtype))
        except RenderError as exc:
            raise ColumnFailed(self.name, str(exc)) from None
        except NotJSON as exc:
            raise ColumnFailed(
                self.name, f"`{self.expression}` gives a value that is not JSON: {exc}"
            ) from None
        except (TypeError, ValueError) as exc:
            raise ColumnFailed(self.name, f"cannot make {value!r} a {self.dtype}: {exc}") from None


class LlmColumn(_ColumnModel):
    prompt: str
    system: str | None = None
    model: str | None = None  # alias in `models:`; may be left out when the design names one model
    attempts: int = Field(3, ge=1)
    _prompt: Template = PrivateAttr()
    _system: Template | None = PrivateAttr(None)

    @field_validator("prompt", "system")
    @classmethod
    def _templates_compile(cls, source: str | None) -> str | None:
        return _compile(source)

    def model_post_init(self, context: Any) -> None:
        self._prompt = Template(self.prompt)
        self._system = None if self.system is None else Template(self.system)

    def references(self) -> set[str]:
        refs = set(self._prompt.variables)
        if self._system is not None:
            refs |= self._system.variables
        return refs

    def _messages(self, row: dict, suffix: str = "", default_system: str | None = None) -> list[dict]:
        system = self._system.render_text(row) if self._system is not None else default_system
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": self._prompt.render_text(row) + suffix})
        return messages

    async def fill(self, row: dict, ctx: RowContext) -> None:
        client = ctx.clients[self.model]
        try:
            messages = self._build_messages(row)
        except RenderError as exc:
            raise ColumnFailed(self.name, str(exc)) from None
        reason = ""
        for _ in range(self.attempts):
            try:
                reply = await client.chat(messages, self._response_format())
            except CallFailed as exc:
                raise ColumnFailed(self.name, str(exc)) from None
            try:
                row.update(self._parse(reply))
                return
            except ParseFailed as exc:
                reason = str(exc)
        raise ColumnFailed(self.name, f"{reason} (after {self.attempts} attempts)")

    def _build_messages(self, row: dict) -> list[dict]:
        return self._messages(row)

    def _response_format(self) -> dict | None:
        return None

    def _parse(self, reply: str) -> dict:
        return {self.name: reply}


class TextColumn(LlmColumn):
    llm: Literal["text"]


class CodeColumn(LlmColumn):
    llm: Literal["code"]
    language: str = "python"

    def _build_messages(self, row: dict) -> list[dict]:
        fence = self.language.split(":")[0]
        return self._messages(
            row, f"\n\nRespond with {self.language} code only, in a single ```{fence} fenced block."
        )

    def _parse(self, reply: str) -> dict:
        return {self.name: extract_code(reply, self.language)}


def _schema_name(column: str) -> str:
    # response_format names allow only letters, digits, '_' and '-'.
    return re.sub(r"[^A-Za-z0-9_-]", "_", column)[:64] or "row"


def _check_schema(schema: dict) -> dict:
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
    return schema


class StructuredColumn(LlmColumn):
    llm: Literal["structured"]
    json_schema: dict[str, Any]

    @field_validator("json_schema")
    @classmethod
    def _valid_schema(cls, schema: dict) -> dict:
        return _check_schema(schema)

    def _build_messages(self, row: dict) -> list[dict]:
        schema = json.dumps(self.json_schema, separators=(",", ":"))
        return self._messages(
            row,
            f"\n\nRespond with one JSON object matching this JSON Schema, inside a ```json fence:\n{schema}",
        )

    def _response_format(self) -> dict | None:
        return {
            "type": "json_schema",
            "json_schema": {"name": _schema_name(self.name), "schema": self.json_schema, "strict": True},
        }

    def _parse(self, reply: str) -> dict:
        value = extract_json_object(reply)
        checker = jsonschema.validators.validator_for(self.json_schema)(self.json_schema)
        error = jsonschema.exceptions.best_match(checker.iter_errors(value))
        if error is not None:
            where = "/".join(str(p) for p in error.path) or "(top level)"
            raise ParseFailed(f"reply does not match json_schema at {where}: {error.message}")
        return {self.name: value}


class JudgeColumn(LlmColumn):
    """Scores listed columns against a rubric; writes `<name>` (int score) and `<name>_reasoning`."""

    llm: Literal["judge"]
    rubric: dict[int, str]
    columns: list[str]

    @field_validator("rubric", mode="before")
    @classmethod
    def _integer_keys(cls, rubric: Any) -> Any:
        # `"4": good` in YAML is a string key; the score it names is still 4.
        if isinstance(rubric, dict):
            return {
                int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k: v
                for k, v in rubric.items()
            }
        return rubric

    @model_validator(mode="after")
    def _complete(self) -> JudgeColumn:
        if not self.rubric or not self.columns:
            raise ValueError("judge needs a rubric and columns")
        return self

    @property
    def bounds(self) -> tuple[int, int]:
        return min(self.rubric), max(self.rubric)

    def references(self) -> set[str]:
        return super().references() | set(self.columns)

    def output_keys(self) -> list[str]:
        return [self.name, f"{self.name}_reasoning"]

    def _build_messages(self, row: dict) -> list[dict]:
        lo, hi = self.bounds
        parts = [f"\n\n{col}:\n{_as_text(row.get(col))}" for col in self.columns]
        parts.append("\n\nRubric:\n" + "".join(f"{k}: {self.rubric[k]}\n" for k in sorted(self.rubric)))
        parts.append(
            f'\nRespond with one JSON object {{"score": <integer {lo}-{hi}>, "reasoning": "<why>"}} '
            "inside a ```json fence."
        )
        return self._messages(row, "".join(parts), default_system=DEFAULT_JUDGE_SYSTEM)

    def _response_format(self) -> dict | None:
        lo, hi = self.bounds
        schema = {
            "type": "object",
            "properties": {
                "score": {"type": "integer", "minimum": lo, "maximum": hi},
                "reasoning": {"type": "string"},
            },
            "required": ["score", "reasoning"],
            "additionalProperties": False,
        }
        return {
            "type": "json_schema",
            "json_schema": {"name": _schema_name(self.name), "schema": schema, "strict": True},
        }

    def _parse(self, reply: str) -> dict:
        verdict = extract_json_object(reply)
        score = _integral(verdict.get("score"))
        lo, hi = self.bounds
        if score is None or not lo <= score <= hi:
            raise ParseFailed(f"score {verdict.get('score')!r} is not an integer in {lo}..{hi}")
        reasoning = verdict.get("reasoning")
        reasoning = (
            "" if reasoning is None else reasoning if isinstance(reasoning, str) else json.dumps(reasoning)
        )
        return {self.name: score, f"{self.name}_reasoning": reasoning}


def _integral(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


LLM_COLUMNS: dict[str, type[LlmColumn]] = {
    "text": TextColumn,
    "code": CodeColumn,
    "structured": StructuredColumn,
    "judge": JudgeColumn,
}

Column = SamplerColumn | ExpressionColumn | TextColumn | CodeColumn | StructuredColumn | JudgeColumn
