"""Tinker's "Custom RL Loop" (seed-004), run locally on SmolLM2-135M-Instruct.

The body of `main` is Tinker's example with only the imports changed (`from hanzo_gym import tinker` for
`import tinker`, `hanzo_gym.cookbook` for `tinker_cookbook`) and chz's `@chz.chz` written as a dataclass. The
example leaves `dataset` and `compute_reward` to the reader; here they are single-digit sums (the questions of
examples/addition-prompts.jsonl) and "is the last number in the answer the sum". A held-out greedy accuracy is
measured before and after, and each batch's mean reward is printed.

    python examples/rl_loop.py [batches=20] [learning_rate=3e-4] …   (any Config field)
"""

import json
import random
import re
import sys
import time
from dataclasses import dataclass

import torch

from hanzo_gym import tinker
from hanzo_gym.cookbook import model_info, renderers
from hanzo_gym.cookbook.cli_utils import config_from_argv
from hanzo_gym.tinker import types
from hanzo_gym.tinker.types.tensor_data import TensorData


@dataclass
class Config:
    model_name: str = ".venv/models/SmolLM2-135M-Instruct.Q4_1.gguf"  # `make demo` links it there
    batch_size: int = 4
    group_size: int = 8
    learning_rate: float = 3e-4
    max_tokens: int = 12
    batches: int = 20
    held_out: int = 20
    seed: int = 0


def load_rows(path: str = "examples/addition-prompts.jsonl") -> list[tuple[str, str]]:
    with open(path) as handle:
        rows = [json.loads(line) for line in handle]
    return [(row["messages"][0]["content"], row["answer"]) for row in rows]


def compute_reward(content: str, answer: str) -> float:
    numbers = re.findall(r"-?\d+", content)
    return 1.0 if numbers and numbers[-1] == answer else 0.0


def held_out_accuracy(sampling_client, renderer, rows) -> float:
    """Greedy answers to every held-out question (submitted together, so they decode as one batch)."""
    params = types.SamplingParams(max_tokens=12, temperature=0.0, stop=renderer.get_stop_sequences())
    futures = [
        sampling_client.sample(renderer.build_generation_prompt([{"role": "user", "content": q}]), 1, params)
        for q, _ in rows
    ]
    rewards = []
    for future, (_, answer) in zip(futures, rows):
        parsed, _ = renderer.parse_response(future.result().sequences[0].tokens)
        rewards.append(compute_reward(parsed["content"], answer))
    return sum(rewards) / len(rewards)


def main(config: Config):
    rows = load_rows()
    random.Random(config.seed).shuffle(rows)
    held_out, train_rows = rows[: config.held_out], rows[config.held_out :]
    dataset = [train_rows[i : i + config.batch_size] for i in range(0, len(train_rows), config.batch_size)][
        : config.batches
    ]

    service_client = tinker.ServiceClient()
    training_client = service_client.create_lora_training_client(
        base_model=config.model_name, rank=32, seed=config.seed
    )
    tokenizer = training_client.get_tokenizer()
    renderer = renderers.get_renderer(model_info.get_recommended_renderer_name(config.model_name), tokenizer)

    sampling_params = types.SamplingParams(
        max_tokens=config.max_tokens,
        stop=renderer.get_stop_sequences(),
    )
    adam_params = types.AdamParams(learning_rate=config.learning_rate)

    base_client = service_client.create_sampling_client(base_model=config.model_name)
    before = held_out_accuracy(base_client, renderer, held_out)
    print(f"held-out greedy accuracy before training: {before:.2f}", flush=True)
    started = time.monotonic()

    for batch_idx, batch_rows in enumerate(dataset):
        # Save weights for sampling
        sampling_path = training_client.save_weights_for_sampler(name=f"{batch_idx:06d}").result().path
        sampling_client = service_client.create_sampling_client(model_path=sampling_path)

        datums = []
        batch_rewards = []
        for question, answer in batch_rows:
            convo = [{"role": "user", "content": question}]
            model_input = renderer.build_generation_prompt(convo)
            prompt_tokens = model_input.to_ints()

            # Sample group_size responses
            result = sampling_client.sample(
                prompt=model_input,
                num_samples=config.group_size,
                sampling_params=sampling_params,
            ).result()

            rewards = []
            for seq in result.sequences:
                parsed, _ = renderer.parse_response(seq.tokens)
                reward = compute_reward(parsed["content"], answer)
                rewards.append(reward)
            batch_rewards += rewards

            # GRPO-style advantage centering
            mean_reward = sum(rewards) / len(rewards)
            advantages = [r - mean_reward for r in rewards]

            if all(a == 0 for a in advantages):
                continue

            for seq, advantage in zip(result.sequences, advantages):
                tokens = prompt_tokens + seq.tokens
                ob_len = len(prompt_tokens) - 1

                datum = types.Datum(
                    model_input=types.ModelInput.from_ints(tokens=tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": TensorData.from_torch(torch.tensor(tokens[1:])),
                        "logprobs": TensorData.from_torch(torch.tensor([0.0] * ob_len + list(seq.logprobs))),
                        "advantages": TensorData.from_torch(
                            torch.tensor([0.0] * ob_len + [advantage] * (len(tokens) - 1 - ob_len))
                        ),
                    },
                )
                datums.append(datum)

        print(
            f"batch {batch_idx:3d}  reward {sum(batch_rewards) / len(batch_rewards):.3f}  "
            f"datums {len(datums):3d}  {time.monotonic() - started:6.1f} s",
            flush=True,
        )
        # Training step
        fwd_bwd = training_client.forward_backward(datums, loss_fn="importance_sampling")
        optim = training_client.optim_step(adam_params)
        fwd_bwd.result()
        optim.result()

    after = held_out_accuracy(training_client.save_weights_and_get_sampling_client(), renderer, held_out)
    print(f"held-out greedy accuracy after {len(dataset)} batches: {after:.2f} (before: {before:.2f})")
    return before, after


if __name__ == "__main__":
    main(config_from_argv(Config, sys.argv[1:]))
