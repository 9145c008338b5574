"""OpenAI response objects and stream chunks, as plain dicts ready for `json.dumps`."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LOGPROB_FLOOR = -9999.0  # JSON has no -Infinity


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _logprob(value: float) -> float:
    return max(float(value), LOGPROB_FLOOR)


# -- log-probabilities -------------------------------------------------------------------------------------
# `pieces[i]` is token i's own text; `tops[i]` its top alternatives as (text, logprob), best first (or None).
def chat_logprobs(
    pieces: Sequence[str], logprobs: Sequence[float], tops: Sequence[Sequence[tuple[str, float]]] | None
) -> dict[str, Any]:
    content = []
    for index, (piece, value) in enumerate(zip(pieces, logprobs)):
        alternatives = tops[index] if tops is not None else []
        content.append(
            {
                "token": piece,
                "logprob": _logprob(value),
                "bytes": list(piece.encode("utf-8")),
                "top_logprobs": [
                    {"token": text, "logprob": _logprob(lp), "bytes": list(text.encode("utf-8"))}
                    for text, lp in alternatives
                ],
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(
    pieces: Sequence[str],
    logprobs: Sequence[float | None],
    tops: Sequence[Sequence[tuple[str, float]]] | None,
    offsets: Sequence[int],
) -> dict[str, Any]:
    """The legacy format: each position's top alternatives always include the sampled token. A `None` logprob
    (an echoed prompt's first token, which nothing predicts) gives `null` for it and for its alternatives."""
    top_dicts: list[dict[str, float] | None] = []
    for index, (piece, value) in enumerate(zip(pieces, logprobs)):
        if value is None:
            top_dicts.append(None)
            continue
        alternatives = {text: _logprob(lp) for text, lp in (tops[index] if tops is not None else [])}
        alternatives.setdefault(piece, _logprob(value))
        top_dicts.append(alternatives)
    return {
        "tokens": list(pieces),
        "token_logprobs": [None if v is None else _logprob(v) for v in logprobs],
        "top_logprobs": top_dicts,
        "text_offset": list(offsets),
    }


# -- whole responses ----------------------------------------------------------------------------------------
def chat_completion(
    id: str, model: str, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_choice(
    index: int, message: dict[str, Any], finish_reason: str, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def text_completion(
    id: str, model: str, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }


def text_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


# -- stream chunks ---------------------------------------------------------------------------------------------
def chat_chunk(
    id: str,
    model: str,
    created: int,
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def text_chunk(
    id: str,
    model: str,
    created: int,
    index: int,
    text: str,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [text_choice(index, text, finish_reason, logprobs)],
    }


def usage_chunk(id: str, object: str, model: str, created: int, prompt_tokens: int, completion_tokens: int):
    """With `stream_options.include_usage`: the last chunk, with no choices."""
    return {
        "id": id,
        "object": object,
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
    }


# -- models ----------------------------------------------------------------------------------------------------
def model_card(id: str, created: int, root: str, parent: str | None) -> dict[str, Any]:
    """`root` is where the weights came from: a hub id as it is, a local folder or file by its name only (the
    server's own folders are nobody else's business)."""
    local = root.startswith(("/", ".", "~", "gym://")) or Path(root).exists()
    return {
        "id": id,
        "object": "model",
        "created": created,
        "owned_by": "hanzo-gym",
        "root": Path(root).name if local else root,
        "parent": parent,
    }


def model_list(cards: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": cards}
