"""`gym serve --tinker --tinker-sampler vllm` with the official tinker SDK, on the real SmolLM2 in float32. Its own
module, run in a pytest process of its own by `make test-vllm`: on a CPU vLLM sizes its cache from the RAM the
process already holds, so a second vLLM engine in one process has no room."""

from __future__ import annotations

import pytest
import torch
from test_vllm_rollouts import _prompts

pytestmark = pytest.mark.vllm


def test_gym_serve_tinker_samples_through_vllm_for_the_official_sdk(model_cache, tmp_path, monkeypatch):
    """`gym serve --tinker --tinker-sampler vllm`: the official SDK trains an adapter on the server, and its
    sampling client decodes in vLLM what the built-in sampler decodes from the same checkpoint, greedily, with
    log-probabilities the trainer recomputes."""
    import tinker
    from tinker import types as sdk_types

    from hanzo_gym import tinker as gym_tinker
    from hanzo_gym.host.model_host import ModelHost
    from hanzo_gym.serve import ServedModels, Server
    from hanzo_gym.serve.server import tinker_api
    from hanzo_gym.tinker import types

    runs = tmp_path / "runs"
    models = ServedModels(ModelHost(str(model_cache.gguf), dtype=torch.float32), name="smol")
    api = tinker_api(models, root=str(runs), sampler="vllm")
    monkeypatch.setenv("TINKER_API_KEY", "tml-local-test")
    with (
        Server(models, port=0, tinker=api) as running,
        gym_tinker.ServiceClient(root=runs, dtype=torch.float32) as reference,
    ):
        sdk = tinker.ServiceClient(base_url=running.base_url)
        trainer = sdk.create_lora_training_client(base_model="smol", rank=8, seed=0).result()
        tokenizer = models.host.tokenizer
        text = tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome.")
        datum = sdk_types.Datum(
            model_input=sdk_types.ModelInput.from_ints(text[:-1]),
            loss_fn_inputs={"target_tokens": text[1:], "weights": [1.0] * (len(text) - 1)},
        )
        for _ in range(3):
            trainer.forward_backward([datum], "cross_entropy").result()
            trainer.optim_step(sdk_types.AdamParams(learning_rate=1e-3)).result()
        path = trainer.save_weights_for_sampler("s1").result().path
        through_vllm = sdk.create_sampling_client(model_path=path).result()
        built_in = reference.create_sampling_client(model_path=path.replace("tinker://", "gym://", 1))
        greedy = sdk_types.SamplingParams(max_tokens=12, temperature=0.0)
        for prompt in _prompts(tokenizer)[:3]:
            got = through_vllm.sample(sdk_types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
            local = types.SamplingParams(max_tokens=12, temperature=0.0)
            expected = built_in.sample(types.ModelInput.from_ints(prompt), 1, local).result().sequences[0]
            assert got.tokens == expected.tokens
        prompt = sdk_types.ModelInput.from_ints(_prompts(tokenizer)[0])
        sampled = through_vllm.sample(prompt, 3, sdk_types.SamplingParams(max_tokens=10, seed=3)).result()
        for sequence in sampled.sequences:
            scored = through_vllm.compute_logprobs(
                sdk_types.ModelInput.from_ints(_prompts(tokenizer)[0] + sequence.tokens)
            ).result()[-len(sequence.tokens) :]
            assert max(abs(a - b) for a, b in zip(scored, sequence.logprobs, strict=True)) < 1e-3
    models.batcher.close()
