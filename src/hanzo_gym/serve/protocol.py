"""OpenAI request bodies → typed requests, or an `APIError` that says which field is wrong and why.

Every check happens here, before anything reaches the model: a body that passes is one the engine can run
(apart from limits that need the model, such as the context length, which `models` checks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MAX_N = 64  # completions per prompt
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_CHOICES = 256  # prompts × n
MAX_STOP = 16  # stop strings
MAX_TOP_LOGPROBS = 20
SEED_RANGE = (-(2**63), 2**63 - 1)
GREEDY_BELOW = 1e-5  # temperatures this small decode greedily (dividing logits by them overflows)
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An OpenAI-style error: HTTP status and `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Sampling:
    n: int = 1
    max_tokens: int | None = None  # None: up to the model's context
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's and the top k
    echo: bool = False  # the prompt comes back before the completion, with its own logprobs when asked


@dataclass
class LoadAdapterRequest:
    name: str
    path: str


# -- field readers ---------------------------------------------------------------------------------------
def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array"}.get(
        type(value), "null" if value is None else "an object"
    )


def _wrong(name: str, expected: str, value: Any) -> APIError:
    return APIError(f"`{name}` must be {expected}, not {_type_name(value)}", param=name, code="invalid_type")


def _out_of_range(name: str, rule: str, value: Any) -> APIError:
    return APIError(f"`{name}` must be {rule} (got {value!r})", param=name, code="invalid_value")


def _int(body: dict, name: str, default: Any, low: int | None = None, high: int | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong(name, "an integer", value)
    if (low is not None and value < low) or (high is not None and value > high):
        rule = f"between {low} and {high}" if low is not None and high is not None else f">= {low}"
        raise _out_of_range(name, rule, value)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong(name, "a number", value)
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        rule = f"{'>' if low_open else '>='} {low} and <= {high}"
        raise _out_of_range(name, rule, value)
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _wrong(name, "a boolean", value)
    return value


def _string(body: dict, name: str, required: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise APIError(f"`{name}` is required", param=name, code="missing_required_parameter")
        return None
    if not isinstance(value, str):
        raise _wrong(name, "a string", value)
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _wrong("stop", "a string or an array of strings", value)
    if len(stops) > MAX_STOP:
        raise _out_of_range("stop", f"at most {MAX_STOP} strings", f"{len(stops)} strings")
    if any(s == "" for s in stops):
        raise APIError("`stop` strings must not be empty", param="stop", code="invalid_value")
    return list(dict.fromkeys(stops))


def _unsupported(body: dict, name: str, allowed: tuple = (None,)) -> None:
    value = body.get(name)
    if value not in allowed and not (isinstance(value, (list, dict)) and not value and None in allowed):
        raise APIError(f"`{name}` is not supported by this server", param=name, code="unsupported_parameter")


def _sampling(body: dict, max_tokens_default: int | None, min_tokens: int = 1) -> Sampling:
    n = _int(body, "n", 1, 1, MAX_N)
    max_tokens = _int(body, "max_tokens", max_tokens_default, min_tokens)
    max_tokens = _int(body, "max_completion_tokens", max_tokens, min_tokens)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = _int(body, "top_k", -1, -1)
    seed = _int(body, "seed", None, *SEED_RANGE)
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise APIError(
                f"`{name}` is not supported by this server", param=name, code="unsupported_parameter"
            )
    _unsupported(body, "logit_bias")
    return Sampling(
        n=n,
        max_tokens=max_tokens,
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=top_p,
        top_k=-1 if top_k == 0 else top_k,
        seed=seed,
        stop=_stop(body),
    )


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _wrong("stream_options", "an object", options)
    if not stream:
        raise APIError("`stream_options` needs `stream: true`", param="stream_options", code="invalid_value")
    return _bool(options, "include_usage", False)


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, not {_type_name(body)}", code="invalid_body")
    return body


# -- requests --------------------------------------------------------------------------------------------
def _message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _wrong(where, "an object", message)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise APIError(
            f"`{where}.role` must be one of {', '.join(ROLES)} (got {role!r})",
            param=f"{where}.role",
            code="invalid_value",
        )
    content = message.get("content")
    if content is None:
        if role != "assistant":
            raise APIError(f"`{where}.content` is required", param=f"{where}.content")
        content = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                raise APIError(
                    f"`{where}.content` parts must be text parts ({{'type': 'text', 'text': ...}}); got {kind!r}",
                    param=f"{where}.content",
                    code="invalid_value",
                )
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise _wrong(f"{where}.content", "a string or an array of text parts", content)
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_chat(body: Any) -> ChatRequest:
    body = _object(body)
    model = _string(body, "model")
    messages = body.get("messages")
    if messages is None:
        raise APIError("`messages` is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise _wrong("messages", "an array", messages)
    if not messages:
        raise APIError("`messages` must not be empty", param="messages", code="invalid_value")
    parsed = [_message(i, m) for i, m in enumerate(messages)]
    for name in ("tools", "functions"):
        _unsupported(body, name)
    _unsupported(body, "tool_choice", (None, "none", "auto"))
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise APIError(
            "`response_format` other than {'type': 'text'} is not supported",
            param="response_format",
            code="unsupported_parameter",
        )
    stream = _bool(body, "stream", False)
    logprobs = _bool(body, "logprobs", False)
    top_logprobs = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top_logprobs and not logprobs:
        raise APIError("`top_logprobs` needs `logprobs: true`", param="top_logprobs", code="invalid_value")
    return ChatRequest(
        model=model,
        messages=parsed,
        sampling=_sampling(body, None),
        stream=stream,
        include_usage=_stream_options(body, stream),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def _prompts(value: Any) -> list[str | list[int]]:
    if value is None:
        raise APIError("`prompt` is required", param="prompt", code="missing_required_parameter")
    if isinstance(value, str):
        prompts: list = [value]
    elif (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        prompts = value
    else:
        raise APIError(
            "`prompt` must be a non-empty string, array of strings, array of token ids or array of such arrays",
            param="prompt",
            code="invalid_value",
        )
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, list) and (
            not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
        ):
            raise APIError(
                f"`prompt[{index}]` must be a non-empty array of token ids (integers >= 0)",
                param="prompt",
                code="invalid_value",
            )
    if len(prompts) > MAX_PROMPTS:
        raise _out_of_range("prompt", f"at most {MAX_PROMPTS} prompts", f"{len(prompts)} prompts")
    return prompts


def parse_completion(body: Any) -> CompletionRequest:
    body = _object(body)
    model = _string(body, "model")
    prompts = _prompts(body.get("prompt"))
    echo = _bool(body, "echo", False)
    _unsupported(body, "suffix", (None, ""))
    if not echo and body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool):
        raise APIError(
            "`max_tokens` must be >= 1 (got 0); 0 is allowed with `echo: true`, to score the prompt only",
            param="max_tokens",
            code="invalid_value",
        )
    # With echo, max_tokens 0 scores the prompt and generates nothing (what evaluation harnesses send).
    sampling = _sampling(body, 16, min_tokens=0 if echo else 1)  # 16: OpenAI's default for /v1/completions
    best_of = _int(body, "best_of", None, 1)
    if best_of is not None and best_of != sampling.n:
        raise APIError(
            "`best_of` other than `n` is not supported", param="best_of", code="unsupported_parameter"
        )
    if len(prompts) * sampling.n > MAX_CHOICES:
        raise _out_of_range("n", f"such that prompts × n <= {MAX_CHOICES}", sampling.n)
    stream = _bool(body, "stream", False)
    if echo and stream:
        raise APIError(
            "`echo` with `stream: true` is not supported: send `stream: false` to get the prompt back",
            param="echo",
            code="unsupported_parameter",
        )
    return CompletionRequest(
        model=model,
        prompts=prompts,
        sampling=sampling,
        stream=stream,
        include_usage=_stream_options(body, stream),
        # `false` is how some clients say "none"; `true` is chat's form and means nothing here.
        logprobs=None if body.get("logprobs") is False else _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS),
        echo=echo,
    )


def parse_load_adapter(body: Any) -> LoadAdapterRequest:
    body = _object(body)
    name = _string(body, "lora_name", required=True)
    path = _string(body, "lora_path", required=True)
    if not name.strip():
        raise APIError("`lora_name` must not be empty", param="lora_name", code="invalid_value")
    return LoadAdapterRequest(name=name, path=path)


def parse_unload_adapter(body: Any) -> str:
    return _string(_object(body), "lora_name", required=True)
