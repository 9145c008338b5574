"""Reward functions for GRPO, named in the config by spec strings (`trl.reward_funcs`):

- `exact_match`, `numeric_match`, `format:<regex>`, `length:<n>`: the original's semantics (text.py);
- `math_equal`: mathematical equivalence of final answers (math_equal.py);
- `http:<url>`, or a bare `http://…` / `https://…` URL: a reward server (remote.py);
- `python:module:function`: user code (user_code.py);
- `module.function`: user code with TRL's reward-function signature, as Axolotl's configs name it (user_code.py).

score_completions combines them as TRL does: total = Σ weight_f · score_f (weights default to 1.0), with the
raw per-function scores returned by name for the `rewards/<name>/mean` metrics.
"""

from __future__ import annotations

import traceback
from concurrent.futures import Future, ThreadPoolExecutor

from hanzo_gym.errors import ConfigError, GymError
from hanzo_gym.rewards.base import Completion, RewardFunction
from hanzo_gym.rewards.math_equal import MathEqual
from hanzo_gym.rewards.remote import HttpReward
from hanzo_gym.rewards.text import ExactMatch, FormatMatch, LengthPenalty, NumericMatch
from hanzo_gym.rewards.user_code import PythonReward, TrlReward, is_dotted_name

__all__ = ["Completion", "RewardFunction", "RewardFunctionFailed", "parse_reward", "score_completions"]


class RewardFunctionFailed(GymError):
    """A reward function raised: one line saying which and where (a run cannot go on without its scores)."""

    def __init__(self, func: RewardFunction, error: Exception):
        frames = traceback.extract_tb(error.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        super().__init__(
            f"reward function {func.name} raised {type(error).__name__}: {error}{where}; fix the reward "
            "function and run again"
        )


def _scores_of(func: RewardFunction, completions: list[Completion]) -> list[float]:
    try:
        return func(completions)
    except GymError:
        raise
    except Exception as error:
        raise RewardFunctionFailed(func, error) from error


_PLAIN = {"exact_match": ExactMatch, "numeric_match": NumericMatch, "math_equal": MathEqual}


def parse_reward(spec: str) -> RewardFunction:
    """The reward function a spec names; ConfigError naming the spec when it is unknown or malformed."""
    if spec in _PLAIN:
        return _PLAIN[spec]()
    kind, sep, rest = spec.partition(":")
    if spec.startswith(("http://", "https://")):
        return HttpReward(spec, spec)
    if sep and kind == "http":
        return HttpReward(spec, rest)
    if sep and kind == "format":
        return FormatMatch(spec, rest)
    if sep and kind == "length":
        return LengthPenalty(spec, rest)
    if sep and kind == "python":
        return PythonReward(spec, rest)
    if not sep and is_dotted_name(spec):
        return TrlReward(spec)
    raise ConfigError(
        f'unknown reward function "{spec}"; use exact_match, numeric_match, math_equal, format:<regex>, '
        "length:<n>, http:<url>, python:<module>:<function> or <module>.<function> (TRL's signature)"
    )


def _unique_names(funcs: list[RewardFunction]) -> list[str]:
    """Names as keys: a spec listed twice (say with two weights) gets `#2`, so neither score is lost."""
    seen: dict[str, int] = {}
    names = []
    for func in funcs:
        seen[func.name] = seen.get(func.name, 0) + 1
        names.append(func.name if seen[func.name] == 1 else f"{func.name}#{seen[func.name]}")
    return names


def score_completions(
    funcs: list[RewardFunction], weights: list[float] | None, completions: list[Completion]
) -> tuple[list[float], dict[str, list[float]]]:
    """Total weighted reward per completion and each function's raw scores, keyed by name in `funcs` order.
    Functions that do I/O run on threads while the others run here, so a slow server costs one wait."""
    if weights is None:
        weights = [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise GymError(f"{len(weights)} reward weights for {len(funcs)} reward functions; give one each")
    with ThreadPoolExecutor(max_workers=max(1, sum(f.does_io for f in funcs))) as pool:
        pending: list[Future[list[float]] | None] = [
            pool.submit(_scores_of, f, completions) if f.does_io else None for f in funcs
        ]
        scores = [
            _scores_of(f, completions) if p is None else None for f, p in zip(funcs, pending, strict=True)
        ]
        scores = [s if p is None else p.result() for s, p in zip(scores, pending, strict=True)]
    by_name: dict[str, list[float]] = {}
    for name, func, func_scores in zip(_unique_names(funcs), funcs, scores, strict=True):
        if len(func_scores) != len(completions):
            raise GymError(
                f"reward {func.name} returned {len(func_scores)} scores for {len(completions)} completions"
            )
        by_name[name] = func_scores
    totals = [
        sum(w * func_scores[i] for w, func_scores in zip(weights, by_name.values(), strict=True))
        for i in range(len(completions))
    ]
    return totals, by_name
