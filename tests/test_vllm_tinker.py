"""The in-process Tinker client sampling through a real vLLM (`ServiceClient(sampler="vllm")`), on the real
SmolLM2 in float32. Its own module, run in a pytest process of its own by `make test-vllm`: on a CPU vLLM
sizes its cache from the RAM the process already holds, and test_vllm_rollouts.py's engines hold plenty."""

from __future__ import annotations

import pytest
import torch
from test_vllm_rollouts import _prompts

pytestmark = pytest.mark.vllm


def test_tinker_sampling_clients_sample_through_vllm(model_cache, tmp_path):
    """The in-process Tinker client with `sampler="vllm"`: a trained adapter's sampling client decodes in vLLM,
    greedily as the built-in sampler does on the same sampler weights, with the trainer's log-probabilities."""
    from hanzo_gym import tinker
    from hanzo_gym.tinker import types

    base = str(model_cache.gguf)
    with (
        tinker.ServiceClient(root=tmp_path / "runs", sampler="vllm", dtype=torch.float32) as service,
        tinker.ServiceClient(root=tmp_path / "runs", dtype=torch.float32) as reference,
    ):
        training = service.create_lora_training_client(base, rank=8, seed=0)
        tokenizer = training.get_tokenizer()
        text = tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome.")
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(text[:-1]),
            loss_fn_inputs={"target_tokens": text[1:], "weights": [1.0] * (len(text) - 1)},
        )
        for _ in range(3):
            training.forward_backward([datum], "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        path = training.save_weights_for_sampler("s1").result().path
        through_vllm = service.create_sampling_client(model_path=path)
        built_in = reference.create_sampling_client(model_path=path)
        greedy = types.SamplingParams(max_tokens=12, temperature=0.0)
        for prompt in _prompts(tokenizer)[:3]:
            model_input = types.ModelInput.from_ints(prompt)
            got = through_vllm.sample(model_input, 1, greedy).result().sequences[0]
            assert got.tokens == built_in.sample(model_input, 1, greedy).result().sequences[0].tokens
        sampled = (
            through_vllm.sample(
                types.ModelInput.from_ints(_prompts(tokenizer)[0]),
                3,
                types.SamplingParams(max_tokens=10, seed=3),
            )
            .result()
            .sequences
        )
        for sequence in sampled:
            scored = through_vllm.compute_logprobs(
                types.ModelInput.from_ints(_prompts(tokenizer)[0] + sequence.tokens)
            ).result()[-len(sequence.tokens) :]
            assert max(abs(a - b) for a, b in zip(scored, sequence.logprobs, strict=True)) < 1e-3
