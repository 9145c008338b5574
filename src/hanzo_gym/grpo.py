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

from hanzo_gym.checkpoint import TrainerPosition, adapter_fingerprint, starting_position, write_checkpoint
from hanzo_gym.config import Config
from hanzo_gym.data.batching import epoch_order
from hanzo_gym.data.prompts import Prompt
from hanzo_gym.distributed import gather_objects, rank, shard, sum_across, world_size
from hanzo_gym.engine import Engine
from hanzo_gym.rewards import Completion, RewardFunction, parse_reward, score_completions
from hanzo_gym.rl_math import (
    group_advantages,
    is_constant,
    k3,
    loss_type_weights,
    mean,
    rl_datum,
    sample_train_metrics,
)
from hanzo_gym.rundir import Progress, RunDir
from hanzo_gym.sampling import SamplingParams
from hanzo_gym.schedule import adam_params

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


def _completions(engine: Engine, prompts: list[Prompt], groups: list) -> list[list[Completion]]:
    decode = engine.tokenizer.decode
    return [
        [
            Completion(
                prompt=prompt.text,
                text=decode(s.tokens, skip_special_tokens=True),
                answer=prompt.answer,
                num_tokens=len(s.tokens),
            )
            for s in group
        ]
        for prompt, group in zip(prompts, groups)
    ]


def evaluate_rewards(
    engine: Engine, prompts: list[Prompt], reward_fns: list[RewardFunction], cfg: Config
) -> dict[str, float]:
    """Greedy completions of held-out prompts: mean reward, and accuracy = the share whose reward is > 0."""
    rewards: list[float] = []
    mine = shard(prompts)
    for start in range(0, len(mine), 64):
        batch = mine[start : start + 64]
        groups = engine.sample([p.tokens for p in batch], 1, _sampling(cfg, cfg.seed, greedy=True))
        flat = [c for group in _completions(engine, batch, groups) for c in group]
        totals, _ = score_completions(reward_fns, cfg.trl.reward_weights or None, flat)
        rewards += totals
    rewards = [r for part in gather_objects(rewards) for r in part]
    return {"eval/reward": mean(rewards), "eval/accuracy": mean([1.0 if r > 0 else 0.0 for r in rewards])}


def train_grpo(
    engine: Engine,
    cfg: Config,
    train: list[Prompt],
    val: list[Prompt],
    run: RunDir,
    resume_from: Path | None = None,
) -> GrpoResult:
    trl = cfg.trl
    reward_fns = [parse_reward(spec) for spec in trl.reward_funcs]
    weights = trl.reward_weights or None
    prompts_per_step = cfg.micro_batch_size * world_size()
    per_epoch = -(-len(train) // prompts_per_step)
    total = (
        cfg.num_epochs * per_epoch
        if cfg.max_steps is None
        else min(cfg.max_steps, cfg.num_epochs * per_epoch)
    )
    plan = {
        **adapter_fingerprint(cfg),
        "train_prompts": len(train),
        "seed": cfg.seed,
        "micro_batch_size": prompts_per_step,
    }
    position = starting_position(engine, run, plan, resume_from)
    progress = Progress(total, position.step)
    say = progress.say
    started = time.perf_counter()
    step = position.step
    last_eval = None

    def run_eval() -> dict[str, float]:
        result = evaluate_rewards(engine, val, reward_fns, cfg)
        run.log({"step": step, **result, "elapsed_s": time.perf_counter() - started})
        say(
            f"eval step {step} eval/reward {result['eval/reward']:.4f} eval/accuracy {result['eval/accuracy']:.3f}"
        )
        return result

    if val and step == 0:
        last_eval = run_eval()

    for epoch in range(position.epoch, cfg.num_epochs):
        order = epoch_order(len(train), cfg.seed, epoch)
        first = position.window if epoch == position.epoch else 0
        for index in range(first, per_epoch):
            if step >= total:
                break
            prompts = shard(
                [train[i] for i in order[index * prompts_per_step : (index + 1) * prompts_per_step]]
            )
            clock = time.perf_counter()
            seed = cfg.seed * 1_000_003 + step + rank() * RANK_SEED_STRIDE
            # (a process can be left without prompts in an epoch's last, short step)
            groups = (
                engine.sample([p.tokens for p in prompts], trl.num_generations, _sampling(cfg, seed))
                if prompts
                else []
            )
            sample_seconds = time.perf_counter() - clock
            clock = time.perf_counter()
            completions = _completions(engine, prompts, groups)
            flat = [c for group in completions for c in group]
            totals, per_function = score_completions(reward_fns, weights, flat)
            rewards_G = [
                totals[g * trl.num_generations : (g + 1) * trl.num_generations] for g in range(len(prompts))
            ]
            samples = [s for group in groups for s in group]
            everyone = _StepView.gather(rewards_G, per_function, samples)
            advantages_G = group_advantages(everyone.rewards_G, trl.reward_scaling)[
                everyone.first_group : everyone.first_group + len(rewards_G)
            ]

            advantages = [a for group in advantages_G for a in group]
            chosen, datums = _training_datums(prompts, samples, advantages, rewards_G, trl, engine)
            adam = adam_params(cfg, step, total)
            lr = adam.learning_rate
            train_metrics: dict[str, float] = {}
            has_signal = any(advantages[i] != 0 for i in chosen) or (trl.beta > 0 and bool(datums))
            has_signal = sum_across(float(has_signal))[0] > 0  # every process steps, or none
            for iteration in range(trl.num_iterations if has_signal else 0):
                out = engine.forward_backward(datums, trl.loss_fn, _loss_config(cfg))
                stats = engine.optim_step(adam)
                if iteration == 0:
                    train_metrics = _train_metrics(out, datums, chosen, samples, advantages, trl, cfg)
                    train_metrics.update(loss=out.loss_sum, grad_norm=stats["grad_norm"])
            if world_size() > 1:
                weight = sum(len(samples[i].tokens) for i in chosen) if train_metrics else 0
                train_metrics = _combine_train_metrics(train_metrics, weight)
            step += 1
            progress.advance()
            train_seconds = time.perf_counter() - clock

            row = {
                "step": step,
                "epoch": round(epoch + (index + 1) / per_epoch, 4),
                "lr": lr,
                "loss": 0.0,
                "grad_norm": 0.0,
                **train_metrics,
                **_reward_metrics(
                    everyone.rewards_G, everyone.per_function, everyone.lengths, everyone.stops
                ),
                "time/sample": sample_seconds,
                "time/train": train_seconds,
                "elapsed_s": time.perf_counter() - started,
            }
            if step % cfg.logging_steps == 0 or step == total:
                run.log(row)
                say(
                    f"step {step}/{total} reward {row['reward']:.4f} reward_std {row['reward_std']:.4f} "
                    f"length {row['completions/mean_length']:.1f} loss {row['loss']:.4f} "
                    f"sample {sample_seconds:.1f}s train {train_seconds:.1f}s"
                )
            end_of_epoch = index == per_epoch - 1
            if val and ((cfg.eval_steps and step % cfg.eval_steps == 0) or end_of_epoch or step == total):
                last_eval = run_eval()
            if cfg.save_steps and step % cfg.save_steps == 0:
                following = (epoch, index + 1) if not end_of_epoch else (epoch + 1, 0)
                mark = TrainerPosition(step=step, epoch=following[0], window=following[1], plan=plan)
                path = run.save_checkpoint(
                    step, row["epoch"], lambda d, mark=mark: write_checkpoint(d, engine, mark)
                )
                say(f"saved {path}")
        if step >= total:
            break
    progress.close()
    return GrpoResult(steps=step, last_eval=last_eval)


def _training_datums(prompts, samples, advantages, rewards_G, trl, engine) -> tuple[list[int], list]:
    """The completions that train (not from a constant group / not truncated, when asked) as RL datums, with
    TRL's loss-type normalisation folded into their advantages and, when beta > 0, the base model's logprobs
    for the KL penalty. Returns the indices of those completions and their datums."""
    group = trl.num_generations
    keep = [
        not (trl.remove_constant_reward_groups and is_constant(rewards_G[i // group]))
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
            prompts[i // group].tokens,
            samples[i].tokens,
            samples[i].logprobs,
            advantages[i] * token_weights[i],
        )
        for i in chosen
    ]
    if trl.beta > 0 and datums:
        for i, datum, reference in zip(chosen, datums, engine.forward(datums, reference=True)):
            completion = len(samples[i].tokens)
            datum.loss_fn_inputs["ref_logprobs"] = reference
            datum.loss_fn_inputs["kl_weights"] = [0.0] * (len(datum) - completion) + [
                trl.beta * token_weights[i]
            ] * completion
    return chosen, datums


@dataclass
class _StepView:
    """What a step's advantages and reward metrics need from every process: all groups' rewards, each
    reward function's scores, completion lengths and stop reasons (in rank order), and where this rank's
    groups start."""

    rewards_G: list[list[float]]
    per_function: dict[str, list[float]]
    lengths: list[int]
    stops: list[str]
    first_group: int

    @staticmethod
    def gather(
        rewards_G: list[list[float]], per_function: dict[str, list[float]], samples: list
    ) -> _StepView:
        mine = (rewards_G, per_function, [len(s.tokens) for s in samples], [s.stop_reason for s in samples])
        parts = gather_objects(mine)
        names = list(dict.fromkeys(name for part in parts for name in part[1]))
        return _StepView(
            rewards_G=[group for part in parts for group in part[0]],
            per_function={name: [x for part in parts for x in part[1].get(name, [])] for name in names},
            lengths=[n for part in parts for n in part[2]],
            stops=[reason for part in parts for reason in part[3]],
            first_group=sum(len(part[0]) for part in parts[: rank()]),
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


def _reward_metrics(
    rewards_G: list[list[float]], per_function: dict[str, list[float]], lengths: list[int], stops: list[str]
) -> dict:
    flat = [r for group in rewards_G for r in group]
    zero_std = [is_constant(group) for group in rewards_G for _ in group]
    return {
        "reward": mean(flat),
        "reward_std": statistics.stdev(flat) if len(flat) > 1 else 0.0,
        "frac_reward_zero_std": mean([1.0 if z else 0.0 for z in zero_std]),
        **{f"rewards/{name}/mean": mean(scores) for name, scores in per_function.items()},
        "completions/mean_length": mean(lengths),
        "completions/clipped_ratio": mean([1.0 if reason == "length" else 0.0 for reason in stops]),
        "ac_tokens_per_turn": mean(lengths),
    }


def _train_metrics(out, datums, chosen, samples, advantages, trl, cfg) -> dict[str, float]:
    sampled, trained, entropies, kls = [], [], [], []
    for datum, i, logprobs, entropy in zip(datums, chosen, out.logprobs, out.entropies):
        n = len(samples[i].tokens)
        sampled.append(torch.tensor(samples[i].logprobs))
        trained.append(logprobs[-n:])
        entropies.append(entropy[-n:])
        if trl.beta > 0:
            reference = torch.as_tensor(datum.loss_fn_inputs["ref_logprobs"])[-n:]
            kls.append(k3(logprobs[-n:], reference))
    config = _loss_config(cfg)
    metrics = sample_train_metrics(
        sampled,
        trained,
        [advantages[i] for i in chosen],
        config.get("clip_low_threshold", 1 - trl.epsilon),
        config.get("clip_high_threshold", 1 + trl.epsilon),
    )
    metrics["entropy"] = torch.cat(entropies).mean().item() if entropies else 0.0
    if kls:
        metrics["kl"] = torch.cat(kls).mean().item()
    return metrics
