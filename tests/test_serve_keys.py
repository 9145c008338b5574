"""`gym serve --api-key`: every request needs a key (the health probes aside), in the header each client sends; each
key is a user, and on the Tinker API one user's runs, checkpoints, models, samplers and futures do not exist for
another; a server without keys will not listen beyond loopback unless told so."""

from __future__ import annotations

import httpx
import openai
import pytest
import tinker
import torch
from tinker import types

from hanzo_gym.errors import GymError
from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.serve import ServedModels, Server
from hanzo_gym.serve.api_keys import ApiKeys
from hanzo_gym.serve.server import tinker_api

ALICE, BOB = "tml-alice-key", "tml-bob-key"
NAME = "tiny/word-llama"


@pytest.fixture(scope="module")
def keyed(tiny_dir, tmp_path_factory):
    models = ServedModels(ModelHost(tiny_dir, dtype=torch.float32), name=NAME)
    api = tinker_api(models, root=str(tmp_path_factory.mktemp("keyed-runs")), long_poll_seconds=2.0)
    with Server(models, port=0, tinker=api, keys=ApiKeys([ALICE, BOB])) as running:
        yield running
    models.batcher.close()


def test_the_openai_side_needs_a_key_in_the_header_the_openai_client_sends(keyed):
    assert httpx.get(f"{keyed.url}/models").status_code == 401
    assert httpx.get(f"{keyed.base_url}/health").status_code == 200  # a load balancer's probe needs none
    with pytest.raises(openai.AuthenticationError, match="needs an API key"):
        openai.OpenAI(base_url=keyed.url, api_key="sk-wrong", max_retries=0).models.list()
    models = openai.OpenAI(base_url=keyed.url, api_key=ALICE, max_retries=0).models.list()
    assert [m.id for m in models.data] == [NAME]
    # the Tinker SDK's header works on this side too
    assert httpx.get(f"{keyed.url}/models", headers={"X-API-Key": BOB}).status_code == 200


def test_the_tinker_side_needs_a_key_as_the_sdk_sends_it(keyed):
    assert httpx.get(f"{keyed.base_url}/api/v1/healthz").status_code == 200
    refused = httpx.post(
        f"{keyed.base_url}/api/v1/create_session", json={}, headers={"X-API-Key": "tml-nope"}
    )
    assert refused.status_code == 401 and refused.json()["category"] == "user"
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=keyed.base_url, api_key="tml-nope").get_server_capabilities()


def test_one_users_runs_and_checkpoints_do_not_exist_for_another(keyed):
    alice = tinker.ServiceClient(base_url=keyed.base_url, api_key=ALICE)
    bob = tinker.ServiceClient(base_url=keyed.base_url, api_key=BOB)
    trainer = alice.create_lora_training_client(base_model=NAME, rank=4, seed=0)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([8, 9, 12]),
        loss_fn_inputs={"target_tokens": [9, 12, 13], "weights": [1.0, 1.0, 1.0]},
    )
    trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = trainer.save_state("mine").result().path
    sampler_path = trainer.save_weights_for_sampler("mine-sampler").result().path
    run_id = state.removeprefix("tinker://").split("/")[0]

    alice_rest = tinker.RestClient(base_url=keyed.base_url, api_key=ALICE)
    bob_rest = tinker.RestClient(base_url=keyed.base_url, api_key=BOB)
    assert [r.training_run_id for r in alice_rest.list_training_runs().result().training_runs] == [run_id]
    assert bob_rest.list_training_runs().result().training_runs == []
    assert bob_rest.list_user_checkpoints().result().checkpoints == []
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_training_run(run_id).result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.delete_checkpoint_from_tinker_path(state).result()
    # nor can bob sample from it, or load its weights and AdamW state
    with pytest.raises((tinker.RequestFailedError, tinker.NotFoundError, tinker.UnprocessableEntityError)):
        bob.create_sampling_client(model_path=sampler_path).sample(
            types.ModelInput.from_ints([8, 9]), 1, types.SamplingParams(max_tokens=2)
        ).result()
    with pytest.raises((tinker.RequestFailedError, tinker.NotFoundError, tinker.UnprocessableEntityError)):
        bob.create_training_client_from_state_with_optimizer(state).get_info()
    # nor reach alice's model through its id
    body = {"model_id": trainer.model_id, "seq_id": 99, "adam_params": {"learning_rate": 1.0}}
    stepped = httpx.post(f"{keyed.base_url}/api/v1/optim_step", json=body, headers={"X-API-Key": BOB})
    request_id = stepped.json()["request_id"]
    reply = httpx.post(
        f"{keyed.base_url}/api/v1/retrieve_future",
        json={"request_id": request_id},
        headers={"X-API-Key": BOB},
    ).json()
    assert reply["category"] == "user" and "unknown model_id" in reply["error"]
    # and alice's futures are not bob's to fetch, even with the request id
    own = {"model_id": trainer.model_id, "seq_id": 100, "adam_params": {"learning_rate": 1e-3}}
    submitted = httpx.post(f"{keyed.base_url}/api/v1/optim_step", json=own, headers={"X-API-Key": ALICE})
    fetch = {"request_id": submitted.json()["request_id"]}
    as_bob = httpx.post(
        f"{keyed.base_url}/api/v1/retrieve_future", json=fetch, headers={"X-API-Key": BOB}
    ).json()
    assert "unknown request id" in as_bob["error"]
    as_alice = httpx.post(
        f"{keyed.base_url}/api/v1/retrieve_future", json=fetch, headers={"X-API-Key": ALICE}
    )
    assert "unknown request id" not in as_alice.text
    # alice still has all of it
    assert alice_rest.get_training_run(run_id).result().training_run_id == run_id
    alice.create_sampling_client(model_path=sampler_path).sample(
        types.ModelInput.from_ints([8, 9]), 1, types.SamplingParams(max_tokens=2)
    ).result()


def test_a_server_without_keys_listens_on_loopback_only_unless_told(tiny_dir):
    models = ServedModels(ModelHost(tiny_dir, dtype=torch.float32), name=NAME)
    try:
        with pytest.raises(GymError, match=r"--host 0\.0\.0\.0 without an API key .* --insecure-no-auth"):
            Server(models, bind="0.0.0.0", port=0)
        Server(models, bind="0.0.0.0", port=0, insecure_no_auth=True).stop()
        Server(models, bind="0.0.0.0", port=0, keys=ApiKeys(["k"])).stop()
        Server(models, bind="127.0.0.1", port=0).stop()
    finally:
        models.batcher.close()


def test_keys_come_from_flags_a_file_and_the_environment(tmp_path):
    (tmp_path / "keys").write_text("# the team\ntml-a\n\n  tml-b  \n")
    keys = ApiKeys.from_sources(["tml-c"], str(tmp_path / "keys"), env={"VLLM_API_KEY": "sk-d"})
    users = [keys.user_of(h) for h in ({"X-API-Key": k} for k in ("tml-a", "tml-b", "tml-c", "sk-d"))]
    assert None not in users and len(set(users)) == 4  # each key its own user
    assert keys.user_of({"Authorization": "Bearer tml-a"}) == users[0]  # either header, the same user
    assert keys.user_of({"X-API-Key": "tml-e"}) is None and keys.user_of({}) is None
    assert all("tml-" not in user for user in users)  # a user is a digest, never the key
    with pytest.raises(GymError, match="holds no key"):
        (tmp_path / "empty").write_text("# nobody\n")
        ApiKeys.from_sources(None, str(tmp_path / "empty"), env={})
    assert not ApiKeys.from_sources(None, None, env={}).required
