"""DPO training throughput and memory: TRL's DPOTrainer against hanzo-gym's `rl: dpo` loop on one workload.

    python bench/dpo_vs_trl.py [--steps N] [--pairs-per-step 4] [--bf16]

Each side runs in its own subprocess, so the peak RSS it reports is its own. Both train a LoRA adapter on the same
conversational preference pairs (TRL's prompt / chosen / rejected message lists, rendered by the model's chat
template on both sides), one micro-batch of pairs per optimizer step, the reference being the frozen base (the
adapter disabled), computed every step on both sides, and both recomputing activations in the backward pass
(gradient checkpointing: TRL's default, set on ours). Steps 2..N are timed (step 1 is warm-up); pairs/s counts
the pairs of those steps. This script only measures; it judges nothing.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import time

from harness import add_side_arguments, compare_sides, finish_side, peak_rss_bytes

SEED = 42
LORA_R, LORA_ALPHA = 16, 32
LEARNING_RATE = 5e-4
BETA = 0.1
MAX_LENGTH = 128
TARGET_SPEEDUP, TARGET_MEMORY = 2.0, 0.75
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def addition_pairs(count: int, seed: int = SEED) -> list[dict]:
    """Addition questions with a right and a wrong answer in the same words, as TRL's conversational rows."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        wrong = a + b + rng.choice([1, 2, 3])
        prompt = [
            {"role": "system", "content": "You are a terse calculator."},
            {"role": "user", "content": f"What is {a} plus {b}?"},
        ]
        answer = f"{WORDS[a].capitalize()} plus {WORDS[b]} makes"
        rows.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": f"{answer} {a + b}."}],
                "rejected": [{"role": "assistant", "content": f"{answer} {wrong}."}],
            }
        )
    return rows


def timed_window(step_end_times: list[float], pairs_per_step: int) -> dict:
    durations = [later - earlier for earlier, later in itertools.pairwise(step_end_times)]
    return {
        "pairs": pairs_per_step * (len(step_end_times) - 1),
        "seconds": step_end_times[-1] - step_end_times[0],
        "median_step_seconds": statistics.median(durations),
    }


def run_trl(model_dir: str, data_path: str, work_dir: str, steps: int, pairs: int, bf16: bool) -> dict:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    step_end_times: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_end_times.append(time.perf_counter())

    args = DPOConfig(
        output_dir=work_dir,
        max_steps=steps,
        per_device_train_batch_size=pairs,
        gradient_accumulation_steps=1,
        learning_rate=LEARNING_RATE,
        beta=BETA,
        max_length=MAX_LENGTH,
        # TRL's bf16=True is autocast over the checkpoint's fp32 weights; on CPU it needs use_cpu=True.
        bf16=bf16,
        use_cpu=True,
        seed=SEED,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        dataloader_drop_last=True,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = DPOTrainer(
        model=model,
        args=args,
        train_dataset=load_dataset("json", data_files=data_path, split="train"),
        peft_config=LoraConfig(
            r=LORA_R,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        ),
        callbacks=[StepClock()],
    )
    loaded_rss = peak_rss_bytes()
    trainer.train()
    return {
        **timed_window(step_end_times, pairs),
        "loaded_rss_bytes": loaded_rss,
        "precision": "bf16 autocast over fp32 weights" if bf16 else "fp32",
        "settings": {
            "loss_type": args.loss_type,
            "precompute_ref_log_probs": args.precompute_ref_log_probs,
            "padding_free": args.padding_free,
            "gradient_checkpointing": args.gradient_checkpointing,
            "optim": args.optim.value,
            "attn_implementation": trainer.model.config._attn_implementation,
        },
    }


def run_ours(model_dir: str, data_path: str, work_dir: str, steps: int, pairs: int, bf16: bool) -> dict:
    import torch

    from hanzo_gym.config import parse_config
    from hanzo_gym.data.preference import load_preferences
    from hanzo_gym.loops.preference import train_preference
    from hanzo_gym.loops.run_dir import RunDir
    from hanzo_gym.loops.train import build_engine
    from hanzo_gym.model.hub import load_tokenizer
    from hanzo_gym.model.load_plan import LoadPlan

    cfg = parse_config(
        {
            "base_model": model_dir,
            "rl": "dpo",
            "rl_beta": BETA,
            "datasets": [{"path": data_path, "type": "passthrough"}],
            "val_set_size": 0,
            "output_dir": work_dir,
            "sequence_len": MAX_LENGTH,
            "adapter": "lora",
            "lora_r": LORA_R,
            "lora_alpha": LORA_ALPHA,
            "lora_dropout": 0.0,
            "lora_target_linear": True,
            "micro_batch_size": pairs,
            "gradient_accumulation_steps": 1,
            "learning_rate": LEARNING_RATE,
            "lr_scheduler": "linear",  # TRL's default
            "max_steps": steps,
            "logging_steps": 1,
            "seed": SEED,
            "bf16": bf16,
            # TRL's DPOConfig default: both sides recompute each layer's activations in the backward pass
            "gradient_checkpointing": True,
        }
    )
    dtype = torch.bfloat16 if bf16 else torch.float32
    tokenizer = load_tokenizer(cfg.base_model)
    train = load_preferences(cfg, tokenizer).train
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), dtype), tokenizer)
    run = RunDir(cfg.output_dir)
    loaded_rss = peak_rss_bytes()
    torch.manual_seed(cfg.seed)
    train_preference(engine, cfg, train, [], run)
    step_rows = [row for row in run.metrics() if "rewards/margins" in row]
    return {
        **timed_window([row["elapsed_s"] for row in step_rows], pairs),
        "loaded_rss_bytes": loaded_rss,
        "precision": "bf16 weights, fp32 LoRA and log-probs" if bf16 else "fp32",
        "settings": {"gradient_checkpointing": cfg.gradient_checkpointing},
    }


SIDES = {"trl": run_trl, "ours": run_ours}


def print_report(trl: dict, ours: dict, opts, load_at_start: float) -> None:
    def per_second(side: dict) -> float:
        return side["pairs"] / side["seconds"]

    def at_median(side: dict) -> float:
        return opts.pairs_per_step / side["median_step_seconds"]

    print(
        f"workload: SmolLM2-135M-Instruct, LoRA r={LORA_R} alpha {LORA_ALPHA} all-linear, DPO sigmoid beta {BETA}, "
        f"{opts.pairs_per_step} addition pairs per step (conversational, chat template), max_length {MAX_LENGTH}, "
        f"CPU, steps 2..{opts.steps} timed"
    )
    print(
        f"machine: {os.cpu_count()} CPUs, 1-minute load average at start {load_at_start:.2f}, "
        f"before TRL {trl['load_at_start']:.2f}, before hanzo-gym {ours['load_at_start']:.2f}"
    )
    print(
        f"{'':18} {'pairs/s':>8} {'median-step p/s':>15} {'peak RSS (GB)':>14} {'RSS pre-train':>14}  precision"
    )
    for name, side in (("TRL DPOTrainer", trl), ("hanzo-gym", ours)):
        print(
            f"{name:18} {per_second(side):8.2f} {at_median(side):15.2f} {side['peak_rss_bytes'] / 1e9:14.2f} "
            f"{side['loaded_rss_bytes'] / 1e9:14.2f}  {side['precision']}"
        )
    speedup = per_second(ours) / per_second(trl)
    median_speedup = at_median(ours) / at_median(trl)
    memory = ours["peak_rss_bytes"] / trl["peak_rss_bytes"]
    print(
        f"{'ratio (ours/TRL)':18} {speedup:7.2f}x {median_speedup:14.2f}x {memory:13.2f}x"
        f"     (targets ≥ {TARGET_SPEEDUP}x pairs/s at ≤ {TARGET_MEMORY}x memory)"
    )
    for name, side in (("TRL", trl), ("hanzo-gym", ours)):
        print(f"{name} settings in effect: " + ", ".join(f"{k}={v}" for k, v in side["settings"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per side; 2..N are timed")
    parser.add_argument("--pairs-per-step", type=int, default=4)
    parser.add_argument("--bf16", action="store_true", help="both sides at their bf16 setting")
    add_side_arguments(parser, SIDES)
    opts = parser.parse_args()
    if opts.steps < 2:
        parser.error("--steps must be at least 2: step 1 is warm-up")
    if opts.side:
        finish_side(
            opts,
            lambda: SIDES[opts.side](
                opts.model_dir, opts.data, opts.work_dir, opts.steps, opts.pairs_per_step, opts.bf16
            ),
        )
        return
    forwarded = ["--pairs-per-step", str(opts.pairs_per_step), *(["--bf16"] if opts.bf16 else [])]
    rows = addition_pairs(opts.steps * opts.pairs_per_step)
    trl, ours, load_at_start = compare_sides(__file__, rows, opts.steps, forwarded)
    print_report(trl, ours, opts, load_at_start)


if __name__ == "__main__":
    main()
