"""Tinker's HTTP API (`/api/v1/*`, what the official `tinker` SDK speaks) over the in-process Tinker clients.

Each endpoint maps onto one operation of `hanzo_gym.tinker` (ServiceClient, TrainingClient, SamplingClient),
so a script gets the same numbers in-process and through the SDK. The transport is not here: `handle()` takes
a method, path, headers and body and returns a `Reply`, and `serve.server` wires it into `gym serve --tinker`.

The protocol's rules, as the SDK 0.38 expects them (`shared/reference/tinker-wire-protocol.md`):
- Work is submitted (`{"request_id"}` at once) and fetched with `retrieve_future`, which holds the poll until
  the result is there or LONG_POLL_SECONDS pass (then `try_again`), under the SDK's 45 s read timeout.
- A failure is `{"error", "category"}`: `user` for anything the request got wrong (GymError), `server` for a
  bug. Never a 5xx or a bare 400 for a user mistake: the SDK retries those for minutes.
- A submit resent with the same `(model_id, seq_id)` (the SDK retries timeouts) gets the first submit's
  request id and runs once. A training client's requests run one at a time in `seq_id` order: one that comes
  early waits for those before it (at most SEQ_GAP_SECONDS). `client/config` also sets
  `parallel_fwdbwd_chunks=false`, so the SDK sends them in that order anyway.
- Model ids are `{session_id}:train:{model_seq_id}` (the SDK derives them itself on create-via-load).
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs, unquote

import hanzo_gym.serve.tinker_fields as fields
import hanzo_gym.serve.tinker_wire as wire
from hanzo_gym.errors import GymError
from hanzo_gym.model.hub import model_key
from hanzo_gym.records import AdamParams, ModelInput
from hanzo_gym.serve.api_keys import LOCAL_USER
from hanzo_gym.serve.models import MAX_REQUEST_TOKENS
from hanzo_gym.serve.tinker_runs import NotFound, TrainingRuns
from hanzo_gym.serve.tinker_wire import WireError
from hanzo_gym.tinker.sampling_client import SamplingClient
from hanzo_gym.tinker.service_client import ServiceClient
from hanzo_gym.tinker.training_client import TrainingClient

PREFIX = "/api/v1/"
LONG_POLL_SECONDS = 30.0  # a retrieve_future waits this long before `try_again` (the SDK gives up at 45)
FUTURE_TTL_SECONDS = 900.0  # a result nobody fetched is dropped this long after its submit
# Work nobody has polled for this long is cancelled: the SDK polls each future from its submit on, and its worst
# gap is a 45 s poll timeout plus a 30 s back-off, so a client this silent has gone (crashed, or hung up).
ABANDONED_AFTER_SECONDS = 120.0
DELIVERED_TTL_SECONDS = 60.0  # a fetched result is kept this long, for a re-poll after a lost reply
MAX_SNAPSHOTS_PER_MODEL = 8  # save_weights_and_get_sampling_client sessions kept per training model
SEQ_GAP_SECONDS = 60.0  # a request that came early waits this long for the seq_ids before it, then runs
PROTO = "application/x-protobuf"
JSON = "application/json"
# Losses of the hosted service whose semantics are not public: refused by name, never silently replaced.
HOSTED_ONLY_LOSSES = ("stable_reinforce", "gspo", "custom")
MAX_LORA_RANK = 1024
# What one user may have decoding or queued at once, in tokens, as a multiple of what one request may ask for.
# More gets 429, which the SDK's sampling client takes as back-pressure: it waits a second and resends.
IN_FLIGHT_REQUESTS = 8


@dataclass
class Reply:
    status: int
    body: bytes
    content_type: str = JSON

    @classmethod
    def json(cls, value: Any, status: int = 200) -> Reply:
        # allow_nan=False: NaN is not JSON, and the SDK cannot read a reply that holds it
        return cls(status, json.dumps(value, allow_nan=False).encode())


class DirectError(GymError):
    """A user error on an endpoint answered directly (not through a future): sent with `status`."""

    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status


class Busy(DirectError):
    """A submit refused for now (429), even where others become failed futures: the client may resend it."""

    def __init__(self, message: str):
        super().__init__(message, 429)


@dataclass
class _Base:
    name: str  # what clients call it (the first served name)
    key: str  # model_key of the base model: how the in-process ServiceClient knows it
    tokenizer_id: str  # what get_info tells the SDK to load: the model's folder when it has one


@dataclass
class _Trained:
    client: TrainingClient
    base: _Base
    snapshots: list[str] = field(default_factory=list)  # sampling sessions made from it, oldest first
    next_seq: int = 1  # the SDK numbers a training client's requests 1, 2, …: the one that may start now
    held: dict[int, tuple[Callable[[], concurrent.futures.Future], concurrent.futures.Future, float]] = field(
        default_factory=dict
    )  # seq_id → (start, the future the client polls, when it came): requests that came before their turn


@dataclass
class _Sampler:
    client: SamplingClient
    base: _Base
    model_path: str | None  # tinker:// path it was made from, if any


@dataclass
class _Pending:
    future: concurrent.futures.Future
    encode: Callable[[Any], Reply]
    owner: str = LOCAL_USER  # the user who submitted it: only they may fetch it
    cancel: Callable[[], None] | None = None  # stops a sample's decoding, queued or running
    created: float = field(default_factory=time.monotonic)
    polled: float = field(default_factory=time.monotonic)  # when a poll for it last came or ended
    polls: int = 0  # polls waiting for it now
    tokens: int = 0  # what a sample may still decode, counted against its owner's tokens in flight
    reply: Reply | None = None
    delivered: float | None = None  # when the result was first sent

    def abandoned(self, now: float, after: float) -> bool:
        """Work that can be stopped (sampling; a training step is short and keeps its client's order) whose
        client has not polled for `after` seconds."""
        return (
            self.cancel is not None
            and not self.future.done()
            and not self.polls
            and now - self.polled > after
        )


class TinkerAPI:
    """`service` does the work; `names` maps each name a client may use as `base_model` to the base model
    (as `service` loads it). The base model's own path and hub id are accepted too."""

    def __init__(
        self,
        service: ServiceClient,
        names: Mapping[str, str],
        long_poll_seconds: float = LONG_POLL_SECONDS,
        max_request_tokens: int = MAX_REQUEST_TOKENS,
        abandoned_after_seconds: float = ABANDONED_AFTER_SECONDS,
    ):
        self.service = service
        self.long_poll_seconds = long_poll_seconds
        self.abandoned_after_seconds = abandoned_after_seconds
        self.max_request_tokens = max_request_tokens  # what one asample may decode: num_samples × max_tokens
        self._bases: dict[str, _Base] = {}  # by every accepted name
        for name, base_model in names.items():
            key = model_key(base_model)
            base = next((b for b in self._bases.values() if b.key == key), None) or _Base(
                name, key, _tokenizer_id(base_model)
            )
            for alias in (name, base_model, key):
                self._bases.setdefault(alias, base)
        self._lock = threading.Lock()
        self._session_owners: dict[str, str] = {}  # session id → the user whose key made it
        self._caller = threading.local()  # the user of the request this thread is answering
        self._training: dict[str, _Trained] = {}
        self._sampling: dict[str, _Sampler] = {}
        self._futures: dict[str, _Pending] = {}
        self._submits: dict[tuple, dict[str, Any]] = {}  # dedup key → the submit's reply
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="tinker-api")
        self.runs = TrainingRuns(service.root, self._display_name)
        self._closed = threading.Event()
        threading.Thread(target=self._reap_abandoned, name="tinker-api-reaper", daemon=True).start()

    def served_names(self) -> list[str]:
        return sorted({base.name for base in self._bases.values()})

    def close(self) -> None:
        self._closed.set()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _reap_abandoned(self) -> None:
        """Give up the work of clients that went away, so it stops holding the model from everyone else."""
        while not self._closed.wait(min(10.0, self.abandoned_after_seconds / 4)):
            now = time.monotonic()
            with self._lock:
                gone = [p for p in self._futures.values() if p.abandoned(now, self.abandoned_after_seconds)]
            for pending in gone:
                pending.cancel()  # its rows leave the batch at the next decode step; the future fails

    # -- dispatch ------------------------------------------------------------------------------------------
    def handle(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        query: str = "",
        user: str = LOCAL_USER,
    ) -> Reply:
        """The reply to one request (`query`: the URL's query string) made with `user`'s key; never raises.
        What a user made (sessions, models, samplers, futures, runs and their checkpoints) is theirs: to
        anyone else it does not exist."""
        endpoint = path[len(PREFIX) :].strip("/") if path.startswith(PREFIX) else path
        self._caller.user = user
        try:
            if method == "GET":
                return self._get(endpoint, parse_qs(query))
            if method == "DELETE" and endpoint.startswith("training_runs/"):
                return self._delete_checkpoint(endpoint)
            if method != "POST":
                raise DirectError(f"{path} takes POST or GET, not {method}", 405)
            if endpoint == "forward_backward":
                return self._submit_reply(lambda: self._forward_backward(body, headers))
            if endpoint.startswith("sessions/") and endpoint.endswith("/finish"):
                return Reply.json({})
            handler = self._POSTS.get(endpoint)
            if handler is None:
                raise DirectError(f"no such endpoint: POST {path}", 404)
            request = _json_object(body)
            if endpoint in self._SUBMITS:
                return self._submit_reply(lambda: handler(self, request))
            result = handler(self, request)
            return result if isinstance(result, Reply) else Reply.json(result)
        except GymError as exc:
            status = exc.status if isinstance(exc, DirectError) else 404 if isinstance(exc, NotFound) else 422
            message = self._public(str(exc))
            return Reply.json({"error": message, "category": "user", "detail": message}, status)
        except Exception as exc:  # noqa: BLE001 - a bug answers once; the server keeps serving
            traceback.print_exc(file=sys.stderr)
            return Reply.json({"error": self._public(f"internal error: {exc}"), "category": "server"}, 500)

    def _get(self, endpoint: str, query: dict[str, list[str]]) -> Reply:
        parts = [unquote(part) for part in endpoint.split("/")]
        if parts[0] == "training_runs" and len(parts) <= 3:
            if len(parts) == 1:
                return Reply.json(self.runs.runs(*_page(query, 20), user=self._me))
            if len(parts) == 2:
                return Reply.json(self.runs.run(parts[1], self._me))
            if parts[2] == "checkpoints":
                return Reply.json(self.runs.checkpoints(parts[1], self._me))
        if endpoint == "checkpoints":
            return Reply.json(self.runs.all_checkpoints(*_page(query, 100), user=self._me))
        if endpoint == "healthz":
            return Reply.json({"status": "ok"})
        if endpoint == "get_server_capabilities":
            models = [
                {"model_name": name, "trainable": True, "sampleable": True} for name in self.served_names()
            ]
            return Reply.json({"supported_models": models})
        if endpoint.startswith("samplers/"):
            session_id = unquote(endpoint[len("samplers/") :])
            sampler = self._sampler(session_id, lambda message: DirectError(message, 404))
            return Reply.json(
                {"sampler_id": session_id, "base_model": sampler.base.name, "model_path": sampler.model_path}
            )
        raise DirectError(f"no such endpoint: GET {PREFIX}{endpoint}", 404)

    # -- direct endpoints ----------------------------------------------------------------------------------
    def _weights_info(self, request: dict) -> dict:
        return self.runs.weights_info(
            *_checkpoint_address(_field(request, "tinker_path", str)), user=self._me
        )

    def _delete_checkpoint(self, endpoint: str) -> Reply:
        """DELETE training_runs/<run>/checkpoints/<weights|sampler_weights>/<name> (the SDK's checkpoint_id is
        `<kind>/<name>`)."""
        parts = [unquote(part) for part in endpoint.split("/")]
        if len(parts) != 5 or parts[2] != "checkpoints":
            raise DirectError(f"no such endpoint: DELETE {PREFIX}{endpoint}", 404)
        self.runs.delete(parts[1], parts[3], parts[4], self._me)
        return Reply.json({})

    def _client_config(self, _: dict) -> dict:
        # One chunk's POST at a time per training client: requests arrive in seq_id order.
        return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": False, "proto_compress_fwdbwd": False}

    def _dynamic_config(self, _: dict) -> dict:
        return {"refresh_interval_sec": 300}

    def _create_session(self, request: dict) -> dict:
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._session_owners[session_id] = self._me
        return {"type": "create_session", "session_id": session_id}

    def _heartbeat(self, _: dict) -> dict:
        return {"type": "session_heartbeat"}

    def _telemetry(self, _: dict) -> dict:
        return {"status": "accepted"}

    def _get_info(self, request: dict) -> dict:
        model_id = _field(request, "model_id", str)
        trained = self._trained(model_id, lambda message: DirectError(message, 404))
        info = trained.client.get_info()
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": info.model_data.arch,
                "model_name": trained.base.name,
                "tokenizer_id": trained.base.tokenizer_id,
            },
            "is_lora": True,
            "lora_rank": info.lora_rank,
            "model_name": trained.base.name,
            "optimizer_config": {"type": "adamw"},
        }

    def _create_sampling_session(self, request: dict) -> dict:
        session_id = self._own_session(_field(request, "session_id", str))
        seq_id = _field(request, "sampling_session_seq_id", int)
        sampling_session_id = f"{session_id}:sample:{seq_id}"
        with self._lock:
            if sampling_session_id in self._sampling:  # a resent request
                return {"type": "create_sampling_session", "sampling_session_id": sampling_session_id}
        model_path = request.get("model_path")
        base_model = request.get("base_model")
        if model_path is None and base_model is None:
            raise DirectError("create_sampling_session needs model_path (a tinker:// path) or base_model")
        base = self._base(base_model) if base_model is not None else None
        if model_path is not None:
            client = self.service.create_sampling_client(
                model_path=self._owned_path(str(model_path), self._me), base_model=base.key if base else None
            )
            base = base or self._base_of(client.get_base_model())
        else:
            client = self.service.create_sampling_client(base_model=base.key)
        with self._lock:
            self._sampling[sampling_session_id] = _Sampler(client, base, model_path)
        return {"type": "create_sampling_session", "sampling_session_id": sampling_session_id}

    # -- submitted work ------------------------------------------------------------------------------------
    def _submit_reply(self, submit: Callable[[], dict]) -> Reply:
        """A submit's `{"request_id", …}`; a request it cannot take becomes a future that fails with its
        error, which the SDK reports as RequestFailedError (a user error for a GymError)."""
        try:
            return Reply.json(submit())
        except Busy:
            raise
        except Exception as exc:  # noqa: BLE001 - the client reads it from the future
            if not isinstance(exc, GymError):
                traceback.print_exc(file=sys.stderr)
            failed: concurrent.futures.Future = concurrent.futures.Future()
            failed.set_exception(exc)
            with self._lock:
                return Reply.json(self._register(None, failed, _json_reply))

    def _register(
        self,
        key: tuple | None,
        future: concurrent.futures.Future,
        encode: Callable[[Any], Reply],
        extra: Callable[[str], dict] | None = None,
        cancel: Callable[[], None] | None = None,
    ) -> dict:
        """Under the lock when `key` is given (the caller checked it is new)."""
        request_id = f"req-{uuid.uuid4().hex}"
        reply = {"request_id": request_id, **(extra(request_id) if extra else {})}
        self._futures[request_id] = _Pending(future, encode, owner=self._me, cancel=cancel)
        if key is not None:
            self._submits[key] = reply
        self._expire()
        return reply

    def _once(
        self,
        key: tuple,
        start: Callable[[], concurrent.futures.Future],
        encode: Callable[[Any], Reply],
        extra: Callable[[str], dict] | None = None,
        cancel: Callable[[], None] | None = None,
    ) -> dict:
        """Start the work unless a submit with this key already did; either way, that submit's reply. A key
        ending in None (a request without a seq_id) is never a resend. Holding the lock while starting keeps
        arrival order as execution order."""
        with self._lock:
            if key[-1] is None:
                return self._register(None, start(), encode, extra, cancel)
            if key in self._submits:
                return self._submits[key]
            return self._register(key, start(), encode, extra, cancel)

    def _in_order(
        self,
        trained: _Trained,
        model_id: str,
        seq_id: Any,
        start: Callable[[], concurrent.futures.Future],
        encode: Callable[[Any], Reply],
    ) -> dict:
        """A training client's request, run in seq_id order: one that comes before its turn waits (its future
        is a placeholder) until the ones before it came, or SEQ_GAP_SECONDS passed. Its checks run in `start`,
        at its turn, so a refused request still takes its place in the order."""

        def ordered() -> concurrent.futures.Future:  # under the lock
            if not isinstance(seq_id, int) or seq_id < trained.next_seq:
                return start()  # no seq_id, or later than its turn: nothing to wait for
            if seq_id > trained.next_seq:
                placeholder: concurrent.futures.Future = concurrent.futures.Future()
                trained.held[seq_id] = (start, placeholder, time.monotonic())
                return placeholder
            try:
                return start()
            finally:
                trained.next_seq += 1
                self._release(trained)

        return self._once(("train", model_id, seq_id), ordered, encode)

    def _release(self, trained: _Trained, now: float | None = None) -> None:
        """Start the held requests whose turn has come (under the lock); with `now`, give up on a gap older
        than SEQ_GAP_SECONDS."""
        while trained.held:
            if trained.next_seq in trained.held:
                start, placeholder, _ = trained.held.pop(trained.next_seq)
                trained.next_seq += 1
                _start_into(start, placeholder)
            elif now is not None and now - trained.held[min(trained.held)][2] > SEQ_GAP_SECONDS:
                trained.next_seq = min(trained.held)  # the missing requests never came
            else:
                return

    def _expire(self) -> None:
        now = time.monotonic()
        old = [
            rid
            for rid, p in self._futures.items()
            if p.future.done()
            and (now - p.created > FUTURE_TTL_SECONDS or now - (p.delivered or now) > DELIVERED_TTL_SECONDS)
        ]
        for request_id in old:
            del self._futures[request_id]
        if old:
            gone = set(old)
            self._submits = {k: v for k, v in self._submits.items() if v["request_id"] not in gone}

    def _retrieve_future(self, request: dict) -> Reply:
        request_id = _field(request, "request_id", str)
        with self._lock:
            pending = self._futures.get(request_id)
            if pending is not None and pending.owner != self._me:
                pending = None  # another user's: as unknown as one that never was
            now = time.monotonic()
            for trained in self._training.values():
                if trained.held:
                    self._release(trained, now)
        if pending is None:
            return Reply.json(
                {
                    "error": f"unknown request id {request_id!r} (expired, or from before a restart)",
                    "category": "user",
                }
            )
        if pending.reply is None:
            future = pending.future
            with self._lock:
                pending.polls += 1
            try:
                finished = concurrent.futures.wait([future], timeout=self.long_poll_seconds).done
            finally:
                with self._lock:
                    pending.polls -= 1
                    pending.polled = time.monotonic()
            if not finished:
                return Reply.json({"type": "try_again", "request_id": request_id, "queue_state": "active"})
            if future.cancelled():
                pending.reply = Reply.json(
                    {
                        "error": "cancelled: nobody polled for it, or the server is shutting down",
                        "category": "user",
                    }
                )
            elif future.exception() is not None:  # the request's own failure, sent as its result
                pending.reply = _failure(future.exception(), self._public)
            else:
                try:
                    pending.reply = pending.encode(future.result())
                except Exception as exc:  # noqa: BLE001
                    pending.reply = _failure(exc, self._public)
        pending.delivered = pending.delivered or time.monotonic()
        return pending.reply

    def _create_model(self, request: dict) -> dict:
        session_id = self._own_session(_field(request, "session_id", str))
        owner = self._me
        seq_id = _field(request, "model_seq_id", int)
        base = self._base(_field(request, "base_model", str))
        lora = request.get("lora_config") or {}
        if not isinstance(lora, dict):
            raise WireError("lora_config must be an object")
        _check_optimizer(request.get("optimizer_config"))
        model_id = f"{session_id}:train:{seq_id}"
        where = "lora_config."
        settings = {
            "rank": fields.integer(lora, "rank", 32, low=1, high=MAX_LORA_RANK, where=where),
            "seed": fields.integer(lora, "seed", None, low=0, high=2**63 - 1, where=where),
            **{
                name: fields.flag(lora, name, True, where)
                for name in ("train_mlp", "train_attn", "train_unembed")
            },
        }

        def create() -> dict:
            client = self.service.create_lora_training_client(
                base.key, **settings, user_metadata=request.get("user_metadata")
            )
            self.runs.set_owner(client.run_id, owner)
            with self._lock:
                self._training[model_id] = _Trained(client, base)
            return {"type": "create_model", "model_id": model_id}

        return self._once(("create_model", model_id), lambda: self._executor.submit(create), _json_reply)

    def _forward_backward(self, body: bytes, headers: Mapping[str, str]) -> dict:
        call = wire.decode_forward_backward(body, headers.get("Content-Encoding", "") or "")
        trained = self._trained(call.model_id)

        def start() -> concurrent.futures.Future:
            _check_loss(call.loss_fn)
            run = trained.client.forward if call.forward_only else trained.client.forward_backward
            return run(call.data, call.loss_fn, call.loss_fn_config).future()

        def encode(output: Any) -> Reply:
            body = wire.encode_forward_backward_output(output.loss_fn_outputs, output.metrics)
            return Reply(200, body, PROTO)

        return self._in_order(trained, call.model_id, call.seq_id, start, encode)

    def _optim_step(self, request: dict) -> dict:
        model_id = _field(request, "model_id", str)
        trained = self._trained(model_id)

        def start() -> concurrent.futures.Future:
            params = request.get("adam_params", request.get("optim_params"))
            if params is None:
                kind = (request.get("optimizer_params") or {}).get("type", "?")
                raise WireError(f"optimizer {kind!r} is not supported: this server steps AdamW (adam_params)")
            return trained.client.optim_step(_adam(params)).future()

        def encode(response: Any) -> Reply:
            return Reply.json(
                {"type": "optim_step", "metrics": {k: float(v) for k, v in (response.metrics or {}).items()}}
            )

        return self._in_order(trained, model_id, request.get("seq_id"), start, encode)

    def _save_weights(self, request: dict) -> dict:
        model_id = _field(request, "model_id", str)
        trained = self._trained(model_id)
        seq_id = request.get("seq_id")
        name = request.get("path") or f"{seq_id or 0:06d}"
        overwrite = bool(request.get("overwrite", False))

        def encode(response: Any) -> Reply:
            return Reply.json({"type": "save_weights", "path": wire.to_tinker_path(response.path)})

        return self._in_order(
            trained,
            model_id,
            seq_id,
            lambda: trained.client.save_state(str(name), overwrite=overwrite).future(),
            encode,
        )

    def _save_weights_for_sampler(self, request: dict) -> dict:
        model_id = _field(request, "model_id", str)
        trained = self._trained(model_id)
        seq_id = request.get("seq_id")
        name = request.get("path")
        if name is not None:

            def encode_path(response: Any) -> Reply:
                return Reply.json(
                    {"type": "save_weights_for_sampler", "path": wire.to_tinker_path(response.path)}
                )

            return self._in_order(
                trained,
                model_id,
                seq_id,
                lambda: trained.client.save_weights_for_sampler(str(name)).future(),
                encode_path,
            )
        # The sampling-session form (save_weights_and_get_sampling_client): a snapshot, no files. "inflight"
        # promises the weights of the save or newer ones, which a snapshot keeps.
        sampling_seq_id = request.get("sampling_session_seq_id")
        session_id = model_id.split(":train:")[0]
        sampling_session_id = f"{session_id}:sample:{sampling_seq_id}"

        def snapshot() -> concurrent.futures.Future:
            _field(request, "sampling_session_seq_id", int)
            return trained.client.sampling_snapshot().future()

        def register(client: SamplingClient) -> Reply:
            with self._lock:
                if sampling_session_id not in self._sampling:
                    self._sampling[sampling_session_id] = _Sampler(client, trained.base, None)
                    trained.snapshots.append(sampling_session_id)
                    while len(trained.snapshots) > MAX_SNAPSHOTS_PER_MODEL:
                        self._sampling.pop(trained.snapshots.pop(0), None)
            return Reply.json(
                {"type": "save_weights_for_sampler", "sampling_session_id": sampling_session_id}
            )

        return self._in_order(trained, model_id, seq_id, snapshot, register)

    def _load_weights(self, request: dict) -> dict:
        with_optimizer = bool(request.get("optimizer", False))
        model_id = request.get("model_id")
        if model_id is not None:  # legacy addressing: load into an existing training client
            trained = self._trained(str(model_id))
            user = self._me  # `load` may start on another request's thread, at its turn

            def load() -> concurrent.futures.Future:
                path = self._owned_path(_field(request, "path", str), user)
                client = trained.client
                return (client.load_state_with_optimizer if with_optimizer else client.load_state)(
                    path
                ).future()

            def encode_legacy(response: Any) -> Reply:
                return Reply.json(
                    {"type": "load_weights", "path": wire.to_tinker_path(response.path), "model_id": model_id}
                )

            return self._in_order(trained, str(model_id), request.get("seq_id"), load, encode_legacy)
        # Create-via-load: a new training client from a checkpoint, under the id the SDK derives itself.
        owner = self._me
        path = self._owned_path(_field(request, "path", str), owner)
        session_id = self._own_session(_field(request, "session_id", str))
        seq_id = _field(request, "model_seq_id", int)
        base = self._base(request["base_model"]) if request.get("base_model") else None
        if not with_optimizer:
            _check_optimizer(request.get("optimizer_config"))
        new_id = f"{session_id}:train:{seq_id}"

        def create() -> dict:
            make = (
                self.service.create_training_client_from_state_with_optimizer
                if with_optimizer
                else self.service.create_training_client_from_state
            )
            client = make(
                path, base_model=base.key if base else None, user_metadata=request.get("user_metadata")
            )
            trained = _Trained(client, base or self._base_of(client.get_info().model_name))
            self.runs.set_owner(client.run_id, owner)
            with self._lock:
                self._training[new_id] = trained
            return {"type": "load_weights", "path": wire.to_tinker_path(path), "model_id": new_id}

        return self._once(("create_model", new_id), lambda: self._executor.submit(create), _json_reply)

    def _unload_model(self, request: dict) -> dict:
        model_id = _field(request, "model_id", str)
        if self._owner_of(model_id) != self._me:
            self._trained(model_id)  # another user's: as unknown as one never made
        with self._lock:
            trained = self._training.pop(model_id, None)
            if trained is not None:
                for session in trained.snapshots:
                    self._sampling.pop(session, None)
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result({"type": "unload_model", "model_id": model_id})
        with self._lock:
            return self._register(None, done, _json_reply)

    def _asample(self, request: dict) -> dict:
        sampling_session_id = _field(request, "sampling_session_id", str)
        seq_id = request.get("seq_id")
        sampler = self._sampler(sampling_session_id)
        for name, what in (
            ("topk_sample_logprobs", "top-k logprobs of sampled tokens"),
            ("prompt_alt_tokens_k", "prompt alternative tokens"),
        ):
            if fields.integer(request, name, 0, low=0) > 0:
                raise WireError(f"{name}: {what} are not supported by this server")
        if request.get("target_prompt_logprobs") is not None:
            raise WireError("target_prompt_logprobs is not supported by this server")
        tokens = wire.prompt_tokens(request.get("prompt"))
        num_samples = fields.integer(request, "num_samples", 1, low=1, high=self.max_request_tokens)
        params = wire.sampling_params(request.get("sampling_params") or {})
        cost = self._check_sampling_cost(sampler, len(tokens), num_samples, params.max_tokens)
        want_logprobs = fields.flag(request, "prompt_logprobs", False)
        topk = fields.integer(request, "topk_prompt_logprobs", 0, low=0, high=wire.MAX_TOP_K)
        last_n = fields.integer(request, "prompt_logprobs_last_n", None, low=1, high=max(len(tokens) - 1, 1))

        stop = threading.Event()

        def start() -> concurrent.futures.Future:
            prompt = ModelInput.from_ints(tokens)
            return sampler.client.sample(
                prompt, num_samples, params, want_logprobs, topk, cancel=stop
            ).future()

        def encode(response: Any) -> Reply:
            prompt_logprobs, topk_rows = response.prompt_logprobs, response.topk_prompt_logprobs
            if last_n is not None:  # the positions before the last N are not scored
                hidden = len(tokens) - int(last_n)
                prompt_logprobs = prompt_logprobs and [None] * hidden + list(prompt_logprobs[hidden:])
                topk_rows = topk_rows and [None] * hidden + list(topk_rows[hidden:])
            body = wire.encode_sample_response(response.sequences, prompt_logprobs, topk_rows)
            return Reply(200, body, PROTO)

        def sequence_ids(request_id: str) -> dict:
            return {"sample_sequence_ids": [f"{request_id}:{index}" for index in range(num_samples)]}

        def start_within_share() -> concurrent.futures.Future:  # under the lock
            self._check_in_flight(cost)
            return start()

        reply = self._once(
            ("sample", sampling_session_id, seq_id),
            start_within_share,
            encode,
            sequence_ids,
            lambda: sampler.client.cancel(stop),
        )
        with self._lock:
            self._futures[reply["request_id"]].tokens = cost
        return reply

    def _check_in_flight(self, cost: int) -> None:
        """Busy when the caller's samples still running and this one would exceed their share (under the lock)."""
        share = IN_FLIGHT_REQUESTS * self.max_request_tokens
        me = self._me
        running = sum(p.tokens for p in self._futures.values() if p.owner == me and not p.future.done())
        if running and running + cost > share:
            raise Busy(
                f"this key has {running} tokens of sampling in flight; {cost} more would pass its share of "
                f"{share} ({IN_FLIGHT_REQUESTS} × --max-request-tokens): resend once some are done"
            )

    def _check_sampling_cost(
        self, sampler: _Sampler, prompt: int, num_samples: int, max_tokens: int | None
    ) -> int:
        """num_samples × max_tokens (the rest of the context where max_tokens is not given), refused before
        any decoding starts unless within max_request_tokens, as the OpenAI side counts a request."""
        context = sampler.client.context_length
        room = None if context is None else context - prompt
        per_sample = max_tokens if room is None else min(max_tokens or room, room)
        if per_sample is None:
            return num_samples  # no context length stated: the sampler asks for max_tokens itself
        if num_samples * per_sample > self.max_request_tokens:
            if max_tokens is None:
                each = "the rest of the context: max_tokens is unset"
            elif room is not None and max_tokens > room:
                each = f"max_tokens {max_tokens}, cut to what the context leaves"
            else:
                each = "max_tokens"
            raise WireError(
                f"num_samples {num_samples} × {per_sample} tokens each ({each}) is {num_samples * per_sample} "
                f"tokens, over this server's {self.max_request_tokens} per request (gym serve "
                "--max-request-tokens); ask for fewer"
            )
        return num_samples * per_sample

    _POSTS: ClassVar[dict[str, Callable[[TinkerAPI, dict], Any]]] = {
        "client/config": _client_config,
        "client/dynamic_config": _dynamic_config,
        "create_session": _create_session,
        "session_heartbeat": _heartbeat,
        "telemetry": _telemetry,
        "get_info": _get_info,
        "create_sampling_session": _create_sampling_session,
        "retrieve_future": _retrieve_future,
        "create_model": _create_model,
        "optim_step": _optim_step,
        "save_weights": _save_weights,
        "save_weights_for_sampler": _save_weights_for_sampler,
        "load_weights": _load_weights,
        "unload_model": _unload_model,
        "asample": _asample,
        "weights_info": _weights_info,
    }
    _SUBMITS = frozenset(
        {
            "create_model",
            "optim_step",
            "save_weights",
            "save_weights_for_sampler",
            "load_weights",
            "unload_model",
            "asample",
        }
    )

    # -- lookups -------------------------------------------------------------------------------------------
    def _base(self, name: Any) -> _Base:
        base = self._bases.get(str(name)) or self._bases.get(model_key(str(name)))
        if base is None:
            raise WireError(
                f"base_model {name!r} is not served here; this server serves: "
                f"{', '.join(self.served_names())}"
            )
        return base

    def _public(self, message: str) -> str:
        """`message` without the server's folders: a checkpoint's folder as its tinker:// path, a base model's
        folder as the name clients call it by."""
        root = self.service.root
        for folder in sorted({str(root), str(root.resolve())}, key=len, reverse=True):
            message = message.replace(folder.rstrip("/") + "/", "tinker://").replace(folder, "tinker://")
        for alias, base in sorted(self._bases.items(), key=lambda item: -len(item[0])):
            if alias.startswith("/"):
                message = message.replace(alias, base.name)
        return message

    def _display_name(self, recorded: str) -> str:
        """What clients call a checkpoint's recorded base model: its served name, else the record as it is
        (never resolved: a listing must not download or convert a model)."""
        base = self._bases.get(recorded) or self._bases.get(model_key(recorded))
        return base.name if base is not None else recorded

    def _base_of(self, base_model: str) -> _Base:
        """The served base behind a checkpoint's recorded base model (else one named after it)."""
        key = model_key(base_model)
        return self._bases.get(key) or _Base(base_model, key, _tokenizer_id(base_model))

    @property
    def _me(self) -> str:
        return getattr(self._caller, "user", LOCAL_USER)

    def _owner_of(self, identifier: str) -> str:
        """The user who owns a session, or a model or sampler made in it (`{session}:train:{n}`)."""
        return self._session_owners.get(identifier.split(":", 1)[0], LOCAL_USER)

    def _own_session(self, session_id: str) -> str:
        if self._owner_of(session_id) != self._me:
            raise WireError(f"unknown session {session_id!r}: create one with create_session")
        return session_id

    def _owned_path(self, path: str, user: str) -> str:
        """A checkpoint path a client sent, as the in-process clients take it, once it is known to be one of
        the caller's own runs (another user's, or a folder of the server's, does not exist for it)."""
        gym_path = wire.to_gym_path(path)
        if not path.startswith(wire.TINKER_SCHEME):
            if user != LOCAL_USER:
                raise NotFound(
                    f"{path!r}: a checkpoint on this server is a tinker://<run>/<kind>/<name> path"
                )
            return gym_path  # a server without keys: its one user may name a folder
        self.runs.require_owner(_checkpoint_address(path)[0], user)
        return gym_path

    def _trained(self, model_id: str, error: Callable[[str], GymError] = WireError) -> _Trained:
        with self._lock:
            trained = self._training.get(model_id)
            if trained is not None and self._owner_of(model_id) != self._me:
                trained = None
        if trained is None:
            raise error(f"unknown model_id {model_id!r}: create it with create_model (or load_weights)")
        return trained

    def _sampler(self, sampling_session_id: str, error: Callable[[str], GymError] = WireError) -> _Sampler:
        with self._lock:
            sampler = self._sampling.get(sampling_session_id)
            if sampler is not None and self._owner_of(sampling_session_id) != self._me:
                sampler = None
        if sampler is None:
            raise error(
                f"unknown sampling session {sampling_session_id!r}: it was never made here, or it is an old "
                f"snapshot (the newest {MAX_SNAPSHOTS_PER_MODEL} per training client are kept)"
            )
        return sampler


def _failure(exc: BaseException, public: Callable[[str], str]) -> Reply:
    """A failed request as the SDK reads it: `user` for what the request got wrong, `server` for a bug; its
    message as `public` rewrites it for clients."""
    if isinstance(exc, GymError):
        return Reply.json({"error": public(str(exc)), "category": "user"})
    traceback.print_exception(exc, file=sys.stderr)
    return Reply.json({"error": public(f"{type(exc).__name__}: {exc}"), "category": "server"})


def _start_into(start: Callable[[], concurrent.futures.Future], out: concurrent.futures.Future) -> None:
    """Start the work and hand its outcome to `out` (the future a client already polls)."""
    try:
        future = start()
    except Exception as exc:  # noqa: BLE001 - the client reads it from `out`
        out.set_exception(exc)
        return

    def copy(done: concurrent.futures.Future) -> None:
        if done.exception() is not None:
            out.set_exception(done.exception())
        else:
            out.set_result(done.result())

    future.add_done_callback(copy)


def _page(query: dict[str, list[str]], default_limit: int) -> tuple[int, int]:
    """`limit` and `offset` of a listing, as the SDK sends them."""
    values = []
    for name, default in (("limit", default_limit), ("offset", 0)):
        text = (query.get(name) or [str(default)])[-1]
        if not (text.isascii() and text.isdigit()):
            raise DirectError(f"{name}={text!r}: use a whole number >= 0")
        values.append(int(text))
    return values[0], values[1]


def _checkpoint_address(tinker_path: str) -> tuple[str, str, str]:
    """(run, kind, name) of tinker://<run>/<weights|sampler_weights>/<name>."""
    parts = tinker_path.removeprefix("tinker://").split("/")
    if not tinker_path.startswith("tinker://") or len(parts) != 3:
        raise WireError(
            f"{tinker_path!r}: a checkpoint path is tinker://<run>/<weights|sampler_weights>/<name>"
        )
    return parts[0], parts[1], parts[2]


def _json_reply(value: Any) -> Reply:
    return Reply.json(value)


def _json_object(body: bytes) -> dict:
    try:
        value = json.loads(body or b"{}")
    except (ValueError, RecursionError) as exc:
        raise WireError(f"the body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise WireError("the body must be a JSON object")
    return value


def _field(request: dict, name: str, kind: type) -> Any:
    value = request.get(name)
    if value is None:
        raise WireError(f"the request needs `{name}`")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise WireError(f"`{name}` must be an integer, not {value!r}")
    if kind is str and not isinstance(value, str):
        raise WireError(f"`{name}` must be a string, not {value!r}")
    return value


def _check_loss(loss_fn: str) -> None:
    if loss_fn in HOSTED_ONLY_LOSSES:
        raise WireError(
            f"loss_fn `{loss_fn}` is a hosted Tinker loss whose semantics are not public; this server does not "
            "have it. Use importance_sampling, ppo, cispo or dro (e.g. the cookbook's loss_fn=importance_sampling)"
        )


def _check_optimizer(config: Any) -> None:
    if config is None:
        return
    kind = config.get("type", "adamw") if isinstance(config, dict) else config
    if kind != "adamw":
        raise WireError(f"optimizer_config type {kind!r} is not supported: this server trains with AdamW")


def _adam(params: Any) -> AdamParams:
    if not isinstance(params, dict):
        raise WireError("adam_params must be an object")
    defaults = AdamParams()
    names = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    unknown = sorted(set(params) - set(names))
    if unknown:
        raise WireError(f"adam_params has unknown fields {unknown}; it takes {list(names)}")
    where = "adam_params."
    return AdamParams(
        learning_rate=fields.number(params, "learning_rate", defaults.learning_rate, low=0, where=where),
        beta1=fields.number(params, "beta1", defaults.beta1, low=0, high=0.999999, where=where),
        beta2=fields.number(params, "beta2", defaults.beta2, low=0, high=0.999999, where=where),
        eps=fields.number(params, "eps", defaults.eps, low=0, above=True, where=where),
        weight_decay=fields.number(params, "weight_decay", defaults.weight_decay, low=0, where=where),
        grad_clip_norm=fields.number(params, "grad_clip_norm", defaults.grad_clip_norm, low=0, where=where),
    )


def _tokenizer_id(base_model: str) -> str:
    """A folder the SDK's AutoTokenizer loads offline: the model's own folder, the converted folder of a .gguf
    file, or a hub model's cached snapshot (else the name as it is)."""
    path = Path(model_key(base_model))
    if path.is_dir():
        return str(path)
    from hanzo_gym.model.hub import resolve_model

    try:
        return str(resolve_model(base_model))
    except GymError:
        return base_model
