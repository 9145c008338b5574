"""LoRA SFT throughput and memory: TRL's SFTTrainer against hanzo-gym's SFT loop on the same workload, each in
fp32 and in bf16, side by side in one run.

    python bench/sft_vs_trl.py [--steps N] [--rows 256] [--batch 8] [--max-length 512] [--full]
                               [--sides trl-fp32,trl-bf16,ours-fp32,ours-bf16] [--peak-seconds 1]

`--full`: full fine-tuning on both sides (every weight trains: TRL without a peft_config, ours without an
`adapter`) instead of LoRA; utilisation then counts 6 × the weights per token (the weight gradients too).

Each side runs in its own subprocess, so the peak RSS it reports is its own. Steps 2..N are timed (step 1 is
warm-up) and tokens/s counts the non-pad tokens of those steps. TRL's bf16 is its own `bf16=True` (autocast over
fp32 weights); ours is the mixed recipe (frozen base in bf16, LoRA and AdamW state in fp32). Utilisation is the
model FLOP/s (4 × the linear layers' weights per token: forward, and the backward to the inputs of frozen
layers; LoRA and attention scores left out) over the matmul peak of the side's precision, measured after the
sides by bench/matmul_peak.py's code. This script only measures; it judges nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from harness import SIDE_NAMES, add_side_arguments, finish_side, peak_rss_bytes, precision_sides, run_sides

SEED = 42
LORA_R, LORA_ALPHA = 16, 32
LEARNING_RATE = 2e-4
TARGET_SPEEDUP, TARGET_MEMORY = 1.5, 0.75  # ours in fp32 against TRL in fp32
# issue 16: ours at our best (bf16) against TRL in fp32, and against TRL at its best, at half its memory
TARGET_BF16_OVER_TRL_FP32, TARGET_BF16_OVER_TRL_BEST, TARGET_BF16_MEMORY = 5.0, 2.0, 0.5

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


def run_trl(
    model_dir: str,
    data_path: str,
    work_dir: str,
    steps: int,
    batch: int,
    max_length: int,
    full: bool,
    bf16: bool,
) -> dict:
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
        # TRL's bf16=True (its default) is bf16 autocast over fp32 weights; on CPU it needs use_cpu=True.
        bf16=bf16,
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
        peft_config=None if full else peft_config,
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
        "bf16": args.bf16,
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
        "precision": f"bf16 autocast, {settings['model dtype']} weights" if bf16 else settings["model dtype"],
        "peak_dtype": "bf16" if bf16 else "fp32",
    }


def run_ours(
    model_dir: str,
    data_path: str,
    work_dir: str,
    steps: int,
    batch: int,
    max_length: int,
    full: bool,
    bf16: bool,
) -> dict:
    import torch

    from hanzo_gym.config import parse_config
    from hanzo_gym.data.dataset import load_examples
    from hanzo_gym.loops.run_dir import RunDir
    from hanzo_gym.loops.sft import train_sft
    from hanzo_gym.loops.train import build_engine
    from hanzo_gym.model.hub import load_tokenizer
    from hanzo_gym.model.load_plan import LoadPlan

    lora = {"adapter": "lora", "lora_r": LORA_R, "lora_alpha": LORA_ALPHA, "lora_dropout": 0.0}
    cfg = parse_config(
        {
            **({} if full else {**lora, "lora_target_linear": True}),
            "base_model": model_dir,
            "datasets": [{"path": data_path, "type": "chat_template"}],
            "val_set_size": 0,
            "output_dir": work_dir,
            "sequence_len": max_length,
            "train_on_inputs": True,  # TRL's default for a `messages` dataset: loss on every token
            "micro_batch_size": batch,
            "gradient_accumulation_steps": 1,
            "learning_rate": LEARNING_RATE,
            "lr_scheduler": "linear",  # TRL's default
            "max_steps": steps,
            "logging_steps": 1,
            "seed": SEED,
            "bf16": bf16,
        }
    )
    tokenizer = load_tokenizer(cfg.base_model)
    train = load_examples(cfg, tokenizer).train
    engine = build_engine(
        cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.bfloat16 if bf16 else torch.float32)
    )
    base_dtypes = {
        str(p.dtype).removeprefix("torch.") for p in engine.model.parameters() if not p.requires_grad
    }
    adapter_dtypes = {str(p.dtype).removeprefix("torch.") for p in engine.trainable}
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
        "precision": (
            f"weights + AdamW {'/'.join(sorted(adapter_dtypes))}" + (", bf16 autocast" if bf16 else "")
            if full
            else f"base {'/'.join(sorted(base_dtypes))}, LoRA + AdamW {'/'.join(sorted(adapter_dtypes))}"
        ),
        "peak_dtype": "bf16" if bf16 else "fp32",
    }


SIDES = precision_sides(run_trl, run_ours)
NAMES = SIDE_NAMES


def model_flops_per_token(model_dir: str, full: bool) -> int:
    """4 × the weights of the linear layers (the output projection included, once even when tied): 2 per
    weight forward, 2 for the gradient to the layer's input; frozen weights get no weight gradient, trained
    ones (`full`) 2 more."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    weights = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return (6 if full else 4) * sum(weights.values())


def print_report(
    results: dict[str, dict], opts, load_at_start: float, flops_per_token: int, peak: dict[str, float] | None
) -> None:
    def per_second(side: dict) -> float:
        return side["tokens"] / side["seconds"]

    def gigabytes(side: dict) -> float:
        return side["peak_rss_bytes"] / 1e9

    method = "full fine-tuning" if opts.full else f"LoRA r={LORA_R} alpha {LORA_ALPHA} all-linear"
    print(
        f"workload: SmolLM2-135M-Instruct (GGUF → fp32 on disk), {method}, "
        f"{opts.rows} rows, batch {opts.batch}, max_length {opts.max_length}, lr {LEARNING_RATE}, CPU, "
        f"steps 2..{opts.steps} timed"
    )
    # tokens/s is only comparable between runs on an otherwise idle machine
    print(f"machine: {os.cpu_count()} CPUs, 1-minute load average at start {load_at_start:.2f}")
    if peak:
        print(
            f"matmul peak (bench/matmul_peak.py shapes, measured after the sides): bf16 {peak['bf16']:.0f}, "
            f"fp32 {peak['fp32']:.0f} GFLOP/s; model work {flops_per_token / 1e6:.0f} MFLOP per token"
        )
    print(
        f"{'':16} {'precision':34} {'tokens/s':>9} {'util':>6} {'peak RSS (GB)':>14} {'RSS pre-train':>14} "
        f"{'tokens':>7} {'seconds':>8} {'load':>5}"
    )
    for key, side in results.items():
        util = (
            f"{100 * per_second(side) * flops_per_token / (peak[side['peak_dtype']] * 1e9):5.0f}%"
            if peak
            else "    -"
        )
        print(
            f"{NAMES[key]:16} {side['precision']:34} {per_second(side):9.1f} {util:>6} {gigabytes(side):14.2f} "
            f"{side['loaded_rss_bytes'] / 1e9:14.2f} {side['tokens']:7d} {side['seconds']:8.1f} "
            f"{side['load_at_start']:5.2f}"
        )

    def ratio(ours: str, theirs: str, what: str, speed_target: float, memory_target: float) -> None:
        if ours in results and theirs in results:
            a, b = results[ours], results[theirs]
            # the targets are issue 16's, for LoRA; full fine-tuning has none
            speed = "" if opts.full else f" (target ≥ {speed_target}x)"
            memory = "" if opts.full else f" (target ≤ {memory_target}x)"
            print(
                f"{NAMES[ours]} / {what}: {per_second(a) / per_second(b):.2f}x tokens/s{speed}, "
                f"{gigabytes(a) / gigabytes(b):.2f}x peak RSS{memory}"
            )

    ratio("ours-fp32", "trl-fp32", "TRL fp32", TARGET_SPEEDUP, TARGET_MEMORY)
    ratio("ours-bf16", "trl-fp32", "TRL fp32", TARGET_BF16_OVER_TRL_FP32, TARGET_BF16_MEMORY)
    trl_sides = [key for key in ("trl-fp32", "trl-bf16") if key in results]
    if trl_sides:
        best = max(trl_sides, key=lambda key: per_second(results[key]))
        ratio(
            "ours-bf16",
            best,
            f"TRL at its best ({NAMES[best]})",
            TARGET_BF16_OVER_TRL_BEST,
            TARGET_BF16_MEMORY,
        )
    for key, side in results.items():
        print(
            f"tokenized rows, {NAMES[key]}: {side['dataset_tokens']} tokens, {side['trained_tokens']} with a label"
        )
    for key in trl_sides:
        settings = results[key]["settings"]
        print(f"{NAMES[key]} settings in effect: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print(
        "TRL differs from its defaults only in: bf16 (False on its fp32 side), use_cpu=True, report_to=none, "
        "save_strategy=no"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per side; 2..N are timed")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--full", action="store_true", help="full fine-tuning on both sides instead of LoRA")
    parser.add_argument(
        "--sides", default=",".join(SIDES), help=f"which sides to run, in order (default: {','.join(SIDES)})"
    )
    parser.add_argument(
        "--peak-seconds", type=float, default=1.0, help="time per shape for the matmul peak; 0 skips it"
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
                opts.model_dir, opts.data, opts.work_dir, opts.steps, opts.batch, opts.max_length, opts.full
            ),
        )
        return
    forwarded = [
        "--batch",
        str(opts.batch),
        "--max-length",
        str(opts.max_length),
        *(["--full"] if opts.full else []),
    ]
    results, load_at_start = run_sides(__file__, sides, synthetic_rows(opts.rows), opts.steps, forwarded)
    from hanzo_gym.model.hub import real_model_gguf, resolve_model

    flops_per_token = model_flops_per_token(str(resolve_model(str(real_model_gguf()))), opts.full)
    peak = None
    if opts.peak_seconds > 0:
        from matmul_peak import measure, peaks

        peak = peaks(measure(opts.peak_seconds))
    print_report(results, opts, load_at_start, flops_per_token, peak)


if __name__ == "__main__":
    main()
