"""Jinja templates and expressions over a row, in a sandbox.

A template that is exactly one `{{ expression }}` yields the expression's own value, so `{{ n * 2 }}` gives the
number 4 and `{{ n > 1 }}` the boolean True; any other template renders to text. Dicts and lists (structured
columns) render as JSON text inside a larger template, so a prompt shows `{"a": 1}` rather than Python's repr.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jinja2 import StrictUndefined, TemplateError, meta, nodes
from jinja2.exceptions import SecurityError

from hanzo_gym.errors import ConfigError, GymError
from hanzo_gym.synth.sandbox import LOOP_GUARD, BoundedSandbox, TooCostly, render_budget
from hanzo_gym.synth.values import json_value


class TemplateTooCostly(ConfigError):
    """A template went over a cost bound (see MAX_LENGTH and the rest): the design must change, so the run stops."""


class RenderError(GymError):
    """A template could not be evaluated for one row (a missing key, a type error): that row fails, not the run."""


def _finalize(value: Any) -> Any:
    if isinstance(value, dict | list):
        return json.dumps(json_value(value), ensure_ascii=False)
    return value


# One environment for the whole package: immutable sandbox (no attribute writes, no unsafe calls) with bounded
# cost, strict undefined (a misspelt column fails loudly instead of rendering as empty text), no autoescape
# (this is not HTML).
_ENV = BoundedSandbox(
    undefined=StrictUndefined, autoescape=False, keep_trailing_newline=True, finalize=_finalize
)
# `{{- … -}}` (whitespace control) is the same single expression as `{{ … }}`.
_SINGLE_OUTPUT = re.compile(r"^\s*\{\{-?(?P<inner>.*?)-?\}\}\s*$", re.DOTALL)


def _syntax_error(source: str, exc: TemplateError) -> ConfigError:
    where = ""
    lineno = getattr(exc, "lineno", None)
    if lineno and "\n" in source.strip():
        where = f" (template line {lineno})"
    message = getattr(exc, "message", None) or str(exc)
    return ConfigError(f"bad template {source!r}{where}: {message}")


def _top_level_names(ast: nodes.Template) -> set[str]:
    return set(meta.find_undeclared_variables(ast)) - {LOOP_GUARD}


class Template:
    """A compiled template; `variables` are the row keys it reads (`{{ facts.lang }}` reads `facts`)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._native = None
        try:
            ast = _ENV.parse(source)
            self._template = _ENV.from_string(source)
            match = _SINGLE_OUTPUT.match(source)
            # Surrounding whitespace (a YAML block scalar's newline) does not turn an expression into text.
            body = _ENV.parse(source.strip()).body
            is_single_expression = (
                match is not None
                and len(body) == 1
                and isinstance(body[0], nodes.Output)
                and len(body[0].nodes) == 1
                and not isinstance(body[0].nodes[0], nodes.TemplateData)
            )
            if is_single_expression:
                self._native = _ENV.compile_expression(match["inner"], undefined_to_none=False)
        except TemplateError as exc:
            raise _syntax_error(source, exc) from None
        self.variables = _top_level_names(ast)

    def render_text(self, row: dict) -> str:
        """The template as text (prompts)."""
        return _guard(lambda: self._template.render(row), self.source)

    def evaluate(self, row: dict) -> Any:
        """The expression's own value for a single `{{ … }}` template, else the rendered text (expression columns)."""
        if self._native is None:
            return self.render_text(row)
        value = _guard(lambda: self._native(row), self.source)
        if isinstance(value, StrictUndefined):
            # compile_expression returns an undefined object instead of raising; touching it raises the message.
            return _guard(lambda: str(value), self.source)
        return value


class Condition:
    """A bare expression (`score >= 4`, braces optional) whose truthiness decides something per row."""

    def __init__(self, source: str) -> None:
        self.source = source
        inner = source.strip()
        match = _SINGLE_OUTPUT.match(inner)
        if match is not None:
            inner = match["inner"]
        try:
            self.variables = _top_level_names(_ENV.parse("{{ " + inner + " }}"))
            self._compiled = _ENV.compile_expression(inner, undefined_to_none=False)
        except TemplateError as exc:
            raise _syntax_error(source, exc) from None

    def holds(self, row: dict) -> bool:
        value = _guard(lambda: self._compiled(row), self.source)
        if isinstance(value, StrictUndefined):
            _guard(lambda: str(value), self.source)
        return bool(value)


def _guard(thunk, source: str) -> Any:
    try:
        with render_budget():
            return thunk()
    except TooCostly as exc:
        raise TemplateTooCostly(f"template {source!r} is too costly: {exc}; make it simpler") from None
    except (RecursionError, MemoryError):
        raise TemplateTooCostly(
            f"template {source!r} is too costly: it recurses or allocates without end; make it simpler"
        ) from None
    except SecurityError as exc:
        # The design asks for something the sandbox forbids: every row would hit it, so stop the run.
        raise ConfigError(f"template {source!r} does something the sandbox forbids: {exc}") from None
    except (
        TemplateError,
        TypeError,
        ValueError,
        ArithmeticError,  # ZeroDivisionError, and OverflowError from float arithmetic (`1e308 * 10 ** 10`)
        KeyError,
        IndexError,
        NameError,  # Jinja's constant folding can emit a name it never defines (`'nan' | float`)
        AttributeError,
    ) as exc:
        raise RenderError(f"template {source!r}: {exc}") from None
