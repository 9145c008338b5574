"""Several LoRA adapters of one base in one pass (engine/shared_pass.py, host/shared_passes.py): each client's
loss, logprobs and gradients equal those of its own calls run alone."""

from __future__ import annotations

import threading

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny_models import tiny_model

from hanzo_gym import tinker
from hanzo_gym.engine import Engine
from hanzo_gym.engine.adapter_tokens import takes_token_adapters
from hanzo_gym.engine.shared_pass import AdapterJob, score_together, why_not_shared
from hanzo_gym.host import sample_batcher as shared_passes_batcher
from hanzo_gym.host import shared_passes
from hanzo_gym.records import AdamParams, Datum
from hanzo_gym.tinker import types

VOCAB = 300
# adapters that differ in rank and in the layers they adapt; one adapts only some of another's layers
ADAPTERS = {
    "first": LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "second": LoraConfig(r=8, lora_alpha=8, target_modules="all-linear", use_rslora=True),
    "third": LoraConfig(r=2, lora_alpha=32, target_modules=["down_proj", "q_proj"]),
}


def three_adapter_engines(dtype: torch.dtype = torch.float32) -> dict[str, Engine]:
    model = None
    for name, config in ADAPTERS.items():
        config.lora_dropout = 0.0
        if model is None:
            model = get_peft_model(
                tiny_model("llama", vocab_size=VOCAB, initializer_range=0.2).to(dtype),
                config,
                adapter_name=name,
            )
        else:
            model.add_adapter(name, config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "lora_B" in parameter_name:  # B is zero at the start: give every adapter an effect
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    engines = {}
    for name in ADAPTERS:
        model.set_adapter(name)
        engines[name] = Engine(model)
    return engines


def datums(generator: torch.Generator, count: int, prompt: list[int] = ()) -> list[Datum]:
    out = []
    for _ in range(count):
        length = int(torch.randint(4, 24, (1,), generator=generator))
        tokens = [*prompt, *torch.randint(0, VOCAB, (length,), generator=generator).tolist()]
        weights = torch.rand(len(tokens) - 1, generator=generator).tolist()
        out.append(Datum.from_tokens(tokens[:-1], target_tokens=tokens[1:], weights=weights))
    return out


def batches() -> dict[str, list[Datum]]:
    """Datums for each adapter; all three start with one 20-token prompt, which prefix sharing shares only
    between datums of one adapter."""
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (20,), generator=generator).tolist()
    return {
        "first": datums(generator, 3, prompt),
        "second": datums(generator, 2, prompt) + datums(generator, 2),
        "third": datums(generator, 4, prompt),
    }


def alone(engines: dict[str, Engine], data: dict[str, list[Datum]], backward: bool):
    results = {}
    for name, engine in engines.items():
        engine.model.set_adapter(name)
        out = engine.forward_backward(data[name]) if backward else engine.forward_loss(data[name])
        results[name] = (out, [p.grad.clone() for p in engine.trainable] if backward else [])
        for parameter in engine.trainable:
            parameter.grad = None
    return results


@pytest.mark.parametrize("backward", [True, False], ids=["forward_backward", "forward"])
@pytest.mark.parametrize("tokens_per_pass", [512, 40], ids=["one-pass", "many-passes"])
def test_adapters_sharing_passes_get_what_each_gets_alone(backward, tokens_per_pass):
    engines = three_adapter_engines()
    data = batches()
    for engine in engines.values():
        engine.max_tokens_per_pass = tokens_per_pass
    expected = alone(engines, data, backward)
    engines["first"].model.set_adapter("second")
    outputs = score_together([AdapterJob(engines[name], data[name]) for name in engines], backward)
    for name, output in zip(engines, outputs):
        reference, gradients = expected[name]
        assert output.loss_sum == pytest.approx(reference.loss_sum, rel=1e-5)
        for got, want in zip(output.logprobs, reference.logprobs, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for got, want in zip(output.entropies, reference.entropies, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for parameter, want in zip(engines[name].trainable, gradients):
            scale = want.abs().max()
            torch.testing.assert_close(parameter.grad / scale, want / scale, rtol=0, atol=1e-5)
        if not backward:
            assert all(parameter.grad is None for parameter in engines[name].trainable)
    # as it was: the active adapter alone trains, the others are frozen
    model = engines["first"].model
    assert model.active_adapter == "second"
    assert all(p.requires_grad for p in engines["second"].trainable)
    assert not any(p.requires_grad for name in ("first", "third") for p in engines[name].trainable)


def test_bf16_base_under_autocast_matches_each_adapter_alone():
    engines = three_adapter_engines(torch.bfloat16)
    for engine in engines.values():  # the adapters stay fp32 over the bf16 base, as a model host keeps them
        for parameter in engine.trainable:
            parameter.data = parameter.data.float()
        engine.autocast_dtype = torch.bfloat16
    data = batches()
    expected = alone(engines, data, backward=True)
    outputs = score_together([AdapterJob(engines[name], data[name]) for name in engines], backward=True)
    for name, output in zip(engines, outputs):
        reference, gradients = expected[name]
        assert output.loss_sum == pytest.approx(reference.loss_sum, rel=1e-2)
        for parameter, want in zip(engines[name].trainable, gradients):
            torch.testing.assert_close(parameter.grad, want, rtol=0.05, atol=0.05 * want.abs().max().item())


def test_a_dora_adapter_or_one_with_dropout_does_not_share_a_pass_and_says_why():
    model = get_peft_model(tiny_model("llama", vocab_size=VOCAB), LoraConfig(r=2, use_dora=True), "dora")
    model.add_adapter("plain", LoraConfig(r=2, lora_dropout=0.0))
    model.add_adapter("dropping", LoraConfig(r=2, lora_dropout=0.1))
    assert "DoRA" in takes_token_adapters(model, "dora")
    assert "dropout" in takes_token_adapters(model, "dropping")
    assert takes_token_adapters(model, "plain") is None
    engine = Engine(model)
    assert "DoRA" in why_not_shared(engine)
    model.set_adapter("plain")
    with pytest.raises(Exception, match="cannot share a pass: .*DoRA"):
        score_together(
            [AdapterJob(engine, batches()["first"]), AdapterJob(Engine(model), batches()["third"])], True
        )


def run_clients(tiny_dir, tmp_path, steps: int, together: bool, monkeypatch) -> tuple[list[dict], list[int]]:
    """Four training clients on one base, `steps` steps each; with `together`, the four calls of each step are
    queued while the host is held, so that they run as one; else one client at a time. Their weights after,
    and the number of calls in each run of shared passes."""
    runs: list[int] = []
    real = shared_passes.score_together

    def counted(jobs, backward):
        runs.append(len(jobs))
        return real(jobs, backward)

    monkeypatch.setattr(shared_passes, "score_together", counted)
    service = tinker.ServiceClient(root=tmp_path / f"runs-{together}", dtype=torch.float32)
    clients = [service.create_lora_training_client(tiny_dir, rank=4, seed=seed) for seed in range(4)]
    host = service._hosts[next(iter(service._hosts))][0]
    generator = torch.Generator().manual_seed(3)
    adam = AdamParams(learning_rate=0.05)
    for _ in range(steps):
        work = {
            client: [
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
                )
                for tokens in (torch.randint(3, 40, (n,), generator=generator).tolist() for n in (9, 14))
            ]
            for client in clients
        }
        if together:
            with host.lock:
                futures = [client.forward_backward(work[client], "cross_entropy") for client in clients]
                while host.lock.waiting() < len(clients):  # every client's call waits for the host
                    threading.Event().wait(0.01)
            outputs = [f.result(timeout=60) for f in futures]
        else:
            outputs = [client.forward_backward(work[client], "cross_entropy").result() for client in clients]
        assert all(out.metrics["loss:sum"] > 0 for out in outputs)
        for client in clients:
            client.optim_step(adam).result()
    weights = [{k: v.clone() for k, v in host.weights(client._adapter).items()} for client in clients]
    service.close()
    return weights, runs


def test_four_clients_stepping_at_once_share_passes_and_train_as_alone(tiny_dir, tmp_path, monkeypatch):
    together, runs = run_clients(tiny_dir, tmp_path, 3, True, monkeypatch)
    assert runs == [4, 4, 4]
    turns, runs = run_clients(tiny_dir, tmp_path, 3, False, monkeypatch)
    assert runs == []
    for mine, theirs in zip(together, turns, strict=True):
        assert mine.keys() == theirs.keys()
        for key in mine:
            torch.testing.assert_close(mine[key], theirs[key], rtol=1e-5, atol=1e-5)


def one_datum(seed: int) -> list[types.Datum]:
    tokens = torch.randint(3, 40, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
    ]


def test_a_client_out_of_step_is_waited_for_once_and_a_lone_client_never_waits(
    tiny_dir, tmp_path, monkeypatch
):
    runs: list[int] = []
    real = shared_passes.SharedPasses._run

    def counted(self, calls):
        runs.append(len(calls))
        return real(self, calls)

    monkeypatch.setattr(shared_passes.SharedPasses, "_run", counted)
    monkeypatch.setattr(shared_passes, "GATHER_SECONDS", 60.0)  # a wait that ran out would fail the timeouts
    with tinker.ServiceClient(root=tmp_path / "runs", dtype=torch.float32) as service:
        first = service.create_lora_training_client(tiny_dir, rank=4, seed=0)
        first.forward_backward(one_datum(0), "cross_entropy").result(timeout=20)  # nobody else: no wait
        second = service.create_lora_training_client(tiny_dir, rank=4, seed=1)
        monkeypatch.setattr(shared_passes, "GATHER_SECONDS", 0.2)
        second.forward_backward(one_datum(9), "cross_entropy").result(
            timeout=20
        )  # waits briefly for the first
        monkeypatch.setattr(shared_passes, "GATHER_SECONDS", 60.0)
        host = first._host
        with host.lock:  # both call at once
            both = [client.forward_backward(one_datum(1), "cross_entropy") for client in (first, second)]
            while host.lock.waiting() < 2:
                threading.Event().wait(0.01)
        assert all(f.result(timeout=20) for f in both)
        assert runs == [1, 1, 2]
        waiting = first.forward_backward(one_datum(2), "cross_entropy")
        threading.Event().wait(0.2)
        assert not waiting.done()  # it waits for the second client, the host free
        late = second.forward_backward(one_datum(3), "cross_entropy")
        assert waiting.result(timeout=20).metrics["loss:sum"] > 0 and late.result(timeout=20)
        assert runs == [1, 1, 2, 2]
        # the second client does not come: the first waits once, then no more
        monkeypatch.setattr(shared_passes, "GATHER_SECONDS", 0.2)
        first.forward_backward(one_datum(4), "cross_entropy").result(timeout=20)
        monkeypatch.setattr(shared_passes, "GATHER_SECONDS", 60.0)
        first.forward_backward(one_datum(5), "cross_entropy").result(timeout=20)
        assert runs == [1, 1, 2, 2, 1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_samples_of_several_adapters_decode_together_as_each_alone(tiny_dir, tmp_path, monkeypatch, dtype):
    """Greedy samples of three trained adapters and of the base, asked at once, decode in one batch (each row
    through its own adapter) and equal what each sampling client decodes alone."""
    mixed: list[int] = []
    real = shared_passes_batcher.SampleBatcher._decode_lanes

    def recorded(self, key, model, router, alone):
        if router is not None:
            mixed.append(len(self._lanes_of(key)))
        return real(self, key, model, router, alone)

    monkeypatch.setattr(shared_passes_batcher.SampleBatcher, "_decode_lanes", recorded)
    with tinker.ServiceClient(root=tmp_path / "runs", dtype=dtype) as service:
        samplers = []
        for seed in range(3):
            client = service.create_lora_training_client(tiny_dir, rank=4, seed=seed)
            client.forward_backward(one_datum(seed), "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=0.1)).result()
            samplers.append(client.save_weights_and_get_sampling_client())
        samplers.append(service.create_sampling_client(base_model=tiny_dir))
        # prompts of different lengths and rows that end at different steps: rows leave a mixed batch
        tokens = one_datum(7)[0].model_input.to_ints()
        asks = {
            sampler: (types.ModelInput.from_ints(tokens[: 3 + 2 * i]), 6 + 5 * i)
            for i, sampler in enumerate(samplers)
        }

        def ask(sampler):
            prompt, max_tokens = asks[sampler]
            params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=[])
            return sampler.sample(prompt, num_samples=2, sampling_params=params)

        alone = [ask(sampler).result(timeout=60).sequences for sampler in samplers]
        assert mixed == []
        assert len({tuple(s[0].tokens) for s in alone}) > 1  # the adapters decode differently
        host = samplers[0]._host
        with host.lock:  # all four wait for the sampler thread's next turn
            futures = [ask(sampler) for sampler in samplers]
            while host.lock.waiting() < 1:
                threading.Event().wait(0.01)
            threading.Event().wait(0.2)
        together = [f.result(timeout=60).sequences for f in futures]
    assert mixed and mixed[0] == 1  # one lane, rows of four adapters (the base's among them)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: the same products, rounded alike
    for mine, theirs in zip(together, alone, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert a.tokens == b.tokens
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=tolerance, atol=tolerance
            )


def test_a_failing_shared_run_leaves_every_gradient_as_it_was(monkeypatch):
    from hanzo_gym.engine import shared_pass

    engines = three_adapter_engines()
    data = batches()
    for name, engine in engines.items():  # gradients accumulated earlier, which a failure must keep
        engine.model.set_adapter(name)
        engine.max_tokens_per_pass = 40
        engine.forward_backward(data[name][:1])
    before = {name: [p.grad.clone() for p in engine.trainable] for name, engine in engines.items()}
    real, scored = shared_pass._loss, []

    def fails_late(driver, job, datums, logprobs):
        scored.append(job)
        if len(scored) > 4:  # after earlier passes have run their backward
            raise RuntimeError("out of memory")
        return real(driver, job, datums, logprobs)

    monkeypatch.setattr(shared_pass, "_loss", fails_late)
    with pytest.raises(RuntimeError, match="out of memory"):
        score_together([AdapterJob(engines[name], data[name]) for name in engines], backward=True)
    for name, engine in engines.items():
        for parameter, grad in zip(engine.trainable, before[name], strict=True):
            assert torch.equal(parameter.grad, grad)
    model = engines["first"].model
    assert not any(layer.disable_adapters for layer in model.modules() if hasattr(layer, "lora_A"))
    assert all(p.requires_grad for p in engines["third"].trainable)  # the active adapter, as before
    assert not any(p.requires_grad for p in engines["first"].trainable)


def test_an_adapter_of_the_embeddings_or_the_output_layer_takes_its_turn_alone():
    model = get_peft_model(
        tiny_model("llama", vocab_size=VOCAB),
        LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]),
        "emb",
    )
    model.add_adapter("head", LoraConfig(r=2, target_modules=["lm_head"]))
    assert "Embedding" in takes_token_adapters(model, "emb")
    assert "output layer" in takes_token_adapters(model, "head")


def test_a_shared_run_that_fails_runs_its_calls_alone(tiny_dir, tmp_path, monkeypatch):
    attempts = []

    def broken(jobs, backward):
        attempts.append(len(jobs))
        raise RuntimeError("a shared pass failed")

    monkeypatch.setattr(shared_passes, "score_together", broken)
    with tinker.ServiceClient(root=tmp_path / "runs", dtype=torch.float32) as service:
        clients = [service.create_lora_training_client(tiny_dir, rank=4, seed=seed) for seed in range(2)]
        for client in clients:  # each adapter's shareability, looked at once
            client.forward(one_datum(0), "cross_entropy").result(timeout=20)
        alone = [client.forward(one_datum(1), "cross_entropy").result(timeout=20) for client in clients]
        host = clients[0]._host
        with host.lock:
            futures = [client.forward(one_datum(1), "cross_entropy") for client in clients]
            while host.lock.waiting() < 2:
                threading.Event().wait(0.01)
        for future, expected in zip(futures, alone, strict=True):
            assert future.result(timeout=20).metrics["loss:sum"] == pytest.approx(
                expected.metrics["loss:sum"]
            )
    assert attempts == [2]


def test_a_request_of_an_adapter_unloaded_while_it_waits_fails_alone(tiny_dir):
    from hanzo_gym.host.model_host import ModelHost
    from hanzo_gym.host.sample_batcher import SampleBatcher
    from hanzo_gym.records import SamplingParams

    host = ModelHost(tiny_dir, dtype=torch.float32)
    for name in ("kept", "unloaded"):
        host.add_adapter(name, LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj"]))
    batcher = SampleBatcher(host)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    try:
        with host.lock:
            kept = batcher.submit("kept", [3, 4, 5], 1, params)
            gone = batcher.submit("unloaded", [3, 4, 5], 1, params)
            host.retire("unloaded")
        # (or, had `kept` finished first, its lone turn finds it gone)
        with pytest.raises(Exception, match="`unloaded` was unloaded|no adapter named `unloaded`"):
            gone.result(timeout=60)
        assert len(kept.result(timeout=60)[0].tokens) == 4
        assert host.adapters == ["kept"]
    finally:
        batcher.close()
