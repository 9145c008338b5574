"""Token-level loss functions over packed datums, with Tinker's names and formulas.

Each takes the policy's log-probabilities of the target tokens (all datums of a pass concatenated, `[N]`), the
matching concatenated loss inputs and a config dict, and returns a scalar SUM: normalisation is the caller's,
carried in `weights` / `advantages` (Tinker's convention), so passes, gradient accumulation and multi-process
sums need no special cases.

RL losses take `logprobs` (the sampler's, q) and `advantages`. Optionally `ref_logprobs` and `kl_weights` add
a KL penalty to a reference policy, k3 = exp(ref − lp) − (ref − lp) − 1 ≥ 0 per token, weighted per token (the
caller folds β and normalisation into `kl_weights`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor], dict], torch.Tensor]


def cross_entropy(logprobs_N: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    return -(logprobs_N * inputs["weights"]).sum()


def _log_ratio(logprobs_N: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    # Positions without advantage (prompt tokens) may carry any sampler logprob: keep their ratio at 1 so that
    # an extreme value there cannot turn into inf · 0 = NaN.
    active = inputs["advantages"] != 0
    return torch.where(active, logprobs_N - inputs["logprobs"], torch.zeros_like(logprobs_N))


def kl_penalty(logprobs_N: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    if "ref_logprobs" not in inputs:
        return logprobs_N.new_zeros(())
    weights = inputs["kl_weights"]
    delta = torch.where(weights != 0, inputs["ref_logprobs"] - logprobs_N, torch.zeros_like(logprobs_N))
    return (weights * (torch.exp(delta) - delta - 1)).sum()


def importance_sampling(
    logprobs_N: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict
) -> torch.Tensor:
    ratio = torch.exp(_log_ratio(logprobs_N, inputs))
    return -(ratio * inputs["advantages"]).sum() + kl_penalty(logprobs_N, inputs)


def ppo(logprobs_N: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    ratio = torch.exp(_log_ratio(logprobs_N, inputs))
    advantages = inputs["advantages"]
    objective = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    return -objective.sum() + kl_penalty(logprobs_N, inputs)


def cispo(logprobs_N: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    low, high = config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 4.0)
    ratio = torch.exp(_log_ratio(logprobs_N, inputs)).clamp(low, high).detach()
    return -(ratio * logprobs_N * inputs["advantages"]).sum() + kl_penalty(logprobs_N, inputs)


def dro(logprobs_N: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    beta = config.get("beta", 0.05)
    active = (inputs["advantages"] != 0).float()
    drift = (logprobs_N - inputs["logprobs"]) * active
    objective = logprobs_N * inputs["advantages"] - 0.5 * beta * drift**2
    return -objective.sum() + kl_penalty(logprobs_N, inputs)


LOSS_FNS: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
}

# The loss inputs each loss needs besides `target_tokens`, and the ones it reads when every datum has them.
_RL = ("logprobs", "advantages")
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    **{name: _RL for name in LOSS_FNS if name != "cross_entropy"},
}
OPTIONAL_INPUTS: tuple[str, ...] = ("ref_logprobs", "kl_weights")

# The loss_fn_config keys each loss reads (Tinker's names); anything else is a mistake worth reporting.
CONFIG_KEYS = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"),
    "dro": ("beta",),
}
