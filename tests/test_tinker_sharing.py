"""`gym serve --tinker` shared by clients that do not wait for each other: work nobody polls for any more is
cancelled and frees the model, one key's sampling in flight has a share (beyond it, the SDK's back-pressure),
and a client that keeps polling keeps its work however long it runs."""

from __future__ import annotations

import threading
import time

import pytest
import tinker
import torch
from test_tinker_server import SERVED_NAME, post, result_of
from tinker import types

from hanzo_gym.engine.sampling import DecodeBatch
from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.serve import ServedModels, Server
from hanzo_gym.serve.api_keys import ApiKeys
from hanzo_gym.serve.server import tinker_api

STEP_SECONDS = 0.05  # each decode step is slowed to this: a request of 40 steps outlasts the limits below


@pytest.fixture
def slow_steps(monkeypatch):
    steps, original = [0], DecodeBatch.step

    def slow(self):
        steps[0] += 1
        time.sleep(STEP_SECONDS)
        return original(self)

    monkeypatch.setattr(DecodeBatch, "step", slow)
    return steps


@pytest.fixture
def sharing_server(tiny_dir, tmp_path):
    """A server for five keys whose clients count as gone after 0.5 s without a poll, and whose requests may
    decode 64 tokens each (so 512 in flight per key)."""
    models = ServedModels(ModelHost(tiny_dir, dtype=torch.float32), name=SERVED_NAME, max_request_tokens=64)
    api = tinker_api(models, root=str(tmp_path / "runs"), long_poll_seconds=1.0, abandoned_after_seconds=0.5)
    keys = ApiKeys(["tml-raw", "tml-other", "tml-sdk", "tml-trainer", "tml-sampler"])
    with Server(models, port=0, tinker=api, keys=keys) as running:
        yield running
    models.batcher.close()


def _sampling_session(server, key: str = "tml-raw") -> str:
    session = post(server, "create_session", {"tags": [], "sdk_version": "raw"}, **{"X-API-Key": key})
    reply = post(
        server,
        "create_sampling_session",
        {"session_id": session.json()["session_id"], "sampling_session_seq_id": 0, "base_model": SERVED_NAME},
        **{"X-API-Key": key},
    )
    return reply.json()["sampling_session_id"]


def _asample(server, session: str, num_samples: int, max_tokens: int, key: str = "tml-raw", seed: int = 1):
    body = {
        "sampling_session_id": session,
        "seq_id": time.monotonic_ns(),
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [8, 9, 12]}]},
        "num_samples": num_samples,
        "sampling_params": {"max_tokens": max_tokens, "seed": seed},
    }
    return post(server, "asample", body, **{"X-API-Key": key})


LONG_SEED = 9  # draws all 64 tokens on the tiny model (seed 1 ends after 22): 3.2 s of slowed steps


def test_work_nobody_polls_for_is_cancelled_and_stops_decoding(sharing_server, slow_steps):
    session = _sampling_session(sharing_server)
    submitted = _asample(sharing_server, session, num_samples=1, max_tokens=64, seed=LONG_SEED)
    assert submitted.status_code == 200
    time.sleep(0.5 + 1.0)  # past the limit, and the reaper's look after it
    stopped_at = slow_steps[0]
    time.sleep(5 * STEP_SECONDS)
    assert slow_steps[0] == stopped_at < 64  # nothing decodes for it any more
    error = result_of(sharing_server, submitted).json()
    assert error["category"] == "user" and "cancelled" in error["error"]


def test_a_client_that_keeps_polling_keeps_its_work_past_the_limit(sharing_server, slow_steps):
    session = _sampling_session(sharing_server)
    submitted = _asample(sharing_server, session, num_samples=1, max_tokens=64, seed=LONG_SEED)
    reply = result_of(sharing_server, submitted, proto=True)  # long polls of 1 s, back to back
    assert reply.headers["content-type"].startswith("application/x-protobuf")
    assert slow_steps[0] >= 63  # every token was drawn, over six times the limit


def test_one_keys_sampling_in_flight_has_a_share_and_another_key_is_not_held_to_it(
    sharing_server, slow_steps
):
    session = _sampling_session(sharing_server)
    first = [_asample(sharing_server, session, num_samples=8, max_tokens=8) for _ in range(8)]  # 8 × 64
    assert all(reply.status_code == 200 for reply in first)
    over = _asample(sharing_server, session, num_samples=1, max_tokens=8)
    assert over.status_code == 429, over.text
    assert "512" in over.json()["error"] and "--max-request-tokens" in over.json()["error"]
    other = _asample(sharing_server, _sampling_session(sharing_server, "tml-other"), 1, 8, key="tml-other")
    assert other.status_code == 200  # the share is per key
    for reply in first:
        result_of(sharing_server, reply, proto=True)
    assert _asample(sharing_server, session, num_samples=1, max_tokens=8).status_code == 200


def test_the_sdk_waits_out_its_share_and_gets_every_sample(sharing_server, slow_steps, monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", "tml-sdk")
    sampler = tinker.ServiceClient(base_url=sharing_server.base_url).create_sampling_client(
        base_model=SERVED_NAME
    )
    prompt = types.ModelInput.from_ints([8, 9, 12])
    params = types.SamplingParams(max_tokens=8, temperature=1.0)
    refused = []
    original = sharing_server.tinker._check_in_flight

    def counting(cost):
        try:
            original(cost)
        except Exception:
            refused.append(cost)
            raise

    monkeypatch.setattr(sharing_server.tinker, "_check_in_flight", counting)
    futures = [sampler.sample(prompt, num_samples=8, sampling_params=params) for _ in range(12)]  # 12 × 64
    assert all(len(f.result(timeout=120).sequences) == 8 for f in futures)
    assert refused  # some went over the share and were sent again


def test_a_training_step_over_http_waits_a_decode_step_for_another_keys_long_sample(
    sharing_server, slow_steps
):
    trainer = tinker.ServiceClient(base_url=sharing_server.base_url, api_key="tml-trainer")
    client = trainer.create_lora_training_client(base_model=SERVED_NAME, rank=4)
    session = _sampling_session(sharing_server, "tml-sampler")
    sampling = _asample(
        sharing_server, session, num_samples=1, max_tokens=64, key="tml-sampler", seed=LONG_SEED
    )
    sampled = threading.Event()

    def poll_it():  # the sampler's client waits for its result
        reply = result_of(sharing_server, sampling, proto=True, **{"X-API-Key": "tml-sampler"})
        sampled.set()
        assert reply.headers["content-type"].startswith("application/x-protobuf")

    threading.Thread(target=poll_it, daemon=True).start()
    deadline = time.monotonic() + 30
    while slow_steps[0] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    before = slow_steps[0]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([8, 9, 12, 13]),
        loss_fn_inputs={"target_tokens": [9, 12, 13, 14], "weights": [1.0] * 4},
    )
    client.forward([datum], "cross_entropy").result(timeout=60)
    assert not sampled.is_set() and slow_steps[0] - before <= 3
    assert sampled.wait(60)
