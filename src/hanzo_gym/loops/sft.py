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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hanzo_gym.clock import paced
from hanzo_gym.config import Config
from hanzo_gym.data.batching import (
    epoch_order,
    length_grouped_order,
    micro_batches,
    packed_rows,
    padding_datum,
    supervised_datum,
)
from hanzo_gym.data.bench import BenchQuestion
from hanzo_gym.data.example import Example
from hanzo_gym.engine import Engine
from hanzo_gym.engine.distributed import shard, sum_across, world_size
from hanzo_gym.loops.bench_eval import bench_scores
from hanzo_gym.loops.checkpoint import adapter_fingerprint
from hanzo_gym.loops.generation_eval import GenerationEval
from hanzo_gym.loops.run_dir import RunDir
from hanzo_gym.loops.schedule import adam_params
from hanzo_gym.loops.tail import LoopTail, StepPlace, StepWindow, planned_steps
from hanzo_gym.records import Datum


@dataclass
class SftResult:
    steps: int
    last_eval_loss: float | None


def _windows(cfg: Config, train: list[Example], epoch: int) -> list[list[list[int]]]:
    lengths = [len(example) for example in train]
    pack_to = cfg.sequence_len if cfg.sample_packing else None
    if cfg.group_by_length:  # HF's sampler, over its batch: micro_batch_size × gradient_accumulation_steps
        batch_size = cfg.micro_batch_size * cfg.gradient_accumulation_steps
        order = length_grouped_order(lengths, batch_size, cfg.sampler_seed, epoch)
    elif cfg.curriculum_sampling:  # Axolotl's sequential sampler: every epoch in the data's own order
        order = list(range(len(train)))
    else:
        order = epoch_order(len(train), cfg.sampler_seed, epoch)
    batches = micro_batches(lengths, order, cfg.micro_batch_size, pack_to)
    accum = cfg.gradient_accumulation_steps * world_size()
    return [batches[i : i + accum] for i in range(0, len(batches), accum)]


def _plan_fingerprint(cfg: Config, train: list[Example]) -> dict:
    return {
        **adapter_fingerprint(cfg),
        "train_examples": len(train),
        "train_tokens": sum(len(e) for e in train),
        "seed": cfg.seed,
        **({"data_seed": cfg.data_seed} if cfg.data_seed is not None else {}),
        "micro_batch_size": cfg.micro_batch_size,
        # per window across all processes: a resume on another process count with the same windows is fine
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps * world_size(),
        "sample_packing": cfg.sample_packing,
        "sequence_len": cfg.sequence_len,
        # Only when set, so that checkpoints written before the key existed still resume.
        **({"group_by_length": True} if cfg.group_by_length else {}),
        **({"curriculum_sampling": True} if cfg.curriculum_sampling else {}),
        **({"shuffle_merged_datasets": False} if not cfg.shuffles_at_load else {}),
    }


def batch_datums(
    examples: list[Example], weight: float, pad_to: int | None, pack: bool, pad_id: int | None
) -> list[Datum]:
    """A micro-batch's datums. With `pad_to` (pad_to_sequence_len) each row (one example, or a packed row
    of several) is followed by pad tokens up to `pad_to` tokens, trained on nothing: the shape of Axolotl's
    batch padded to sequence_len, whatever the examples' lengths."""
    datums = [supervised_datum(example, weight) for example in examples]
    if pad_to is None:
        return datums
    lengths = [len(example) for example in examples]
    padded: list[Datum] = []
    for row in packed_rows(lengths, list(range(len(examples))), pad_to if pack else None):
        padded += [datums[i] for i in row]
        used = sum(len(datums[i]) for i in row)
        if used < pad_to:
            padded.append(padding_datum(pad_to - used, pad_id or 0))
    return padded


def evaluate(
    engine: Engine,
    examples: list[Example],
    micro_batch_size: int,
    pack_to: int | None = None,
    pad_to: int | None = None,
) -> float:
    """Mean next-token NLL over every trained token of `examples` (no update, dropout off); under torchrun
    each process scores its share and the sums are added up. `pack_to` (eval_sample_packing): micro-batches
    of packed rows, as in training; `pad_to` (pad_to_sequence_len): rows padded to that many tokens. Neither
    changes the result: the mean is over tokens, and packed or padded datums never attend to each other."""
    nll, count = 0.0, 0
    mine = shard(examples)
    lengths = [len(example) for example in mine]
    pad_id = engine.tokenizer.pad_token_id if engine.tokenizer is not None else None
    batches = micro_batches(lengths, list(range(len(mine))), micro_batch_size, pack_to)
    for indices in paced(list(batches), "evaluating, batches"):
        batch = [mine[i] for i in indices]
        datums = batch_datums(batch, 1.0, pad_to, pack_to is not None, pad_id)
        for datum, logprobs in zip(datums, engine.forward(datums, scored_from=first_trained(datums))):
            weights = datum.loss_fn_inputs["weights"].data
            nll -= sum(lp for lp, w in zip(logprobs.tolist(), weights) if w)
            count += sum(1 for w in weights if w)
    nll, count = sum_across(nll, count)
    return nll / max(count, 1)


def first_trained(datums: list[Datum]) -> list[int]:
    """Each datum's first position of non-zero weight (0 when it has none): the engine's `scored_from`, so
    that the output layer computes no logits over a leading prompt, whose loss weight is 0."""
    return [next((i for i, w in enumerate(d.loss_fn_inputs["weights"].data) if w), 0) for d in datums]


def _evaluation(
    engine: Engine,
    cfg: Config,
    val: list[Example],
    run: RunDir,
    pack_to: int | None,
    pad_to: int | None,
    bench: list[BenchQuestion] | None,
) -> Callable[[int], dict[str, float]]:
    """The eval loss, with do_causal_lm_eval / eval_table_size the held-out completions (loops/generation_eval.py),
    with do_bench_eval the benchmark's accuracy (loops/bench_eval.py)."""
    batch = cfg.eval_micro_batch_size

    def mean_nll(examples: list[Example]) -> float:
        return evaluate(engine, examples, batch, pack_to, pad_to)

    generation = GenerationEval(engine, cfg, val, run.log_predictions) if cfg.generates_at_eval else None

    def scores(step: int) -> dict[str, float]:
        return {
            "eval/loss": mean_nll(val),
            **(generation(step, mean_nll) if generation else {}),
            **(bench_scores(engine, bench, batch) if bench else {}),
        }

    return scores


def train_sft(
    engine: Engine,
    cfg: Config,
    train: list[Example],
    val: list[Example],
    run: RunDir,
    resume_from: Path | None = None,
    bench: list[BenchQuestion] | None = None,
) -> SftResult:
    """`bench`: do_bench_eval's questions (data/bench.py), scored at each evaluation."""
    total, epochs = planned_steps(cfg, len(_windows(cfg, train, 0)))  # max_steps: as long as it says
    pad_to = cfg.sequence_len if cfg.pad_to_sequence_len else None
    pad_id = engine.tokenizer.pad_token_id if engine.tokenizer is not None else None
    # Axolotl packs the eval set when sample_packing does, unless eval_sample_packing is false
    eval_pack = cfg.sequence_len if cfg.sample_packing and cfg.eval_sample_packing is not False else None
    tail = LoopTail(
        engine,
        cfg,
        run,
        _plan_fingerprint(cfg, train),
        total,
        resume_from,
        evaluate=_evaluation(engine, cfg, val, run, eval_pack, pad_to, bench) if val else None,
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
            window_nll = window_tokens = router_aux = 0.0
            for batch in shard(window) if trained else []:
                datums = batch_datums(
                    [train[i] for i in batch], 1.0 / trained, pad_to, cfg.sample_packing, pad_id
                )
                scored = engine.forward_backward(datums, "cross_entropy", scored_from=first_trained(datums))
                window_nll += scored.loss_sum * trained
                router_aux += scored.metrics.get("router_aux_loss:sum", 0.0)
                window_tokens += sum(len(train[i]) for i in batch)
            window_nll, window_tokens, router_aux = sum_across(window_nll, window_tokens, router_aux)
            adam = adam_params(cfg, tail.step, total)
            stats = engine.optim_step(adam)
            values = {
                "nll": window_nll,
                "trained": trained,
                "tokens": window_tokens,
                "seconds": time.perf_counter() - window_started,  # training time only: no evals or saves
                "lr": adam.learning_rate,
                "grad_norm": stats["grad_norm"],
                # model_config.output_router_logits: the router loss this step added, all processes'
                **({"router_aux_loss": router_aux} if engine.routes_experts else {}),
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
        **({"router_aux_loss": window.means()["router_aux_loss"]} if "router_aux_loss" in sums else {}),
    }
