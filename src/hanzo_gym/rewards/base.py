"""What a reward function sees and returns."""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from hanzo_gym.errors import GymError


@dataclass(frozen=True)
class Completion:
    prompt: str  # the prompt text
    text: str  # the decoded completion (special tokens skipped)
    answer: str | None  # the dataset's reference answer
    num_tokens: int  # completion tokens, including a generated eos
    # the prompt as chat messages when it came from a conversation (TRL then passes conversational data)
    prompt_messages: tuple[dict, ...] | None = None
    token_ids: tuple[int, ...] = ()  # the completion's tokens
    columns: Mapping[str, object] = field(default_factory=dict)  # the dataset row's other fields


class RewardFunction(ABC):
    """Scores a batch of completions, one float each. `name` is the spec as written in the config, so the
    per-function metric `rewards/<name>/mean` reads back to the config line that produced it."""

    name: str
    # Functions that wait on I/O (a server, user code) run on threads beside the others in score_completions.
    does_io: ClassVar[bool] = False

    @abstractmethod
    def __call__(self, completions: list[Completion]) -> list[float]: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def checked_scores(name: str, scores: object, expected: int) -> list[float]:
    """Scores from code we do not control (a server, user code): one finite real number per completion,
    because a NaN or a short list would silently poison the group's advantages."""
    if not isinstance(scores, Sequence) or isinstance(scores, str | bytes):
        raise GymError(f"reward {name}: expected a list of {expected} numbers, got {type(scores).__name__}")
    if len(scores) != expected:
        raise GymError(f"reward {name}: expected {expected} scores (one per completion), got {len(scores)}")
    out = []
    for i, score in enumerate(scores):
        if not isinstance(score, numbers.Real) or not math.isfinite(score):
            raise GymError(f"reward {name}: score {i} is {score!r}; expected a finite number")
        out.append(float(score))
    return out
