"""`math_equal`: 1 when the completion's final answer is mathematically equal to the reference answer.

Backend: sympy, always (math-verify is not a dependency, and a reward whose meaning changed with whatever happens
to be installed would make runs incomparable). sympy's own LaTeX parser needs antlr4, so a small converter
handles the LaTeX that answers actually use: `\\frac{a}{b}` (also `\\dfrac`, `\\tfrac`, `\\frac12`),
`\\sqrt{x}`, `\\sqrt[n]{x}`, `\\cdot`, `\\times`, `\\div`, `\\pi`, `^`, `$…$`, `\\left`/`\\right`, spacing
commands, `\\text{…}` units (dropped) and degree signs (dropped).

The final answer of a text is the contents of its last `\\boxed{…}` (nested braces allowed), else what
follows its last `####` (GSM8K), else the whole text. If that is prose rather than an expression, its last
number-like span (`\\frac{a}{b}`, `a/b`, a decimal, a number with thousands commas, a percentage) is used.
In an equation (`x = 5`) the right-hand side is the answer. A percentage equals both its number and its
fraction (`50%` matches `50` and `0.5`), because datasets write percent answers either way. Two answers
that are the same string (whitespace aside) are equal even when neither parses (`\\boxed{Paris}` vs `Paris`).
Not handled: tuples, sets, intervals, matrices, inequalities, units conversion.
"""

from __future__ import annotations

import functools
import math
import re

import sympy
from sympy.parsing.sympy_parser import (
    auto_number,
    auto_symbol,
    convert_xor,
    implicit_multiplication,
    parse_expr,
    rationalize,
)

from hanzo_gym.rewards.base import Completion, RewardFunction

_MAX_EXPRESSION_CHARS = 200
# An exact result with more digits than this is refused: completions are untrusted text, and `9^9^9` would
# otherwise hang the trainer computing a power.
_MAX_RESULT_DIGITS = 10_000
# Decimals become exact rationals (`rationalize`), so 0.5 == 1/2 exactly; products are implicit (`2\sqrt{2}`).
_TRANSFORMATIONS = (auto_symbol, auto_number, rationalize, convert_xor, implicit_multiplication)
# parse_expr evaluates Python: the names it can reach are only these, and the text is whitelisted first.
_PARSER_NAMES = ["Integer", "Float", "Rational", "Symbol", "Mul", "Add", "Pow", "sqrt", "pi"]
_ALLOWED_TEXT = re.compile(r"[0-9A-Za-z.+\-*/() ]*")
_ALLOWED_WORDS = {"sqrt", "pi"}

_NUMBER_LIKE = re.compile(
    r"-?\s*\\[dt]?frac\s*\{[^{}]*\}\s*\{[^{}]*\}"
    r"|-?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*\d+(?:,\d{3})*(?:\.\d+)?)?(?:\s*\\?%)?"
)
_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d])")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")
_DROPPED_GROUPS = {"text", "textbf", "textrm", "mathrm", "mbox", "unit"}
_DROPPED_COMMANDS = {"left", "right", "displaystyle", "quad", "qquad"}
_OPERATORS = {"cdot": "*", "times": "*", "ast": "*", "div": "/"}
_UNICODE = str.maketrans({"−": "-", "×": "*", "÷": "/", "·": "*"})


class _Unparseable(Exception):
    pass


def _last_boxed(text: str) -> str | None:
    """Contents of the last balanced `\\boxed{…}` / `\\fbox{…}`; a truncated one is skipped."""
    for match in reversed(list(re.finditer(r"\\(?:boxed|fbox)\s*\{", text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def final_answer(text: str) -> str:
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    return text.strip()


def _argument(s: str, i: int) -> tuple[str, int]:
    """A LaTeX macro argument at s[i:]: a braced group or a single character (`\\frac12`)."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s) or s[i] == "}":
        raise _Unparseable
    if s[i] != "{":
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1 : j], j + 1
    raise _Unparseable


def _latex_to_python(s: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(s):
        ch = s[i]
        if ch != "\\":
            out.append({"{": "(", "}": ")", "^": "**"}.get(ch, ch))
            i += 1
            continue
        command = re.match(r"\\([A-Za-z]+|.)", s[i:])
        if command is None:
            raise _Unparseable
        name, i = command.group(1), i + command.end()
        if name in {"frac", "dfrac", "tfrac"}:
            numerator, i = _argument(s, i)
            denominator, i = _argument(s, i)
            out.append(f"(({_latex_to_python(numerator)})/({_latex_to_python(denominator)}))")
        elif name == "sqrt":
            index = None
            if s.startswith("[", i):
                close = s.find("]", i)
                if close < 0:
                    raise _Unparseable
                index, i = s[i + 1 : close], close + 1
            radicand, i = _argument(s, i)
            inner = _latex_to_python(radicand)
            out.append(
                f" sqrt({inner})" if index is None else f"(({inner})**(1/({_latex_to_python(index)})))"
            )
        elif name in {"boxed", "fbox"}:
            group, i = _argument(s, i)
            out.append(f"({_latex_to_python(group)})")
        elif name in _DROPPED_GROUPS:
            _, i = _argument(s, i)
        elif name in _OPERATORS:
            out.append(_OPERATORS[name])
        elif name == "pi":
            out.append(" pi ")
        elif name == "%":
            out.append("%")
        elif name in _DROPPED_COMMANDS or name in {",", ";", ":", "!", " "}:
            pass
        else:  # \infty, \{, \cup, ...: outside what this reward compares
            raise _Unparseable
    return "".join(out)


def _bounded_size(expr: sympy.Expr) -> bool:
    """Whether every power in the unevaluated tree has an exact value of reasonable size (innermost first,
    so each check only evaluates powers already known to be small)."""
    for node in sympy.postorder_traversal(expr):
        if not isinstance(node, sympy.Pow) or node.free_symbols:
            continue
        base, exponent = abs(sympy.N(node.base)), abs(sympy.N(node.exp))
        if base == 0 or not (base.is_finite and exponent.is_finite):
            continue
        digits = abs(float(sympy.log(base) / math.log(10))) * float(exponent)
        if digits > _MAX_RESULT_DIGITS:
            return False
    return True


def _parse_expression(text: str) -> sympy.Expr | None:
    if len(text) > _MAX_EXPRESSION_CHARS or not _ALLOWED_TEXT.fullmatch(text) or not text.strip():
        return None
    if any(len(word) > 1 and word not in _ALLOWED_WORDS for word in re.findall(r"[A-Za-z]+", text)):
        return None  # a word such as "apples": prose, not an expression
    if re.search(r"[A-Za-z)]\s*\.|\.\s*[A-Za-z(]", text):
        return None  # attribute access (`x.n()`): parse_expr runs Python, so only arithmetic may pass
    if re.search(r"[\d.][eE][+-]?\d{4,}", text):
        return None  # scientific notation with a huge exponent would be materialised as an exact integer
    names: dict[str, object] = {name: getattr(sympy, name) for name in _PARSER_NAMES}
    try:
        unevaluated = parse_expr(text, dict(names), _TRANSFORMATIONS, dict(names), evaluate=False)
        if not _bounded_size(unevaluated):
            return None
        expr = sympy.sympify(parse_expr(text, dict(names), _TRANSFORMATIONS, dict(names)))
    # sympy raises many types (SyntaxError, TokenError, TypeError, ...) for text that is not an expression.
    except Exception:  # noqa: BLE001
        return None
    if not isinstance(expr, sympy.Expr) or expr.has(sympy.zoo, sympy.nan, sympy.oo, -sympy.oo):
        return None
    return expr


@functools.lru_cache(maxsize=1024)  # a group's completions share one reference answer
def _values(answer: str) -> tuple[sympy.Expr, ...]:
    """The values an answer may stand for: one, or two for a percentage; empty when it does not parse."""
    candidates = [answer]
    if re.search(r"[A-Za-z]{2,}", re.sub(r"\\[A-Za-z]+", "", answer)):
        # Prose ("so the total is 72 apples"): its last number is the answer. Not for unparseable maths
        # such as `\{1, 2\}` or `9^9^9`, whose last number is not what the text means.
        candidates += [m.group(0) for m in _NUMBER_LIKE.finditer(answer)][-1:]
    for candidate in candidates:
        text = _DEGREES.sub("", candidate.translate(_UNICODE)).replace("$", "")
        text = _THOUSANDS.sub(lambda m: m.group(0).replace(",", ""), text)
        try:
            text = _latex_to_python(text)
        except _Unparseable:
            continue
        text = text.rsplit("=", 1)[-1].strip().rstrip(".").strip()
        percent = text.endswith("%")
        expr = _parse_expression(text.removesuffix("%").strip())
        if expr is not None:
            return (expr / 100, expr) if percent else (expr,)
    return ()


def _equal(a: sympy.Expr, b: sympy.Expr) -> bool:
    difference = a - b
    if difference == 0 or sympy.simplify(difference) == 0:
        return True
    if difference.free_symbols:
        return False
    # simplify cannot prove every identity of constants (nested radicals); 50 digits separates a true
    # identity from a rounded decimal such as 0.3333 vs 1/3.
    return abs(sympy.N(difference, 50)) < sympy.Float(1e-30)


def _normal_string(text: str) -> str:
    return re.sub(r"\s+", "", text).replace("$", "").rstrip(".")


def math_equal(completion: str, answer: str) -> bool:
    expected, got = final_answer(answer), final_answer(completion)
    if not got:
        return False
    if _normal_string(expected) == _normal_string(got):
        return True
    return any(_equal(a, b) for a in _values(expected) for b in _values(got))


class MathEqual(RewardFunction):
    """1 when the completion's final answer is mathematically equal to the answer (see the module doc), else 0;
    0 without an answer."""

    name = "math_equal"

    def __call__(self, completions: list[Completion]) -> list[float]:
        return [1.0 if c.answer is not None and math_equal(c.text, c.answer) else 0.0 for c in completions]
