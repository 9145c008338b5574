"""`gym serve --tinker` against the official, unmodified `tinker` SDK (0.38.0) on loopback, on a tiny model:
every call the SDK makes goes over HTTP (protobuf where the SDK sends it), and the numbers equal the in-process
client's on the same datums."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import time

import httpx
import numpy as np
import pytest
import tinker  # the official SDK (the `test` extra pins 0.38.0): not skipped when missing, a hole in CI
import torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output
from tinker_serve import start_gym_serve, stop

from hanzo_gym import tinker as gym_tinker
from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.serve import ServedModels, Server
from hanzo_gym.serve.server import tinker_api
from hanzo_gym.serve.tinker_api import Reply, TinkerAPI
from hanzo_gym.tinker import types as gym_types

SERVED_NAME = "tiny/word-llama"  # what clients call the base model (gym serve --served-model-name)
ADAM = {"learning_rate": 5e-2}
SENTENCES = [[8, 9, 12, 13, 14, 15], [20, 21, 22, 23], [30, 31, 32, 33, 34, 35, 36, 37, 38]]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    models = ServedModels(ModelHost(tiny_dir, dtype=torch.float32), name=SERVED_NAME)
    api = tinker_api(models, root=str(tmp_path_factory.mktemp("served-runs")), long_poll_seconds=2.0)
    with Server(models, port=0, tinker=api) as running:
        yield running
    models.batcher.close()


@pytest.fixture(scope="module")
def sdk(server, monkeypatch_module):
    monkeypatch_module.setenv("TINKER_API_KEY", "tml-local-test")
    return tinker.ServiceClient(base_url=server.base_url)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The in-process client: what the server's numbers must equal."""
    return gym_tinker.ServiceClient(root=tmp_path_factory.mktemp("reference-runs"), dtype=torch.float32)


def sdk_datum(tokens: list[int], **inputs) -> types.Datum:
    inputs.setdefault("weights", [1.0] * (len(tokens) - 1))
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], **inputs},
    )


def gym_datum(tokens: list[int], **inputs) -> gym_types.Datum:
    inputs.setdefault("weights", [1.0] * (len(tokens) - 1))
    return gym_types.Datum(
        model_input=gym_types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], **inputs},
    )


def rl_inputs(tokens: list[int], index: int) -> dict:
    n = len(tokens) - 1
    return {
        "logprobs": [-1.0 - 0.1 * (t % 3) for t in range(n)],
        "advantages": [(1.0 if index % 2 else -0.5)] * n,
    }


def assert_same_output(remote, local) -> None:
    np.testing.assert_allclose(remote.metrics["loss:sum"], local.metrics["loss:sum"], rtol=1e-5)
    assert len(remote.loss_fn_outputs) == len(local.loss_fn_outputs)
    for theirs, ours in zip(remote.loss_fn_outputs, local.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(
            theirs["logprobs"].to_numpy(), np.asarray(ours["logprobs"].data), rtol=1e-5, atol=1e-6
        )


def test_the_sdk_trains_like_the_in_process_client(sdk, reference, tiny_dir, word_tokenizer):
    remote = sdk.create_lora_training_client(base_model=SERVED_NAME, rank=4, seed=0).result()
    local = reference.create_lora_training_client(tiny_dir, rank=4, seed=0)

    info = remote.get_info()
    assert info.model_data.model_name == SERVED_NAME and info.lora_rank == 4
    assert remote.get_tokenizer().encode("one two three") == word_tokenizer.encode("one two three")

    # cross_entropy, then an RL loss, each followed by a step: the same losses, logprobs and weights.
    sft = [s for s in SENTENCES]
    assert_same_output(
        remote.forward_backward([sdk_datum(s) for s in sft], "cross_entropy").result(),
        local.forward_backward([gym_datum(s) for s in sft], "cross_entropy").result(),
    )
    step = remote.optim_step(types.AdamParams(**ADAM)).result()
    assert step.metrics and set(step.metrics) >= {"grad_norm"}
    local.optim_step(gym_types.AdamParams(**ADAM)).result()
    # Every RL loss the engine has, with a loss_fn_config where it takes one.
    configs = {
        "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        "dro": {"beta": 0.2},
        "cispo": {},
    }
    for loss in ("importance_sampling", "ppo", "cispo", "dro"):
        config = configs.get(loss)
        assert_same_output(
            remote.forward_backward(
                [sdk_datum(s, **rl_inputs(s, i)) for i, s in enumerate(SENTENCES)], loss, config
            ).result(),
            local.forward_backward(
                [gym_datum(s, **rl_inputs(s, i)) for i, s in enumerate(SENTENCES)], loss, config
            ).result(),
        )
    remote.optim_step(types.AdamParams(**ADAM)).result()
    local.optim_step(gym_types.AdamParams(**ADAM)).result()
    assert_same_output(
        remote.forward([sdk_datum(s) for s in SENTENCES], "cross_entropy").result(),
        local.forward([gym_datum(s) for s in SENTENCES], "cross_entropy").result(),
    )


def test_state_saves_loads_and_resumes_through_tinker_paths(sdk, server):
    client = sdk.create_lora_training_client(base_model=SERVED_NAME, rank=4, seed=1).result()
    data = [sdk_datum(s) for s in SENTENCES]
    client.forward_backward(data, "cross_entropy")
    client.optim_step(types.AdamParams(**ADAM))
    path = client.save_state("step-1").result().path
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)
    assert (parsed.checkpoint_type, parsed.checkpoint_id) == ("training", "weights/step-1")

    # A resumed client (create-via-load, with the optimizer) continues exactly like the one that kept going.
    resumed = sdk.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().model_data.model_name == SERVED_NAME
    for trainer in (client, resumed):
        trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(types.AdamParams(**ADAM))
    after = [t.forward(data, "cross_entropy").result().metrics["loss:sum"] for t in (client, resumed)]
    np.testing.assert_allclose(after[0], after[1], rtol=1e-5)

    # load_state puts the saved weights back (the optimizer fresh): the loss at the checkpoint again.
    at_checkpoint = (
        sdk.create_training_client_from_state(path).result().forward(data, "cross_entropy").result()
    )
    client.load_state(path).result()
    np.testing.assert_allclose(
        client.forward(data, "cross_entropy").result().metrics["loss:sum"],
        at_checkpoint.metrics["loss:sum"],
        rtol=1e-5,
    )

    sampler_path = client.save_weights_for_sampler("for-sampling").result().path
    assert types.ParsedCheckpointTinkerPath.from_tinker_path(sampler_path).checkpoint_type == "sampler"
    sampler = sdk.create_sampling_client(model_path=sampler_path).result()
    assert sampler.get_base_model() == SERVED_NAME
    prompt = types.ModelInput.from_ints(SENTENCES[0])
    out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=3, temperature=0)).result()
    assert len(out.sequences[0].tokens) <= 3


def test_sampling_through_the_sdk(sdk, reference, tiny_dir, word_tokenizer):
    trainer = sdk.create_lora_training_client(base_model=SERVED_NAME, rank=4, seed=0).result()
    trainer.forward_backward([sdk_datum(s) for s in SENTENCES], "cross_entropy")
    trainer.optim_step(types.AdamParams(**ADAM))
    sampler = trainer.save_weights_and_get_sampling_client().result()

    prompt = types.ModelInput.from_ints(SENTENCES[2][:4])
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    result = sampler.sample(prompt, 3, params).result()
    assert len(result.sequences) == 3
    ids = [s.sequence_id for s in result.sequences]
    assert len(set(ids)) == 3 and all(ids)
    for sequence in result.sequences:
        assert 1 <= len(sequence.tokens) <= 6 and len(sequence.logprobs) == len(sequence.tokens)
    again = sampler.sample(prompt, 3, params).result()  # a seed reproduces the samples
    assert [s.tokens for s in again.sequences] == [s.tokens for s in result.sequences]

    # Sampled logprobs are the model's: recomputed over prompt + completion, they come out the same.
    base = sdk.create_sampling_client(base_model=SERVED_NAME).result()
    assert_sampled_logprobs_are_recomputed_ones(base, prompt, params)

    # Stop token ids and stop strings end a greedy completion where the in-process sampler ends it.
    greedy = (
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0)).result().sequences[0]
    )
    assert len(greedy.tokens) >= 3, greedy
    stop_id = greedy.tokens[2]
    by_id = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0, stop=[stop_id]))
    by_id = by_id.result().sequences[0]
    assert by_id.stop_reason == "stop" and by_id.tokens == greedy.tokens[: greedy.tokens.index(stop_id) + 1]
    stop_text = word_tokenizer.decode([stop_id])
    by_text = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0, stop=stop_text))
    by_text = by_text.result().sequences[0]
    assert by_text.stop_reason == "stop" and by_text.tokens == greedy.tokens[: len(by_text.tokens)]
    assert stop_text not in word_tokenizer.decode(by_text.tokens[:-1])

    # compute_logprobs equals the training forward on the same tokens (sampling snapshot = trained weights).
    tokens = SENTENCES[2]
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert logprobs[0] is None and len(logprobs) == len(tokens)
    forward = trainer.forward([sdk_datum(tokens)], "cross_entropy").result()
    np.testing.assert_allclose(logprobs[1:], forward.loss_fn_outputs[0]["logprobs"].to_numpy(), rtol=1e-4)
    last = sampler.compute_logprobs(types.ModelInput.from_ints(tokens), prompt_logprobs_last_n=3).result()
    assert last[:-3] == [None] * (len(tokens) - 3) and last[-3:] == pytest.approx(logprobs[-3:])

    # Top-k prompt logprobs: k per position after the first, best first, the token's own among or below them.
    scored = sampler.sample(
        types.ModelInput.from_ints(tokens),
        1,
        types.SamplingParams(max_tokens=1),
        True,
        topk_prompt_logprobs=2,
    ).result()
    assert scored.prompt_logprobs == pytest.approx(logprobs)
    top = scored.topk_prompt_logprobs
    assert top[0] is None and all(len(row) == 2 for row in top[1:])
    for position, row in enumerate(top[1:], start=1):
        assert row[0][1] >= row[1][1]
        ranked = dict(row)
        if tokens[position] in ranked:
            assert ranked[tokens[position]] == pytest.approx(logprobs[position], abs=1e-5)
        else:
            assert logprobs[position] <= row[1][1] + 1e-5


def test_user_mistakes_are_user_errors_at_once(sdk):
    start = time.monotonic()
    with pytest.raises(tinker.RequestFailedError) as unknown_base:
        sdk.create_lora_training_client(base_model="no-such/model", rank=4).result()
    assert unknown_base.value.category == types.RequestErrorCategory.User
    assert SERVED_NAME in str(unknown_base.value)

    client = sdk.create_lora_training_client(base_model=SERVED_NAME, rank=4, seed=0).result()
    with pytest.raises(tinker.RequestFailedError) as hosted_only:
        client.forward_backward([sdk_datum(SENTENCES[0])], "stable_reinforce").result()
    assert hosted_only.value.category == types.RequestErrorCategory.User
    # What the cookbook's rl_loop sends by default: the error names the loss to use instead.
    assert "stable_reinforce" in str(hosted_only.value) and "importance_sampling" in str(hosted_only.value)

    with pytest.raises(tinker.RequestFailedError) as bad_token:
        client.forward([sdk_datum([1, 2, 10_000])], "cross_entropy").result()
    assert bad_token.value.category == types.RequestErrorCategory.User
    with pytest.raises(tinker.UnprocessableEntityError, match="category.*user"):
        sdk.create_sampling_client(model_path="tinker://no-such-run/sampler_weights/x").result()
    assert time.monotonic() - start < 20  # no retries of a 5xx or a bare 400

    # The client is still usable afterwards.
    client.forward([sdk_datum(SENTENCES[1])], "cross_entropy").result()


def assert_sampled_logprobs_are_recomputed_ones(sampler, prompt, params) -> None:
    for sequence in sampler.sample(prompt, 3, params).result().sequences:
        rescored = sampler.compute_logprobs(prompt.append(types.EncodedTextChunk(tokens=sequence.tokens)))
        np.testing.assert_allclose(
            rescored.result()[prompt.length :], sequence.logprobs, rtol=1e-4, atol=1e-5
        )


def test_sampled_logprobs_equal_recomputed_ones_through_an_adapter(sdk):
    trainer = sdk.create_lora_training_client(base_model=SERVED_NAME, rank=4, seed=0).result()
    trainer.forward_backward([sdk_datum(s) for s in SENTENCES], "cross_entropy")
    trainer.optim_step(types.AdamParams(**ADAM))
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(SENTENCES[2][:4])
    assert_sampled_logprobs_are_recomputed_ones(sampler, prompt, types.SamplingParams(max_tokens=6, seed=7))


def post(server, endpoint: str, body, **headers) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"X-API-Key": "tml-raw", "Content-Type": "application/json", **headers}
    return httpx.post(f"{server.base_url}/api/v1/{endpoint}", content=content, headers=headers, timeout=30)


def result_of(server, submitted: httpx.Response, proto: bool = False, **headers) -> httpx.Response:
    assert submitted.status_code == 200, submitted.text
    headers.update({"Accept": "application/x-protobuf"} if proto else {})
    while True:
        reply = post(server, "retrieve_future", {"request_id": submitted.json()["request_id"]}, **headers)
        if (
            reply.headers["content-type"].startswith("application/x-protobuf")
            or reply.json().get("type") != "try_again"
        ):
            return reply


def fwdbwd_body(model_id: str, seq_id: int, data, loss_fn: str = "cross_entropy") -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_a_resent_submit_runs_once(server, reference, tiny_dir):
    session = post(server, "create_session", {"tags": [], "sdk_version": "raw"}).json()["session_id"]
    create = {
        "session_id": session,
        "model_seq_id": 0,
        "base_model": SERVED_NAME,
        "lora_config": {"rank": 4, "seed": 0},
    }
    first, again = post(server, "create_model", create), post(server, "create_model", create)
    assert first.json()["request_id"] == again.json()["request_id"]
    model_id = result_of(server, first).json()["model_id"]
    assert model_id == f"{session}:train:0"

    # forward_backward (seq 1) and optim_step (seq 2), each sent twice, act once: as one in-process step.
    data = [sdk_datum(s) for s in SENTENCES]
    proto = {"Content-Type": "application/x-protobuf"}
    fwd = [post(server, "forward_backward", fwdbwd_body(model_id, 1, data), **proto) for _ in range(2)]
    assert fwd[0].json()["request_id"] == fwd[1].json()["request_id"]
    step_body = {"model_id": model_id, "seq_id": 2, "adam_params": ADAM}
    steps = [post(server, "optim_step", step_body) for _ in range(2)]
    assert steps[0].json()["request_id"] == steps[1].json()["request_id"]
    assert "grad_norm" in result_of(server, steps[0]).json()["metrics"]
    check = result_of(
        server, post(server, "forward_backward", fwdbwd_body(model_id, 3, data), **proto), proto=True
    )
    remote_loss = deserialize_forward_backward_output(check.content).metrics["loss:sum"]

    local = reference.create_lora_training_client(tiny_dir, rank=4, seed=0)
    local.forward_backward([gym_datum(s) for s in SENTENCES], "cross_entropy")
    local.optim_step(gym_types.AdamParams(**ADAM))
    want = local.forward([gym_datum(s) for s in SENTENCES], "cross_entropy").result().metrics["loss:sum"]
    np.testing.assert_allclose(remote_loss, want, rtol=1e-5)


def test_a_zstd_body_and_a_bad_proto_body(server, sdk):
    import zstandard

    model_id = sdk.create_lora_training_client(base_model=SERVED_NAME, rank=4, seed=0).result().model_id
    body = zstandard.ZstdCompressor().compress(fwdbwd_body(model_id, 1, [sdk_datum(SENTENCES[0])]))
    headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
    output = result_of(server, post(server, "forward_backward", body, **headers), proto=True)
    assert deserialize_forward_backward_output(output.content).metrics["loss:sum"] > 0
    garbage = result_of(server, post(server, "forward_backward", b"\xff\xff not protobuf", **headers))
    assert garbage.json()["category"] == "user"


def test_a_poll_waits_then_says_try_again(tmp_path):
    api = TinkerAPI(gym_tinker.ServiceClient(root=tmp_path, dtype=torch.float32), {}, long_poll_seconds=0.2)
    slow: concurrent.futures.Future = concurrent.futures.Future()
    with api._lock:
        request_id = api._register(None, slow, lambda value: Reply.json(value))["request_id"]
    start = time.monotonic()
    reply = api.handle("POST", "/api/v1/retrieve_future", {}, json.dumps({"request_id": request_id}).encode())
    assert json.loads(reply.body)["type"] == "try_again" and time.monotonic() - start >= 0.2
    slow.set_result({"done": True})
    reply = api.handle("POST", "/api/v1/retrieve_future", {}, json.dumps({"request_id": request_id}).encode())
    assert json.loads(reply.body) == {"done": True}
    unknown = api.handle("POST", "/api/v1/retrieve_future", {}, b'{"request_id": "nope"}')
    assert json.loads(unknown.body)["category"] == "user"


def test_service_endpoints_and_unknown_ones(server, sdk):
    assert httpx.get(f"{server.base_url}/api/v1/healthz").json() == {"status": "ok"}
    capabilities = tinker.RestClient(base_url=server.base_url).get_server_capabilities().result()
    assert [m.model_name for m in capabilities.supported_models] == [SERVED_NAME]
    missing = post(server, "no_such_endpoint", {})
    assert missing.status_code == 404 and missing.json()["category"] == "user"
    not_json = post(server, "get_info", b"{not json")
    assert not_json.status_code == 422 and "JSON" in not_json.json()["error"]
    # The OpenAI endpoints answer beside the Tinker ones, on the same base model.
    assert httpx.get(f"{server.url}/models").json()["data"][0]["id"] == SERVED_NAME


def test_one_server_trains_and_samples_several_base_models(
    tiny_dir, tiny_base, qwen3_tokenizer, reference, tmp_path, monkeypatch
):
    """`gym serve --tinker-model NAME=PATH`: a second base model beside the served one, loaded at its first
    use, trained and sampled through the SDK under its own name, with its own tokenizer."""
    monkeypatch.setenv("TINKER_API_KEY", "tml-local-test")
    models = ServedModels(ModelHost(tiny_dir, dtype=torch.float32), name=SERVED_NAME)
    api = tinker_api(models, root=str(tmp_path), more_models={"tiny/qwen3": str(tiny_base)})
    with Server(models, port=0, tinker=api) as running:
        service = tinker.ServiceClient(base_url=running.base_url)
        capabilities = tinker.RestClient(base_url=running.base_url).get_server_capabilities().result()
        assert sorted(m.model_name for m in capabilities.supported_models) == sorted(
            [SERVED_NAME, "tiny/qwen3"]
        )

        remote = service.create_lora_training_client(base_model="tiny/qwen3", rank=4, seed=0).result()
        assert remote.get_info().model_data.model_name == "tiny/qwen3"
        assert remote.get_tokenizer().encode("one two three") == qwen3_tokenizer.encode("one two three")
        local = reference.create_lora_training_client(str(tiny_base), rank=4, seed=0)
        words = [qwen3_tokenizer.encode(text) for text in ("the cat sat on the mat", "a dog ran far away")]
        assert_same_output(
            remote.forward_backward([sdk_datum(t) for t in words], "cross_entropy").result(),
            local.forward_backward([gym_datum(t) for t in words], "cross_entropy").result(),
        )
        other = service.create_lora_training_client(base_model=SERVED_NAME, rank=4, seed=0).result()
        assert other.get_info().model_data.model_name == SERVED_NAME

        sampler = service.create_sampling_client(base_model="tiny/qwen3").result()
        prompt = types.ModelInput.from_ints(words[0][:3])
        sample = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0)).result()
        want = reference.create_sampling_client(base_model=str(tiny_base)).sample(
            gym_types.ModelInput.from_ints(words[0][:3]),
            1,
            gym_types.SamplingParams(max_tokens=4, temperature=0),
        )
        assert sample.sequences[0].tokens == want.result().sequences[0].tokens

        with pytest.raises(tinker.RequestFailedError) as unknown:
            service.create_lora_training_client(base_model="meta-llama/Llama-3.2-1B", rank=4).result()
        assert SERVED_NAME in str(unknown.value) and "tiny/qwen3" in str(unknown.value)
    models.batcher.close()


def test_gym_serve_tinker_model_flags_are_checked_before_loading(tmp_path):
    from hanzo_gym.errors import GymError
    from hanzo_gym.serve.server import run_serve

    with pytest.raises(GymError, match="give --tinker as well"):
        run_serve(str(tmp_path / "never-loaded"), tinker_model_specs=[f"other={tmp_path}"])
    with pytest.raises(GymError, match="--tinker-model other="):
        run_serve(str(tmp_path / "never-loaded"), tinker=True, tinker_model_specs=[f"other={tmp_path}/none"])
    with pytest.raises(GymError, match="write NAME=PATH"):
        run_serve(str(tmp_path / "never-loaded"), tinker=True, tinker_model_specs=["no-name"])
    with pytest.raises(GymError, match="already the served model's"):
        run_serve(str(tmp_path / "m"), name="served", tinker=True, tinker_model_specs=[f"served={tmp_path}"])
    with pytest.raises(GymError, match="--tinker-sampler picks .* give --tinker as well"):
        run_serve(str(tmp_path / "never-loaded"), tinker_sampler="vllm")
    if importlib.util.find_spec("vllm") is None:  # the main environment: the install command, before loading
        with pytest.raises(
            GymError, match=r"--tinker-sampler vllm needs vLLM, which is not installed here: "
        ):
            run_serve(str(tmp_path / "never-loaded"), tinker=True, tinker_sampler="vllm")


def test_rest_client_sees_runs_and_checkpoints_and_the_cookbook_its_renderer(sdk, server):
    """The SDK's RestClient over the checkpoint folders: a run's base model, rank and user_metadata (what the
    cookbook's checkpoint_utils reads to check the renderer), its checkpoints newest last, weights_info, and
    deleting a checkpoint; all read from disk, as after a restart."""
    from tinker_cookbook import checkpoint_utils

    client = sdk.create_lora_training_client(
        base_model=SERVED_NAME, rank=4, seed=0, train_mlp=False, user_metadata={"renderer_name": "role_colon"}
    ).result()
    client.forward_backward([sdk_datum(s) for s in SENTENCES], "cross_entropy")
    client.optim_step(types.AdamParams(**ADAM))
    state = client.save_state("rest-state").result().path
    sampler_path = client.save_weights_for_sampler("rest-sampler").result().path
    run_id = types.ParsedCheckpointTinkerPath.from_tinker_path(state).training_run_id

    rest = tinker.RestClient(base_url=server.base_url)
    run = rest.get_training_run_by_tinker_path(sampler_path).result()
    assert (run.training_run_id, run.base_model, run.lora_rank, run.is_lora) == (run_id, SERVED_NAME, 4, True)
    assert run.user_metadata == {"renderer_name": "role_colon"}
    assert run.last_checkpoint.tinker_path == state
    assert run.last_sampler_checkpoint.tinker_path == sampler_path
    assert checkpoint_utils.get_renderer_name_from_checkpoint(sdk, state) == "role_colon"

    listed = rest.list_checkpoints(run_id).result().checkpoints
    assert [(c.checkpoint_type, c.tinker_path) for c in listed] == [
        ("training", state),
        ("sampler", sampler_path),
    ]
    assert all(c.size_bytes > 0 for c in listed)
    assert run_id in [r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs]
    everything = rest.list_user_checkpoints(limit=2).result()
    assert len(everything.checkpoints) == 2 and everything.cursor.total_count >= 2

    info = rest.get_weights_info_by_tinker_path(state).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (SERVED_NAME, True, 4)
    assert (info.train_mlp, info.train_attn) == (False, True)

    # A run made from the checkpoint keeps its metadata; a deleted checkpoint is gone from disk and listings.
    resumed = sdk.create_training_client_from_state(state).result()
    resumed_state = resumed.save_state("resumed").result().path
    assert rest.get_training_run_by_tinker_path(resumed_state).result().user_metadata == run.user_metadata
    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    assert [c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints] == [state]
    with pytest.raises(tinker.NotFoundError):
        rest.get_weights_info_by_tinker_path(sampler_path).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run("no-such-run").result()
    with pytest.raises(tinker.NotFoundError):
        rest.list_checkpoints("no-such-run").result()
    # A damaged checkpoint marks its run corrupted; the listing still answers, and a bad page is a user error.
    damaged = server.tinker.runs.root / "damaged-run" / "weights" / "w"
    damaged.mkdir(parents=True)
    (damaged / "adapter_config.json").write_text("{not json")
    listed = {r.training_run_id: r for r in rest.list_training_runs(limit=1000).result().training_runs}
    assert listed["damaged-run"].corrupted and not listed[run_id].corrupted
    bad_page = httpx.get(f"{server.base_url}/api/v1/training_runs", params={"limit": "\u00b2"})
    assert bad_page.status_code == 422 and bad_page.json()["category"] == "user"


def test_custom_losses_async_calls_and_clients_side_by_side(sdk, reference, tiny_dir):
    """forward_backward_custom as the SDK does it (a forward, then a weighted cross-entropy pass), the async
    forms, and two training clients and their samplers interleaved on one base model."""

    def custom(data, logprobs_list):
        loss = sum((lp**2).sum() for lp in logprobs_list)
        return loss, {"squares:sum": loss.item()}

    async def run() -> tuple:
        one = await sdk.create_lora_training_client(base_model=SERVED_NAME, rank=4, seed=0)
        two = await sdk.create_lora_training_client(base_model=SERVED_NAME, rank=2, seed=3)
        futures = [
            one.forward_backward_custom([sdk_datum(s) for s in SENTENCES], custom),
            two.forward_backward([sdk_datum(s) for s in SENTENCES[:2]], "cross_entropy"),
        ]
        steps = [one.optim_step(types.AdamParams(**ADAM)), two.optim_step(types.AdamParams(**ADAM))]
        outputs = [await f for f in futures]
        for step in steps:
            await step
        samplers = [await c.save_weights_and_get_sampling_client() for c in (one, two)]
        prompt = types.ModelInput.from_ints(SENTENCES[0])
        samples = [await s.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=1)) for s in samplers]
        after = await one.forward([sdk_datum(s) for s in SENTENCES], "cross_entropy")
        return outputs, samples, after

    import asyncio

    (custom_out, plain_out), samples, after = asyncio.run(run())
    local = reference.create_lora_training_client(tiny_dir, rank=4, seed=0)
    want = local.forward_backward_custom([gym_datum(s) for s in SENTENCES], custom).result()
    local.optim_step(gym_types.AdamParams(**ADAM)).result()
    for key in ("loss:sum", "surrogate_loss:sum", "squares:sum"):
        np.testing.assert_allclose(custom_out.metrics[key], want.metrics[key], rtol=1e-5)
    assert "loss:sum" in plain_out.metrics
    assert [len(s.sequences) for s in samples] == [2, 2]
    assert_same_output(after, local.forward([gym_datum(s) for s in SENTENCES], "cross_entropy").result())


@pytest.mark.slow
def test_gym_serve_tinker_checkpoints_survive_a_restart(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", "tml-cli-test")
    data = [sdk_datum(s) for s in SENTENCES]
    process, url = start_gym_serve(tiny_dir, tmp_path / "runs", SERVED_NAME)
    try:
        client = (
            tinker.ServiceClient(base_url=url)
            .create_lora_training_client(base_model=SERVED_NAME, rank=4, seed=0)
            .result()
        )
        client.forward_backward(data, "cross_entropy")
        client.optim_step(types.AdamParams(**ADAM))
        path = client.save_state("before-restart").result().path
        client.forward_backward(data, "cross_entropy")
        client.optim_step(types.AdamParams(**ADAM))
        want = client.forward(data, "cross_entropy").result().metrics["loss:sum"]
    finally:
        stop(process)
    run = types.ParsedCheckpointTinkerPath.from_tinker_path(path).training_run_id
    assert (tmp_path / "runs" / run / "weights" / "before-restart" / "adapter_config.json").is_file()

    process, url = start_gym_serve(tiny_dir, tmp_path / "runs", SERVED_NAME)
    try:
        resumed = (
            tinker.ServiceClient(base_url=url).create_training_client_from_state_with_optimizer(path).result()
        )
        resumed.forward_backward(data, "cross_entropy")
        resumed.optim_step(types.AdamParams(**ADAM))
        got = resumed.forward(data, "cross_entropy").result().metrics["loss:sum"]
    finally:
        stop(process)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_old_snapshot_sessions_are_let_go_and_sessions_finish(server, sdk, monkeypatch):
    monkeypatch.setattr("hanzo_gym.serve.tinker_api.MAX_SNAPSHOTS_PER_MODEL", 2)
    trainer = sdk.create_lora_training_client(base_model=SERVED_NAME, rank=4, seed=0).result()
    samplers = [trainer.save_weights_and_get_sampling_client().result() for _ in range(3)]
    prompt = types.ModelInput.from_ints(SENTENCES[0])
    params = types.SamplingParams(max_tokens=2, temperature=0)
    assert samplers[-1].sample(prompt, 1, params).result().sequences
    with pytest.raises(tinker.RequestFailedError, match="old snapshot") as gone:
        samplers[0].sample(prompt, 1, params).result()
    assert gone.value.category == types.RequestErrorCategory.User

    other = tinker.ServiceClient(base_url=server.base_url)
    other.create_lora_training_client(base_model=SERVED_NAME, rank=2).result()
    other.close("success").result(timeout=30)


def test_requests_run_in_seq_id_order_whatever_order_they_come_in(server, reference, tiny_dir, monkeypatch):
    session = post(server, "create_session", {"tags": [], "sdk_version": "raw"}).json()["session_id"]
    create = {
        "session_id": session,
        "model_seq_id": 0,
        "base_model": SERVED_NAME,
        "lora_config": {"rank": 4, "seed": 0},
    }
    model_id = result_of(server, post(server, "create_model", create)).json()["model_id"]
    data = [sdk_datum(s) for s in SENTENCES]
    proto = {"Content-Type": "application/x-protobuf"}
    # The step (seq 2) comes first and waits for the gradients (seq 1); the check (seq 3) comes before both.
    check = post(server, "forward_backward", fwdbwd_body(model_id, 3, data), **proto)
    step = post(server, "optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": ADAM})
    fwd = post(server, "forward_backward", fwdbwd_body(model_id, 1, data), **proto)
    for submitted in (fwd, step):
        result_of(server, submitted, proto=submitted is fwd)
    got = deserialize_forward_backward_output(result_of(server, check, proto=True).content).metrics[
        "loss:sum"
    ]
    local = reference.create_lora_training_client(tiny_dir, rank=4, seed=0)
    local.forward_backward([gym_datum(s) for s in SENTENCES], "cross_entropy")
    local.optim_step(gym_types.AdamParams(**ADAM))
    want = local.forward([gym_datum(s) for s in SENTENCES], "cross_entropy").result().metrics["loss:sum"]
    np.testing.assert_allclose(got, want, rtol=1e-5)

    # A seq_id that never comes holds the ones after it only so long.
    monkeypatch.setattr("hanzo_gym.serve.tinker_api.SEQ_GAP_SECONDS", 0.2)
    late = post(server, "optim_step", {"model_id": model_id, "seq_id": 9, "adam_params": ADAM})
    assert "grad_norm" in result_of(server, late).json()["metrics"]


def test_the_sdk_trains_a_bf16_gym_serve_like_the_in_process_bf16_client(tiny_dir, tmp_path, monkeypatch):
    """`gym serve --bf16 true` (what `auto` picks on a CPU with avx512_bf16 or AMX) through the official SDK: the
    same bf16 engine as the in-process client's, so the same losses, and not fp32's."""
    monkeypatch.setenv("TINKER_API_KEY", "tml-bf16-test")
    process, url = start_gym_serve(tiny_dir, tmp_path / "runs", SERVED_NAME, bf16="true")
    data = [sdk_datum(s) for s in SENTENCES]
    losses = {}
    try:
        remote = (
            tinker.ServiceClient(base_url=url)
            .create_lora_training_client(SERVED_NAME, rank=4, seed=0)
            .result()
        )
        for dtype in (torch.bfloat16, torch.float32):
            with gym_tinker.ServiceClient(root=tmp_path / str(dtype), dtype=dtype) as service:
                local = service.create_lora_training_client(tiny_dir, rank=4, seed=0)
                losses[dtype] = local.forward_backward(
                    [gym_datum(s) for s in SENTENCES], "cross_entropy"
                ).result()
                local.optim_step(gym_types.AdamParams(**ADAM)).result()
                losses[dtype, "after"] = local.forward(
                    [gym_datum(s) for s in SENTENCES], "cross_entropy"
                ).result()
        assert_same_output(remote.forward_backward(data, "cross_entropy").result(), losses[torch.bfloat16])
        remote.optim_step(types.AdamParams(**ADAM)).result()
        after = remote.forward(data, "cross_entropy").result()
    finally:
        stop(process)
    assert_same_output(after, losses[torch.bfloat16, "after"])
    fp32 = losses[torch.float32, "after"].metrics["loss:sum"]
    assert after.metrics["loss:sum"] != fp32 and after.metrics["loss:sum"] == pytest.approx(fp32, rel=2e-2)
