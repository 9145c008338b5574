"""Preference losses (DPO and its family) over per-sequence log-probabilities, with TRL 1.16's formulas and names.

Every function takes SUMMED log-probabilities: for each sequence `b`, the sum over its completion tokens (the prompt
excluded) of log π(y_t | x, y_<t), shape `[B]`. Where a loss averages per token (IPO, SimPO, ORPO, WPO weights) it
also takes the completion lengths `[B]` (token counts) and divides itself, so callers have one contract: sums plus
lengths. Chosen and rejected tensors of a pair share an index.

Each returns a `PreferenceLoss`: `loss`, a scalar that is the MEAN over the batch's pairs (or examples, for KTO),
as TRL reduces it, with gradients through the policy inputs only; and `metrics`, floats under TRL's names
(`rewards/chosen`, `rewards/rejected`, `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`,
plus loss-specific ones). A loop accumulating micro-batches weights each `loss` by its pair count.

Parity with TRL (tests/test_preference_losses.py holds it against TRL's own code):
- `dpo_loss`: `trl.trainer.dpo_trainer.DPOTrainer._compute_loss` (loss types `sigmoid`, `ipo`, `sft`; `use_weighting`).
- `simpo_loss`: `trl.experimental.cpo.CPOTrainer.cpo_loss` with `loss_type="simpo"` plus `get_batch_loss_metrics`.
- `orpo_loss`: `trl.experimental.orpo.ORPOTrainer.odds_ratio_loss` plus `get_batch_loss_metrics`.
- `kto_loss`: `trl.trainer.kto_trainer.KTOTrainer._compute_loss` (loss type `kto`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

# the metrics every pair loss reports (KTO: all but accuracies, and margins only with both sides present)
PAIR_METRIC_NAMES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


@dataclass(frozen=True)
class PreferenceLoss:
    loss: torch.Tensor  # scalar, mean over the batch
    metrics: dict[str, float]


def mean_token_nll(chosen_logps_B: torch.Tensor, chosen_lengths_B: torch.Tensor) -> torch.Tensor:
    """The chosen completions' negative log-likelihood averaged over all their tokens in the batch (one token-level
    mean, not a mean of per-sequence means), as TRL's cross-entropy over the chosen labels computes it."""
    return -chosen_logps_B.sum() / chosen_lengths_B.sum().clamp(min=1)


def log_sum_squared_probs(logits_NV: torch.Tensor) -> torch.Tensor:
    """log Σ_v π(v)² per position, `[N, V]` → `[N]`: the WPO alignment term (TRL's `log_sum_sq_probs`). Feed it a
    chunk of positions at a time to keep `[N, V]` small."""
    return torch.logsumexp(2 * logits_NV.float().log_softmax(-1), dim=-1)


def _pair_metrics(
    chosen_rewards_B: torch.Tensor,
    rejected_rewards_B: torch.Tensor,
    chosen_logps_B: torch.Tensor,
    rejected_logps_B: torch.Tensor,
) -> dict[str, float]:
    chosen_rewards_B, rejected_rewards_B = chosen_rewards_B.detach(), rejected_rewards_B.detach()
    return {
        "rewards/chosen": chosen_rewards_B.mean().item(),
        "rewards/rejected": rejected_rewards_B.mean().item(),
        "rewards/accuracies": (chosen_rewards_B > rejected_rewards_B).float().mean().item(),
        "rewards/margins": (chosen_rewards_B - rejected_rewards_B).mean().item(),
        "logps/chosen": chosen_logps_B.detach().mean().item(),
        "logps/rejected": rejected_logps_B.detach().mean().item(),
    }


def dpo_loss(
    policy_chosen_logps_B: torch.Tensor,
    policy_rejected_logps_B: torch.Tensor,
    ref_chosen_logps_B: torch.Tensor,
    ref_rejected_logps_B: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths_B: torch.Tensor | None = None,
    rejected_lengths_B: torch.Tensor | None = None,
    rpo_alpha: float | None = None,
    chosen_wpo_logps_B: torch.Tensor | None = None,
    rejected_wpo_logps_B: torch.Tensor | None = None,
) -> PreferenceLoss:
    """DPO over summed completion log-probs of the policy and the frozen reference, each `[B]`.

    - `sigmoid`: −log σ(β·Δ), Δ = (π_c − ref_c) − (π_r − ref_r). With `label_smoothing` ε > 0 it is conservative
      DPO (cDPO): −(1−ε)·log σ(β·Δ) − ε·log σ(−β·Δ). TRL 1.16's `sigmoid` ignores `label_smoothing` (its cDPO
      formula now lives only in `aot`, which on a single pair is exactly this); ε = 0 is TRL's `sigmoid`.
    - `ipo`: (Δ̄ − 1/(2β))², where Δ̄ divides each log-ratio by its completion length (TRL normalises so;
      needs `chosen_lengths_B` / `rejected_lengths_B`). `label_smoothing` does not apply.
    - `rpo_alpha`: adds α × the chosen NLL, one token-level mean over the batch's chosen completion tokens (needs
      `chosen_lengths_B`); TRL 1.16 spells it `loss_type=["sigmoid", "sft"], loss_weights=[1, α]`.
    - WPO (`dpo_use_weighting`): pass `chosen_wpo_logps_B` / `rejected_wpo_logps_B`, each the sum over completion
      tokens of log π(y_t) − log Σ_v π(v)² (see `log_sum_squared_probs`) and the lengths; every per-pair term, the
      NLL included, is multiplied by w_c·w_r with w = exp(that sum / length), held constant (no gradient).

    Rewards are β·(π − ref) per sequence; `logps/*` are means of the summed policy log-probs.
    """
    chosen_logratios_B = policy_chosen_logps_B - ref_chosen_logps_B
    rejected_logratios_B = policy_rejected_logps_B - ref_rejected_logps_B
    needs_lengths = loss_type == "ipo" or rpo_alpha is not None or chosen_wpo_logps_B is not None
    if needs_lengths and (chosen_lengths_B is None or rejected_lengths_B is None):
        raise ValueError("ipo, rpo_alpha and WPO weighting need chosen_lengths_B and rejected_lengths_B")
    if loss_type == "sigmoid":
        logits_B = beta * (chosen_logratios_B - rejected_logratios_B)
        pair_loss_B = -(1 - label_smoothing) * F.logsigmoid(logits_B) - label_smoothing * F.logsigmoid(
            -logits_B
        )
    elif loss_type == "ipo":
        chosen_average_B = chosen_logratios_B / chosen_lengths_B.clamp(min=1)
        rejected_average_B = rejected_logratios_B / rejected_lengths_B.clamp(min=1)
        pair_loss_B = (chosen_average_B - rejected_average_B - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type `{loss_type}`; choose sigmoid or ipo")

    weight_B = torch.ones_like(pair_loss_B)
    if (chosen_wpo_logps_B is None) != (rejected_wpo_logps_B is None):
        raise ValueError("WPO weighting needs both chosen_wpo_logps_B and rejected_wpo_logps_B")
    if chosen_wpo_logps_B is not None:
        chosen_weight_B = torch.exp(chosen_wpo_logps_B.detach() / chosen_lengths_B.clamp(min=1))
        rejected_weight_B = torch.exp(rejected_wpo_logps_B.detach() / rejected_lengths_B.clamp(min=1))
        weight_B = chosen_weight_B * rejected_weight_B
    loss = (pair_loss_B * weight_B).mean()
    metrics = _pair_metrics(
        beta * chosen_logratios_B, beta * rejected_logratios_B, policy_chosen_logps_B, policy_rejected_logps_B
    )
    if rpo_alpha is not None:
        nll = mean_token_nll(policy_chosen_logps_B, chosen_lengths_B)
        loss = loss + rpo_alpha * (nll * weight_B).mean()
        metrics["nll_loss"] = nll.item()
    return PreferenceLoss(loss, metrics)


def simpo_loss(
    policy_chosen_logps_B: torch.Tensor,
    policy_rejected_logps_B: torch.Tensor,
    chosen_lengths_B: torch.Tensor,
    rejected_lengths_B: torch.Tensor,
    *,
    beta: float = 0.1,
    simpo_gamma: float = 0.5,
    label_smoothing: float = 0.0,
    cpo_alpha: float = 0.0,
    chosen_nll: torch.Tensor | None = None,
) -> PreferenceLoss:
    """SimPO (TRL: CPO with `loss_type="simpo"`): no reference model, length-normalised log-probs.

    With a_c, a_r the average log-probs (summed / length): −(1−ε)·log σ(β·(a_c − a_r) − γ) − ε·log σ(−(…)),
    mean over pairs, plus `cpo_alpha` × `chosen_nll` (a scalar mean token NLL of the chosen completions, e.g.
    `mean_token_nll`; TRL takes it over the chosen completion tokens). `cpo_alpha` = 0 is SimPO as published; TRL's
    CPOConfig defaults it to 1.0. Rewards are β·a and `logps/*` are means of the AVERAGE log-probs, as TRL logs them.
    """
    chosen_average_B = policy_chosen_logps_B / chosen_lengths_B.clamp(min=1)
    rejected_average_B = policy_rejected_logps_B / rejected_lengths_B.clamp(min=1)
    logits_B = beta * (chosen_average_B - rejected_average_B - simpo_gamma / beta)
    pair_loss_B = -(1 - label_smoothing) * F.logsigmoid(logits_B) - label_smoothing * F.logsigmoid(-logits_B)
    loss = pair_loss_B.mean()
    metrics = _pair_metrics(
        beta * chosen_average_B, beta * rejected_average_B, chosen_average_B, rejected_average_B
    )
    if cpo_alpha != 0:
        if chosen_nll is None:
            raise ValueError("cpo_alpha > 0 needs chosen_nll")
        loss = loss + cpo_alpha * chosen_nll
        metrics["nll_loss"] = chosen_nll.item()
    return PreferenceLoss(loss, metrics)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − eˣ) for x < 0, branching at −ln 2 so neither side cancels catastrophically."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(
    policy_chosen_logps_B: torch.Tensor,
    policy_rejected_logps_B: torch.Tensor,
    chosen_lengths_B: torch.Tensor,
    rejected_lengths_B: torch.Tensor,
    chosen_nll: torch.Tensor,
    *,
    orpo_alpha: float = 0.1,
) -> PreferenceLoss:
    """ORPO: `chosen_nll` − λ·mean log σ(log-odds), no reference model; λ is `orpo_alpha` (TRL's ORPO `beta`).

    log-odds = (a_c − a_r) − (log(1 − e^{a_c}) − log(1 − e^{a_r})) on the average log-probs a = summed / length.
    `chosen_nll` is a scalar mean token NLL of the chosen sequences: TRL takes it over prompt AND completion tokens
    (the attention mask), the paper over the completion; the caller chooses by what it sums. Rewards are λ·a and
    `logps/*` means of the average log-probs, as TRL logs them; also `nll_loss`, `log_odds_ratio`, `log_odds_chosen`.
    """
    chosen_average_B = (policy_chosen_logps_B / chosen_lengths_B.clamp(min=1)).float()
    rejected_average_B = (policy_rejected_logps_B / rejected_lengths_B.clamp(min=1)).float()
    log_odds_B = (chosen_average_B - rejected_average_B) - (
        _log1mexp(chosen_average_B) - _log1mexp(rejected_average_B)
    )
    log_sigmoid_odds_B = F.logsigmoid(log_odds_B)
    loss = chosen_nll - (orpo_alpha * log_sigmoid_odds_B).mean()
    metrics = _pair_metrics(
        orpo_alpha * chosen_average_B, orpo_alpha * rejected_average_B, chosen_average_B, rejected_average_B
    )
    metrics["nll_loss"] = chosen_nll.item()
    metrics["log_odds_ratio"] = log_sigmoid_odds_B.mean().item()
    metrics["log_odds_chosen"] = log_odds_B.mean().item()
    return PreferenceLoss(loss, metrics)


def kto_loss(
    policy_logps_B: torch.Tensor,
    ref_logps_B: torch.Tensor,
    desirable_B: torch.Tensor,
    policy_kl_logps_B: torch.Tensor | None = None,
    ref_kl_logps_B: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> PreferenceLoss:
    """KTO over unpaired examples: summed completion log-probs of policy and reference `[B]`, `desirable_B` bool.

    z = mean over the batch of (policy − ref) summed log-probs on mismatched (prompt, completion) pairs (TRL's KL
    batch: each prompt with another example's completion), clamped at 0 and held constant; 0 when those are not given.
    Loss per example: desirable 1 − σ(β·(r − z)) × `desirable_weight`, undesirable 1 − σ(β·(z − r)) ×
    `undesirable_weight`, r = policy − ref; `loss` is their mean over all examples. Metrics as TRL's: `rewards/*` and
    `logps/*` are means within each side, `rewards/margins` only when both sides are present, plus `kl`. KTO has
    no pairs, so no `rewards/accuracies` (TRL logs none).
    """
    desirable_B = desirable_B.bool()
    if policy_kl_logps_B is not None and ref_kl_logps_B is not None:
        kl = (policy_kl_logps_B - ref_kl_logps_B).mean().detach().clamp(min=0)
    else:
        kl = policy_logps_B.new_zeros(())
    logratios_B = policy_logps_B - ref_logps_B
    example_loss_B = torch.where(
        desirable_B,
        desirable_weight * (1 - torch.sigmoid(beta * (logratios_B - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios_B))),
    )
    rewards_B = beta * logratios_B.detach()
    metrics = {"kl": kl.item()}
    for side, mask_B in (("chosen", desirable_B), ("rejected", ~desirable_B)):
        if mask_B.any():
            metrics[f"rewards/{side}"] = rewards_B[mask_B].mean().item()
            metrics[f"logps/{side}"] = policy_logps_B.detach()[mask_B].mean().item()
    if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return PreferenceLoss(example_loss_B.mean(), metrics)
