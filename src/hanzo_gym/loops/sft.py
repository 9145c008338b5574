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

from hanzo_gym.config import Config
from hanzo_gym.data.batching import epoch_order, micro_batches, supervised_datum
from hanzo_gym.data.example import Example
from hanzo_gym.engine import Engine
from hanzo_gym.engine.distributed import shard, sum_across, world_size
from hanzo_gym.loops.checkpoint import adapter_fingerprint
from hanzo_gym.loops.run_dir import RunDir
from hanzo_gym.loops.schedule import adam_params
from hanzo_gym.loops.tail import LoopTail, StepPlace, StepWindow, planned_steps


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
            weights = datum.loss_fn_inputs["weights"].data
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
    total, epochs = planned_steps(cfg, len(_windows(cfg, train, 0)))  # max_steps: as long as it says
    tail = LoopTail(
        engine,
        cfg,
        run,
        _plan_fingerprint(cfg, train),
        total,
        resume_from,
        evaluate=(lambda: {"eval/loss": evaluate(engine, val, cfg.micro_batch_size)}) if val else None,
        row=_logged_row,
        line=lambda row: (
            f"step {row['step']}/{total} loss {row['loss']:.4f} lr {row['lr']:.3e} "
            f"grad_norm {row['grad_norm']:.3f} tokens/s {row['tokens_per_s']:.0f}"
        ),
    )
    for epoch in range(tail.position.epoch, epochs):
        windows = _windows(cfg, train, epoch)
        for index in range(tail.first_index(epoch), len(windows)):
            if tail.done:
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
            adam = adam_params(cfg, tail.step, total)
            stats = engine.optim_step(adam)
            values = {
                "nll": window_nll,
                "trained": trained,
                "tokens": window_tokens,
                "seconds": time.perf_counter() - window_started,  # training time only: no evals or saves
                "lr": adam.learning_rate,
                "grad_norm": stats["grad_norm"],
            }
            tail.finish_step(values, StepPlace(epoch, index, len(windows)))
        if tail.done:
            break
    tail.close()
    last_eval = tail.last_eval["eval/loss"] if tail.last_eval else None
    return SftResult(steps=tail.step, last_eval_loss=last_eval)


def _logged_row(window: StepWindow) -> dict[str, float]:
    """The window's mean NLL per trained token and throughput; lr and grad_norm of its last step."""
    sums = window.sums
    return {
        "loss": sums["nll"] / max(sums["trained"], 1),
        "lr": window.last["lr"],
        "grad_norm": window.last["grad_norm"],
        "tokens": int(sums["tokens"]),
        "trained_tokens": int(sums["trained"]),
        "tokens_per_s": sums["tokens"] / max(sums["seconds"], 1e-9),
    }
