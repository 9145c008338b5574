# ruff: noqa: F811 - the server and SDK fixtures are test_tinker_server's, taken by name
"""`gym serve --tinker` against hostile numbers: every field is typed and ranged before anything is allocated or
decoded, each refusal a user error (4xx, category `user`) naming the field; the two requests that used to exhaust
the server's memory are refused in a moment; NaN never reaches the weights."""

from __future__ import annotations

import math
import resource
import time

import numpy as np
import pytest
import tinker
from test_tinker_server import (  # noqa: F401 - the module's server and SDK fixtures
    ADAM,
    SENTENCES,
    SERVED_NAME,
    fwdbwd_body,
    monkeypatch_module,
    post,
    result_of,
    sdk,
    sdk_datum,
    server,
)
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

PROTO = {"Content-Type": "application/x-protobuf"}


def _user_error(server, reply) -> str:
    """The error of a refused request, answered at once or, for work the SDK submits, through its future
    (already failed: nothing ran); either way a user error (4xx, or a failed future of category `user`)."""
    if reply.status_code == 200 and "request_id" in reply.json():
        reply = result_of(server, reply)
    else:
        assert 400 <= reply.status_code < 500, reply.text
    body = reply.json()
    assert body.get("category") == "user", body
    return body["error"]


@pytest.fixture(scope="module")
def sampling_session(server):
    session = post(server, "create_session", {"tags": [], "sdk_version": "raw"}).json()["session_id"]
    reply = post(
        server,
        "create_sampling_session",
        {"session_id": session, "sampling_session_seq_id": 0, "base_model": SERVED_NAME},
    )
    return reply.json()["sampling_session_id"]


def _sample(server, session: str, **fields):
    body = {
        "sampling_session_id": session,
        "seq_id": time.monotonic_ns(),
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [8, 9, 12]}]},
        "num_samples": 1,
        "sampling_params": {"max_tokens": 4},
    }
    params = fields.pop("sampling_params", {})
    body.update(fields)
    body["sampling_params"].update(params)
    return post(server, "asample", body)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"num_samples": 1_000_000_000}, "num_samples"),
        ({"num_samples": "8"}, "num_samples"),
        ({"num_samples": 2.5}, "num_samples"),
        ({"num_samples": 0}, "num_samples"),
        ({"num_samples": 512, "sampling_params": {"max_tokens": 1000}}, "max-request-tokens"),
        ({"sampling_params": {"max_tokens": -3}}, "sampling_params.max_tokens"),
        ({"sampling_params": {"max_tokens": 10**30}}, "sampling_params.max_tokens"),
        ({"sampling_params": {"seed": "x"}}, "sampling_params.seed"),
        ({"sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ({"sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"sampling_params": {"top_p": 5}}, "sampling_params.top_p"),
        ({"sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ({"sampling_params": {"top_k": -7}}, "sampling_params.top_k"),
        ({"sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"sampling_params": {"stop": {"a": 1}}}, "sampling_params.stop"),
        ({"sampling_params": {"stop": [1, "x"]}}, "sampling_params.stop"),
        ({"prompt_logprobs_last_n": "all"}, "prompt_logprobs_last_n"),
        ({"prompt_logprobs_last_n": 99}, "prompt_logprobs_last_n"),
        ({"topk_prompt_logprobs": -1}, "topk_prompt_logprobs"),
        ({"prompt_logprobs": "yes"}, "prompt_logprobs"),
    ],
)
def test_each_bad_sampling_field_is_a_user_error_naming_it(server, sampling_session, fields, named):
    started = time.monotonic()
    error = _user_error(server, _sample(server, sampling_session, **fields))
    assert named in error
    assert time.monotonic() - started < 2


def test_a_huge_num_samples_is_refused_before_any_decoding_and_memory_stays_flat(
    server, sdk, sampling_session
):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    error = _user_error(server, _sample(server, sampling_session, num_samples=1_000_000_000))
    assert time.monotonic() - started < 1
    assert "num_samples" in error and "32768" in error
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KB: nothing was allocated
    # the budget counts num_samples × max_tokens (at most the 253 the tiny model's context of 256 leaves), as
    # the OpenAI side counts a request, and names the flag that sets it
    reply = _sample(server, sampling_session, num_samples=200, sampling_params={"max_tokens": 200})
    assert "num_samples 200 × 200 tokens each (max_tokens) is 40000 tokens" in _user_error(server, reply)
    reply = _sample(server, sampling_session, num_samples=200, sampling_params={"max_tokens": 1500})
    error = _user_error(server, reply)
    assert "num_samples 200 × 253 tokens each (max_tokens 1500, cut to what the context leaves)" in error
    assert "over this server's 32768 per request (gym serve --max-request-tokens)" in error
    reply = _sample(server, sampling_session, num_samples=200, sampling_params={"max_tokens": None})
    assert "(the rest of the context: max_tokens is unset)" in _user_error(server, reply)
    # within it, the server samples
    sampler = sdk.create_sampling_client(base_model=SERVED_NAME)
    prompt = types.ModelInput.from_ints([8, 9, 12])
    params = types.SamplingParams(max_tokens=4, temperature=1.0)
    assert len(sampler.sample(prompt, num_samples=2, sampling_params=params).result().sequences) == 2


@pytest.mark.parametrize(
    ("lora", "named"),
    [
        ({"rank": 1.5}, "lora_config.rank"),
        ({"rank": "8"}, "lora_config.rank"),
        ({"rank": 0}, "lora_config.rank"),
        ({"rank": 10**9}, "lora_config.rank"),
        ({"seed": 1.5}, "lora_config.seed"),
        ({"train_mlp": "no"}, "lora_config.train_mlp"),
    ],
)
def test_each_bad_lora_field_is_a_user_error_naming_it(server, lora, named):
    session = post(server, "create_session", {"tags": [], "sdk_version": "raw"}).json()["session_id"]
    create = {"session_id": session, "model_seq_id": 0, "base_model": SERVED_NAME, "lora_config": lora}
    assert named in _user_error(server, post(server, "create_model", create))


def _model(server) -> str:
    session = post(server, "create_session", {"tags": [], "sdk_version": "raw"}).json()["session_id"]
    create = {"session_id": session, "model_seq_id": 0, "base_model": SERVED_NAME, "lora_config": {"rank": 4}}
    return result_of(server, post(server, "create_model", create)).json()["model_id"]


def _sparse_body(
    model_id: str, shape: list[int], crow: list[int], cols: list[int], values: list[int]
) -> bytes:
    """A forward_backward whose target_tokens is a sparse CSR tensor of the given (claimed) shape."""
    request = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    datum = request.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray([8, 9, 12], dtype="<i4").tobytes()
    target = datum.loss_fn_inputs["target_tokens"]
    target.dtype = pb.DTYPE_INT64
    target.shape.extend(shape)
    target.sparse_csr.crow_indices = np.asarray(crow, dtype="<i8").tobytes()
    target.sparse_csr.col_indices = np.asarray(cols, dtype="<i8").tobytes()
    target.sparse_csr.values = np.asarray(values, dtype="<i8").tobytes()
    return request.SerializeToString()


def test_a_sparse_tensor_claiming_a_huge_shape_is_refused_before_allocation(server):
    model_id = _model(server)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    body = _sparse_body(model_id, [1, 900_000_000], [0, 1], [5], [9])  # 3.6 GB of int64 once dense
    error = _user_error(server, post(server, "forward_backward", body, **PROTO))
    assert time.monotonic() - started < 1
    assert "target_tokens" in error and "does not fit its datum's 3 tokens" in error
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000
    # index arrays that do not fit the shape: a user error, not numpy's IndexError
    error = _user_error(
        server, post(server, "forward_backward", _sparse_body(model_id, [1, 3], [0, 1], [7], [9]), **PROTO)
    )
    assert "do not fit shape [1, 3]" in error


def test_nan_never_reaches_the_weights(server, sdk):
    client = sdk.create_lora_training_client(base_model=SERVED_NAME, rank=4, seed=0).result()
    datum = sdk_datum(SENTENCES[0], weights=np.array([1.0, math.nan, 1, 1, 1], dtype=np.float32))
    with pytest.raises(tinker.RequestFailedError, match=r"weights.*NaN or infinite") as refused:
        client.forward_backward([datum], "cross_entropy").result()
    assert refused.value.category == types.RequestErrorCategory.User
    # a huge weight gives an infinite gradient: the step is refused and the weights stay as they were
    before = client.forward([sdk_datum(SENTENCES[1])], "cross_entropy").result().metrics["loss:sum"]
    huge = sdk_datum(SENTENCES[0], weights=np.full(5, 3e38, dtype=np.float32))
    client.forward_backward([huge, huge], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="optim_step refused: the gradients") as step:
        client.optim_step(types.AdamParams(**ADAM)).result()
    assert step.value.category == types.RequestErrorCategory.User
    after = client.forward([sdk_datum(SENTENCES[1])], "cross_entropy").result().metrics["loss:sum"]
    assert after == before
    # the dropped gradients do not linger: the next step trains on the next batch alone
    client.forward_backward([sdk_datum(SENTENCES[1])], "cross_entropy").result()
    metrics = client.optim_step(types.AdamParams(**ADAM)).result().metrics
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0


@pytest.mark.parametrize(
    ("adam", "named"),
    [
        ({"learning_rate": "fast"}, "adam_params.learning_rate"),
        ({"learning_rate": -1}, "adam_params.learning_rate"),
        ({"beta1": 1.5}, "adam_params.beta1"),
        ({"eps": 0}, "adam_params.eps"),
    ],
)
def test_each_bad_adam_field_is_a_user_error_naming_it(server, adam, named):
    model_id = _model(server)
    reply = result_of(
        server, post(server, "optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": adam})
    )
    assert reply.json()["category"] == "user" and named in reply.json()["error"]


def test_the_server_sweeps_what_a_killed_server_left_and_keeps_the_rest(tmp_path, capsys):
    import os

    from hanzo_gym.serve.tinker_runs import TrainingRuns

    weights, sampler = tmp_path / "run-a" / "weights", tmp_path / "run-a" / "sampler_weights"
    for folder in (weights / "step-1", weights / ".step-2.tmp-999999", sampler / ".deleting-s-1a2b3c4d"):
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(b"weights")
    live = weights / f".step-3.tmp-{os.getpid()}"  # a live process is writing it: not ours to remove
    live.mkdir()
    TrainingRuns(tmp_path, str)
    assert sorted(p.name for p in weights.iterdir()) == [live.name, "step-1"]
    assert list(sampler.iterdir()) == []
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path}: removed 2 checkpoint(s) that a killed server left half-written")
    assert "run-a/weights/.step-2.tmp-999999" in out and "run-a/sampler_weights/.deleting-s-1a2b3c4d" in out
    TrainingRuns(tmp_path, str)  # nothing left to say
    assert capsys.readouterr().out == ""


def test_no_reply_names_a_folder_of_the_server(server, sdk):
    client = sdk.create_lora_training_client(base_model=SERVED_NAME, rank=4, seed=0).result()
    path = client.save_state("damaged").result().path
    run, _, name = path.removeprefix("tinker://").split("/")
    root = server.tinker.service.root
    (root / run / "weights" / name / "adapter_model.safetensors").unlink()  # a disk error, say
    with pytest.raises(tinker.RequestFailedError) as refused:
        sdk.create_training_client_from_state(path).result()
    message = str(refused.value)
    assert "adapter" in message and f"tinker://{run}/weights/{name}" in message, message
    assert str(root) not in message and str(root.resolve()) not in message
