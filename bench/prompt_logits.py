"""What skipping the prompt's logits saves: one training pass (forward + backward) of a GRPO group on SmolLM2-135M
with LoRA r 16, scoring every position against scoring from each completion on
(`Engine.forward_backward(..., scored_from=...)`, which the loops pass), in fp32 and bf16.

    python bench/prompt_logits.py [--repeats 4]

It only measures. The two orders alternate so that a burst of load from another job hits both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _engine(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from hanzo_gym.engine import Engine
    from hanzo_gym.model.hub import real_model_gguf, resolve_model
    from hanzo_gym.model.lora import attach_lora

    model = AutoModelForCausalLM.from_pretrained(resolve_model(str(real_model_gguf())), dtype=dtype)
    return Engine(
        attach_lora(model, r=16, alpha=32, dropout=0.0, target_modules="all-linear", base_model_name="x")
    )


def _grpo_group(prompt_tokens: int = 38, completions: int = 8, completion_tokens: int = 20):
    """One prompt and its group of completions as RL datums: the workload of bench/grpo_vs_trl.py's steps."""
    from hanzo_gym.loops.rl_math import rl_datum

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (prompt_tokens,), generator=g).tolist()
    datums = []
    for _ in range(completions):
        completion = torch.randint(100, 40000, (completion_tokens,), generator=g).tolist()
        datums.append(rl_datum(prompt, completion, [-1.0] * completion_tokens, 0.1))
    return datums, [prompt_tokens - 1] * completions


def _timed(engine, datums, scored_from, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        engine.forward_backward(datums, "importance_sampling", scored_from=scored_from)
        times.append(time.perf_counter() - started)
        engine.optimizer.zero_grad(set_to_none=True)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=4)
    opts = parser.parse_args()
    datums, starts = _grpo_group()
    print("GRPO group: 38 prompt tokens, 8 completions of 20 tokens; median seconds per forward + backward")
    for dtype in (torch.float32, torch.bfloat16):
        engine = _engine(dtype)
        _timed(engine, datums, None, 1)  # warm-up
        every, skipping = [], []
        for _ in range(2):
            every.append(_timed(engine, datums, None, opts.repeats))
            skipping.append(_timed(engine, datums, starts, opts.repeats))
        all_s, from_s = statistics.median(every), statistics.median(skipping)
        print(
            f"{dtype!s:15} every position {all_s:.3f} s   from the completions {from_s:.3f} s   "
            f"({all_s / from_s:.2f}x)"
        )


if __name__ == "__main__":
    main()
