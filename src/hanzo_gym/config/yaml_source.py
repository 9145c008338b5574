"""YAML loading that remembers where every key came from, so config errors can name a line.

PyYAML follows YAML 1.1, where `2e-4` (no dot) is a string; configs in the wild write learning rates that
way, so floats are resolved with the YAML 1.2 rule instead.

A config is small and shallow, so the reader refuses what only an attack or an accident looks like: aliases
that together repeat more than `MAX_ALIASED_NODES` nodes (a few hundred bytes of nested aliases, the "billion
laughs" shape, would otherwise expand to billions), an alias inside its own anchor (a value that contains
itself), and nesting deeper than `MAX_DEPTH` (Python's recursion limit would stop it with a traceback).

A key written twice in one mapping is kept as YAML readers keep it, the last value, and reported in
`KeyLines.repeated`: each caller says what it means (a run config says which value it read; a design refuses).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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


MAX_ALIASED_NODES = 10_000
MAX_DEPTH = 100


class _Refused(Exception):
    def __init__(self, mark: yaml.Mark, message: str) -> None:
        super().__init__(message)
        self.mark, self.message = mark, message


class _Loader(yaml.SafeLoader):
    """SafeLoader that bounds alias expansion and nesting while it composes the node graph, before anything
    walks or constructs the expanded document."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliased_nodes = 0
        self._open_anchors: set[str] = set()
        # id(node) → (nodes it stands for with its aliases expanded, depth): one entry per composed node.
        self._shapes: dict[int, tuple[int, int]] = {}

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self._check_alias(event)
            return super().compose_node(parent, index)
        if self._depth >= MAX_DEPTH:
            raise _Refused(
                event.start_mark,
                f"nested more than {MAX_DEPTH} levels deep; no config is, so check the brackets and indentation",
            )
        anchor = event.anchor
        if anchor is not None:
            self._open_anchors.add(anchor)
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        self._open_anchors.discard(anchor)
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        shapes = [self._shapes[id(child)] for child in children]
        self._shapes[id(node)] = (
            1 + sum(size for size, _ in shapes),
            1 + max((d for _, d in shapes), default=0),
        )
        return node

    def _check_alias(self, event: yaml.AliasEvent) -> None:
        name = event.anchor
        if name in self._open_anchors:
            raise _Refused(
                event.start_mark,
                f"alias `*{name}` sits inside its own anchor `&{name}`, so the value would contain itself; "
                "write the value out",
            )
        node = self.anchors.get(name)
        if node is None:
            return  # PyYAML reports the undefined alias
        size, depth = self._shapes[id(node)]
        self._aliased_nodes += size
        if self._aliased_nodes > MAX_ALIASED_NODES:
            raise _Refused(
                event.start_mark,
                f"aliases repeat more than {MAX_ALIASED_NODES} values in all (`*{name}` here stands for "
                f"{size}), which only an alias bomb needs; write the values out or use fewer aliases",
            )
        if self._depth + depth > MAX_DEPTH:
            raise _Refused(
                event.start_mark,
                f"alias `*{name}` nests the value more than {MAX_DEPTH} levels deep; write it out flatter",
            )


# Rebuild the implicit resolvers for numbers: ints stay ints, everything float-shaped becomes a float.
_Loader.yaml_implicit_resolvers = {
    first: [
        (tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:float", "tag:yaml.org,2002:int")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", _YAML12_INT, list("-+0123456789"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))


_UNSET = {"", "~", "null", "Null", "NULL", "false", "False", "FALSE"}


@dataclass(frozen=True)
class RepeatedKey:
    """A key written twice in one mapping with two settings: where, and the value that was kept (the last)."""

    path: Path_
    first_line: int
    line: int
    kept: str  # the last value as written, or `a mapping` / `a list`

    def describe(self, source: str) -> str:
        return (
            f"{source}:{self.line}: key `{dotted(self.path)}` appears twice (first on line {self.first_line})"
        )


class KeyLines(dict):
    """Key path → 1-based line number, and the keys written twice with two settings."""

    def __init__(self) -> None:
        super().__init__()
        self.repeated: list[RepeatedKey] = []


def dotted(path: Path_) -> str:
    """`datasets[0].type` for ("datasets", 0, "type")."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _same_setting(first: yaml.Node, second: yaml.Node) -> bool:
    """A key written twice asks for one thing when both values are the same scalar or both ask for nothing
    (empty, null or false): config templates repeat such keys."""
    if not (isinstance(first, yaml.ScalarNode) and isinstance(second, yaml.ScalarNode)):
        return False
    return first.value == second.value or (first.value in _UNSET and second.value in _UNSET)


def _as_written(node: yaml.Node) -> str:
    if isinstance(node, yaml.ScalarNode):
        return node.value or "(empty)"
    return "a list" if isinstance(node, yaml.SequenceNode) else "a mapping"


def _walk(node: yaml.Node, path: Path_, lines: KeyLines, source: str) -> None:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, tuple[int, yaml.Node]] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            key_line = key_node.start_mark.line + 1
            if key in seen and not _same_setting(seen[key][1], value_node):
                lines.repeated.append(
                    RepeatedKey((*path, key), seen[key][0], key_line, _as_written(value_node))
                )
            seen[key] = (key_line, value_node)
            _walk(value_node, (*path, key), lines, source)
            lines[(*path, key)] = key_line
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, (*path, index), lines, source)


def load_yaml(text: str, source: str) -> tuple[Any, KeyLines]:
    """Parse YAML text; return the data and a map from key path to 1-based line number."""
    loader = None
    try:
        loader = _Loader(text)  # the reader refuses non-printable characters here
        node = loader.get_single_node()
        if node is None:
            return None, KeyLines()
        lines = KeyLines()
        _walk(node, (), lines, source)
        return loader.construct_document(node), lines
    except _Refused as exc:
        raise ConfigError(f"{source}:{exc.mark.line + 1}: {exc.message}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark else source
        raise ConfigError(f"{where}: not valid YAML: {exc.problem or exc}") from None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise ConfigError(
            f"{source}:{line}: control character #x{exc.character:04x} is not allowed in YAML; "
            "remove it, or write it as an escape (\\x..) inside a double-quoted string"
        ) from None
    except ValueError as exc:  # a scalar that matches a YAML 1.1 type but is no value of it: `2001-02-30`
        raise ConfigError(f"{source}: not valid YAML: {exc}; quote the value if it is text") from None
    finally:
        if loader is not None:
            loader.dispose()


def load_yaml_file(path: str | Path) -> tuple[Any, KeyLines]:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{path}:{line}: byte 0x{raw[exc.start]:02x} is not UTF-8 text; save the file as UTF-8"
        ) from None
    return load_yaml(text, str(path))
