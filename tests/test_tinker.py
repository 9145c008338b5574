"""The Tinker-style client on a tiny random model: the primitives' semantics, checkpoints and sampling."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from hanzo_gym import tinker
from hanzo_gym.engine.sampling import DecodeBatch
from hanzo_gym.errors import GymError
from hanzo_gym.tinker import types
from hanzo_gym.tinker.paths import resolve
from hanzo_gym.tinker.types.tensor_data import TensorData

ADAM = types.AdamParams(learning_rate=5e-2)


@pytest.fixture
def service(tmp_path):
    return tinker.ServiceClient(root=tmp_path / "runs", dtype=torch.float32)


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    weights = weights if weights is not None else [1.0] * (len(tokens) - 1)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


SENTENCES = [[8, 9, 12, 13, 14, 15], [20, 21, 22, 23], [30, 31, 32, 33, 34, 35, 36, 37, 38]]


def weights_of(client: tinker.TrainingClient) -> dict[str, torch.Tensor]:
    client.forward([datum(SENTENCES[0])], "cross_entropy").result()  # everything submitted before has run
    return client._host.weights(client._adapter)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        torch.testing.assert_close(value, b[key], rtol=1e-5, atol=1e-6)


def loss_of(client: tinker.TrainingClient) -> float:
    return client.forward([datum(s) for s in SENTENCES], "cross_entropy").result().metrics["loss:sum"]


def test_tensor_data_round_trips_and_datum_coerces_by_key():
    array = np.arange(6, dtype=np.int32).reshape(2, 3)
    data = TensorData.from_numpy(array)
    assert (data.dtype, data.shape) == ("int64", [2, 3])
    np.testing.assert_array_equal(data.to_numpy(), array)
    half = torch.tensor([0.5, 1.5], dtype=torch.bfloat16)
    widened = TensorData.from_torch(half)
    assert widened.dtype == "float32" and widened.to_torch().dtype == torch.float32
    assert widened.tolist() == [0.5, 1.5]
    d = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"target_tokens": [2, 3], "weights": np.array([1, 0]), "advantages": torch.ones(2)},
    )
    assert d.loss_fn_inputs["target_tokens"].dtype == "int64"
    assert d.loss_fn_inputs["weights"].dtype == "float32"
    assert d.loss_fn_inputs["advantages"].to_torch().tolist() == [1.0, 1.0]
    prompt = types.ModelInput.from_ints([4, 5]).append_int(6)
    assert (prompt.length, prompt.to_ints()) == (3, [4, 5, 6])


def test_gradients_accumulate_across_forward_backward_calls_until_optim_step(service, tiny_dir):
    split = service.create_lora_training_client(tiny_dir, rank=4, seed=0)
    whole = service.create_lora_training_client(tiny_dir, rank=4, seed=0)
    start = weights_of(whole)
    assert_same_weights(start, weights_of(split))  # same seed, same initial adapter
    # forward() must not leave gradients behind.
    split.forward([datum(SENTENCES[2])], "cross_entropy")
    split.forward_backward([datum(SENTENCES[0])], "cross_entropy")
    # Other adapters activated in between (a snapshot, the base model) must not disturb the accumulation.
    snapshot = split.save_weights_and_get_sampling_client()
    snapshot.sample(types.ModelInput.from_ints([8, 9]), 2, types.SamplingParams(max_tokens=3)).result()
    base = service.create_sampling_client(base_model=tiny_dir)
    base.compute_logprobs(types.ModelInput.from_ints(SENTENCES[1])).result()
    split.forward_backward([datum(SENTENCES[1]), datum(SENTENCES[2])], "cross_entropy")
    split.optim_step(ADAM)
    whole.forward_backward([datum(s) for s in SENTENCES], "cross_entropy")
    whole.optim_step(ADAM).result()
    after = weights_of(whole)
    assert_same_weights(weights_of(split), after)
    assert any(not torch.equal(start[k], after[k]) for k in start)
    # The step consumed the gradients: a step with nothing accumulated changes nothing.
    whole.optim_step(ADAM).result()
    assert_same_weights(weights_of(whole), after)


def test_state_with_optimizer_resumes_exactly_and_weights_only_starts_a_fresh_optimizer(service, tiny_dir):
    def step(client):
        client.forward_backward([datum(s) for s in SENTENCES], "cross_entropy")
        client.optim_step(ADAM)

    straight = service.create_lora_training_client(tiny_dir, rank=4, seed=1)
    step(straight)
    step(straight)
    path = straight.save_state("middle").result().path
    assert path == f"gym://{straight.run_id}/weights/middle"
    step(straight)
    want = loss_of(straight)

    resumed = service.create_training_client_from_state_with_optimizer(path)
    step(resumed)
    assert loss_of(resumed) == pytest.approx(want, rel=1e-6)

    reloaded = service.create_lora_training_client(tiny_dir, rank=4, seed=7)
    reloaded.load_state_with_optimizer(path)
    step(reloaded)
    assert loss_of(reloaded) == pytest.approx(want, rel=1e-6)

    weights_only = service.create_training_client_from_state(path)
    step(weights_only)
    fresh = service.create_lora_training_client(tiny_dir, rank=4, seed=9)
    fresh.load_state(path)
    step(fresh)
    assert loss_of(fresh) == pytest.approx(loss_of(weights_only), rel=1e-6)
    assert loss_of(weights_only) != pytest.approx(want, rel=1e-4)  # the moments mattered


def test_outputs_come_back_in_input_order(service, tiny_dir):
    client = service.create_lora_training_client(tiny_dir, rank=4, seed=0)
    data = [datum(s) for s in SENTENCES]
    together = client.forward_backward(data, "cross_entropy").result()
    assert together.loss_fn_output_type == "cross_entropy"
    for sentence, d, output in zip(SENTENCES, data, together.loss_fn_outputs):
        alone = client.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        assert output["logprobs"].shape == [len(sentence) - 1]
        np.testing.assert_allclose(output["logprobs"].to_numpy(), alone.to_numpy(), rtol=1e-5, atol=1e-5)
    summed = -sum(o["logprobs"].to_numpy().sum() for o in together.loss_fn_outputs)
    assert together.metrics["loss:sum"] == pytest.approx(summed, rel=1e-5)


def test_compute_logprobs_is_none_at_position_zero_and_matches_the_learner(service, tiny_dir):
    client = service.create_lora_training_client(tiny_dir, rank=4, seed=0)
    client.forward_backward([datum(s) for s in SENTENCES], "cross_entropy")
    client.optim_step(ADAM)
    sampler = client.save_weights_and_get_sampling_client()
    tokens = SENTENCES[2]
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert logprobs[0] is None and len(logprobs) == len(tokens)
    learner = client.forward([datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    np.testing.assert_allclose(logprobs[1:], learner.to_numpy(), rtol=1e-5, atol=1e-5)
    response = sampler.sample(
        types.ModelInput.from_ints(tokens),
        1,
        types.SamplingParams(max_tokens=2, seed=0),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
    ).result()
    assert response.prompt_logprobs[0] is None
    np.testing.assert_allclose(response.prompt_logprobs[1:], logprobs[1:], rtol=1e-5, atol=1e-5)
    # The top candidate at each position is at least as likely as the actual token.
    for position, top in enumerate(response.topk_prompt_logprobs[1:], start=1):
        assert len(top) == 3 and top[0][1] >= logprobs[position] - 1e-5


def test_forward_backward_custom_gives_the_gradient_of_the_custom_loss(service, tiny_dir):
    custom = service.create_lora_training_client(tiny_dir, rank=4, seed=2)
    builtin = service.create_lora_training_client(tiny_dir, rank=4, seed=2)
    data = [datum(s) for s in SENTENCES]

    def mean_nll(batch, logprobs):
        loss = torch.stack([-lp.mean() for lp in logprobs]).sum()
        return loss, {"mean_nll": loss.item()}

    out = custom.forward_backward_custom(data, mean_nll).result()
    custom.optim_step(ADAM)
    scaled = [datum(s, [1.0 / (len(s) - 1)] * (len(s) - 1)) for s in SENTENCES]
    builtin.forward_backward(scaled, "cross_entropy")
    builtin.optim_step(ADAM)
    assert_same_weights(weights_of(custom), weights_of(builtin))
    assert out.metrics["mean_nll"] > 0 and "loss:sum" in out.metrics
    with pytest.raises(GymError, match="target_tokens"):
        bad = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2]),
            loss_fn_inputs={"target_tokens": [2, 3], "advantages": [1.0, 1.0]},
        )
        custom.forward_backward_custom([bad], mean_nll).result()


def test_sampler_weights_are_a_peft_directory_that_scores_like_the_client(service, tiny_dir):
    client = service.create_lora_training_client(tiny_dir, rank=4, seed=3)
    client.forward_backward([datum(s) for s in SENTENCES], "cross_entropy")
    client.optim_step(ADAM)
    path = client.save_weights_for_sampler("step-1").result().path
    assert path == f"gym://{client.run_id}/sampler_weights/step-1"
    directory = resolve(path, service.root)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), str(directory))
    tokens = SENTENCES[2]
    with torch.no_grad():
        logits = peft_model(input_ids=torch.tensor([tokens[:-1]])).logits[0]
    want = logits.log_softmax(-1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)
    got = client.forward([datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    torch.testing.assert_close(got.to_torch(), want, rtol=1e-4, atol=1e-4)
    assert not list(directory.parent.glob(".*"))  # no staging folder left behind


def test_sampling_from_a_checkpoint_equals_a_snapshot_and_seeds_reproduce(service, tiny_dir):
    client = service.create_lora_training_client(tiny_dir, rank=4, seed=4)
    client.forward_backward([datum(s) for s in SENTENCES], "cross_entropy")
    client.optim_step(ADAM)
    from_disk = service.create_sampling_client(model_path=client.save_weights_for_sampler("s").result().path)
    snapshot = client.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(SENTENCES[0][:3])
    params = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0)
    first = from_disk.sample(prompt, 4, params).result().sequences
    assert first == snapshot.sample(prompt, 4, params).result().sequences
    assert first == from_disk.sample(prompt, 4, params).result().sequences
    assert len(first) == 4 and all(
        1 <= len(s.tokens) <= 6 and s.stop_reason in ("stop", "length") for s in first
    )
    # Training on does not change what the snapshot samples.
    client.forward_backward([datum(s) for s in SENTENCES], "cross_entropy")
    client.optim_step(types.AdamParams(learning_rate=0.5)).result()
    assert snapshot.sample(prompt, 4, params).result().sequences == first


def test_base_model_sampling_client_scores_without_any_adapter(service, tiny_dir):
    client = service.create_lora_training_client(tiny_dir, rank=4, seed=5)
    client.forward_backward([datum(s) for s in SENTENCES], "cross_entropy")
    client.optim_step(types.AdamParams(learning_rate=0.5))
    base = service.create_sampling_client(base_model=tiny_dir)
    tokens = SENTENCES[1]
    got = base.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:]
    plain = AutoModelForCausalLM.from_pretrained(tiny_dir)
    with torch.no_grad():
        logits = plain(input_ids=torch.tensor([tokens[:-1]])).logits[0]
    want = logits.log_softmax(-1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)
    assert base.get_base_model() == tiny_dir


def test_async_twins_double_await_and_keep_submission_order(service, tiny_dir):
    client = service.create_lora_training_client(tiny_dir, rank=4, seed=6)

    async def run():
        losses = []
        for _ in range(3):
            forward_backward = await client.forward_backward_async(
                [datum(s) for s in SENTENCES], "cross_entropy"
            )
            optim = await client.optim_step_async(ADAM)
            losses.append((await forward_backward).metrics["loss:sum"])
            await optim
        sampler = await client.save_weights_and_get_sampling_client_async()
        response = await sampler.sample_async(
            types.ModelInput.from_ints([8, 9]), 2, types.SamplingParams(max_tokens=3, seed=0)
        )
        return losses, response

    losses, response = asyncio.run(run())
    assert losses[2] < losses[0]  # each forward_backward saw the previous optim_step
    assert len(response.sequences) == 2


def test_concurrent_sample_requests_run_as_one_batch(service, tiny_dir, monkeypatch):
    sampler = service.create_sampling_client(base_model=tiny_dir)
    admitted, widest = [], []
    original_add, original_step = DecodeBatch.add, DecodeBatch.step
    gate = threading.Event()

    def counting(self, prompts):
        gate.wait(5)  # hold the first prefill so that the others queue up behind it
        admitted.append(len(prompts))
        return original_add(self, prompts)

    def measuring(self):
        widest.append(self.live_rows)
        return original_step(self)

    monkeypatch.setattr(DecodeBatch, "add", counting)
    monkeypatch.setattr(DecodeBatch, "step", measuring)
    params = types.SamplingParams(max_tokens=3)
    futures = [sampler.sample(types.ModelInput.from_ints(s[:2]), 2, params) for s in SENTENCES * 2]
    gate.set()
    results = [f.result(timeout=30) for f in futures]
    assert all(len(r.sequences) == 2 for r in results)
    assert sum(admitted) == 6 and len(admitted) < 6
    assert max(widest) >= 4  # rows of several requests in one decode step


def test_bad_requests_fail_with_a_message_that_says_what_to_do(service, tiny_dir):
    client = service.create_lora_training_client(tiny_dir, rank=4, seed=0)
    short = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]},
    )
    with pytest.raises(GymError, match=r"datum 0: .*target_tokens.* shape \(2,\).* 3 tokens"):
        client.forward_backward([short], "cross_entropy").result()
    with pytest.raises(GymError, match="unknown loss_fn `ppo2`"):
        client.forward_backward([datum(SENTENCES[0])], "ppo2").result()
    with pytest.raises(GymError, match="needs loss_fn_inputs\\[`logprobs`\\]"):
        client.forward_backward([datum(SENTENCES[0])], "ppo").result()
    client.save_state("once").result()
    with pytest.raises(GymError, match="already exists"):
        client.save_state("once").result()
    sampler_path = client.save_weights_for_sampler("s").result().path
    with pytest.raises(GymError, match="no optimizer state"):
        client.load_state_with_optimizer(sampler_path).result()
    with pytest.raises(GymError, match="gym://<run>/weights/<name>"):
        client.load_state("gym://run/checkpoints/x").result()
    with pytest.raises(GymError, match="without slashes"):
        client.save_state("a/b")
    with pytest.raises(GymError, match="model_path or base_model"):
        service.create_sampling_client()
    with pytest.raises(GymError, match="nothing to train"):
        service.create_lora_training_client(tiny_dir, train_mlp=False, train_attn=False)
    # The client still works after every failure.
    assert loss_of(client) > 0


def test_cookbook_model_info_and_conversation_to_datum(tiny_dir, word_tokenizer):
    from hanzo_gym.cookbook import model_info, renderers
    from hanzo_gym.cookbook.supervised.data import conversation_to_datum

    assert model_info.get_recommended_renderer_name("Qwen/Qwen3-8B") == "qwen3"
    assert model_info.get_recommended_renderer_name(tiny_dir) == "chat_template"  # its tokenizer's ChatML
    renderer = renderers.get_renderer("chat_template", word_tokenizer)
    messages = [{"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine thanks"}]
    model_input, weights = renderer.build_supervised_example(
        messages, renderers.TrainOnWhat.LAST_ASSISTANT_MESSAGE
    )
    tokens = model_input.to_ints()
    d = conversation_to_datum(messages, renderer, max_length=None, train_on_what="last_assistant_message")
    assert d.model_input.to_ints() == tokens[:-1]
    assert d.loss_fn_inputs["target_tokens"].tolist() == tokens[1:]
    assert d.loss_fn_inputs["weights"].tolist() == weights.tolist()[1:]
    trained = [t for t, w in zip(tokens[1:], weights.tolist()[1:]) if w]
    assert word_tokenizer.decode(trained).startswith("fine thanks")
    cut = conversation_to_datum(messages, renderer, max_length=5)
    assert cut.model_input.length == 4


def test_example_settings_parse_from_the_command_line():
    from dataclasses import dataclass

    from hanzo_gym.cookbook.cli_utils import config_from_argv

    @dataclass
    class Settings:
        batches: int = 1
        learning_rate: float = 1e-4
        model_name: str = "m"

    assert config_from_argv(Settings, ["batches=3", "learning_rate=3e-4"]) == Settings(3, 3e-4, "m")
    with pytest.raises(SystemExit, match="key among batches"):
        config_from_argv(Settings, ["batchez=3"])
    with pytest.raises(SystemExit, match="not a valid int"):
        config_from_argv(Settings, ["batches=three"])


def test_a_fresh_service_resumes_a_saved_state_exactly(tmp_path, tiny_dir):
    def step(client):
        client.forward_backward([datum(s) for s in SENTENCES], "cross_entropy")
        client.optim_step(ADAM)

    first = tinker.ServiceClient(root=tmp_path / "runs", dtype=torch.float32).create_lora_training_client(
        tiny_dir, rank=4, seed=1
    )
    step(first)
    path = first.save_state("s").result().path
    step(first)
    later = tinker.ServiceClient(
        root=tmp_path / "runs", dtype=torch.float32
    ).create_training_client_from_state_with_optimizer(path)
    step(later)
    assert loss_of(later) == pytest.approx(loss_of(first), rel=1e-6)


def test_a_dropped_sampling_client_still_answers_its_pending_requests(service, tiny_dir):
    client = service.create_lora_training_client(tiny_dir, rank=4, seed=0)
    params = types.SamplingParams(max_tokens=3, seed=0)
    prompt = types.ModelInput.from_ints([8, 9])
    futures = [client.save_weights_and_get_sampling_client().sample(prompt, 2, params) for _ in range(3)]
    gc.collect()
    assert all(len(f.result(timeout=30).sequences) == 2 for f in futures)
    del futures
    gc.collect()
    client.forward([datum(SENTENCES[0])], "cross_entropy").result()
    assert client._host.adapters == [client._adapter]  # every snapshot's slot is gone again


def test_a_custom_loss_may_call_other_clients_on_the_same_model(service, tiny_dir):
    client = service.create_lora_training_client(tiny_dir, rank=4, seed=0)
    reference = service.create_sampling_client(base_model=tiny_dir)
    data = [datum(s) for s in SENTENCES[:2]]

    def margin_to_reference(batch, logprobs):
        total = torch.zeros(())
        for d, lp in zip(batch, logprobs):
            tokens = [*d.model_input.to_ints(), d.loss_fn_inputs["target_tokens"].tolist()[-1]]
            ref = reference.compute_logprobs(types.ModelInput.from_ints(tokens)).result(timeout=20)[1:]
            total = total - (lp - torch.tensor(ref)).sum()
        return total, {"margin": -total.item()}

    out = client.forward_backward_custom(data, margin_to_reference).result(timeout=60)
    assert out.metrics["margin"] == pytest.approx(0.0, abs=1e-4)  # the adapter starts as the base model


def test_waiting_with_a_timeout_does_not_cancel_the_request(service, tiny_dir):
    client = service.create_lora_training_client(tiny_dir, rank=4, seed=0)

    def slow_loss(batch, logprobs):
        time.sleep(0.5)
        return -logprobs[0].sum(), {}

    async def run():
        client.forward_backward_custom([datum(SENTENCES[0])], slow_loss)  # keeps the worker busy
        queued = client.forward_backward([datum(SENTENCES[1])], "cross_entropy")
        with pytest.raises(asyncio.TimeoutError):
            await queued.result_async(timeout=0.05)
        return await queued

    out = asyncio.run(run())
    assert out.metrics["loss:sum"] > 0 and len(out.loss_fn_outputs) == 1


def test_bad_requests_fail_their_caller_and_everything_keeps_working(service, tiny_dir):
    client = service.create_lora_training_client(tiny_dir, rank=4, seed=0)
    sampler = client.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints([8, 9])
    with pytest.raises(GymError, match="SamplingParams"):
        sampler.sample(prompt, 1, {"max_tokens": 2})
    with pytest.raises(GymError, match="not a token id"):
        sampler.sample(types.ModelInput.from_ints([8, 10_000]), 1, types.SamplingParams(max_tokens=2))
    with pytest.raises(GymError, match="max_tokens must be at least 1"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=0)).result(timeout=10)
    out_of_vocabulary = types.Datum(
        model_input=types.ModelInput.from_ints([8, 9]),
        loss_fn_inputs={"target_tokens": [9, 5000], "weights": [1.0, 1.0]},
    )
    with pytest.raises(GymError, match="datum 0: target_tokens holds 5000"):
        client.forward_backward([out_of_vocabulary], "cross_entropy").result()
    with pytest.raises(GymError, match="unknown keys \\['clip'\\]"):
        client.forward([datum(SENTENCES[0])], "cross_entropy", {"clip": 1.0}).result()
    with pytest.raises(GymError, match="AdamParams"):
        client.optim_step(None)
    empty = client.forward_backward([], "importance_sampling").result()
    assert (empty.loss_fn_outputs, empty.metrics["loss:sum"]) == ([], 0.0)
    assert (
        len(sampler.sample(prompt, 2, types.SamplingParams(max_tokens=2)).result(timeout=30).sequences) == 2
    )


def test_closing_the_service_ends_its_sampler_threads(tmp_path, tiny_dir):
    with tinker.ServiceClient(root=tmp_path / "runs", dtype=torch.float32) as service:
        sampler = service.create_sampling_client(base_model=tiny_dir)
        prompt = types.ModelInput.from_ints([8, 9])
        pending = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=3))
        thread = sampler._batcher._thread
        assert thread.is_alive()
    assert not thread.is_alive()
    assert len(pending.result(timeout=1).sequences) == 2  # what was queued was answered first


def test_a_training_step_waits_for_one_decode_step_of_a_long_sample_not_for_all_of_it(
    service, tiny_dir, monkeypatch
):
    client = service.create_lora_training_client(tiny_dir, rank=4, seed=0)
    sampler = client.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints([8, 9])
    params = types.SamplingParams(max_tokens=120, seed=5, temperature=1.0)
    alone = sampler.sample(prompt, 16, params).result(timeout=60).sequences
    steps, original_step = [0], DecodeBatch.step

    def counting(self):
        steps[0] += 1
        time.sleep(0.01)  # a decode step of a real model: long enough for the trainer to queue behind one
        return original_step(self)

    monkeypatch.setattr(DecodeBatch, "step", counting)
    sample = sampler.sample(prompt, 16, params)
    while steps[0] < 5:
        time.sleep(0.005)
    submitted_at = steps[0]
    client.forward_backward([datum(s) for s in SENTENCES], "cross_entropy").result(timeout=60)
    trained_at = steps[0]
    assert not sample.done()  # the step ran while the sample went on
    assert trained_at - submitted_at <= 2
    # Stepping aside changes nothing the sample draws: a seeded request gives what it gives alone.
    assert sample.result(timeout=60).sequences == alone
    assert steps[0] > trained_at + 10, steps
