"""Pull a JSON object or a block of code out of a model's reply text."""

from __future__ import annotations

import json
import re

from hanzo_gym.errors import GymError


class ParseFailed(GymError):
    """The reply does not hold what the column asked for; the column asks again, up to its `attempts`."""


_FENCE = re.compile(r"```[ \t]*(?P<tag>[^\n`]*)\n(?P<body>.*?)```", re.DOTALL)

# Fence tags models write for the same language.
_TAG_ALIASES = {
    "python": {"python", "py", "python3"},
    "javascript": {"javascript", "js"},
    "typescript": {"typescript", "ts"},
    "bash": {"bash", "sh", "shell"},
    "cpp": {"cpp", "c++"},
    "csharp": {"csharp", "cs", "c#"},
}


def extract_json_object(text: str) -> dict:
    """The whole reply if it is an object; else the last ```json fence; else the first balanced {…} that parses."""
    stripped = text.strip()
    candidates = [stripped]
    fences = [m["body"] for m in _FENCE.finditer(text) if m["tag"].strip().lower() in ("json", "")]
    candidates += list(reversed(fences))
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    for candidate in _balanced_objects(text):
        try:
            return json.loads(candidate)
        except ValueError:
            continue
    raise ParseFailed(f"reply holds no JSON object: {_preview(text)}")


def _balanced_objects(text: str):
    """Substrings `{…}` whose braces balance, skipping braces inside JSON strings, in order of their start."""
    for start, char in enumerate(text):
        if char != "{":
            continue
        depth, in_string, escaped = 0, False, False
        for end in range(start, len(text)):
            c = text[end]
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    yield text[start : end + 1]
                    break


def extract_code(text: str, language: str) -> str:
    """The first fenced block tagged with `language` (or untagged); a reply without fences is taken whole."""
    wanted = language.split(":")[0].lower()
    accepted = _TAG_ALIASES.get(wanted, {wanted})
    blocks = list(_FENCE.finditer(text))
    if not blocks:
        code = text.strip()
        if not code:
            raise ParseFailed("reply is empty")
        return code
    for block in blocks:
        tag = block["tag"].strip().lower()
        if tag == "" or tag in accepted:
            return block["body"].strip("\n")
    tags = ", ".join(sorted({b["tag"].strip() for b in blocks}))
    raise ParseFailed(f"reply's code is fenced as {tags}, not {language}")


def _preview(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit] + "…")
