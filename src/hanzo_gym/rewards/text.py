"""The original's built-in rewards (spec §6), with its semantics kept exactly."""

from __future__ import annotations

import re

from hanzo_gym.errors import ConfigError
from hanzo_gym.rewards.base import Completion, RewardFunction

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")  # no nested braces, as in the original
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")  # optional thousands commas
_NUMERIC_TOLERANCE = 1e-6


def _normal(text: str) -> str:
    return " ".join(text.split()).lower()


def last_number(text: str) -> float | None:
    """The last number inside the last `\\boxed{…}` if there is one, else the last number in the text."""
    boxed = _BOXED.findall(text)
    scope = boxed[-1] if boxed else text
    numbers = _NUMBER.findall(scope)
    return float(numbers[-1].replace(",", "")) if numbers else None


class ExactMatch(RewardFunction):
    """1 when the completion equals the answer after collapsing whitespace and lowercasing; 0 without an answer."""

    name = "exact_match"

    def __call__(self, completions: list[Completion]) -> list[float]:
        return [
            1.0 if c.answer is not None and _normal(c.answer) == _normal(c.text) else 0.0 for c in completions
        ]


class NumericMatch(RewardFunction):
    """1 when the answer's and the completion's last numbers (see `last_number`) agree within 1e-6, else 0."""

    name = "numeric_match"

    def __call__(self, completions: list[Completion]) -> list[float]:
        return [self._score(c) for c in completions]

    @staticmethod
    def _score(c: Completion) -> float:
        if c.answer is None:
            return 0.0
        expected, got = last_number(c.answer), last_number(c.text)
        if expected is None or got is None:
            return 0.0
        return 1.0 if abs(expected - got) < _NUMERIC_TOLERANCE else 0.0


class FormatMatch(RewardFunction):
    """`format:<regex>`: 1 when the regex matches anywhere in the completion (`re.search`: unanchored unless
    the pattern anchors itself), else 0. Python `re` syntax; the original used Rust's `regex`, which agrees on
    the common subset (classes, quantifiers, anchors, groups) but has no look-around or backreferences."""

    def __init__(self, spec: str, pattern: str):
        self.name = spec
        try:
            self._regex = re.compile(pattern)
        except re.error as e:
            raise ConfigError(f'reward function "{spec}": bad regex {pattern!r}: {e}') from None

    def __call__(self, completions: list[Completion]) -> list[float]:
        return [1.0 if self._regex.search(c.text) else 0.0 for c in completions]


class LengthPenalty(RewardFunction):
    """`length:<n>`: 0 when the completion has at most n tokens (a generated eos counts), else -1."""

    def __init__(self, spec: str, limit: str):
        self.name = spec
        # ASCII digits only, like Rust's usize parse (Python's int() would also take "1_000" and " 5").
        if not re.fullmatch(r"\+?[0-9]+", limit):
            raise ConfigError(
                f'reward function "{spec}": length needs a non-negative integer token count, got {limit!r}'
            )
        self.limit = int(limit)

    def __call__(self, completions: list[Completion]) -> list[float]:
        return [0.0 if c.num_tokens <= self.limit else -1.0 for c in completions]
