"""The HTTP layer: the standard library's threading server, one thread per request; each request submits to the
shared batcher and waits. Streams are Server-Sent Events over HTTP/1.1 chunked encoding. Whatever a request
sends, the answer is JSON (an OpenAI-style error for anything wrong) and the server keeps serving.

Threads rather than asyncio, by measurement (bench/http_stacks.py): against Starlette on uvicorn it answers
quick requests 1.3x faster and holds 1,000 Tinker long polls at the same latency and RSS; at 2,000 it costs
23 MB and 0.5 s more, which sampling 2,000 completions dwarfs.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import threading
import traceback
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import unquote, urlsplit

from hanzo_gym.errors import GymError
from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.model.hub import choose_precision, model_key, resolve_model
from hanzo_gym.serve.api import chat, complete
from hanzo_gym.serve.api_keys import KEY_ENV, LOCAL_USER, ApiKeys, is_loopback
from hanzo_gym.serve.models import ServedModels
from hanzo_gym.serve.protocol import (
    APIError,
    parse_chat,
    parse_completion,
    parse_load_adapter,
    parse_unload_adapter,
)
from hanzo_gym.serve.responses import model_card, model_list
from hanzo_gym.serve.tinker_api import PREFIX as TINKER_PREFIX
from hanzo_gym.serve.tinker_api import TinkerAPI

MAX_BODY = 16 * 1024 * 1024
# What answers without a key: a load balancer's or an orchestrator's health probe.
UNGUARDED = ("/health", TINKER_PREFIX + "healthz")
POST_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
GET_ROUTES = ("/v1/models", "/health")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 2048  # connections waiting to be accepted (uvicorn's default): a burst of
    # SDK polls beyond it would wait on SYN retries, seconds each
    models: ServedModels
    verbose: bool
    tinker: TinkerAPI | None = None  # with `gym serve --tinker`: Tinker's /api/v1/* beside OpenAI's /v1/*
    keys: ApiKeys  # who may use it (no keys: whoever reaches a loopback address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if self.verbose:
            super().handle_error(request, client_address)


class _IPv6HTTPServer(_HTTPServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "hanzo-gym"
    timeout = 600  # seconds a connection may sit idle or stall mid-request
    # Headers and body go out in two writes; with Nagle on, the second waits for the client's delayed ACK
    # (40 ms on Linux) on every keep-alive request: 23 requests/s instead of over 1,000 (bench/http_stacks.py).
    disable_nagle_algorithm = True
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_POST

    # -- routing ---------------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        self._body_read = False
        path = urlsplit(self.path).path
        user = self.server.keys.user_of(self.headers)
        if user is None and path.rstrip("/") not in UNGUARDED:
            self._refuse_without_key(path)
            return
        if self.server.tinker is not None and path.startswith(TINKER_PREFIX):
            self._tinker(path, user or LOCAL_USER)
            return
        try:
            result = self._route(urlsplit(self.path).path.rstrip("/") or "/")
        except APIError as error:
            self._send_json(error.status, error.body())
            return
        except Exception as exc:  # noqa: BLE001 - a bug answers 500; it must not take the server down
            traceback.print_exc(file=sys.stderr)
            self._send_json(500, APIError(f"internal error: {exc}", 500, "server_error").body())
            return
        if isinstance(result, Iterator):
            self._send_stream(result)
        elif isinstance(result, str):
            self._send(200, result.encode(), "text/plain; charset=utf-8")
        else:
            self._send_json(200, result)

    def _route(self, path: str) -> Any:
        models = self.server.models
        if path in GET_ROUTES or path.startswith("/v1/models/"):
            self._require("GET")
            if path == "/health":
                return {"status": "ok"}
            if path == "/v1/models":
                return model_list(_cards(models))
            wanted = unquote(path[len("/v1/models/") :])
            for card in _cards(models):
                if card["id"] == wanted:
                    return card
            raise APIError(f"The model `{wanted}` does not exist", 404, param="model", code="model_not_found")
        if path not in POST_ROUTES:
            raise APIError(f"no such endpoint: {self.command} {path}", 404, code="not_found")
        self._require("POST")
        body = self._read_json()
        if path == "/v1/chat/completions":
            return chat(models, parse_chat(body), self._client_gone)
        if path == "/v1/completions":
            return complete(models, parse_completion(body), self._client_gone)
        if path == "/v1/load_lora_adapter":
            request = parse_load_adapter(body)
            models.load(request.name, request.path)
            return f"Success: LoRA adapter '{request.name}' added successfully."
        name = parse_unload_adapter(body)
        models.unload(name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _tinker(self, path: str, user: str) -> None:
        """A Tinker SDK request: the body as bytes (protobuf or JSON) to the Tinker API, its reply back."""
        try:
            body = self._read_body()
        except APIError as error:
            self._send_json(error.status, {"error": error.message, "category": "user"})
            return
        query = urlsplit(self.path).query
        reply = self.server.tinker.handle(self.command, path, self.headers, body, query, user=user)
        self._send(reply.status, reply.body, reply.content_type)

    def _refuse_without_key(self, path: str) -> None:
        """A 401 in the form each client reads: OpenAI's error object, or the Tinker SDK's user error."""
        message = "this server needs an API key: send it as `Authorization: Bearer KEY` or `X-API-Key: KEY`"
        if path.startswith(TINKER_PREFIX):
            body: Any = {"error": message, "category": "user"}
        else:
            body = APIError(message, 401, "invalid_request_error", code="invalid_api_key").body()
        self._send_json(401, body)

    def _read_body(self) -> bytes:
        """The request body, sent with a Content-Length or chunked (at most MAX_BODY bytes either way)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts, size = [], 0
            while True:
                line = self.rfile.readline(1024)
                try:
                    length = int(line.split(b";")[0].strip() or b"x", 16)
                except ValueError:
                    self.close_connection = True
                    raise APIError("bad chunked body", code="invalid_body") from None
                if length == 0:
                    while self.rfile.readline(1024).strip():  # trailers
                        pass
                    break
                size += length
                if size > MAX_BODY:
                    self.close_connection = True
                    raise APIError(f"the body is over {MAX_BODY} bytes", 413, code="body_too_large")
                parts.append(self.rfile.read(length))
                self.rfile.readline(1024)
            self._body_read = True
            return b"".join(parts)
        header = self.headers.get("Content-Length") or "0"
        try:
            length = int(header)
        except ValueError:
            raise APIError(f"bad Content-Length {header!r}", code="invalid_body") from None
        if not 0 <= length <= MAX_BODY:
            raise APIError(f"the body is over {MAX_BODY} bytes", 413, code="body_too_large")
        data = self.rfile.read(length)
        self._body_read = True
        if len(data) < length:
            self.close_connection = True
            raise APIError("the body ended before its Content-Length", code="invalid_body")
        return data

    def _client_gone(self) -> bool:
        """Whether the client hung up: its socket reads as closed. Bytes waiting (a pipelined request) are not
        a hang-up."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _require(self, method: str) -> None:
        if self.command != method:
            raise APIError(f"{self.path} takes {method}, not {self.command}", 405, code="method_not_allowed")

    def _read_json(self) -> Any:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise APIError("chunked request bodies are not supported: send a Content-Length", 411)
        header = self.headers.get("Content-Length")
        if header is None:
            raise APIError("a JSON body with a Content-Length is required", 411, code="length_required")
        try:
            length = int(header)
        except ValueError:
            raise APIError(f"bad Content-Length {header!r}", code="invalid_body") from None
        if length < 0:
            raise APIError(f"bad Content-Length {header!r}", code="invalid_body")
        if length > MAX_BODY:
            raise APIError(f"the body is over {MAX_BODY} bytes", 413, code="body_too_large")
        data = self.rfile.read(length)
        self._body_read = True
        if len(data) < length:
            self.close_connection = True
            raise APIError("the body ended before its Content-Length", code="invalid_body")
        try:
            body = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise APIError(f"the body is not valid JSON: {exc}", code="invalid_json") from None
        try:
            # JSON escapes can spell a lone surrogate (\ud800), which no tokenizer can encode.
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(
                "the body holds a lone UTF-16 surrogate: send valid Unicode text", code="invalid_body"
            ) from None
        return body

    # -- writing ---------------------------------------------------------------------------------------------
    def _send(self, status: int, data: bytes, content_type: str) -> None:
        if not self._body_read and int(self.headers.get("Content-Length") or 0) != 0:
            self.close_connection = True  # the unread body would be taken for the next request
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        except (ConnectionError, TimeoutError):
            self.close_connection = True

    def _send_json(self, status: int, body: Any) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send_stream(self, chunks: Iterator[dict[str, Any]]) -> None:
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for chunk in chunks:
                    self._write_event(json.dumps(chunk))
            except APIError as error:  # after the headers: the error travels as an event
                self._write_event(json.dumps(error.body()))
            except (ConnectionError, TimeoutError):
                raise
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc(file=sys.stderr)
                self._write_event(json.dumps(APIError(f"internal error: {exc}", 500, "server_error").body()))
            self._write_event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (ConnectionError, TimeoutError):
            self.close_connection = True  # the client left; closing the stream cancels its sampling
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    def _write_event(self, payload: str) -> None:
        data = f"data: {payload}\n\n".encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def _cards(models: ServedModels) -> list[dict[str, Any]]:
    cards = [model_card(models.name, models.created, models.host.base_model, None)]
    cards += [model_card(a.name, a.created, a.path, models.name) for a in models.adapters()]
    for card in cards:  # what a request may ask of this server (vLLM states max_model_len too)
        card["max_model_len"] = models.context_length
        card["default_max_tokens"] = models.max_tokens_default
        card["max_request_tokens"] = models.max_request_tokens
    return cards


class Server:
    """An OpenAI-compatible server over `models`. `port=0` takes a free port; `start()` serves on a thread
    (what tests do), `serve_forever()` on this one; `stop()` ends it."""

    def __init__(
        self,
        models: ServedModels,
        bind: str = "127.0.0.1",
        port: int = 8000,
        verbose: bool = False,
        tinker: TinkerAPI | None = None,
        keys: ApiKeys | None = None,
        insecure_no_auth: bool = False,
    ):
        self.models = models
        self.tinker = tinker
        keys = keys or ApiKeys([])
        check_exposure(keys, bind, tinker is not None, insecure_no_auth)
        server_class = _IPv6HTTPServer if ":" in bind else _HTTPServer
        try:
            self.httpd = server_class((bind, port), _Handler)
        except OSError as exc:
            raise GymError(f"cannot listen on {bind}:{port}: {exc.strerror or exc}") from None
        self.httpd.models = models
        self.httpd.verbose = verbose
        self.httpd.tinker = tinker
        self.httpd.keys = keys
        self.bind = bind
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"http://{host}:{self.port}/v1"

    @property
    def base_url(self) -> str:
        """What the Tinker SDK takes as base_url (TINKER_BASE_URL)."""
        return self.url.removesuffix("/v1")

    def banner(self) -> str:
        text = f"serving {', '.join(self.models.names())} on {self.url}"
        if self.tinker is not None:
            key = "one of the server's keys" if self.httpd.keys.required else "tml-local"
            text += f"; Tinker API on {self.base_url} (TINKER_BASE_URL={self.base_url} TINKER_API_KEY={key})"
        if self.httpd.keys.required:
            text += "; requests need an API key"
        return text

    def start(self) -> Self:
        if self._thread is not None:
            return self  # a second serving thread would outlive stop(): shutdown() ends only one of them
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="hanzo-gym-serve", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()
        if self.tinker is not None:
            self.tinker.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def check_exposure(keys: ApiKeys, bind: str, tinker: bool, insecure_no_auth: bool) -> None:
    """A server without keys listens on a loopback address only, unless told --insecure-no-auth."""
    if not keys.required and not is_loopback(bind) and not insecure_no_auth:
        raise GymError(
            f"--host {bind} without an API key would let anyone who reaches this machine use "
            f"{'every run, checkpoint and adapter on it' if tinker else 'its models and adapters'}: give "
            f"--api-key KEY (or --api-key-file, or ${KEY_ENV}), or --insecure-no-auth to serve without keys"
        )


def serve(
    host: ModelHost,
    adapters: dict[str, str] | None = None,
    bind: str = "127.0.0.1",
    port: int = 8000,
    renderer: str | None = None,
    name: str | None = None,
    verbose: bool = False,
    limits: dict[str, int] | None = None,
    tinker: bool = False,
    tinker_models: dict[str, str] | None = None,
    tinker_sampler: str = "builtin",
    keys: ApiKeys | None = None,
    insecure_no_auth: bool = False,
) -> None:
    """Serve `host`'s base model and `adapters` (name → PEFT folder or gym:// path) until interrupted; with
    `tinker`, Tinker's training and sampling API too (checkpoints under $HANZO_GYM_RUNS), on `host` and on
    `tinker_models` (name → base model, each loaded at its first use), its samples decoded by `tinker_sampler`
    (`builtin` or `vllm`)."""
    try:
        models = ServedModels(host, adapters, renderer=renderer, name=name, **(limits or {}))
    except APIError as error:
        raise GymError(error.message) from None
    api = tinker_api(models, more_models=tinker_models, sampler=tinker_sampler) if tinker else None
    server = Server(models, bind, port, verbose, api, keys, insecure_no_auth)
    print(server.banner(), flush=True)
    try:
        server.serve_forever()
    finally:
        server.stop()
        models.batcher.close()


def parse_named_paths(specs: list[str] | None, flag: str, what: str) -> dict[str, str]:
    """`NAME=PATH` command-line values (`flag` and `what` PATH is, for the error) as {name: path}."""
    named: dict[str, str] = {}
    for spec in specs or []:
        name, sep, path = (part.strip() for part in spec.partition("="))
        if not sep or not name or not path:
            raise GymError(f"{flag} {spec!r}: write NAME=PATH ({what})")
        if name in named:
            raise GymError(f"{flag} {name} is given twice")
        named[name] = path
    return named


def run_serve(
    model: str,
    adapter_specs: list[str] | None = None,
    bind: str = "127.0.0.1",
    port: int = 8000,
    renderer: str | None = None,
    name: str | None = None,
    verbose: bool = False,
    default_max_tokens: int | None = None,
    max_request_tokens: int | None = None,
    tinker: bool = False,
    tinker_model_specs: list[str] | None = None,
    bf16: str | bool = "auto",
    tinker_sampler: str = "builtin",
    api_keys: list[str] | None = None,
    api_key_file: str | None = None,
    insecure_no_auth: bool = False,
) -> None:
    """`gym serve`: load the base model once, in the precision `bf16` picks (the config key's values), then
    serve it with its adapters, to the holders of `api_keys` (and the file's, and $VLLM_API_KEY's) only."""
    keys = ApiKeys.from_sources(api_keys, api_key_file)
    check_exposure(keys, bind, tinker, insecure_no_auth)  # before the model loads: refused in a moment
    adapters = parse_named_paths(adapter_specs, "--adapter", "a PEFT adapter folder or a gym:// path")
    tinker_models = parse_named_paths(
        tinker_model_specs, "--tinker-model", "a base model: hub id, local folder or .gguf file"
    )
    if tinker_models and not tinker:
        raise GymError("--tinker-model adds base models to the Tinker API: give --tinker as well")
    if tinker_sampler != "builtin" and not tinker:
        raise GymError("--tinker-sampler picks what decodes the Tinker API's samples: give --tinker as well")
    for tinker_name, path in tinker_models.items():
        if tinker_name in (name, model) or model_key(tinker_name) == model_key(model):
            raise GymError(f"--tinker-model {tinker_name}: that name is already the served model's")
        try:
            resolve_model(path)  # a typo fails now, not at a client's first create_model
        except GymError as exc:
            raise GymError(f"--tinker-model {tinker_name}={path}: {exc}") from None
    if not 0 <= port <= 65535:
        raise GymError(f"--port {port}: use 0-65535")
    limits = {"default_max_tokens": default_max_tokens, "max_request_tokens": max_request_tokens}
    for key, value in limits.items():
        if value is not None and value < 1:
            raise GymError(f"--{key.replace('_', '-')} {value}: use a positive number of tokens")
    limits = {key: value for key, value in limits.items() if value is not None}
    if tinker:
        from hanzo_gym.serve.tinker_wire import proto

        proto()  # before the model loads: a missing SDK fails in a moment
    if tinker_sampler == "vllm":
        from hanzo_gym.rollout.vllm_import import import_vllm

        import_vllm("--tinker-sampler vllm")  # likewise: without vLLM, the install command now
    precision = choose_precision(bf16)
    print(precision.describe(), flush=True)
    host = ModelHost(model, precision.device, precision.dtype)
    serve(
        host,
        adapters,
        bind,
        port,
        renderer,
        name,
        verbose,
        limits,
        tinker,
        tinker_models,
        tinker_sampler,
        keys,
        insecure_no_auth,
    )


def tinker_api(
    models: ServedModels,
    root: str | None = None,
    more_models: dict[str, str] | None = None,
    sampler: str = "builtin",
    **options: Any,
) -> TinkerAPI:
    """Tinker's API over `models`' base model (one copy in memory, shared with the OpenAI endpoints), which
    answers to the served name as well as to its path, and over `more_models` (name → base model, loaded at
    the first request that names it). Training clients add adapters to their base model. With `sampler="vllm"`
    the Tinker clients' samples are decoded by a colocated vLLM (the OpenAI endpoints keep the built-in
    sampler, which streams)."""
    from hanzo_gym.tinker.service_client import ServiceClient

    service = ServiceClient(
        root=root, device=models.host.device, dtype=models.host.precision.dtype, sampler=sampler
    )
    if sampler == "vllm":
        from hanzo_gym.rollout.vllm_batcher import VllmBatcher

        service.serve_host(models.host, VllmBatcher(models.host))
    else:
        service.serve_host(models.host, models.batcher)
    names = {models.name: models.host.base_model}
    for name, base_model in (more_models or {}).items():
        if name in names:
            raise GymError(f"--tinker-model {name}: that name is already the served model's")
        names[name] = base_model
    return TinkerAPI(service, names, max_request_tokens=models.max_request_tokens, **options)
