"""GRPO rollout-and-train throughput and memory: TRL's GRPOTrainer against hanzo-gym's GRPO loop on one workload,
each in fp32 and in bf16, side by side in one run.

    python bench/grpo_vs_trl.py [--steps N] [--generations 8] [--max-completion-length 32] [--vllm]
                                [--sides trl-fp32,trl-bf16,ours-fp32,ours-bf16]

TRL's bf16 is its own `bf16=True` (autocast over fp32 weights, sampling included); ours is the mixed recipe (frozen
base in bf16, which the sampler decodes from too; LoRA and AdamW state in fp32).

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

from harness import SIDE_NAMES, add_side_arguments, finish_side, peak_rss_bytes, precision_sides, run_sides

SEED = 42
LORA_R, LORA_ALPHA = 16, 32
# TRL's GRPO default. A small rate keeps both policies, and so their completion lengths (which set the cost of
# a step), close to the base model's over the timed steps: neither side's speed depends on what it learned.
LEARNING_RATE = 1e-6
PROMPT_COUNT = 16
TARGET_SPEEDUP = 2.0  # ours in fp32 against TRL in fp32
# issue 16: ours at our best (bf16) against TRL in fp32, and against TRL at its best
TARGET_BF16_OVER_TRL_FP32, TARGET_BF16_OVER_TRL_BEST = 6.0, 2.0
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
    model_dir: str,
    data_path: str,
    work_dir: str,
    steps: int,
    generations: int,
    max_new: int,
    vllm: bool,
    bf16: bool,
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
        # TRL's default bf16=True means bf16 autocast; on CPU it refuses to start without use_cpu=True.
        bf16=bf16,
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
        "bf16": args.bf16,
    }
    loaded_rss = peak_rss_bytes()
    trainer.train()
    return {
        **timed_window(step_end_times, step_completions),
        "spread_steps": spread_steps,
        "mean_length": sum(step_lengths[1:]) / len(step_lengths[1:]),
        "loaded_rss_bytes": loaded_rss,
        "settings": settings,
        "precision": f"bf16 autocast, {settings['model dtype']} weights" if bf16 else settings["model dtype"],
    }


def run_ours(
    model_dir: str,
    data_path: str,
    work_dir: str,
    steps: int,
    generations: int,
    max_new: int,
    vllm: bool,
    bf16: bool,
) -> dict:
    import torch

    from hanzo_gym.config import parse_config
    from hanzo_gym.data.prompts import load_prompts
    from hanzo_gym.loops.grpo import train_grpo
    from hanzo_gym.loops.run_dir import RunDir
    from hanzo_gym.loops.train import build_engine
    from hanzo_gym.model.hub import load_tokenizer
    from hanzo_gym.model.load_plan import LoadPlan

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
            "bf16": bf16,
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
    dtype = torch.bfloat16 if bf16 else torch.float32
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), dtype), tokenizer)
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
        "precision": "base bfloat16, LoRA + AdamW float32" if bf16 else "float32",
    }


SIDES = precision_sides(run_trl, run_ours)
NAMES = SIDE_NAMES


def print_report(results: dict[str, dict], opts, load_at_start: float) -> None:
    def per_second(side: dict) -> float:
        return side["completions"] / side["seconds"]

    def per_second_at_median_step(side: dict) -> float:
        return opts.generations / side["median_step_seconds"]

    def gigabytes(side: dict) -> float:
        return side["peak_rss_bytes"] / 1e9

    timed_steps = opts.steps - 1
    print(
        f"workload: SmolLM2-135M-Instruct (GGUF → fp32 on disk), LoRA r={LORA_R} alpha {LORA_ALPHA} all-linear, "
        f"{PROMPT_COUNT} single-digit addition prompts, 1 prompt × {opts.generations} generations per step, "
        f"max_completion_length {opts.max_completion_length}, temperature 1, beta 0, lr {LEARNING_RATE}, "
        f"reward length:{LENGTH_LIMIT}, CPU, steps 2..{opts.steps} timed"
        + (f", rollouts on colocated vLLM (memory share {VLLM_MEMORY}) on every side" if opts.vllm else "")
    )
    # completions/s is only comparable between runs on an otherwise idle machine
    print(f"machine: {os.cpu_count()} CPUs, 1-minute load average at start {load_at_start:.2f}")
    ran = {key: side for key, side in results.items() if "failed" not in side}
    print(
        f"{'':15} {'precision':35} {'compl./s':>8} {'s/step':>7} {'median c/s':>10} {'peak RSS (GB)':>13} "
        f"{'RSS pre-train':>13} {'mean tokens':>11} {'spread steps':>12} {'load':>5}"
    )
    for key, side in ran.items():
        print(
            f"{NAMES[key]:15} {side['precision']:35} {per_second(side):8.2f} {side['seconds'] / timed_steps:7.2f} "
            f"{per_second_at_median_step(side):10.2f} {gigabytes(side):13.2f} "
            f"{side['loaded_rss_bytes'] / 1e9:13.2f} {side['mean_length']:11.1f} "
            f"{side['spread_steps']:>6d} of {timed_steps:<3d} {side['load_at_start']:5.2f}"
        )
    for key, side in results.items():
        if "failed" in side:
            print(
                f"{NAMES[key]} failed; the last lines of its log:\n    "
                + side["failed"].replace("\n", "\n    ")
            )

    def ratio(ours: str, theirs: str, what: str, target: float) -> None:
        if ours in ran and theirs in ran:
            a, b = ran[ours], ran[theirs]
            print(
                f"{NAMES[ours]} / {what}: {per_second(a) / per_second(b):.2f}x completions/s "
                f"({per_second_at_median_step(a) / per_second_at_median_step(b):.2f}x at the median step; "
                f"target ≥ {target}x), {gigabytes(a) / gigabytes(b):.2f}x peak RSS"
            )

    ratio("ours-fp32", "trl-fp32", "TRL fp32", TARGET_SPEEDUP)
    ratio("ours-bf16", "trl-fp32", "TRL fp32", TARGET_BF16_OVER_TRL_FP32)
    trl_sides = [key for key in ("trl-fp32", "trl-bf16") if key in ran]
    if trl_sides:
        best = max(trl_sides, key=lambda key: per_second(ran[key]))
        ratio("ours-bf16", best, f"TRL at its best ({NAMES[best]})", TARGET_BF16_OVER_TRL_BEST)
    for key in ("ours-fp32", "ours-bf16"):
        if key in ran:
            print(
                f"{NAMES[key]} time split over the timed steps: sampling {ran[key]['sample_seconds']:.1f} s, "
                f"scoring + training {ran[key]['train_seconds']:.1f} s"
            )
    for key in trl_sides:
        settings = ran[key]["settings"]
        print(f"{NAMES[key]} settings in effect: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print(
        "TRL differs from its defaults only in: per_device_train_batch_size = num_generations = "
        f"generation_batch_size = {opts.generations}, max_completion_length={opts.max_completion_length}, "
        "bf16 (False on its fp32 side), use_cpu=True, logging_steps=1, report_to=none, save_strategy=no"
        + (
            f", use_vllm=True, vllm_mode=colocate, vllm_gpu_memory_utilization={VLLM_MEMORY}"
            if opts.vllm
            else ""
        )
    )
    print(
        "median c/s: completions per second of the median timed step. mean tokens: completion tokens per "
        "completion, stop token included (sampling is random on every side: longer completions cost more). "
        "spread steps: timed steps whose rewards differ within the group; our loop skips the update of the "
        "others, TRL runs it. load: the 1-minute load average as the side started"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per side; 2..N are timed")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (group size)")
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--vllm", action="store_true", help="every side samples through a colocated vLLM")
    parser.add_argument(
        "--sides", default=",".join(SIDES), help=f"which sides to run, in order (default: {','.join(SIDES)})"
    )
    add_side_arguments(parser, SIDES)
    opts = parser.parse_args()
    if opts.steps < 2:
        parser.error("--steps must be at least 2: step 1 is warm-up")
    sides = [side.strip() for side in opts.sides.split(",") if side.strip()]
    unknown = [side for side in sides if side not in SIDES]
    if unknown or not sides:
        parser.error(f"--sides takes {', '.join(SIDES)} (got {opts.sides!r})")
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
    may_fail = ("trl-fp32", "trl-bf16") if opts.vllm else ()
    results, load_at_start = run_sides(__file__, sides, addition_prompts(), opts.steps, forwarded, may_fail)
    print_report(results, opts, load_at_start)


if __name__ == "__main__":
    main()
