"""The Jinja sandbox that synth templates run in: Jinja's immutable sandbox (no attribute writes, no unsafe calls)
plus bounds on what one render may cost, since a design is text someone hands us."""

from __future__ import annotations

import contextlib
import functools
import re
import string
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace as JinjaNamespace
from jinja2.utils import _PassArg

# What one template may cost. A design is text someone hands us: without bounds `{{ 7 ** 7777777777 }}` hangs
# (Jinja folds constants when it compiles), `'a' * 10**11` or `'a' | center(10**11)` takes all memory and
# two nested loops over big ranges run for hours.
MAX_LENGTH = 1_000_000  # characters or items in any one value a template makes
MAX_INT_BITS = 100_000  # about 30,000 digits
MAX_LOOP_STEPS = 1_000_000  # iterations of all `{% for %}` loops in one render
MAX_CALLS = 100_000  # function, method and macro calls in one render


class TooCostly(SecurityError):
    """A template asks for more work or memory than a row's template may take; every row would, so the run stops."""


@dataclass
class _Budget:
    loop_steps: int = MAX_LOOP_STEPS
    calls: int = MAX_CALLS


# The budget of the render in progress; None while Jinja compiles (constant folding runs filters then).
_BUDGET: ContextVar[_Budget | None] = ContextVar("hanzo_gym_template_budget", default=None)
LOOP_GUARD = "_hanzo_gym_loop_steps"


def _length_of(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes | list | tuple | dict | set | frozenset) else 0


def _check_length(length: int, what: str) -> None:
    if length > MAX_LENGTH:
        raise TooCostly(f"{what} would hold {length:,} characters or items (at most {MAX_LENGTH:,})")


def _check_bits(bits: int, what: str) -> None:
    if bits > MAX_INT_BITS:
        raise TooCostly(f"{what} would be an integer of about {bits:,} bits (at most {MAX_INT_BITS:,})")


def _check_int(value: Any, what: str) -> None:
    if isinstance(value, int):
        _check_bits(value.bit_length(), what)


def _check_result(value: Any, what: str) -> Any:
    _check_length(_length_of(value), what)
    return value


def _bounded_range(*args: int) -> range:
    numbers = range(*args)
    _check_length(len(numbers), f"range({', '.join(map(str, args))})")
    return numbers


_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?[diouxXeEfFgGcrsa%]")
_FORMAT_NUMBER = re.compile(r"\d+")


def _check_printf(template: str, args: Any) -> None:
    """`'%99999999999d' % 1` pads to 100 GB: refuse widths and precisions above MAX_LENGTH."""
    values = args if isinstance(args, tuple) else (args,)
    for field in _PRINTF_FIELD.finditer(template):
        for size in field.groups():
            if size == "*":
                for value in values:
                    if isinstance(value, int):
                        _check_length(abs(value), f"`{field[0]}`")
            elif size:
                _check_length(int(size), f"`{field[0]}`")


def _check_str_format(template: str, args: tuple, kwargs: dict) -> None:
    """`'{:>99999999999}'.format(1)`: the same bound on widths in str.format fields (nested ones included)."""
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError:
        return  # str.format reports the malformed template itself
    for _, name, spec, _ in fields:
        if name is None or not spec:
            continue
        for size in _FORMAT_NUMBER.findall(spec):
            _check_length(int(size), f"format field `{{{name}:{spec}}}`")
        if "{" in spec:  # a width taken from the arguments
            for value in (*args, *kwargs.values()):
                if isinstance(value, int):
                    _check_length(abs(value), f"format field `{{{name}:{spec}}}`")


def _check_str_method(text: str, name: str, args: tuple, kwargs: dict) -> None:
    """Sizes of what str methods make, judged before they make it."""
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        _check_length(args[0], f"str.{name}({args[0]})")
    elif name == "expandtabs":
        tabsize = args[0] if args and isinstance(args[0], int) else kwargs.get("tabsize", 8)
        if isinstance(tabsize, int):
            _check_length(len(text) + text.count("\t") * tabsize, f"str.expandtabs({tabsize})")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _check_replace(text, args[0], args[1], f"str.replace({args[0]!r}, …)")
    elif name in ("format", "format_map"):
        _check_str_format(
            text,
            args,
            kwargs if name == "format" else (args[0] if args and isinstance(args[0], dict) else {}),
        )
    elif name == "join" and args and isinstance(args[0], list | tuple):
        _check_join(text, args[0], "str.join")


def _check_replace(text: str, old: str, new: str, what: str) -> None:
    occurrences = text.count(old) if old else len(text) + 1
    _check_length(len(text) + occurrences * max(0, len(new) - len(old)), what)


def _check_join(separator: str, items: list | tuple, what: str) -> None:
    _check_length(sum(map(_length_of, items)) + len(separator) * max(0, len(items) - 1), what)


def _bounded_filter(name: str, function: Callable) -> Callable:
    """A built-in filter that refuses sizes above MAX_LENGTH, before making them where they come from an argument."""
    skip = (
        1 if _PassArg.from_obj(function) is not None else 0
    )  # the environment or context Jinja passes first

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        value, params = (args[skip], args[skip + 1 :]) if len(args) > skip else (None, ())
        if name in ("center", "indent", "wordwrap", "batch", "slice", "truncate"):
            for size in (*params, *kwargs.values()):
                if isinstance(size, int) and not isinstance(size, bool):
                    _check_length(abs(size), f"`{name}({size})`")
        elif name == "format" and isinstance(value, str):
            _check_printf(value, params or tuple(kwargs.values()))
        elif name == "replace" and isinstance(value, str) and len(params) >= 2:
            _check_replace(value, str(params[0]), str(params[1]), "`replace`")
        elif name == "join" and isinstance(value, list | tuple):
            _check_join(str(params[0]) if params else "", value, "`join`")
        elif name == "sum" and not isinstance(
            kwargs.get("start", params[1] if len(params) > 1 else 0), int | float
        ):
            raise TooCostly("`sum` adds numbers only here (summing lists or text is quadratic)")
        return _check_result(function(*args, **kwargs), f"`{name}`")

    return bounded


class Namespace(JinjaNamespace):
    """Jinja's `namespace()`, whose attributes a loop may grow: here each assignment is held to MAX_LENGTH."""

    def __setitem__(self, name: str, value: Any) -> None:
        _check_result(value, f"namespace attribute `{name}`")
        _check_int(value, f"namespace attribute `{name}`")
        super().__setitem__(name, value)


def _count_loop_steps(iterable: Any) -> Iterator:
    budget = _BUDGET.get()
    for item in iterable:
        if budget is not None:
            budget.loop_steps -= 1
            if budget.loop_steps < 0:
                raise TooCostly(f"its loops would run more than {MAX_LOOP_STEPS:,} steps")
        yield item


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox plus bounds on cost (see MAX_LENGTH and the rest above)."""

    # Intercepted operators are never folded at compile time and run through call_binop at render time.
    intercepted_binops = frozenset({"**", "*", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals.update(range=_bounded_range, namespace=Namespace, **{LOOP_GUARD: _count_loop_steps})
        del self.globals["lipsum"]  # lorem ipsum of any length: no design needs it
        self.filters = {name: _bounded_filter(name, function) for name, function in self.filters.items()}

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        numbers = (int, float)
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            # at least (bits of |left| - 1) bits per unit of the exponent
            _check_bits(right * max(0, abs(left).bit_length() - 1), f"{left} ** {right}")
        elif operator == "*":
            if isinstance(left, int) and isinstance(right, int):
                _check_bits(left.bit_length() + right.bit_length(), "the product")
            elif isinstance(right, int) and not isinstance(left, numbers):
                _check_length(_length_of(left) * right, "the repetition")
            elif isinstance(left, int) and not isinstance(right, numbers):
                _check_length(_length_of(right) * left, "the repetition")
        elif operator == "+" and not isinstance(left, numbers):
            _check_length(_length_of(left) + _length_of(right), "the sum")
        elif operator == "%" and isinstance(left, str):
            _check_printf(left, right)
        return super().call_binop(context, operator, left, right)

    def call(self, context: Any, callee: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            budget.calls -= 1
            if budget.calls < 0:
                raise TooCostly(f"it would make more than {MAX_CALLS:,} calls")
        method = getattr(callee, "__wrapped__", callee)  # the sandbox wraps str.format
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            _check_str_method(owner, getattr(method, "__name__", ""), args, kwargs)
        result = super().call(context, callee, *args, **kwargs)
        return _check_result(result, f"`{getattr(method, '__name__', 'the call')}(…)`")

    def _generate(self, source: nodes.Template, *args: Any, **kwargs: Any) -> str:
        # Every `{% for %}` iterates through the step counter, so nested loops cannot multiply without bound.
        for loop in source.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.Name(LOOP_GUARD, "load"), [loop.iter], [], None, None).set_lineno(
                loop.lineno
            )
        return super()._generate(source, *args, **kwargs)


@contextlib.contextmanager
def render_budget() -> Iterator[None]:
    """Count one render's loop steps and calls against MAX_LOOP_STEPS and MAX_CALLS."""
    token = _BUDGET.set(_Budget())
    try:
        yield
    finally:
        _BUDGET.reset(token)
