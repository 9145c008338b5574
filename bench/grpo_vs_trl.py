"""GRPO rollout-and-train throughput and memory: TRL's GRPOTrainer against hanzo-gym's GRPO loop on one workload.

    python bench/grpo_vs_trl.py [--steps N] [--generations 8] [--max-completion-length 32] [--vllm]

--vllm: both sides sample through a colocated vLLM (TRL's `use_vllm=True, vllm_mode="colocate"`, ours
`trl.use_vllm: true, vllm_mode: colocate`), each with VLLM_MEMORY of the device for vLLM; run it with the Python
of an environment that has vLLM and TRL (`make test-vllm` builds .venv-vllm; add `trl==1.16.0 datasets`).

Each side runs in its own subprocess, so the peak RSS it reports is its own. Every step samples one prompt's group
of completions, scores it and takes one optimizer step. Steps 2..N are timed (step 1 is warm-up) and
completions/s counts the completions of those steps. This script only measures; it judges nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import time
from pathlib import Path

from harness import add_side_arguments, compare_sides, finish_side, peak_rss_bytes

SEED = 42
LORA_R, LORA_ALPHA = 16, 32
# TRL's GRPO default. A small rate keeps both policies, and so their completion lengths (which set the cost of
# a step), close to the base model's over the timed steps: neither side's speed depends on what it learned.
LEARNING_RATE = 1e-6
PROMPT_COUNT = 16
TARGET_SPEEDUP = 2.0
# The reward both sides compute: 0 for a completion of at most LENGTH_LIMIT tokens (stop token included), else -1;
# ours is the built-in `length:<n>`, TRL's the same rule as a Python function. A correctness or format reward is
# 0 for nearly every sample of the base model, and our loop skips the update of a step whose advantages are all
# 0 (TRL still runs it), so such a reward would time our sampling against TRL's sampling plus training. The base
# model's completions straddle 16 tokens, so most groups have a spread and both sides train at most steps. The
# reward's own cost is negligible on either side.
LENGTH_LIMIT = 16
VLLM_MEMORY = 0.25  # vLLM's share of the device (on a CPU: of RAM) on both sides under --vllm


def addition_prompts(count: int = PROMPT_COUNT, seed: int = SEED) -> list[dict]:
    """Single-digit addition questions as one-turn chats, with the sum as the reference answer."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        question = f"What is {a} + {b}? Answer with the number only."
        rows.append({"messages": [{"role": "user", "content": question}], "answer": str(a + b)})
    return rows


def timed_window(step_end_times: list[float], step_completions: list[int]) -> dict:
    """Completions and seconds of steps 2..N (from the end of step 1 to the end of step N), and the median
    duration of those steps, which a burst of load from another job moves less than the total."""
    durations = [later - earlier for earlier, later in itertools.pairwise(step_end_times)]
    return {
        "completions": sum(step_completions[1:]),
        "seconds": step_end_times[-1] - step_end_times[0],
        "median_step_seconds": statistics.median(durations),
    }


def run_trl(
    model_dir: str, data_path: str, work_dir: str, steps: int, generations: int, max_new: int, vllm: bool
) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    step_end_times: list[float] = []
    step_completions: list[int] = []
    step_lengths: list[float] = []  # mean completion tokens per step, eos included as on our side
    spread_steps = 0  # timed steps whose group's rewards differ (our loop trains only at those)

    # TRL calls each reward function once per generation batch, which is one step's group here. Its
    # completion_ids run up to and including the stop token, as our completions' tokens do.
    def length_reward(completions, completion_ids, **kwargs):
        nonlocal spread_steps
        rewards = [0.0 if len(ids) <= LENGTH_LIMIT else -1.0 for ids in completion_ids]
        step_completions.append(len(completions))
        step_lengths.append(sum(len(ids) for ids in completion_ids) / len(completion_ids))
        spread_steps += len(step_completions) > 1 and len(set(rewards)) > 1
        return rewards

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_end_times.append(time.perf_counter())

    rows = [json.loads(line) for line in Path(data_path).read_text().splitlines()]
    # TRL's conversational prompt format: the turns to answer under `prompt`; `answer` rides along unused.
    dataset = Dataset.from_list([{"prompt": row["messages"], "answer": row["answer"]} for row in rows])
    args = GRPOConfig(
        output_dir=work_dir,
        max_steps=steps,
        # One prompt per step: a generation batch of `generations` completions, all trained in one step.
        per_device_train_batch_size=generations,
        num_generations=generations,
        generation_batch_size=generations,
        gradient_accumulation_steps=1,
        max_completion_length=max_new,
        learning_rate=LEARNING_RATE,
        beta=0.0,
        temperature=1.0,
        # TRL's default bf16=True means bf16 autocast, and on CPU it refuses to start without use_cpu=True;
        # the workload is fp32.
        bf16=False,
        use_cpu=True,
        seed=SEED,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        **(
            {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": VLLM_MEMORY}
            if vllm
            else {}
        ),
    )
    peft_config = LoraConfig(
        r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    # The model goes in as a path, as users pass it; TRL loads it in the checkpoint's dtype (fp32).
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        args=args,
        train_dataset=dataset,
        peft_config=peft_config,
        callbacks=[StepClock()],
    )
    model = trainer.model
    settings = {
        "use_vllm": args.use_vllm,
        "use_transformers_paged": args.use_transformers_paged,
        "gradient_checkpointing": args.gradient_checkpointing,
        "loss_type": args.loss_type,
        "scale_rewards": args.scale_rewards,
        "beta": args.beta,
        "epsilon": args.epsilon,
        "num_iterations": args.num_iterations,
        "steps_per_generation": args.steps_per_generation,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "mask_truncated_completions": args.mask_truncated_completions,
        "optim": args.optim.value,
        "lr_scheduler_type": args.lr_scheduler_type.value,
        "attn_implementation": model.config._attn_implementation,
        "model dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
    loaded_rss = peak_rss_bytes()
    trainer.train()
    return {
        **timed_window(step_end_times, step_completions),
        "spread_steps": spread_steps,
        "mean_length": sum(step_lengths[1:]) / len(step_lengths[1:]),
        "loaded_rss_bytes": loaded_rss,
        "settings": settings,
    }


def run_ours(
    model_dir: str, data_path: str, work_dir: str, steps: int, generations: int, max_new: int, vllm: bool
) -> dict:
    import torch

    from hanzo_gym.config import parse_config
    from hanzo_gym.data.prompts import load_prompts
    from hanzo_gym.loops.grpo import train_grpo
    from hanzo_gym.loops.run_dir import RunDir
    from hanzo_gym.loops.train import build_engine
    from hanzo_gym.model.hub import load_tokenizer

    cfg = parse_config(
        {
            "base_model": model_dir,
            "datasets": [{"path": data_path, "type": "chat_template"}],
            "val_set_size": 0,
            "output_dir": work_dir,
            "adapter": "lora",
            "lora_r": LORA_R,
            "lora_alpha": LORA_ALPHA,
            "lora_dropout": 0.0,
            "lora_target_linear": True,
            "micro_batch_size": 1,  # prompts per step
            "gradient_accumulation_steps": 1,
            "learning_rate": LEARNING_RATE,
            "lr_scheduler": "linear",  # TRL's default
            "max_steps": steps,
            "num_epochs": -(-steps // PROMPT_COUNT),  # enough passes over the prompts for `steps`
            "logging_steps": 1,
            "seed": SEED,
            "bf16": False,
            "rl": "grpo",
            "trl": {
                "num_generations": generations,
                "max_completion_length": max_new,
                "beta": 0.0,
                "temperature": 1.0,
                "loss_type": "dapo",  # TRL's default, also ours
                "reward_funcs": [f"length:{LENGTH_LIMIT}"],
                **(
                    {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": VLLM_MEMORY}
                    if vllm
                    else {}
                ),
            },
        }
    )
    # The same steps as `gym train` (hanzo_gym.loops.train.run_training), split so that the load's RSS is seen.
    tokenizer = load_tokenizer(cfg.base_model)
    train = load_prompts(cfg, tokenizer).train
    engine = build_engine(cfg, torch.device("cpu"), torch.float32, tokenizer)
    run = RunDir(cfg.output_dir)
    loaded_rss = peak_rss_bytes()
    torch.manual_seed(cfg.seed)
    train_grpo(engine, cfg, train, [], run)
    step_rows = [row for row in run.metrics() if "time/sample" in row]
    timed_rows = step_rows[1:]
    return {
        **timed_window([row["elapsed_s"] for row in step_rows], [generations] * len(step_rows)),
        "spread_steps": sum(row["frac_reward_zero_std"] < 1 for row in timed_rows),
        "mean_length": sum(row["completions/mean_length"] for row in timed_rows) / len(timed_rows),
        "loaded_rss_bytes": loaded_rss,
        "sample_seconds": sum(row["time/sample"] for row in timed_rows),
        "train_seconds": sum(row["time/train"] for row in timed_rows),
    }


SIDES = {"trl": run_trl, "ours": run_ours}


def print_report(trl: dict, ours: dict, opts, load_at_start: float) -> None:
    def per_second(side: dict) -> float:
        return side["completions"] / side["seconds"]

    def per_second_at_median_step(side: dict) -> float:
        return opts.generations / side["median_step_seconds"]

    def gigabytes(side: dict) -> float:
        return side["peak_rss_bytes"] / 1e9

    timed_steps = opts.steps - 1
    print(
        f"workload: SmolLM2-135M-Instruct (GGUF → fp32), LoRA r={LORA_R} alpha {LORA_ALPHA} all-linear, "
        f"{PROMPT_COUNT} single-digit addition prompts, 1 prompt × {opts.generations} generations per step, "
        f"max_completion_length {opts.max_completion_length}, temperature 1, beta 0, lr {LEARNING_RATE}, "
        f"reward length:{LENGTH_LIMIT}, CPU, steps 2..{opts.steps} timed"
        + (f", rollouts on colocated vLLM (memory share {VLLM_MEMORY}) on both sides" if opts.vllm else "")
    )
    # completions/s is only comparable between runs on an otherwise idle machine
    print(
        f"machine: {os.cpu_count()} CPUs, 1-minute load average at start {load_at_start:.2f}, "
        f"before TRL {trl['load_at_start']:.2f}, before hanzo-gym {ours['load_at_start']:.2f}"
    )
    print(
        f"{'':18} {'completions/s':>13} {'s/step':>7} {'median-step c/s':>15} {'peak RSS (GB)':>14} "
        f"{'RSS pre-train':>14} {'completions':>11} {'seconds':>8} {'mean tokens':>11} {'spread steps':>12}"
    )
    for name, side in (("TRL GRPOTrainer", trl), ("hanzo-gym", ours)):
        print(
            f"{name:18} {per_second(side):13.2f} {side['seconds'] / timed_steps:7.2f} "
            f"{per_second_at_median_step(side):15.2f} {gigabytes(side):14.2f} "
            f"{side['loaded_rss_bytes'] / 1e9:14.2f} {side['completions']:11d} {side['seconds']:8.1f} "
            f"{side['mean_length']:11.1f} {side['spread_steps']:>6d} of {timed_steps:<3d}"
        )
    speedup = per_second(ours) / per_second(trl)
    median_speedup = per_second_at_median_step(ours) / per_second_at_median_step(trl)
    memory = gigabytes(ours) / gigabytes(trl)
    print(
        f"{'ratio (ours/TRL)':18} {speedup:12.2f}x {'':7} {median_speedup:14.2f}x {memory:13.2f}x"
        f"     (target ≥ {TARGET_SPEEDUP}x completions/s)"
    )
    print(
        f"hanzo-gym time split over the timed steps: sampling {ours['sample_seconds']:.1f} s, "
        f"scoring + training {ours['train_seconds']:.1f} s"
    )
    print("TRL settings in effect: " + ", ".join(f"{k}={v}" for k, v in trl["settings"].items()))
    print(
        "TRL differs from its defaults only in: per_device_train_batch_size = num_generations = "
        f"generation_batch_size = {opts.generations}, max_completion_length={opts.max_completion_length}, "
        "bf16=False, use_cpu=True, logging_steps=1, report_to=none, save_strategy=no"
        + (
            f", use_vllm=True, vllm_mode=colocate, vllm_gpu_memory_utilization={VLLM_MEMORY}"
            if opts.vllm
            else ""
        )
    )
    print(
        "median-step c/s: completions per second of the median timed step. mean tokens: completion tokens per "
        "completion, stop token included (sampling is random on both sides: longer completions cost more). "
        "spread steps: timed steps whose rewards differ within the group; our loop skips the update of the "
        "others, TRL runs it"
    )


def print_ours_alone(trl_failure: str, ours: dict, opts) -> None:
    print(
        f"workload: as without --vllm, rollouts on colocated vLLM (memory share {VLLM_MEMORY}), "
        f"1 prompt × {opts.generations} generations per step, max_completion_length {opts.max_completion_length}, "
        f"steps 2..{opts.steps} timed, CPU {os.cpu_count()} cores"
    )
    print("TRL GRPOTrainer (use_vllm=True, vllm_mode=colocate) failed; the last lines of its log:")
    print("    " + trl_failure.replace("\n", "\n    "))
    print(
        f"hanzo-gym: {ours['completions'] / ours['seconds']:.2f} completions/s, "
        f"{opts.generations / ours['median_step_seconds']:.2f} at the median step, peak RSS "
        f"{ours['peak_rss_bytes'] / 1e9:.2f} GB, mean tokens {ours['mean_length']:.1f}; sampling "
        f"{ours['sample_seconds']:.1f} s, scoring + training {ours['train_seconds']:.1f} s over the timed steps"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per side; 2..N are timed")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (group size)")
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--vllm", action="store_true", help="both sides sample through a colocated vLLM")
    add_side_arguments(parser, SIDES)
    opts = parser.parse_args()
    if opts.steps < 2:
        parser.error("--steps must be at least 2: step 1 is warm-up")
    if opts.side:
        finish_side(
            opts,
            lambda: SIDES[opts.side](
                opts.model_dir,
                opts.data,
                opts.work_dir,
                opts.steps,
                opts.generations,
                opts.max_completion_length,
                opts.vllm,
            ),
        )
        return
    forwarded = [
        "--generations",
        str(opts.generations),
        "--max-completion-length",
        str(opts.max_completion_length),
        *(["--vllm"] if opts.vllm else []),
    ]
    # TRL's colocated vLLM may not run on this device: its result is then the failure, printed as such.
    may_fail = ("trl",) if opts.vllm else ()
    trl, ours, load_at_start = compare_sides(__file__, addition_prompts(), opts.steps, forwarded, may_fail)
    if "failed" in trl:
        print_ours_alone(trl["failed"], ours, opts)
        return
    print_report(trl, ours, opts, load_at_start)


if __name__ == "__main__":
    main()
