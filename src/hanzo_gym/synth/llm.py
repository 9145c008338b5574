"""An async client for OpenAI-compatible `/chat/completions` endpoints, one per named model.

Each model has its own concurrency gate. Transport errors, timeouts, 429 and 5xx replies are retried with
exponential back-off (or the server's Retry-After); a reply that is not a usable completion is retried the same
way. Errors that cannot heal by waiting — a refused key (401/403) or an unknown model or path (404) — raise
`EndpointRefused`, which stops the whole run. So does a model whose first `REFUSAL_CALLS` calls all fail with
the same 4xx while none has ever succeeded: servers such as LiteLLM and OpenRouter answer 400, not 404, for a
model they do not serve. Anything else that still fails after the retries raises `CallFailed`, which costs
only the row that made the call.

`response_format` is switched off for a model only when the endpoint is shown not to take it: its 400/422
names `response_format` / `json_schema`, or the same request without it succeeds. A 400 about something else
(one prompt over the context length) leaves it on.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx2
from pydantic import BaseModel, ConfigDict, Field, field_validator

from hanzo_gym.errors import GymError

DEFAULT_ENDPOINT = "https://api.hanzo.ai/v1"
MAX_RETRY_WAIT_S = 60.0
# A model whose first this many calls all fail with one 4xx status, none ever succeeding, stops the run.
REFUSAL_CALLS = 5
_RESPONSE_FORMAT_WORDS = ("response_format", "json_schema")


class ModelSettings(BaseModel):
    """One entry of `models:` (or the single `model:`)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, allow_inf_nan=False)
    name: str
    endpoint: str = DEFAULT_ENDPOINT
    api_key_env: str | None = "HANZO_API_KEY"
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    concurrency: int = Field(4, ge=1)
    timeout: float = Field(120.0, gt=0)
    retries: int = Field(3, ge=0)
    retry_backoff: float = Field(1.0, ge=0)
    response_format: bool = True

    @field_validator("endpoint")
    @classmethod
    def _http_url(cls, endpoint: str) -> str:
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(
                "endpoint must be an http:// or https:// URL (the part before /chat/completions)"
            )
        return endpoint

    @property
    def url(self) -> str:
        return self.endpoint.rstrip("/") + "/chat/completions"


class CallFailed(GymError):
    """A call that did not yield a completion after its retries; the row that made it fails."""


class EndpointRefused(GymError):
    """The endpoint refuses every call (bad key, unknown model): retrying cannot help, so the run stops."""


class _Transient(Exception):
    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


class _RejectsResponseFormat(Exception):
    """A 400/422 to a body with response_format; `certain` when the error names response_format itself."""

    def __init__(self, failure: CallFailed, certain: bool) -> None:
        super().__init__(str(failure))
        self.failure = failure
        self.certain = certain


class _ClientError(CallFailed):
    """A 4xx (not 401/403/404/408/429) about this request; `status` feeds the unknown-model check."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ModelUsage:
    calls: int = 0
    failed_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def add(self, other: dict[str, int]) -> None:
        for key, value in other.items():
            setattr(self, key, getattr(self, key) + value)


def _retry_after_seconds(header: str | None) -> float | None:
    if not header:
        return None
    try:
        return max(0.0, float(header))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(header)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "…"


class ChatClient:
    def __init__(self, alias: str, settings: ModelSettings, api_key: str | None, http: httpx2.AsyncClient):
        self.alias = alias
        self.settings = settings
        self.usage = ModelUsage()
        self.takes_response_format = settings.response_format
        self._http = http
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._gate = asyncio.Semaphore(settings.concurrency)
        self._succeeded = False
        self._early_statuses: list[int] | None = []  # 4xx of calls before any success; None: stop watching
        self._refused: EndpointRefused | None = None

    def _body(self, messages: list[dict], response_format: dict | None) -> dict:
        body: dict[str, Any] = {"model": self.settings.name, "messages": messages}
        for key in ("temperature", "top_p", "max_tokens"):
            value = getattr(self.settings, key)
            if value is not None:
                body[key] = value
        if response_format is not None and self.takes_response_format:
            body["response_format"] = response_format
        return body

    async def chat(self, messages: list[dict], response_format: dict | None = None) -> str:
        """The assistant's reply text for `messages`."""
        if self._refused is not None:
            raise self._refused
        try:
            reply = await self._chat(messages, response_format)
        except _ClientError as exc:
            self._note_client_error(exc)
            raise
        self._succeeded = True
        return reply

    async def _chat(self, messages: list[dict], response_format: dict | None) -> str:
        attempts = self.settings.retries + 1
        attempt = 0
        reason = ""
        probe: _RejectsResponseFormat | None = None  # set while asking again without response_format
        while attempt < attempts:
            body = self._body(messages, None if probe is not None else response_format)
            try:
                async with self._gate:
                    reply = await self._post(body)
            except _RejectsResponseFormat as exc:
                if exc.certain:
                    # The endpoint says it does not take response_format; the prompt already asks for a fenced
                    # JSON object, so leave it out for this model from now on.
                    self.takes_response_format = False
                else:
                    probe = exc  # a 400 that does not say why: ask once more without response_format
                continue
            except _ClientError:
                if probe is not None:
                    # Refused without response_format too: the 400 was about this request, and response_format
                    # stays on for the model.
                    raise probe.failure from None
                raise
            except _Transient as exc:
                reason = str(exc)
                attempt += 1
                if attempt < attempts:
                    await asyncio.sleep(self._backoff(attempt, exc.retry_after))
                continue
            if probe is not None:
                self.takes_response_format = False
            return reply
        raise CallFailed(f"model `{self.alias}`: {reason} (gave up after {attempts} attempts)")

    def _note_client_error(self, exc: _ClientError) -> None:
        """Stop the run when a model's first calls all fail alike: it is most likely not served there."""
        if self._succeeded or self._early_statuses is None:
            return
        self._early_statuses.append(exc.status)
        if len(set(self._early_statuses)) > 1:
            self._early_statuses = None
            return
        if len(self._early_statuses) >= REFUSAL_CALLS:
            self._refused = EndpointRefused(
                f"model `{self.alias}`: its first {REFUSAL_CALLS} calls all failed with http {exc.status} and "
                f"none has succeeded: `{self.settings.name}` is probably not served at "
                f"{self.settings.endpoint} (some servers answer 400 for an unknown model), or every request "
                f"is refused for the same reason. Last answer: {exc}"
            )
            raise self._refused

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, MAX_RETRY_WAIT_S)
        base = self.settings.retry_backoff * 2 ** (attempt - 1)
        # Jitter spreads out rows that failed together so they do not hit the endpoint in lockstep again.
        return min(base * random.uniform(0.75, 1.25), MAX_RETRY_WAIT_S)

    async def _post(self, body: dict) -> str:
        self.usage.calls += 1
        url = self.settings.url
        try:
            response = await self._http.post(
                url, json=body, headers=self._headers, timeout=self.settings.timeout
            )
        except httpx2.TimeoutException:
            self.usage.failed_calls += 1
            raise _Transient(f"{url}: no reply within {self.settings.timeout:g} s (timeout)") from None
        except httpx2.TransportError as exc:
            self.usage.failed_calls += 1
            raise _Transient(f"{url}: {type(exc).__name__}: {exc}") from None
        status = response.status_code
        if status != 200:
            self.usage.failed_calls += 1
            self._raise_for_status(url, status, response, body)
        try:
            payload = response.json()
            content = payload["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            self.usage.failed_calls += 1
            raise _Transient(f"{url}: reply is not a chat completion: {_short(response.text)}") from None
        if not isinstance(content, str):
            self.usage.failed_calls += 1
            raise _Transient(f"{url}: completion has no content")
        usage = payload.get("usage") or {}
        self.usage.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        self.usage.completion_tokens += int(usage.get("completion_tokens") or 0)
        return content

    def _raise_for_status(self, url: str, status: int, response: httpx2.Response, body: dict) -> None:
        detail = f"{url}: http {status}: {_short(response.text)}"
        if status in (401, 403):
            key = self.settings.api_key_env
            hint = f"check `{key}` (api_key_env)" if key else "this endpoint needs a key: set `api_key_env`"
            raise EndpointRefused(
                f"model `{self.alias}`: the endpoint refused the API key ({detail}); {hint}"
            )
        if status == 404:
            raise EndpointRefused(
                f"model `{self.alias}`: `{self.settings.name}` is not served there or the endpoint path is "
                f"wrong ({detail})"
            )
        if status in (429, 408) or status >= 500:
            raise _Transient(detail, _retry_after_seconds(response.headers.get("retry-after")))
        # Another 4xx is about this request (say, a prompt over the context length): this row's call fails.
        failure = _ClientError(f"model `{self.alias}`: {detail}", status)
        if status in (400, 422) and "response_format" in body:
            text = response.text.lower()
            raise _RejectsResponseFormat(failure, any(word in text for word in _RESPONSE_FORMAT_WORDS))
        raise failure
