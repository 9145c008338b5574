"""Row validators: checks on a finished row, and what to do when one fails (`on_fail: drop | retry:<n>`)."""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, PrivateAttr, field_validator, model_validator

from hanzo_gym.errors import ConfigError
from hanzo_gym.synth.expressions import Condition, RenderError

_ON_FAIL = re.compile(r"drop|retry:(?P<n>[0-9]+)")
MAX_RETRIES = 100


def cell_text(value: Any) -> str:
    """What text checks see: strings as they are, anything else (null included) as JSON text."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class Validator(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, allow_inf_nan=False)
    column: str
    kind: Literal["regex", "json_schema", "length", "expression", "python"]
    name: str | None = None
    pattern: str | None = None
    json_schema: dict[str, Any] | None = None
    min: int | None = None
    max: int | None = None
    expression: str | None = None
    on_fail: str = "drop"
    _regex: re.Pattern | None = PrivateAttr(None)
    _condition: Condition | None = PrivateAttr(None)
    _schema_validator: Any = PrivateAttr(None)

    @field_validator("on_fail")
    @classmethod
    def _on_fail_form(cls, value: str) -> str:
        match = _ON_FAIL.fullmatch(value)
        if match is None:
            raise ValueError(f"on_fail `{value}`: use drop or retry:<n>")
        if match["n"] is not None and int(match["n"]) > MAX_RETRIES:
            raise ValueError(
                f"on_fail `{value}`: at most retry:{MAX_RETRIES} (each retry counts against max_attempts)"
            )
        return value

    @model_validator(mode="after")
    def _needs_its_parameter(self) -> Validator:
        where = f"validator on `{self.column}`"
        if self.kind == "regex":
            if self.pattern is None:
                raise ValueError(f"{where}: regex needs `pattern`")
            try:
                self._regex = re.compile(self.pattern)
            except re.error as exc:
                raise ValueError(f"{where}: bad pattern: {exc}") from None
        elif self.kind == "json_schema":
            if self.json_schema is None:
                raise ValueError(f"{where}: needs `json_schema`")
            cls = jsonschema.validators.validator_for(self.json_schema)
            try:
                cls.check_schema(self.json_schema)
            except jsonschema.SchemaError as exc:
                raise ValueError(f"{where}: not a valid JSON Schema: {exc.message}") from None
            self._schema_validator = cls(self.json_schema)
        elif self.kind == "length":
            if self.min is None and self.max is None:
                raise ValueError(f"{where}: length needs `min` or `max`")
        elif self.kind == "expression":
            if self.expression is None:
                raise ValueError(f"{where}: needs `expression`")
            try:
                self._condition = Condition(self.expression)
            except ConfigError as exc:
                raise ValueError(f"{where}: {exc}") from None
        return self

    @property
    def label(self) -> str:
        return self.name or f"{self.kind} on {self.column}"

    @property
    def retries(self) -> int:
        match = _ON_FAIL.fullmatch(self.on_fail)
        return int(match["n"]) if match and match["n"] else 0

    def references(self) -> set[str]:
        refs = {self.column}
        if self._condition is not None:
            refs |= self._condition.variables
        return refs

    def failure(self, row: dict) -> str | None:
        """None when the row passes; otherwise why it fails."""
        value = row.get(self.column)
        if self.kind == "regex":
            return None if self._regex.search(cell_text(value)) else f"does not match /{self.pattern}/"
        if self.kind == "length":
            size = len(cell_text(value))
            low = 0 if self.min is None else self.min
            high = float("inf") if self.max is None else self.max
            return None if low <= size <= high else f"length {size} is outside {self.min}..{self.max}"
        if self.kind == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    return "is not JSON"
            error = jsonschema.exceptions.best_match(self._schema_validator.iter_errors(value))
            return None if error is None else f"does not match json_schema: {error.message}"
        if self.kind == "python":
            try:
                ast.parse(cell_text(value))
            except SyntaxError as exc:
                return f"python syntax error on line {exc.lineno}: {exc.msg}"
            except ValueError as exc:  # null bytes in the source
                return f"python syntax error: {exc}"
            return None
        try:
            return None if self._condition.holds(row) else f"`{self.expression}` is false"
        except RenderError as exc:
            return str(exc)
