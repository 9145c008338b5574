"""The supervised fine-tuning loop: a plain function over the engine's primitives.

One optimizer step is one accumulation window of micro-batches. The loss is the mean next-token NLL over every
trained token of the window: each datum's weights are 1/(trained tokens in the window), so the engine's summed
loss needs no further division and gradient accumulation gives the same update as one big batch.

Under torchrun a window holds gradient_accumulation_steps micro-batches per process; each process takes its
share of the window's micro-batches, and the weights divide by the trained tokens of the whole window (every
process sees the whole window, so the count is the sum over ranks without a collective). The engine sums the
gradients over processes, so N processes train exactly as one process with N times the accumulation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from hanzo_gym.checkpoint import TrainerPosition, adapter_fingerprint, starting_position, write_checkpoint
from hanzo_gym.config import Config
from hanzo_gym.data.batching import epoch_order, micro_batches, supervised_datum
from hanzo_gym.data.example import Example
from hanzo_gym.distributed import shard, sum_across, world_size
from hanzo_gym.engine import Engine
from hanzo_gym.rundir import Progress, RunDir
from hanzo_gym.schedule import adam_params


@dataclass
class SftResult:
    steps: int
    last_eval_loss: float | None


def _windows(cfg: Config, train: list[Example], epoch: int) -> list[list[list[int]]]:
    lengths = [len(example) for example in train]
    pack_to = cfg.sequence_len if cfg.sample_packing else None
    batches = micro_batches(lengths, epoch_order(len(train), cfg.seed, epoch), cfg.micro_batch_size, pack_to)
    accum = cfg.gradient_accumulation_steps * world_size()
    return [batches[i : i + accum] for i in range(0, len(batches), accum)]


def _plan_fingerprint(cfg: Config, train: list[Example]) -> dict:
    return {
        **adapter_fingerprint(cfg),
        "train_examples": len(train),
        "train_tokens": sum(len(e) for e in train),
        "seed": cfg.seed,
        "micro_batch_size": cfg.micro_batch_size,
        # per window across all processes: a resume on another process count with the same windows is fine
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps * world_size(),
        "sample_packing": cfg.sample_packing,
        "sequence_len": cfg.sequence_len,
    }


def evaluate(engine: Engine, examples: list[Example], micro_batch_size: int) -> float:
    """Mean next-token NLL over every trained token of `examples` (no update, dropout off); under torchrun
    each process scores its share and the sums are added up."""
    nll, count = 0.0, 0
    mine = shard(examples)
    for start in range(0, len(mine), micro_batch_size):
        batch = mine[start : start + micro_batch_size]
        datums = [supervised_datum(e, 1.0) for e in batch]
        for datum, logprobs in zip(datums, engine.forward(datums)):
            weights = datum.loss_fn_inputs["weights"]
            nll -= sum(lp for lp, w in zip(logprobs.tolist(), weights) if w)
            count += sum(1 for w in weights if w)
    nll, count = sum_across(nll, count)
    return nll / max(count, 1)


def train_sft(
    engine: Engine,
    cfg: Config,
    train: list[Example],
    val: list[Example],
    run: RunDir,
    resume_from: Path | None = None,
) -> SftResult:
    steps_per_epoch = len(_windows(cfg, train, 0))
    total = cfg.num_epochs * steps_per_epoch
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    plan = _plan_fingerprint(cfg, train)

    position = starting_position(engine, run, plan, resume_from)
    progress = Progress(total, position.step)
    say = progress.say
    started = time.perf_counter()
    logged_nll = position.log_window.get("nll", 0.0)
    logged_trained = position.log_window.get("trained", 0.0)
    logged_tokens = position.log_window.get("tokens", 0.0)
    logged_seconds = position.log_window.get("seconds", 0.0)
    last_eval: float | None = None
    step = position.step

    def run_eval(epoch_progress: float) -> float:
        loss = evaluate(engine, val, cfg.micro_batch_size)
        run.log(
            {
                "step": step,
                "epoch": round(epoch_progress, 4),
                "eval/loss": loss,
                "elapsed_s": time.perf_counter() - started,
            }
        )
        say(f"eval step {step} epoch {epoch_progress:.2f} eval/loss {loss:.4f}")
        return loss

    if val and step == 0:
        last_eval = run_eval(0.0)  # the base model's loss: the number training has to beat

    for epoch in range(position.epoch, cfg.num_epochs):
        windows = _windows(cfg, train, epoch)
        first = position.window if epoch == position.epoch else 0
        for index in range(first, len(windows)):
            if step >= total:
                break
            window = windows[index]
            window_started = time.perf_counter()
            trained = sum(train[i].trained_tokens for batch in window for i in batch)  # all processes'
            window_nll = window_tokens = 0.0
            for batch in shard(window) if trained else []:
                datums = [supervised_datum(train[i], 1.0 / trained) for i in batch]
                window_nll += engine.forward_backward(datums, "cross_entropy").loss_sum * trained
                window_tokens += sum(len(train[i]) for i in batch)
            window_nll, window_tokens = sum_across(window_nll, window_tokens)
            logged_nll += window_nll
            logged_tokens += window_tokens
            logged_trained += trained
            adam = adam_params(cfg, step, total)
            lr = adam.learning_rate
            stats = engine.optim_step(adam)
            step += 1
            logged_seconds += time.perf_counter() - window_started  # training time only: no evals or saves
            progress.advance()
            epoch_progress = epoch + (index + 1) / len(windows)

            if step % cfg.logging_steps == 0 or step == total:
                now = time.perf_counter()
                row = {
                    "step": step,
                    "epoch": round(epoch_progress, 4),
                    "loss": logged_nll / max(logged_trained, 1),
                    "lr": lr,
                    "grad_norm": stats["grad_norm"],
                    "tokens": int(logged_tokens),
                    "trained_tokens": int(logged_trained),
                    "tokens_per_s": logged_tokens / max(logged_seconds, 1e-9),
                    "elapsed_s": now - started,
                }
                run.log(row)
                say(
                    f"step {step}/{total} loss {row['loss']:.4f} lr {lr:.3e} grad_norm {row['grad_norm']:.3f} "
                    f"tokens/s {row['tokens_per_s']:.0f}"
                )
                logged_nll = logged_trained = logged_tokens = logged_seconds = 0.0

            end_of_epoch = index == len(windows) - 1
            if val and ((cfg.eval_steps and step % cfg.eval_steps == 0) or end_of_epoch or step == total):
                last_eval = run_eval(epoch_progress)

            if cfg.save_steps and step % cfg.save_steps == 0:
                next_position = (epoch, index + 1) if not end_of_epoch else (epoch + 1, 0)
                window_sums = {
                    "nll": logged_nll,
                    "trained": logged_trained,
                    "tokens": logged_tokens,
                    "seconds": logged_seconds,
                }
                mark = TrainerPosition(
                    step=step,
                    epoch=next_position[0],
                    window=next_position[1],
                    plan=plan,
                    log_window=window_sums,
                )
                path = run.save_checkpoint(
                    step, epoch_progress, lambda d, mark=mark: write_checkpoint(d, engine, mark)
                )
                say(f"saved {path}")
        if step >= total:
            break
    progress.close()
    return SftResult(steps=step, last_eval_loss=last_eval)
