"""Rewards written by the user, in two forms:

- `python:module:function`: `function(completions: list[Completion]) -> list[float]`, called once per batch
  with every completion of the step (so it can batch its own work), returning one finite number per
  completion in the same order;
- `module.function` (TRL's and Axolotl's form, e.g. `rewards.accuracy_reward`): called with TRL's keywords,
  `prompts`, `completions`, `completion_ids`, and each other field of the dataset rows by its name (a list,
  one value per completion, None where a row lacks it), as TRL passes the dataset's columns. Prompts that came
  from a conversation are passed as TRL passes conversational data: each prompt its message list, each
  completion `[{"role": "assistant", "content": text}]`; otherwise both are strings. TRL lets a function
  return None for a completion it does not score; here every score must be a finite number.

`module` is imported like any Python module (dotted names allowed); when it is not importable
from sys.path, the current directory is tried too, as TRL and Axolotl import reward modules relative to it.
The function may do I/O: it runs on a thread beside the other rewards.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable

from hanzo_gym.errors import ConfigError
from hanzo_gym.rewards.base import Completion, RewardFunction, checked_scores

_DOTTED_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")


def is_dotted_name(text: str) -> bool:
    """`module.function` (dotted Python names, at least one dot): how Axolotl names user code."""
    return _DOTTED_NAME.fullmatch(text) is not None


def import_user_module(what: str, module_name: str):
    """Import the user's module `module_name` from sys.path, else from the current directory (as TRL and
    Axolotl import reward and transform modules); ConfigError naming `what` (the config entry) otherwise."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing_here = e.name is not None and module_name.split(".")[0] == e.name.split(".")[0]
        if not missing_here or os.getcwd() in sys.path:
            raise ConfigError(f"{what}: cannot import module {module_name!r}: {e}") from None
    except Exception as e:  # the module itself raised while importing: show what, not a traceback
        raise ConfigError(f"{what}: importing {module_name!r} raised {type(e).__name__}: {e}") from e
    sys.path.append(os.getcwd())  # stays, so the module's own imports of its neighbours work at call time
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"{what}: cannot import module {module_name!r} from sys.path or the current directory "
            f"({os.getcwd()}): {e}"
        ) from None
    except Exception as e:
        raise ConfigError(f"{what}: importing {module_name!r} raised {type(e).__name__}: {e}") from e


class PythonReward(RewardFunction):
    does_io = True

    def __init__(self, spec: str, target: str, separator: str = ":"):
        module_name, _, function_name = target.rpartition(separator)
        if not module_name or not function_name:
            raise ConfigError(f'reward function "{spec}": expected python:<module>:<function>')
        self.name = spec
        module = import_user_module(f'reward function "{spec}"', module_name)
        function = getattr(module, function_name, None)
        if not callable(function):
            found = "not defined" if function is None else f"a {type(function).__name__}, not callable"
            raise ConfigError(f'reward function "{spec}": {module_name}.{function_name} is {found}')
        self._function: Callable[[list[Completion]], list[float]] = function

    def __call__(self, completions: list[Completion]) -> list[float]:
        return checked_scores(self.name, self._function(completions), len(completions))


_TRL_ARGUMENTS = ("prompts", "completions", "completion_ids")


class TrlReward(PythonReward):
    """`module.function` with TRL's reward-function signature."""

    def __init__(self, spec: str):
        super().__init__(spec, spec, separator=".")

    def __call__(self, completions: list[Completion]) -> list[float]:
        conversational = all(c.prompt_messages is not None for c in completions)
        if conversational:
            prompts = [list(c.prompt_messages) for c in completions]
            texts = [[{"role": "assistant", "content": c.text}] for c in completions]
        else:
            prompts, texts = [c.prompt for c in completions], [c.text for c in completions]
        names = dict.fromkeys(name for c in completions for name in c.columns if name not in _TRL_ARGUMENTS)
        columns = {name: [c.columns.get(name) for c in completions] for name in names}
        scores = self._function(
            **columns,
            prompts=prompts,
            completions=texts,
            completion_ids=[list(c.token_ids) for c in completions],
        )
        return checked_scores(self.name, scores, len(completions))
