"""The GRPO loop: sample a group of completions per prompt, score them, turn group-relative advantages into
datums, and train with one of the engine's RL losses. A plain function over the engine's primitives.

Under torchrun a step's prompts are micro_batch_size per process: each process samples and scores its own
prompts (with its own sampling seed), then the rewards, lengths and stop reasons of all processes are
gathered, so advantages (batch scaling included), the loss-type normalisers and the logged metrics cover the global
batch. The engine sums the gradients over processes."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hanzo_gym.clock import paced
from hanzo_gym.config import Config
from hanzo_gym.config.grpo_keys import TrlConfig
from hanzo_gym.data.batching import epoch_order
from hanzo_gym.data.prompts import Prompt
from hanzo_gym.engine import Engine, ForwardBackwardOutput
from hanzo_gym.engine.distributed import gather_objects, rank, say, shard, sum_across, world_size
from hanzo_gym.errors import GymError
from hanzo_gym.loops.checkpoint import adapter_fingerprint
from hanzo_gym.loops.completion_log import CompletionLog
from hanzo_gym.loops.rl_math import (
    decoupled_advantages,
    group_advantages,
    is_constant,
    k3,
    loss_type_weights,
    mean,
    rl_datum,
    sample_train_metrics,
)
from hanzo_gym.loops.run_dir import RunDir
from hanzo_gym.loops.schedule import adam_params
from hanzo_gym.loops.tail import LoopTail, StepPlace, check_finite, planned_steps
from hanzo_gym.records import Datum, SampledSequence, SamplingParams, TensorData
from hanzo_gym.rewards import (
    Completion,
    RewardFunction,
    RewardFunctionFailed,
    parse_reward,
    score_completions,
)
from hanzo_gym.rollout import RolloutSampler, rollout_sampler

# step k of a run with seed s samples with s·stride + k: runs of neighbouring seeds share no step's stream (while a
# run has fewer steps than the stride)
RUN_SEED_STRIDE = 1_000_003
RANK_SEED_STRIDE = 1_000_000_007  # rank r samples with seed + r·stride: no two processes share a stream


@dataclass
class GrpoResult:
    steps: int
    last_eval: dict[str, float] | None


def _loss_config(cfg: Config) -> dict[str, float]:
    trl = cfg.trl
    high = trl.epsilon_high if trl.epsilon_high is not None else trl.epsilon
    if trl.loss_fn == "ppo":
        return {"clip_low_threshold": 1 - trl.epsilon, "clip_high_threshold": 1 + high}
    if trl.loss_fn == "cispo" and trl.epsilon_high is not None:
        return {"clip_low_threshold": 0.0, "clip_high_threshold": trl.epsilon_high}
    return {}


def _sampling(cfg: Config, seed: int, greedy: bool = False) -> SamplingParams:
    trl = cfg.trl
    return SamplingParams(
        max_tokens=trl.max_completion_length,
        seed=seed,
        temperature=0.0 if greedy else trl.temperature,
        top_p=trl.top_p,
        top_k=trl.top_k,
    )


def _completions(
    engine: Engine, prompts: list[Prompt], groups: list[list[SampledSequence]]
) -> list[list[Completion]]:
    decode = engine.tokenizer.decode
    return [
        [
            Completion(
                prompt=prompt.text,
                text=decode(s.tokens, skip_special_tokens=True),
                answer=prompt.answer,
                num_tokens=len(s.tokens),
                prompt_messages=None if prompt.messages is None else tuple(prompt.messages),
                token_ids=tuple(s.tokens),
                columns=prompt.columns or {},
            )
            for s in group
        ]
        for prompt, group in zip(prompts, groups)
    ]


def _scored(
    reward_fns: list[RewardFunction], weights: list[float] | None, completions: list[Completion], when: str
) -> tuple[list[float], dict[str, list[float]]]:
    try:
        return score_completions(reward_fns, weights, completions)
    except RewardFunctionFailed as exc:
        raise GymError(f"{when}: {exc}") from None


def evaluate_rewards(
    engine: Engine,
    prompts: list[Prompt],
    reward_fns: list[RewardFunction],
    cfg: Config,
    sampler: RolloutSampler | None = None,
) -> dict[str, float]:
    """Greedy completions of held-out prompts: mean reward, and accuracy = the share whose reward is > 0."""
    rewards: list[float] = []
    mine = shard(prompts)
    sample = (sampler or engine).sample
    chunk = cfg.eval_batch_size or 64  # how many held-out prompts decode together
    for start in paced(range(0, len(mine), chunk), "evaluating, chunks of held-out prompts"):
        batch = mine[start : start + chunk]
        groups = sample([p.tokens for p in batch], 1, _sampling(cfg, cfg.seed, greedy=True))
        flat = [c for group in _completions(engine, batch, groups) for c in group]
        totals, _ = _scored(reward_fns, cfg.trl.reward_weights or None, flat, "scoring the held-out prompts")
        rewards += totals
    rewards = [r for part in gather_objects(rewards) for r in part]
    return {"eval/reward": mean(rewards), "eval/accuracy": mean([1.0 if r > 0 else 0.0 for r in rewards])}


@dataclass
class Rollouts:
    """One step's groups on this process: prompt p's completions, their rewards and their advantages."""

    prompts_P: list[Prompt]
    samples_P_G: list[list[SampledSequence]]
    rewards_P_G: list[list[float]]
    advantages_P_G: list[list[float]]

    @property
    def samples(self) -> list[SampledSequence]:
        return [s for group in self.samples_P_G for s in group]

    @property
    def advantages(self) -> list[float]:
        return [a for group in self.advantages_P_G for a in group]


@dataclass
class TrainingBatch:
    """The completions that train (flat indices into the rollouts' samples), their datums, and where each
    datum's completion starts (the engine's `scored_from`: no logits are computed over the prompt)."""

    chosen: list[int]
    datums: list[Datum]
    scored_from: list[int]


def train_grpo(
    engine: Engine,
    cfg: Config,
    train: list[Prompt],
    val: list[Prompt],
    run: RunDir,
    resume_from: Path | None = None,
) -> GrpoResult:
    """GRPO over `train`, rollouts sampled where `cfg.trl` says (the engine, or vLLM)."""
    sampler = rollout_sampler(engine, cfg, run.path / "vllm-policy")
    try:
        return _train(engine, cfg, train, val, run, resume_from, sampler)
    finally:
        sampler.close()


def _train(
    engine: Engine,
    cfg: Config,
    train: list[Prompt],
    val: list[Prompt],
    run: RunDir,
    resume_from: Path | None,
    sampler: RolloutSampler,
) -> GrpoResult:
    trl = cfg.trl
    reward_fns = [parse_reward(spec) for spec in trl.reward_funcs]
    weights = trl.reward_weights or None
    prompts_per_step = cfg.micro_batch_size * world_size()
    per_epoch = -(-len(train) // prompts_per_step)
    total, epochs = planned_steps(cfg, per_epoch)  # max_steps: as long as it says, looping the prompts
    plan = {
        **adapter_fingerprint(cfg),
        "train_prompts": len(train),
        "seed": cfg.seed,
        **({"data_seed": cfg.data_seed} if cfg.data_seed is not None else {}),
        "micro_batch_size": prompts_per_step,
    }
    if trl.use_vllm:
        say(f"rollouts: {sampler.name}")
    if engine.full_fine_tuning and trl.beta > 0:
        # the KL penalty's reference is the starting model: its weights kept before a checkpoint loads
        engine.keep_reference()
    tail = LoopTail(
        engine,
        cfg,
        run,
        plan,
        total,
        resume_from,
        evaluate=(lambda step: evaluate_rewards(engine, val, reward_fns, cfg, sampler)) if val else None,
        row=lambda window: {**window.means(), "lr": window.last["lr"]},
        line=lambda row: (
            f"step {row['step']}/{total} reward {row['reward']:.4f} reward_std {row['reward_std']:.4f} "
            f"length {row['completions/mean_length']:.1f} loss {row['loss']:.4f} "
            f"sample {row['time/sample']:.1f}s train {row['time/train']:.1f}s"
        ),
    )
    completion_log = (
        CompletionLog(run, trl.num_completions_to_print, tail.say) if trl.log_completions else None
    )
    for epoch in range(tail.position.epoch, epochs):
        order = epoch_order(len(train), cfg.sampler_seed, epoch)
        for index in range(tail.first_index(epoch), per_epoch):
            if tail.done:
                break
            step = tail.step
            prompts_P = shard(
                [train[i] for i in order[index * prompts_per_step : (index + 1) * prompts_per_step]]
            )
            clock = time.perf_counter()
            seed = cfg.seed * RUN_SEED_STRIDE + step + rank() * RANK_SEED_STRIDE
            # (a process can be left without prompts in an epoch's last, short step)
            samples_P_G = (
                sampler.sample([p.tokens for p in prompts_P], trl.num_generations, _sampling(cfg, seed))
                if prompts_P
                else []
            )
            sample_seconds = time.perf_counter() - clock
            clock = time.perf_counter()
            flat = [c for group in _completions(engine, prompts_P, samples_P_G) for c in group]
            totals, per_function = _scored(reward_fns, weights, flat, f"step {step + 1}")
            group = trl.num_generations
            rewards_P_G = [totals[p * group : (p + 1) * group] for p in range(len(prompts_P))]
            everyone = _StepView.gather(rewards_P_G, per_function, [s for g in samples_P_G for s in g])
            check_finite({"sampled logprobs": everyone.sampled_logprob_sum}, step + 1, cfg)
            if trl.multi_objective_aggregation == "normalize_then_sum":
                scores = list(everyone.per_function.values())
                everyone_advantages = decoupled_advantages(scores, weights or [1.0] * len(scores), group)
            else:
                everyone_advantages = group_advantages(everyone.rewards_P_G, trl.reward_scaling)
            advantages_P_G = everyone_advantages[
                everyone.first_group : everyone.first_group + len(rewards_P_G)
            ]
            rollouts = Rollouts(prompts_P, samples_P_G, rewards_P_G, advantages_P_G)
            if completion_log is not None:
                completion_log.add(flat, per_function, [a for group in advantages_P_G for a in group])
            batch = _training_batch(rollouts, trl, engine)
            adam = adam_params(cfg, step, total)
            train_metrics: dict[str, float] = {}
            advantages = rollouts.advantages
            has_signal = any(advantages[i] != 0 for i in batch.chosen) or (
                trl.beta > 0 and bool(batch.datums)
            )
            has_signal = sum_across(float(has_signal))[0] > 0  # every process steps, or none
            for iteration in range(trl.num_iterations if has_signal else 0):
                out = engine.forward_backward(
                    batch.datums, trl.loss_fn, _loss_config(cfg), scored_from=batch.scored_from
                )
                stats = engine.optim_step(adam)
                sampler.policy_changed()
                if iteration == 0:
                    train_metrics = _train_metrics(out, rollouts, batch, cfg)
                    train_metrics.update(loss=out.loss_sum, grad_norm=stats["grad_norm"])
            if world_size() > 1:
                samples = rollouts.samples
                weight = sum(len(samples[i].tokens) for i in batch.chosen) if train_metrics else 0
                train_metrics = _combine_train_metrics(train_metrics, weight)
            values = {
                "lr": adam.learning_rate,
                "loss": 0.0,
                "grad_norm": 0.0,
                **train_metrics,
                **_reward_metrics(everyone),
                "time/sample": sample_seconds,
                "time/train": time.perf_counter() - clock,
            }
            tail.finish_step(values, StepPlace(epoch, index, per_epoch))
            if completion_log is not None and (tail.step % tail.log_every == 0 or tail.done):
                completion_log.flush(tail.step)
        if tail.done:
            break
    tail.close()
    return GrpoResult(steps=tail.step, last_eval=tail.last_eval)


def _training_batch(rollouts: Rollouts, trl: TrlConfig, engine: Engine) -> TrainingBatch:
    """The completions that train (not from a constant group / not truncated, when asked) as RL datums, with
    TRL's loss-type normalisation folded into their advantages and, when beta > 0, the base model's logprobs
    for the KL penalty."""
    samples, advantages = rollouts.samples, rollouts.advantages
    group = trl.num_generations
    keep = [
        not (trl.remove_constant_reward_groups and is_constant(rollouts.rewards_P_G[i // group]))
        and not (trl.mask_truncated_completions and sample.stop_reason != "stop")
        for i, sample in enumerate(samples)
    ]
    lengths = [len(s.tokens) if k else 0 for s, k in zip(samples, keep)]
    # The normalisers (completion and token counts) are those of every process's completions together.
    everyone = gather_objects(lengths)
    offset = sum(len(part) for part in everyone[: rank()])
    token_weights = loss_type_weights(
        [n for part in everyone for n in part], trl.loss_type, trl.max_completion_length
    )[offset : offset + len(lengths)]
    chosen = [i for i, k in enumerate(keep) if k and samples[i].tokens]
    datums = [
        rl_datum(
            rollouts.prompts_P[i // group].tokens,
            samples[i].tokens,
            samples[i].logprobs,
            advantages[i] * token_weights[i],
        )
        for i in chosen
    ]
    scored_from = [len(rollouts.prompts_P[i // group].tokens) - 1 for i in chosen]
    if trl.beta > 0 and datums:
        references = engine.forward(datums, reference=True, scored_from=scored_from)
        for i, datum, reference in zip(chosen, datums, references):
            completion = len(samples[i].tokens)
            datum.loss_fn_inputs["ref_logprobs"] = TensorData.from_torch(reference)
            datum.loss_fn_inputs["kl_weights"] = TensorData.coerce(
                [0.0] * (len(datum) - completion) + [trl.beta * token_weights[i]] * completion, "float32"
            )
    return TrainingBatch(chosen, datums, scored_from)


@dataclass
class _StepView:
    """What a step's advantages and reward metrics need from every process: all groups' rewards, each
    reward function's scores, completion lengths and stop reasons (in rank order), where this rank's
    groups start, and the sum of every sampled token's logprob (not finite once the policy's outputs are
    not, though a step without a training signal computes no loss that would show it)."""

    rewards_P_G: list[list[float]]
    per_function: dict[str, list[float]]
    lengths: list[int]
    stops: list[str]
    first_group: int
    sampled_logprob_sum: float

    @staticmethod
    def gather(
        rewards_P_G: list[list[float]], per_function: dict[str, list[float]], samples: list[SampledSequence]
    ) -> _StepView:
        mine = (
            rewards_P_G,
            per_function,
            [len(s.tokens) for s in samples],
            [s.stop_reason for s in samples],
            sum(sum(s.logprobs) for s in samples),
        )
        parts = gather_objects(mine)
        names = list(dict.fromkeys(name for part in parts for name in part[1]))
        return _StepView(
            rewards_P_G=[group for part in parts for group in part[0]],
            per_function={name: [x for part in parts for x in part[1].get(name, [])] for name in names},
            lengths=[n for part in parts for n in part[2]],
            stops=[reason for part in parts for reason in part[3]],
            first_group=sum(len(part[0]) for part in parts[: rank()]),
            sampled_logprob_sum=sum(part[4] for part in parts),
        )


def _combine_train_metrics(metrics: dict[str, float], weight: float) -> dict[str, float]:
    """One process's training metrics → the global step's: the loss sums over processes, the grad norm is
    already global, the rest are averages weighted by each process's trained completion tokens."""
    parts = gather_objects((metrics, weight))
    combined: dict[str, float] = {}
    keys = {key for part, _ in parts for key in part}
    for key in sorted(keys):
        if key == "loss":
            combined[key] = sum(part.get(key, 0.0) for part, _ in parts)
        elif key == "grad_norm":
            combined[key] = next(part[key] for part, _ in parts if key in part)
        else:
            weighted = [(part[key], w) for part, w in parts if key in part and w > 0]
            total = sum(w for _, w in weighted)
            if total:
                combined[key] = sum(value * w for value, w in weighted) / total
    return combined


def _reward_metrics(view: _StepView) -> dict[str, float]:
    flat = [r for group in view.rewards_P_G for r in group]
    zero_std = [is_constant(group) for group in view.rewards_P_G for _ in group]
    return {
        "reward": mean(flat),
        "reward_std": statistics.stdev(flat) if len(flat) > 1 else 0.0,
        "frac_reward_zero_std": mean([1.0 if z else 0.0 for z in zero_std]),
        **{f"rewards/{name}/mean": mean(scores) for name, scores in view.per_function.items()},
        "completions/mean_length": mean(view.lengths),
        "completions/clipped_ratio": mean([1.0 if reason == "length" else 0.0 for reason in view.stops]),
        "ac_tokens_per_turn": mean(view.lengths),
    }


def _train_metrics(
    out: ForwardBackwardOutput, rollouts: Rollouts, batch: TrainingBatch, cfg: Config
) -> dict[str, float]:
    trl = cfg.trl
    samples, advantages = rollouts.samples, rollouts.advantages
    sampled, trained, entropies, kls = [], [], [], []
    for datum, i, logprobs, entropy in zip(batch.datums, batch.chosen, out.logprobs, out.entropies):
        n = len(samples[i].tokens)
        sampled.append(torch.tensor(samples[i].logprobs))
        trained.append(logprobs[-n:])
        entropies.append(entropy[-n:])
        if trl.beta > 0:
            reference = datum.loss_fn_inputs["ref_logprobs"].to_torch()[-n:]
            kls.append(k3(logprobs[-n:], reference))
    config = _loss_config(cfg)
    metrics = sample_train_metrics(
        sampled,
        trained,
        [advantages[i] for i in batch.chosen],
        config.get("clip_low_threshold", 1 - trl.epsilon),
        config.get("clip_high_threshold", 1 + trl.epsilon),
    )
    metrics["entropy"] = torch.cat(entropies).mean().item() if entropies else 0.0
    if kls:
        metrics["kl"] = torch.cat(kls).mean().item()
    return metrics
