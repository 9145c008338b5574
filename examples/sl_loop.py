"""Tinker's supervised-learning loop (seed-004's custom dataset and training-step pattern), run locally on
SmolLM2-135M-Instruct.

Only the imports differ from Tinker's: `from hanzo_gym import tinker` for `import tinker` and
`hanzo_gym.cookbook` for `tinker_cookbook`. Each batch of conversations from examples/addition.jsonl becomes
Datums through `conversation_to_datum`; `forward_backward` and `optim_step` are submitted back to back before
waiting, the learning rate decays linearly, and the mean NLL per trained token is printed for the training
batch and, every `eval_every` batches, for held-out conversations (`forward`, no gradients).

    python examples/sl_loop.py [batches=30] [learning_rate=3e-4] …   (any Config field)
"""

import json
import random
import sys
import time
from dataclasses import dataclass

from hanzo_gym import tinker
from hanzo_gym.cookbook import model_info, renderers
from hanzo_gym.cookbook.cli_utils import config_from_argv
from hanzo_gym.cookbook.renderers import TrainOnWhat
from hanzo_gym.cookbook.supervised.data import conversation_to_datum
from hanzo_gym.tinker import types


@dataclass
class Config:
    model_name: str = ".venv/models/SmolLM2-135M-Instruct.Q4_1.gguf"  # `make demo` links it there
    batch_size: int = 8
    learning_rate: float = 3e-4
    lora_rank: int = 16
    max_length: int = 256
    batches: int = 30
    eval_every: int = 10
    held_out: int = 16
    seed: int = 0


def mean_nll(result, batch) -> float:
    """Mean negative log-likelihood per trained token: Σ −logprob · weight / Σ weight."""
    total = weight_sum = 0.0
    for output, datum in zip(result.loss_fn_outputs, batch):
        logprobs = output["logprobs"].to_torch()
        weights = datum.loss_fn_inputs["weights"].to_torch()
        total += float(-(logprobs * weights).sum())
        weight_sum += float(weights.sum())
    return total / max(weight_sum, 1.0)


def main(config: Config):
    with open("examples/addition.jsonl") as handle:
        conversations = [json.loads(line)["messages"] for line in handle]
    random.Random(config.seed).shuffle(conversations)
    held_out, train = conversations[: config.held_out], conversations[config.held_out :]

    service_client = tinker.ServiceClient()
    training_client = service_client.create_lora_training_client(
        base_model=config.model_name, rank=config.lora_rank, seed=config.seed
    )
    tokenizer = training_client.get_tokenizer()
    renderer = renderers.get_renderer(model_info.get_recommended_renderer_name(config.model_name), tokenizer)

    def to_datum(messages):
        return conversation_to_datum(
            messages, renderer, config.max_length, train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES
        )

    test_batch = [to_datum(m) for m in held_out]
    started = time.monotonic()
    for batch_idx in range(config.batches):
        if batch_idx % config.eval_every == 0:
            test = training_client.forward(test_batch, loss_fn="cross_entropy").result()
            print(f"batch {batch_idx:3d}  test nll {mean_nll(test, test_batch):.4f}", flush=True)
        start = batch_idx * config.batch_size % len(train)
        batch = [to_datum(m) for m in (train + train)[start : start + config.batch_size]]
        learning_rate = config.learning_rate * (1 - batch_idx / config.batches)
        adam_params = types.AdamParams(learning_rate=learning_rate, beta1=0.9, beta2=0.95, eps=1e-8)

        fwd_bwd_future = training_client.forward_backward(batch, loss_fn="cross_entropy")
        optim_step_future = training_client.optim_step(adam_params)
        fwd_bwd_result = fwd_bwd_future.result()
        optim_step_future.result()
        print(
            f"batch {batch_idx:3d}  train nll {mean_nll(fwd_bwd_result, batch):.4f}  lr {learning_rate:.2e}  "
            f"{time.monotonic() - started:6.1f} s",
            flush=True,
        )

    test = training_client.forward(test_batch, loss_fn="cross_entropy").result()
    final = mean_nll(test, test_batch)
    path = training_client.save_weights_for_sampler(name="final").result().path
    sampling_client = service_client.create_sampling_client(model_path=path)
    conversation = held_out[0][:-1]  # the system and user messages
    question = conversation[-1]["content"]
    prompt = renderer.build_generation_prompt(conversation)
    params = types.SamplingParams(max_tokens=40, temperature=0.0, stop=renderer.get_stop_sequences())
    answer, _ = renderer.parse_response(
        sampling_client.sample(prompt, 1, params).result().sequences[0].tokens
    )
    print(f"test nll after {config.batches} batches: {final:.4f}; sampler weights: {path}")
    print(f"{question!r} → {answer['content']!r}")
    return final


if __name__ == "__main__":
    main(config_from_argv(Config, sys.argv[1:]))
