"""LoRA SFT throughput and memory: TRL's SFTTrainer against hanzo-gym's SFT loop on the same workload.

    python bench/sft_vs_trl.py [--steps N] [--rows 256] [--batch 8] [--max-length 512]

Each side runs in its own subprocess, so the peak RSS it reports is its own. Steps 2..N are timed (step 1 is
warm-up) and tokens/s counts the non-pad tokens of those steps. This script only measures; it judges nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from harness import add_side_arguments, compare_sides, finish_side, peak_rss_bytes

SEED = 42
LORA_R, LORA_ALPHA = 16, 32
LEARNING_RATE = 2e-4
TARGET_SPEEDUP, TARGET_MEMORY = 1.5, 0.75

# fmt: off
WORDS = (
    "the", "model", "learns", "a", "small", "task", "from", "many", "short", "answers", "while", "data",
    "stays", "fixed", "and", "every", "run", "sees", "same", "rows", "in", "seeded", "order", "so", "that",
    "speed", "memory", "can", "be", "compared", "across", "two", "trainers", "on", "one", "machine", "with",
    "plain",
    "river", "stone", "garden", "window", "light", "paper", "music", "number", "yellow", "quiet", "market",
    "bridge", "winter", "summer", "orange", "silver", "engine", "letter", "mountain", "forest", "ocean",
)
# fmt: on


def synthetic_rows(count: int, seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        question = "What about " + " ".join(rng.choices(WORDS, k=rng.randint(2, 5))) + "?"
        answer = " ".join(rng.choices(WORDS, k=rng.randint(30, 210))) + "."
        rows.append(
            {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
        )
    return rows


def timed_window(step_end_times: list[float], step_tokens: list[int]) -> tuple[int, float]:
    """Tokens and seconds of steps 2..N: from the end of step 1 to the end of step N."""
    return sum(step_tokens[1:]), step_end_times[-1] - step_end_times[0]


def run_trl(model_dir: str, data_path: str, work_dir: str, steps: int, batch: int, max_length: int) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    step_tokens: list[int] = []
    step_end_times: list[float] = []

    class TokenCountingSFTTrainer(SFTTrainer):
        def training_step(self, model, inputs, *args, **kwargs):
            step_tokens.append(int(inputs["attention_mask"].sum()))  # non-pad tokens, as TRL's own num_tokens
            return super().training_step(model, inputs, *args, **kwargs)

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_end_times.append(time.perf_counter())

    rows = [json.loads(line) for line in Path(data_path).read_text().splitlines()]
    args = SFTConfig(
        output_dir=work_dir,
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        learning_rate=LEARNING_RATE,
        max_length=max_length,
        packing=False,
        # TRL's default bf16=True means bf16 autocast, and on CPU it refuses to start without use_cpu=True;
        # the workload is fp32.
        bf16=False,
        use_cpu=True,
        seed=SEED,
        report_to="none",
        save_strategy="no",
    )
    peft_config = LoraConfig(
        r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    # The model goes in as a path, as users pass it; TRL then loads it in float32 by default.
    trainer = TokenCountingSFTTrainer(
        model=model_dir,
        args=args,
        train_dataset=Dataset.from_list(rows),
        peft_config=peft_config,
        callbacks=[StepClock()],
    )
    model = trainer.model
    settings = {
        "gradient_checkpointing": args.gradient_checkpointing,
        "padding_free": args.padding_free,
        "packing": args.packing,
        "pad_to_multiple_of": args.pad_to_multiple_of,
        "assistant_only_loss": args.assistant_only_loss,
        "completion_only_loss": args.completion_only_loss,
        "loss_type": args.loss_type,
        "optim": args.optim.value,
        "lr_scheduler_type": args.lr_scheduler_type.value,
        "attn_implementation": model.config._attn_implementation,
        "model dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "dataloader_num_workers": args.dataloader_num_workers,
    }
    dataset = trainer.train_dataset
    loaded_rss = peak_rss_bytes()
    trainer.train()
    tokens, seconds = timed_window(step_end_times, step_tokens)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "loaded_rss_bytes": loaded_rss,
        "dataset_tokens": sum(len(ids) for ids in dataset["input_ids"]),
        "trained_tokens": sum(label != -100 for labels in dataset["labels"] for label in labels),
        "settings": settings,
    }


def run_ours(model_dir: str, data_path: str, work_dir: str, steps: int, batch: int, max_length: int) -> dict:
    import torch

    from hanzo_gym.config import parse_config
    from hanzo_gym.data.dataset import load_examples
    from hanzo_gym.loops.run_dir import RunDir
    from hanzo_gym.loops.sft import train_sft
    from hanzo_gym.loops.train import build_engine
    from hanzo_gym.model.hub import load_tokenizer

    cfg = parse_config(
        {
            "base_model": model_dir,
            "datasets": [{"path": data_path, "type": "chat_template"}],
            "val_set_size": 0,
            "output_dir": work_dir,
            "sequence_len": max_length,
            "train_on_inputs": True,  # TRL's default for a `messages` dataset: loss on every token
            "adapter": "lora",
            "lora_r": LORA_R,
            "lora_alpha": LORA_ALPHA,
            "lora_dropout": 0.0,
            "lora_target_linear": True,
            "micro_batch_size": batch,
            "gradient_accumulation_steps": 1,
            "learning_rate": LEARNING_RATE,
            "lr_scheduler": "linear",  # TRL's default
            "max_steps": steps,
            "logging_steps": 1,
            "seed": SEED,
            "bf16": False,
        }
    )
    tokenizer = load_tokenizer(cfg.base_model)
    train = load_examples(cfg, tokenizer).train
    engine = build_engine(cfg, torch.device("cpu"), torch.float32)
    run = RunDir(cfg.output_dir)
    loaded_rss = peak_rss_bytes()
    torch.manual_seed(cfg.seed)
    train_sft(engine, cfg, train, [], run)
    step_rows = [row for row in run.metrics() if "tokens" in row]
    tokens, seconds = timed_window(
        [row["elapsed_s"] for row in step_rows], [row["tokens"] for row in step_rows]
    )
    return {
        "tokens": tokens,
        "seconds": seconds,
        "loaded_rss_bytes": loaded_rss,
        "dataset_tokens": sum(len(e) for e in train),
        "trained_tokens": sum(e.trained_tokens for e in train),
    }


SIDES = {"trl": run_trl, "ours": run_ours}


def print_report(trl: dict, ours: dict, opts, load_at_start: float) -> None:
    def per_second(side: dict) -> float:
        return side["tokens"] / side["seconds"]

    def gigabytes(side: dict) -> float:
        return side["peak_rss_bytes"] / 1e9

    print(
        f"workload: SmolLM2-135M-Instruct (GGUF → fp32), LoRA r={LORA_R} alpha {LORA_ALPHA} all-linear, "
        f"{opts.rows} rows, batch {opts.batch}, max_length {opts.max_length}, lr {LEARNING_RATE}, CPU, "
        f"steps 2..{opts.steps} timed"
    )
    # tokens/s is only comparable between runs on an otherwise idle machine
    print(f"machine: {os.cpu_count()} CPUs, 1-minute load average at start {load_at_start:.2f}")
    print(f"{'':18} {'tokens/s':>9} {'peak RSS (GB)':>14} {'RSS pre-train':>15} {'tokens':>7} {'seconds':>8}")
    for name, side in (("TRL SFTTrainer", trl), ("hanzo-gym", ours)):
        loaded = side["loaded_rss_bytes"] / 1e9
        print(
            f"{name:18} {per_second(side):9.1f} {gigabytes(side):14.2f} {loaded:15.2f} "
            f"{side['tokens']:7d} {side['seconds']:8.1f}"
        )
    speedup, memory = per_second(ours) / per_second(trl), gigabytes(ours) / gigabytes(trl)
    print(
        f"{'ratio (ours/TRL)':18} {speedup:8.2f}x {memory:13.2f}x"
        f"     (target ≥ {TARGET_SPEEDUP}x tokens/s, ≤ {TARGET_MEMORY}x memory)"
    )
    for name, side in (("TRL", trl), ("hanzo-gym", ours)):
        print(
            f"tokenized rows, {name}: {side['dataset_tokens']} tokens, {side['trained_tokens']} with a label"
        )
    print("TRL settings in effect: " + ", ".join(f"{k}={v}" for k, v in trl["settings"].items()))
    print("TRL differs from its defaults only in: bf16=False, use_cpu=True, report_to=none, save_strategy=no")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per side; 2..N are timed")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512)
    add_side_arguments(parser, SIDES)
    opts = parser.parse_args()
    if opts.steps < 2:
        parser.error("--steps must be at least 2: step 1 is warm-up")
    if opts.side:
        finish_side(
            opts,
            lambda: SIDES[opts.side](
                opts.model_dir, opts.data, opts.work_dir, opts.steps, opts.batch, opts.max_length
            ),
        )
        return
    forwarded = ["--batch", str(opts.batch), "--max-length", str(opts.max_length)]
    trl, ours, load_at_start = compare_sides(__file__, synthetic_rows(opts.rows), opts.steps, forwarded)
    print_report(trl, ours, opts, load_at_start)


if __name__ == "__main__":
    main()
