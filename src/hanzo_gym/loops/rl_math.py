"""GRPO's arithmetic, free of models: group-relative advantages, TRL's loss-type normalisations as per-token
weights, and the datums and metrics of one RL step."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import torch

from hanzo_gym.records import Datum, ModelInput

STD_EPS = 1e-4  # TRL's: keeps a near-constant group from exploding its advantages


def group_advantages(rewards_P_G: Sequence[Sequence[float]], scaling: str) -> list[list[float]]:
    """A_i = r_i − mean(group); divided by the group's (or the whole batch's) unbiased std + 1e-4, or not."""
    batch_std = (
        statistics.stdev([r for g in rewards_P_G for r in g]) if sum(map(len, rewards_P_G)) > 1 else 0.0
    )
    advantages = []
    for group in rewards_P_G:
        mean = sum(group) / len(group)
        scale = 1.0
        if scaling == "group":
            scale = (statistics.stdev(group) if len(group) > 1 else 0.0) + STD_EPS
        elif scaling == "batch":
            scale = batch_std + STD_EPS
        advantages.append([(r - mean) / scale for r in group])
    return advantages


def decoupled_advantages(
    scores_F_N: Sequence[Sequence[float]], weights: Sequence[float], group: int
) -> list[list[float]]:
    """GDPO (TRL's normalize_then_sum): each reward function's scores normalized within each group (mean 0,
    divided by the group's unbiased std + 1e-4), summed with the weights, then the sums normalized over the
    whole batch the same way. `scores_F_N`: each function's scores of all N completions, in group order."""
    count = len(scores_F_N[0]) if scores_F_N else 0
    totals = [0.0] * count
    for weight, scores in zip(weights, scores_F_N, strict=True):
        for start in range(0, count, group):
            part = scores[start : start + group]
            mean = sum(part) / len(part)
            scale = (statistics.stdev(part) if len(part) > 1 else 0.0) + STD_EPS
            for offset, score in enumerate(part):
                totals[start + offset] += weight * (score - mean) / scale
    mean = sum(totals) / count if count else 0.0
    scale = (statistics.stdev(totals) if count > 1 else 0.0) + STD_EPS
    advantages = [(total - mean) / scale for total in totals]
    return [advantages[start : start + group] for start in range(0, count, group)]


def is_constant(group: Sequence[float]) -> bool:
    return max(group) - min(group) < 1e-9


def loss_type_weights(lengths: Sequence[int], loss_type: str, max_completion_length: int) -> list[float]:
    """The per-token weight of each completion's tokens that turns a token-level SUM into TRL's aggregation:
    grpo = mean over sequences of each sequence's token mean; bnpo and dapo = mean over all tokens of the
    batch; dr_grpo = sum divided by (completions × max_completion_length)."""
    count = len(lengths)
    if loss_type == "grpo":
        return [1.0 / (n * count) if n else 0.0 for n in lengths]
    if loss_type in ("bnpo", "dapo"):
        total = sum(lengths)
        return [1.0 / total if total else 0.0 for _ in lengths]
    if loss_type == "dr_grpo":
        return [1.0 / (count * max_completion_length) for _ in lengths]
    raise ValueError(f"unknown loss_type {loss_type!r}")


def rl_datum(
    prompt: Sequence[int],
    completion: Sequence[int],
    sampled_logprobs: Sequence[float],
    advantage_per_token: float,
) -> Datum:
    """Prompt + completion as one next-token datum: completion positions carry the sampler's logprobs and the
    (normalised) advantage; prompt positions carry advantage 0 and so no gradient."""
    tokens = [*prompt, *completion]
    prompt_targets = len(prompt) - 1
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * prompt_targets + list(sampled_logprobs),
            "advantages": [0.0] * prompt_targets + [advantage_per_token] * len(completion),
        },
    )


def sample_train_metrics(
    sampled: Sequence[torch.Tensor],
    trained: Sequence[torch.Tensor],
    advantages: Sequence[float],
    low: float,
    high: float,
) -> dict[str, float]:
    """Tinker's kl_sample_train estimators and TRL's clip ratios over completion tokens.

    `sampled[i]` / `trained[i]` are completion i's sampler and learner logprobs; `advantages[i]` its advantage.
    """
    diffs, low_hits, high_hits, region_hits, count = [], 0, 0, 0, 0
    for q, lp, advantage in zip(sampled, trained, advantages):
        if len(q) == 0:
            continue
        diff = q - lp
        diffs.append(diff)
        ratio = torch.exp(lp - q)
        below, above = ratio < low, ratio > high
        low_hits += int((below & (advantage < 0)).sum()) if advantage < 0 else 0
        high_hits += int((above & (advantage > 0)).sum()) if advantage > 0 else 0
        region_hits += int((below | above).sum())
        count += len(q)
    if not diffs:
        return {}
    all_diffs = torch.cat(diffs)
    return {
        "optim/kl_sample_train_v1": all_diffs.mean().item(),
        "optim/kl_sample_train_v2": 0.5 * (all_diffs**2).mean().item(),
        "clip_ratio/low_mean": low_hits / count,
        "clip_ratio/high_mean": high_hits / count,
        "clip_ratio/region_mean": region_hits / count,
    }


def k3(policy: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    delta = reference - policy
    return torch.exp(delta) - delta - 1


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan
