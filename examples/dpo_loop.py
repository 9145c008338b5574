"""DPO written the tinker-cookbook way, over `forward_backward_custom`, run locally on SmolLM2-135M-Instruct.

Only the imports differ from Tinker's: `from hanzo_gym import tinker` for `import tinker` and `hanzo_gym.cookbook`
for `tinker_cookbook`. Each pair of examples/addition-pairs.jsonl (a right and a wrong sum in the same words)
becomes two Datums, prompt + chosen and prompt + rejected, whose weights mark the answer's tokens. The reference
log-probabilities come from a sampling client of the base model (`compute_logprobs`), once per pair. The loss is
DPO's −log σ(β·((π_c − ref_c) − (π_r − ref_r))), computed by our Python function on the policy's log-probs, which
`forward_backward_custom` turns into gradients; held-out preference accuracy (the policy's implicit reward prefers
the right answer) is printed every `eval_every` batches.

    python examples/dpo_loop.py [batches=20] [beta=0.1] …   (any Config field)
"""

import json
import random
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hanzo_gym import tinker
from hanzo_gym.cookbook import model_info, renderers
from hanzo_gym.cookbook.cli_utils import config_from_argv
from hanzo_gym.cookbook.renderers import TrainOnWhat
from hanzo_gym.cookbook.supervised.data import conversation_to_datum
from hanzo_gym.tinker import types


@dataclass
class Config:
    model_name: str = ".venv/models/SmolLM2-135M-Instruct.Q4_1.gguf"  # `make demo` links it there
    batch_size: int = 4  # pairs per step
    learning_rate: float = 5e-4
    beta: float = 0.1
    lora_rank: int = 16
    max_length: int = 128
    batches: int = 20
    eval_every: int = 5
    held_out: int = 20
    seed: int = 0


def weighted_sum(logprobs: torch.Tensor, datum: types.Datum) -> torch.Tensor:
    return (logprobs * datum.loss_fn_inputs["weights"].to_torch()).sum()


def main(config: Config):
    with open("examples/addition-pairs.jsonl") as handle:
        rows = [json.loads(line) for line in handle]
    random.Random(config.seed).shuffle(rows)
    held_out, train = rows[: config.held_out], rows[config.held_out :]

    service_client = tinker.ServiceClient()
    training_client = service_client.create_lora_training_client(
        base_model=config.model_name, rank=config.lora_rank, seed=config.seed
    )
    reference_client = service_client.create_sampling_client(base_model=config.model_name)
    tokenizer = training_client.get_tokenizer()
    renderer = renderers.get_renderer(model_info.get_recommended_renderer_name(config.model_name), tokenizer)

    def pair_datums(row) -> list[types.Datum]:
        """prompt + chosen, prompt + rejected: weights on the answer's tokens (the last assistant message)."""
        return [
            conversation_to_datum(
                [*row["messages"], {"role": "assistant", "content": row[side]}],
                renderer,
                config.max_length,
                train_on_what=TrainOnWhat.LAST_ASSISTANT_MESSAGE,
            )
            for side in ("chosen", "rejected")
        ]

    def reference_sums(data: list[types.Datum]) -> list[float]:
        """The base model's summed log-probs of each datum's weighted tokens."""
        futures = []
        for datum in data:
            whole = datum.model_input.to_ints() + datum.loss_fn_inputs["target_tokens"].tolist()[-1:]
            futures.append(reference_client.compute_logprobs(types.ModelInput.from_ints(whole)))
        sums = []
        for datum, future in zip(data, futures):
            logprobs = torch.tensor(future.result()[1:])  # token t's log-prob, aligned with target t-1
            sums.append(float(weighted_sum(logprobs, datum)))
        return sums

    def dpo_loss(data, logprobs_list, reference):
        policy = torch.stack([weighted_sum(lp, d) for d, lp in zip(data, logprobs_list)])
        ref = torch.tensor(reference)
        chosen_ratio, rejected_ratio = policy[0::2] - ref[0::2], policy[1::2] - ref[1::2]
        margin = config.beta * (chosen_ratio - rejected_ratio)
        loss = -F.logsigmoid(margin).mean()
        return loss, {"dpo_loss": loss.item(), "accuracy": (margin > 0).float().mean().item()}

    test_data = [d for row in held_out for d in pair_datums(row)]
    test_reference = reference_sums(test_data)

    def held_out_accuracy() -> float:
        result = training_client.forward(test_data, loss_fn="cross_entropy").result()
        logprobs = [output["logprobs"].to_torch() for output in result.loss_fn_outputs]
        return dpo_loss(test_data, logprobs, test_reference)[1]["accuracy"]

    started = time.monotonic()
    for batch_idx in range(config.batches):
        if batch_idx % config.eval_every == 0:
            print(f"batch {batch_idx:3d}  held-out accuracy {held_out_accuracy():.2f}", flush=True)
        start = batch_idx * config.batch_size % len(train)
        batch = [d for row in (train + train)[start : start + config.batch_size] for d in pair_datums(row)]
        reference = reference_sums(batch)
        result = training_client.forward_backward_custom(
            batch, lambda data, logprobs, reference=reference: dpo_loss(data, logprobs, reference)
        ).result()
        learning_rate = config.learning_rate * (1 - batch_idx / config.batches)
        training_client.optim_step(types.AdamParams(learning_rate=learning_rate)).result()
        print(
            f"batch {batch_idx:3d}  dpo loss {result.metrics['dpo_loss']:.4f}  "
            f"accuracy {result.metrics['accuracy']:.2f}  {time.monotonic() - started:6.1f} s",
            flush=True,
        )
    final = held_out_accuracy()
    print(f"held-out accuracy after {config.batches} batches: {final:.2f}")
    return final


if __name__ == "__main__":
    main(config_from_argv(Config, sys.argv[1:]))
