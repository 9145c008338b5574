"""YAML loading that remembers where every key came from, so config errors can name a line.

PyYAML follows YAML 1.1, where `2e-4` (no dot) is a string; configs in the wild write learning rates that
way, so floats are resolved with the YAML 1.2 rule instead.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from hanzo_gym.errors import ConfigError

Path_ = tuple[str | int, ...]

_YAML12_FLOAT = re.compile(
    r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.VERBOSE,
)
_YAML12_INT = re.compile(r"^[-+]?[0-9]+$")


class _Loader(yaml.SafeLoader):
    pass


# Rebuild the implicit resolvers for numbers: ints stay ints, everything float-shaped becomes a float.
_Loader.yaml_implicit_resolvers = {
    first: [
        (tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:float", "tag:yaml.org,2002:int")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", _YAML12_INT, list("-+0123456789"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))


def _walk(node: yaml.Node, path: Path_, lines: dict[Path_, int], source: str) -> None:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            key_line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(
                    f"{source}:{key_line}: key `{key}` appears twice (first on line {seen[key]}); keep one"
                )
            seen[key] = key_line
            _walk(value_node, (*path, key), lines, source)
            lines[(*path, key)] = key_line
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, (*path, index), lines, source)


def load_yaml(text: str, source: str) -> tuple[Any, dict[Path_, int]]:
    """Parse YAML text; return the data and a map from key path to 1-based line number."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        lines: dict[Path_, int] = {}
        _walk(node, (), lines, source)
        return loader.construct_document(node), lines
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark else source
        raise ConfigError(f"{where}: not valid YAML: {exc.problem or exc}") from None
    finally:
        loader.dispose()


def load_yaml_file(path: str | Path) -> tuple[Any, dict[Path_, int]]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    return load_yaml(text, str(path))
