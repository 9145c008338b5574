"""The synth LLM client against a real OpenAI-compatible HTTP server on localhost with scripted answers.

`FakeLLM` is shared by the other synth tests: each request is answered by `script(request)`, which returns a
`Reply` (content, an HTTP error, a malformed body, a delay). Every request is recorded.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

import httpx2
import pytest

from hanzo_gym.synth.llm import CallFailed, ChatClient, EndpointRefused, ModelSettings


@dataclass
class Reply:
    content: str | None = None
    status: int = 200
    raw: bytes | None = None  # sent as the body instead of a completion (malformed replies)
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    prompt_tokens: int = 3
    completion_tokens: int = 5


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: dict
    index: int

    @property
    def user(self) -> str:
        return [m for m in self.body["messages"] if m["role"] == "user"][-1]["content"]

    @property
    def system(self) -> str | None:
        found = [m["content"] for m in self.body["messages"] if m["role"] == "system"]
        return found[0] if found else None


class FakeLLM:
    """A threaded HTTP server speaking just enough of /chat/completions; use as a context manager."""

    def __init__(self, script: Callable[[Request], Reply] | None = None):
        self.script = script or (lambda request: Reply(content=f"echo: {request.user}"))
        self.requests: list[Request] = []
        self.active = 0
        self.peak_active = 0
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake._lock:
                    request = Request(self.path, dict(self.headers), body, len(fake.requests))
                    fake.requests.append(request)
                    fake.active += 1
                    fake.peak_active = max(fake.peak_active, fake.active)
                try:
                    reply = fake.script(request)
                    time.sleep(reply.delay)
                    self._send(reply, body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting (timeout tests)
                finally:
                    with fake._lock:
                        fake.active -= 1

            def _send(self, reply: Reply, body: dict) -> None:
                if reply.raw is not None:
                    payload = reply.raw
                elif reply.status == 200:
                    payload = json.dumps(
                        {
                            "id": "x",
                            "object": "chat.completion",
                            "model": body["model"],
                            "choices": [
                                {"index": 0, "message": {"role": "assistant", "content": reply.content}}
                            ],
                            "usage": {
                                "prompt_tokens": reply.prompt_tokens,
                                "completion_tokens": reply.completion_tokens,
                                "total_tokens": reply.prompt_tokens + reply.completion_tokens,
                            },
                        }
                    ).encode()
                else:
                    payload = json.dumps({"error": {"message": f"scripted {reply.status}"}}).encode()
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                for key, value in reply.headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(payload)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> Self:
        threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def llm():
    with FakeLLM() as server:
        yield server


def _settings(server: FakeLLM, **overrides) -> ModelSettings:
    values = {"name": "tiny", "endpoint": server.url, "api_key_env": None, "retry_backoff": 0.01, **overrides}
    return ModelSettings(**values)


def _chat(settings: ModelSettings, key: str | None = None, messages=None, response_format=None):
    async def go():
        async with httpx2.AsyncClient(trust_env=False) as http:
            client = ChatClient("m", settings, key, http)
            try:
                reply = await client.chat(messages or [{"role": "user", "content": "hi"}], response_format)
            except (CallFailed, EndpointRefused) as exc:  # the caller inspects the error and the usage
                return exc, client
            return reply, client

    return asyncio.run(go())


def test_sends_model_sampling_settings_and_key_and_counts_tokens(llm):
    reply, client = _chat(_settings(llm, temperature=0.3, top_p=0.9, max_tokens=17), key="sekret")
    assert reply == "echo: hi"
    request = llm.requests[0]
    assert request.path == "/v1/chat/completions"
    assert request.headers["Authorization"] == "Bearer sekret"
    assert request.body == {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.3,
        "top_p": 0.9,
        "max_tokens": 17,
    }
    assert client.usage.as_dict() == {
        "calls": 1,
        "failed_calls": 0,
        "prompt_tokens": 3,
        "completion_tokens": 5,
    }


def test_429_waits_for_retry_after_then_succeeds(llm):
    llm.script = lambda r: Reply(status=429, headers={"Retry-After": "0.3"}) if r.index == 0 else Reply("ok")
    started = time.monotonic()
    reply, client = _chat(_settings(llm, retry_backoff=0.0))
    assert reply == "ok"
    assert time.monotonic() - started >= 0.3  # the server's Retry-After, not the zero back-off
    assert (client.usage.calls, client.usage.failed_calls) == (2, 1)


def test_5xx_and_malformed_replies_are_retried(llm):
    replies = [
        Reply(status=500),
        Reply(status=503),
        Reply(raw=b"{not json"),
        Reply(raw=b'{"choices": []}'),
        Reply("ok"),
    ]
    llm.script = lambda r: replies[r.index]
    reply, client = _chat(_settings(llm, retries=4))
    assert reply == "ok"
    assert (client.usage.calls, client.usage.failed_calls) == (5, 4)


def test_gives_up_after_retries_with_the_last_reason(llm):
    llm.script = lambda r: Reply(status=502)
    error, client = _chat(_settings(llm, retries=2))
    assert isinstance(error, CallFailed)
    assert "http 502" in str(error) and "gave up after 3 attempts" in str(error)
    assert client.usage.calls == 3


def test_slow_reply_times_out_and_is_retried(llm):
    llm.script = lambda r: Reply("late", delay=1.0) if r.index == 0 else Reply("on time")
    reply, client = _chat(_settings(llm, timeout=0.2))
    assert reply == "on time"
    assert client.usage.failed_calls == 1


@pytest.mark.parametrize("status", [401, 403])
def test_refused_key_is_fatal_at_once(llm, status):
    llm.script = lambda r: Reply(status=status)
    error, client = _chat(_settings(llm, api_key_env="SYNTH_KEY"), key="wrong")
    assert isinstance(error, EndpointRefused)
    assert f"http {status}" in str(error) and "SYNTH_KEY" in str(error)
    assert client.usage.calls == 1  # no retries: waiting cannot fix a key


def test_unknown_model_is_fatal(llm):
    llm.script = lambda r: Reply(status=404)
    error, _ = _chat(_settings(llm, name="no-such-model"))
    assert isinstance(error, EndpointRefused)
    assert "no-such-model" in str(error) and "http 404" in str(error)


def test_endpoint_without_response_format_is_asked_again_without_it(llm):
    llm.script = lambda r: Reply(status=400) if "response_format" in r.body else Reply('{"a": 1}')
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": True}}
    reply, client = _chat(_settings(llm), response_format=response_format)
    assert reply == '{"a": 1}'
    assert ["response_format" in r.body for r in llm.requests] == [True, False]
    assert client.takes_response_format is False


def test_other_4xx_fails_the_call_without_retrying(llm):
    llm.script = lambda r: Reply(status=400)
    error, client = _chat(_settings(llm))
    assert isinstance(error, CallFailed) and "http 400" in str(error)
    assert client.usage.calls == 1


def test_concurrency_is_limited_per_model(llm):
    llm.script = lambda r: Reply("ok", delay=0.05)
    settings = _settings(llm, concurrency=2)

    async def go():
        async with httpx2.AsyncClient(trust_env=False) as http:
            client = ChatClient("m", settings, None, http)
            messages = [{"role": "user", "content": "hi"}]
            return await asyncio.gather(*(client.chat(messages) for _ in range(8)))

    assert asyncio.run(go()) == ["ok"] * 8
    assert llm.peak_active == 2


RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": True}}


def _calls(settings: ModelSettings, prompts: list[str], response_format=None):
    """Each prompt in turn through one client: the replies (or errors) and the client."""

    async def go():
        async with httpx2.AsyncClient(trust_env=False) as http:
            client = ChatClient("m", settings, None, http)
            results = []
            for prompt in prompts:
                try:
                    results.append(await client.chat([{"role": "user", "content": prompt}], response_format))
                except (CallFailed, EndpointRefused) as exc:
                    results.append(exc)
            return results, client

    return asyncio.run(go())


def test_a_400_about_something_else_keeps_response_format_on(llm):
    # One prompt is "too long" with or without response_format; the endpoint takes response_format otherwise.
    llm.script = lambda r: Reply(status=400) if r.user == "too long" else Reply('{"a": 1}')
    results, client = _calls(_settings(llm), ["too long", "short"], RESPONSE_FORMAT)
    assert isinstance(results[0], CallFailed) and "http 400" in str(results[0])
    assert results[1] == '{"a": 1}'
    assert client.takes_response_format is True
    # The failing prompt was asked once more without response_format; the next call still sends it.
    assert [(r.user, "response_format" in r.body) for r in llm.requests] == [
        ("too long", True),
        ("too long", False),
        ("short", True),
    ]


def test_a_400_naming_response_format_switches_it_off_without_a_probe(llm):
    refusal = json.dumps({"error": {"message": "`response_format` other than text is not supported"}})

    def script(request):
        if "response_format" in request.body:
            return Reply(status=400, raw=refusal.encode())
        return Reply('{"a": 1}')

    llm.script = script
    results, client = _calls(_settings(llm), ["one", "two"], RESPONSE_FORMAT)
    assert results == ['{"a": 1}', '{"a": 1}']
    assert client.takes_response_format is False
    assert ["response_format" in r.body for r in llm.requests] == [True, False, False]


def test_a_model_whose_first_calls_all_get_the_same_400_stops_the_run(llm):
    # LiteLLM and OpenRouter answer 400, not 404, for a model they do not serve.
    llm.script = lambda r: Reply(status=400)
    results, _ = _calls(_settings(llm, name="no-such-model"), [f"p{i}" for i in range(8)])
    assert all(isinstance(r, CallFailed) for r in results[:4])
    assert all(isinstance(r, EndpointRefused) for r in results[4:])
    assert "first 5 calls all failed with http 400" in str(results[4]) and "no-such-model" in str(results[4])
    assert len(llm.requests) == 5  # once refused, no further calls are made


def test_400s_after_a_success_or_mixed_statuses_only_fail_their_calls(llm):
    llm.script = lambda r: Reply("ok") if r.index == 0 else Reply(status=400)
    results, _ = _calls(_settings(llm), [f"p{i}" for i in range(8)])
    assert results[0] == "ok" and all(isinstance(r, CallFailed) for r in results[1:])

    llm.requests.clear()
    llm.script = lambda r: Reply(status=400 if r.index % 2 else 422)
    results, _ = _calls(_settings(llm), [f"p{i}" for i in range(8)])
    assert all(isinstance(r, CallFailed) for r in results) and len(llm.requests) == 8
