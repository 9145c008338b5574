"""Preference training (`rl: dpo | ipo | orpo | simpo | kto`): a plain loop over the engine's primitives, with
TRL 1.16's losses (engine/preference_losses.py).

A micro-batch is `micro_batch_size` items. A pair is two datums, prompt + chosen and prompt + rejected, side by
side in one packed pass, so the engine's prefix sharing computes their shared prompt once; a KTO example is one
datum. The micro-batch's loss is TRL's on it (a mean over its items; a chosen NLL is a token-level mean), and an
optimizer step averages the losses of its `gradient_accumulation_steps` micro-batches, as HF's Trainer does.

DPO, IPO and KTO compare the policy with the reference model: the frozen base, scored by the same engine with the
adapter disabled (no second model in memory). An item's reference log-probabilities never change, so they are
computed once per item and kept: for every item before the first step with `precompute_ref_log_probs`, else when
the item is first trained or evaluated. KTO's KL term pairs each prompt of a micro-batch with the completion of
the item before it (TRL's rotation by one within the batch); those mismatched sequences are scored without
gradient by the policy and the reference. SimPO and ORPO need no reference. With `dpo_use_weighting` (WPO) the
engine's scoring pass also returns each position's log Σ_v π(v)² under the policy, from the same chunks of logits,
and each pair's loss is weighted by w_c·w_r, w = exp(mean over the completion of log π(y_t) − log Σ_v π(v)²).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from hanzo_gym.clock import paced
from hanzo_gym.config import Config
from hanzo_gym.data.batching import epoch_order
from hanzo_gym.data.preference import KtoExample, PreferencePair
from hanzo_gym.engine import Engine
from hanzo_gym.engine import preference_losses as pl
from hanzo_gym.engine.distributed import shard, sum_across, world_size
from hanzo_gym.errors import GymError
from hanzo_gym.loops.checkpoint import adapter_fingerprint
from hanzo_gym.loops.run_dir import RunDir
from hanzo_gym.loops.schedule import adam_params
from hanzo_gym.loops.tail import LoopTail, StepPlace, StepWindow, planned_steps
from hanzo_gym.records import Datum


@dataclass
class PreferenceResult:
    steps: int
    last_eval: dict[str, float] | None


def completion_datum(prompt: Sequence[int], completion: Sequence[int]) -> Datum:
    """prompt + completion as a next-token datum; weight 1 on the completion's targets only."""
    tokens = [*prompt, *completion]
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return Datum.from_tokens(tokens[:-1], target_tokens=tokens[1:], weights=weights)


def completion_start(prompt: Sequence[int]) -> int:
    """The first position of a `completion_datum` whose target is a completion token: the engine's
    `scored_from`, so that the output layer computes no logits over the prompt."""
    return len(prompt) - 1


def pair_datums(pair: PreferencePair) -> list[Datum]:
    return [completion_datum(pair.prompt, pair.chosen), completion_datum(pair.prompt, pair.rejected)]


def _completion_sum(logprobs: torch.Tensor, prompt_length: int) -> torch.Tensor:
    return logprobs[prompt_length - 1 :].sum()


def _method_outputs(cfg: Config) -> tuple[str, ...]:
    """What the loss needs from the scoring pass besides the log-probs (Engine.forward_with's `outputs`)."""
    return ("log_sum_sq_probs",) if cfg.dpo_use_weighting else ()


class _Scores:
    """Summed completion log-probs per item, computed once by `score(indices)` and kept. Once `frozen`, every
    item must be known: full fine-tuning's reference is the starting weights, which only exist before the
    first step."""

    def __init__(self, score):
        self._score = score
        self._known: dict = {}
        self.frozen = False

    def of(self, keys: Sequence, chunk: int | None = None) -> torch.Tensor:
        missing = [key for key in dict.fromkeys(keys) if key not in self._known]
        if missing and self.frozen:
            raise GymError(f"reference log-probs of items {missing[:3]} were not computed before training")
        chunk = chunk or max(len(missing), 1)
        for start in range(0, len(missing), chunk):
            batch = missing[start : start + chunk]
            for key, value in zip(batch, self._score(batch)):
                self._known[key] = value
        return torch.stack([self._known[key] for key in keys]) if keys else torch.zeros(0)


class PairMethod:
    """DPO, IPO, SimPO and ORPO over pairs: datums [chosen₀, rejected₀, chosen₁, …]."""

    def __init__(self, cfg: Config, engine: Engine, pairs: Sequence[PreferencePair]):
        self.cfg, self.engine, self.items = cfg, engine, pairs
        self.beta = cfg.preference_beta
        extra = {"orpo": ("nll_loss", "log_odds_ratio", "log_odds_chosen"), "simpo": ("nll_loss",)}
        with_nll = cfg.rl == "dpo" and "sft" in cfg.dpo_terms
        self.metric_names = (
            "loss",
            *pl.PAIR_METRIC_NAMES,
            *extra.get(cfg.rl, ("nll_loss",) if with_nll else ()),
        )
        self.reference = _Scores(self._reference_sums) if cfg.rl in ("dpo", "ipo") else None
        self.outputs = _method_outputs(cfg)

    def _reference_sums(self, indices: Sequence[int]) -> list[torch.Tensor]:
        pairs = [self.items[i] for i in indices]
        # full fine-tuning has no adapter to disable: its reference is the weights before the first step
        reference = not self.engine.full_fine_tuning
        scored = self.engine.forward(
            self.datums(indices), reference=reference, scored_from=self.scored_from(indices)
        )
        return [self._sums(scored[2 * j : 2 * j + 2], [pair])[:, 0] for j, pair in enumerate(pairs)]

    @staticmethod
    def _sums(logprobs: Sequence[torch.Tensor], pairs: Sequence[PreferencePair]) -> torch.Tensor:
        """`[2, B]`: summed completion log-probs of chosen (row 0) and rejected (row 1)."""
        return torch.stack(
            [
                torch.stack(
                    [_completion_sum(logprobs[2 * i + side], len(p.prompt)) for i, p in enumerate(pairs)]
                )
                for side in (0, 1)
            ]
        )

    def datums(self, batch: Sequence[int]) -> list[Datum]:
        return [d for i in batch for d in pair_datums(self.items[i])]

    def scored_from(self, batch: Sequence[int]) -> list[int]:
        """Where the loss starts reading each datum: the completion; TRL's ORPO takes the chosen NLL over the
        whole chosen sequence, prompt included."""
        whole_chosen = self.cfg.rl == "orpo"
        starts = []
        for i in batch:
            start = completion_start(self.items[i].prompt)
            starts += [0 if whole_chosen else start, start]
        return starts

    def prepare(self, batch: Sequence[int]) -> torch.Tensor | None:
        """What the loss needs besides the policy's log-probs: the reference sums `[2, B]` (DPO, IPO)."""
        return self.reference.of(batch).T if self.reference else None

    def loss(
        self,
        batch: Sequence[int],
        logprobs: Sequence[torch.Tensor],
        reference,
        log_sum_sq_probs: Sequence[torch.Tensor] | None = None,
    ) -> pl.PreferenceLoss:
        """TRL's loss on the micro-batch `batch` from the policy's per-token log-probs, one tensor per datum;
        with WPO also each datum's per-position log Σ_v π(v)² (`log_sum_sq_probs`)."""
        cfg = self.cfg
        pairs = [self.items[i] for i in batch]
        policy = self._sums(logprobs, pairs)
        lengths = torch.tensor([[len(p.chosen) for p in pairs], [len(p.rejected) for p in pairs]])
        chosen_nll = pl.mean_token_nll(policy[0], lengths[0])
        if cfg.rl == "simpo":
            return pl.simpo_loss(
                *policy, *lengths, beta=self.beta, simpo_gamma=cfg.simpo_gamma, cpo_alpha=cfg.cpo_alpha,
                chosen_nll=chosen_nll,
            )  # fmt: skip
        if cfg.rl == "orpo":
            # TRL's ORPO takes the chosen NLL over the whole chosen sequence, prompt included (scored_from)
            whole = torch.cat([logprobs[2 * i] for i in range(len(pairs))])
            return pl.orpo_loss(*policy, *lengths, -whole.mean(), orpo_alpha=self.beta)
        terms = cfg.dpo_terms
        main = "ipo" if "ipo" in terms else "sigmoid"
        wpo = {}
        if cfg.dpo_use_weighting:
            if log_sum_sq_probs is None:
                raise ValueError("dpo_use_weighting needs the policy's log_sum_sq_probs of every datum")
            aligned = [lp - lss for lp, lss in zip(logprobs, log_sum_sq_probs, strict=True)]
            chosen_wpo, rejected_wpo = self._sums(aligned, pairs)
            wpo = {"chosen_wpo_logps_B": chosen_wpo, "rejected_wpo_logps_B": rejected_wpo}
        result = pl.dpo_loss(
            *policy,
            *reference,
            beta=self.beta,
            loss_type=main,
            label_smoothing=cfg.dpo_label_smoothing,
            chosen_lengths_B=lengths[0],
            rejected_lengths_B=lengths[1],
            **wpo,
        )
        loss, metrics = terms[main] * result.loss, dict(result.metrics)
        if "sft" in terms:
            loss = loss + terms["sft"] * chosen_nll
            metrics["nll_loss"] = chosen_nll.item()
        return pl.PreferenceLoss(loss, metrics)


class KtoMethod:
    """KTO over unpaired examples: datums [x₀ + y₀, x₁ + y₁, …]; the KL batch is [x₀ + y_{B−1}, x₁ + y₀, …]."""

    metric_names = ("loss", "kl", *(name for name in pl.PAIR_METRIC_NAMES if name != "rewards/accuracies"))
    outputs = ()

    def __init__(self, cfg: Config, engine: Engine, examples: Sequence[KtoExample]):
        self.cfg, self.engine, self.items = cfg, engine, examples
        self.beta = cfg.preference_beta
        # keyed by (prompt's item, completion's item): the matched and the KL sequences share one store; full
        # fine-tuning has no adapter to disable: its reference is the weights before the first step
        self.reference = _Scores(partial(self._sums, reference=not engine.full_fine_tuning))

    def _sums(self, keys: Sequence[tuple[int, int]], reference: bool = False) -> list[torch.Tensor]:
        """Summed log-probs of prompt i + completion j for each (i, j), by the reference or the policy."""
        datums = [completion_datum(self.items[i].prompt, self.items[j].completion) for i, j in keys]
        starts = [completion_start(self.items[i].prompt) for i, _ in keys]
        scored = self.engine.forward(datums, reference=reference, scored_from=starts)
        return [_completion_sum(lp, len(self.items[i].prompt)) for lp, (i, _) in zip(scored, keys)]

    @staticmethod
    def _mismatched(batch: Sequence[int]) -> list[tuple[int, int]]:
        return [(i, batch[k - 1]) for k, i in enumerate(batch)]

    def datums(self, batch: Sequence[int]) -> list[Datum]:
        return [completion_datum(self.items[i].prompt, self.items[i].completion) for i in batch]

    def scored_from(self, batch: Sequence[int]) -> list[int]:
        return [completion_start(self.items[i].prompt) for i in batch]

    def prepare(self, batch: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(reference sums, the policy's and the reference's sums on the KL batch), all without gradient."""
        mismatched = self._mismatched(batch)
        policy_kl = torch.stack(self._sums(mismatched))
        return self.reference.of([(i, i) for i in batch]), policy_kl, self.reference.of(mismatched)

    def loss(self, batch: Sequence[int], logprobs: Sequence[torch.Tensor], prepared) -> pl.PreferenceLoss:
        reference, policy_kl, reference_kl = prepared
        examples = [self.items[i] for i in batch]
        policy = torch.stack([_completion_sum(lp, len(e.prompt)) for lp, e in zip(logprobs, examples)])
        desirable = torch.tensor([e.desirable for e in examples])
        return pl.kto_loss(
            policy,
            reference,
            desirable,
            policy_kl,
            reference_kl,
            beta=self.beta,
            desirable_weight=self.cfg.kto_desirable_weight,
            undesirable_weight=self.cfg.kto_undesirable_weight,
        )


def preference_method(cfg: Config, engine: Engine, items: Sequence) -> PairMethod | KtoMethod:
    return KtoMethod(cfg, engine, items) if cfg.rl == "kto" else PairMethod(cfg, engine, items)


def _windows(cfg: Config, count: int, epoch: int) -> list[list[list[int]]]:
    order = epoch_order(count, cfg.sampler_seed, epoch)
    batches = [order[i : i + cfg.micro_batch_size] for i in range(0, len(order), cfg.micro_batch_size)]
    accum = cfg.gradient_accumulation_steps * world_size()
    return [batches[i : i + accum] for i in range(0, len(batches), accum)]


def _plan_fingerprint(cfg: Config, train: Sequence) -> dict:
    return {
        **adapter_fingerprint(cfg),
        "rl": cfg.rl,
        "train_items": len(train),
        "train_tokens": sum(item.tokens for item in train),
        "seed": cfg.seed,
        **({"data_seed": cfg.data_seed} if cfg.data_seed is not None else {}),
        "micro_batch_size": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps * world_size(),
        "sequence_len": cfg.sequence_len,
    }


class _MetricSums:
    """Each metric's sum over micro-batches and how many gave it (a KTO micro-batch without a desirable example
    has no `rewards/chosen`): the mean is over the micro-batches that have the metric, as TRL averages them."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
            self.counts[key] = self.counts.get(key, 0) + 1

    def means_across(self, names: Sequence[str], *extra: float) -> tuple[dict[str, float], list[float]]:
        """Means over every process's micro-batches of the metrics `names` (the same on every process); the
        `extra` values summed over processes."""
        totals = sum_across(
            *extra, *(self.sums.get(k, 0.0) for k in names), *(float(self.counts.get(k, 0)) for k in names)
        )
        values, counts = totals[len(extra) : len(extra) + len(names)], totals[len(extra) + len(names) :]
        means = {key: value / count for key, value, count in zip(names, values, counts) if count}
        return means, totals[: len(extra)]


def _eval_batches(count: int, micro_batch_size: int) -> list[list[int]]:
    """This process's held-out micro-batches, in order."""
    return shard(
        [list(range(i, min(i + micro_batch_size, count))) for i in range(0, count, micro_batch_size)]
    )


def _reference_keys(cfg: Config, batches: Iterable[Sequence[int]]) -> list:
    """Every item whose reference log-probs these micro-batches need: the items (DPO, IPO), or for KTO each
    matched (i, i) and each KL pair of its micro-batch."""
    batches = list(batches)
    if cfg.rl != "kto":
        return [i for batch in batches for i in batch]
    return [key for batch in batches for key in ((i, i) for i in batch)] + [
        key for batch in batches for key in KtoMethod._mismatched(batch)
    ]


def evaluate(method: PairMethod | KtoMethod, micro_batch_size: int) -> dict[str, float]:
    """The loss and metrics on held-out items: the mean over micro-batches (TRL's eval reduction)."""
    sums = _MetricSums()
    for batch in paced(_eval_batches(len(method.items), micro_batch_size), "evaluating, batches"):
        prepared = method.prepare(batch)
        logprobs, extras = method.engine.forward_with(
            method.datums(batch), method.outputs, scored_from=method.scored_from(batch)
        )
        scored = method.loss(batch, logprobs, prepared, **extras)
        sums.add({"loss": scored.loss.item(), **scored.metrics})
    means, _ = sums.means_across(method.metric_names)
    return {f"eval/{key}": value for key, value in means.items()}


def train_preference(
    engine: Engine, cfg: Config, train: Sequence, val: Sequence, run: RunDir, resume_from=None
) -> PreferenceResult:
    method, held_out = preference_method(cfg, engine, train), preference_method(cfg, engine, val)
    total, epochs = planned_steps(cfg, len(_windows(cfg, len(train), 0)))  # max_steps: as long as it says
    if cfg.precompute_ref_log_probs and method.reference is not None:
        started = time.perf_counter()
        planned = (
            batch
            for epoch in range(epochs)
            for window in _windows(cfg, len(train), epoch)
            for batch in shard(window)
        )
        for scoring, batches in (
            (method, planned),
            (held_out, _eval_batches(len(val), cfg.eval_micro_batch_size)),
        ):
            scoring.reference.of(_reference_keys(cfg, batches), chunk=cfg.micro_batch_size)
        print(
            f"reference log-probs of {len(train) + len(val)} items in {time.perf_counter() - started:.1f} s"
        )
        if engine.full_fine_tuning:  # scored with the starting weights: nothing may be scored after a step
            method.reference.frozen = held_out.reference.frozen = True
    tail = LoopTail(
        engine,
        cfg,
        run,
        _plan_fingerprint(cfg, train),
        total,
        resume_from,
        evaluate=(lambda step: evaluate(held_out, cfg.eval_micro_batch_size)) if val else None,
        row=partial(_logged_row, "examples_per_s" if cfg.rl == "kto" else "pairs_per_s"),
        line=lambda row: (
            f"step {row['step']}/{total} loss {row['loss']:.4f} margin {row.get('rewards/margins', 0):.3f} "
            f"lr {row['lr']:.3e} grad_norm {row['grad_norm']:.3f} tokens/s {row['tokens_per_s']:.0f}"
        ),
    )
    for epoch in range(tail.position.epoch, epochs):
        windows = _windows(cfg, len(train), epoch)
        for index in range(tail.first_index(epoch), len(windows)):
            if tail.done:
                break
            window = windows[index]
            started = time.perf_counter()
            sums = _MetricSums()
            tokens = 0
            for batch in shard(window):
                loss_fn = partial(_share_of_step, method, batch, method.prepare(batch), len(window))
                scored = engine.forward_backward_custom(
                    method.datums(batch), loss_fn, method.outputs, scored_from=method.scored_from(batch)
                )
                sums.add(scored[1])
                tokens += sum(train[i].tokens for i in batch)
            values, (tokens,) = sums.means_across(method.metric_names, float(tokens))
            stats = engine.optim_step(adam_params(cfg, tail.step, total))
            values.update(
                tokens=tokens,
                items=float(sum(len(batch) for batch in window)),
                seconds=time.perf_counter() - started,
                lr=stats["lr"],
                grad_norm=stats["grad_norm"],
            )
            tail.finish_step(values, StepPlace(epoch, index, len(windows)))
        if tail.done:
            break
    tail.close()
    return PreferenceResult(steps=tail.step, last_eval=tail.last_eval)


def _share_of_step(
    method: PairMethod | KtoMethod, batch: Sequence[int], prepared, micro_batches: int, logprobs, **extras
) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's part of the step's loss (its TRL loss over the step's micro-batch count), and its
    metrics; `extras` are the method's `outputs` of the scoring pass."""
    scored = method.loss(batch, logprobs, prepared, **extras)
    return scored.loss / micro_batches, {"loss": scored.loss.item(), **scored.metrics}


def _logged_row(items_per_s: str, window: StepWindow) -> dict[str, float]:
    """The loss and TRL's metrics averaged over the window's steps; lr and grad_norm of its last step; the
    throughput in tokens and in items (`pairs_per_s`, KTO's `examples_per_s`)."""
    throughput = {"tokens", "items", "seconds", "lr", "grad_norm"}
    row = {key: value for key, value in window.means().items() if key not in throughput}
    seconds = max(window.sums["seconds"], 1e-9)
    row.update(
        lr=window.last["lr"],
        grad_norm=window.last["grad_norm"],
        tokens_per_s=window.sums["tokens"] / seconds,
    )
    row[items_per_s] = window.sums["items"] / seconds
    return row
