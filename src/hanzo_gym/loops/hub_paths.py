"""What stands on the Hub for a local path: a base model's repo id (from a Hub id, or a folder in the Hub's cache
layout), else the path's last name, so that nothing of the user's file system is uploaded (loops/hub_push.py and
loops/model_card.py write through it)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hanzo_gym.config.hub_keys import is_repo_id
from hanzo_gym.loops.run_dir import ADAPTER_MARKER, TRAINER_STATE

# JSON files whose strings may name local paths (the base model, the plan's fingerprint); tokenizer.json is
# vocabulary, whose tokens may look like paths and are left as they are.
_SCRUBBED_JSON = ("adapter_config.json", "config.json", "generation_config.json", TRAINER_STATE)
_HUB_CACHE_FOLDER = re.compile(r"models--([\w\-.]+?)--([\w\-.]+)")


def hub_model_of(base_model: str | None) -> str | None:
    """The Hub repo id of a run's base model: base_model itself when it is one, the repo of a folder in the Hub's
    cache layout, else None (a local folder or a .gguf file)."""
    if not base_model:
        return None
    path = Path(base_model).expanduser()
    looks_local = path.is_absolute() or base_model.startswith((".", "~")) or path.exists()
    if looks_local:
        for part in reversed(path.parts):
            match = _HUB_CACHE_FOLDER.fullmatch(part)
            if match:
                return f"{match[1]}/{match[2]}"
        return None
    if base_model.lower().endswith(".gguf") or not is_repo_id(base_model):
        return None
    return base_model


class Scrub:
    """Local absolute paths (those the run's config names, and the run directory) → what stands for them on the
    Hub: a base model's repo id, else the path's last name. A path below one of them keeps the rest of itself."""

    def __init__(self, run_config: dict, *directories: Path):
        base = run_config.get("base_model")
        self.base_model = hub_model_of(base)
        self.names: dict[str, str] = {}
        for value in [*_strings(run_config), *(str(directory.absolute()) for directory in directories)]:
            path = Path(value).expanduser()
            if not path.is_absolute():
                continue
            stand_in = self.base_model if value == base and self.base_model else (path.name or "/")
            for spelling in {value, str(path), str(path.resolve())}:
                self.names.setdefault(spelling.rstrip("/") or "/", stand_in)
        self._longest_first = sorted(self.names, key=len, reverse=True)

    def text(self, value: str) -> str:
        for local in self._longest_first:
            if value == local:
                return self.names[local]
            if value.startswith(local + "/"):
                return self.names[local] + value[len(local) :]
        return value

    def value(self, value: Any) -> Any:
        """`value` (a config, a parsed JSON file) with every string that is a local path replaced."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {key: self.value(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.value(item) for item in value]
        return value

    def file(self, path: Path) -> Path | bytes:
        """A file to upload as it is, or its bytes with local paths replaced."""
        if path.name not in _SCRUBBED_JSON:
            return path
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError):
            return path
        if path.name == ADAPTER_MARKER and "base_model_name_or_path" in content:
            name = content["base_model_name_or_path"]
            content["base_model_name_or_path"] = self.base_model or (Path(name).name if name else name)
        scrubbed = self.value(content)
        if scrubbed == content and path.name != ADAPTER_MARKER:
            return path
        return (json.dumps(scrubbed, indent=2, sort_keys=True) + "\n").encode()


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
