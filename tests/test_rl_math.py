import math

import pytest
import torch

from hanzo_gym.loops.rl_math import (
    group_advantages,
    is_constant,
    loss_type_weights,
    rl_datum,
    sample_train_metrics,
)


def test_group_advantages_are_centred_and_scaled_by_the_group_std():
    [a] = group_advantages([[0.0, 10.0]], "group")
    assert a == pytest.approx([-5 / (math.sqrt(50) + 1e-4), 5 / (math.sqrt(50) + 1e-4)])
    assert a[0] == pytest.approx(-0.7071, abs=1e-4)
    groups = group_advantages([[1.0, 2.0, 3.0, 6.0], [0.0, 0.0, 1.0, 1.0]], "group")
    for group in groups:
        assert sum(group) == pytest.approx(0.0, abs=1e-9)


def test_constant_groups_get_zero_advantage_and_scaling_modes_differ():
    assert group_advantages([[1.0, 1.0, 1.0]], "group") == [[0.0, 0.0, 0.0]]
    rewards = [[0.0, 1.0], [0.0, 4.0]]
    none = group_advantages(rewards, "none")
    assert none == [[-0.5, 0.5], [-2.0, 2.0]]
    batch = group_advantages(rewards, "batch")
    batch_std = torch.tensor([0.0, 1.0, 0.0, 4.0]).std().item()
    assert batch[1][1] == pytest.approx(2.0 / (batch_std + 1e-4))
    assert is_constant([2.0, 2.0]) and not is_constant([2.0, 2.5])


def test_loss_type_weights_reproduce_trl_aggregations():
    lengths = [2, 4, 0]
    # grpo: each sequence's token mean, averaged over sequences
    assert loss_type_weights(lengths, "grpo", 8) == pytest.approx([1 / 6, 1 / 12, 0.0])
    # bnpo / dapo: one mean over all tokens of the batch
    assert loss_type_weights(lengths, "dapo", 8) == pytest.approx([1 / 6] * 3)
    assert loss_type_weights(lengths, "bnpo", 8) == loss_type_weights(lengths, "dapo", 8)
    # dr_grpo: sum over tokens / (sequences × max_completion_length)
    assert loss_type_weights(lengths, "dr_grpo", 8) == pytest.approx([1 / 24] * 3)
    per_token_loss = [[1.0, 3.0], [2.0, 2.0, 2.0, 6.0], []]
    for kind, expected in (("grpo", (2.0 + 3.0 + 0.0) / 3), ("dapo", 16.0 / 6), ("dr_grpo", 16.0 / 24)):
        w = loss_type_weights(lengths, kind, 8)
        assert sum(w[i] * sum(tokens) for i, tokens in enumerate(per_token_loss)) == pytest.approx(expected)


def test_rl_datum_aligns_completion_inputs_with_targets():
    datum = rl_datum([10, 11, 12], [20, 21], [-0.5, -0.25], 0.3)
    assert datum.model_input.to_ints() == [10, 11, 12, 20]
    inputs = {key: value.tolist() for key, value in datum.loss_fn_inputs.items()}
    assert inputs["target_tokens"] == [11, 12, 20, 21]
    assert inputs["logprobs"] == [0.0, 0.0, -0.5, -0.25]
    assert inputs["advantages"] == pytest.approx([0.0, 0.0, 0.3, 0.3])


def test_sample_train_metrics():
    q = [torch.tensor([-1.0, -2.0]), torch.tensor([-1.0])]
    lp = [torch.tensor([-1.0, -1.0]), torch.tensor([-2.0])]  # ratios e^0, e^1 (high), e^-1 (low)
    metrics = sample_train_metrics(q, lp, [1.0, -1.0], 0.8, 1.2)
    assert metrics["optim/kl_sample_train_v1"] == pytest.approx((0 - 1 + 1) / 3)
    assert metrics["optim/kl_sample_train_v2"] == pytest.approx(0.5 * (0 + 1 + 1) / 3)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(1 / 3)
    assert metrics["clip_ratio/low_mean"] == pytest.approx(1 / 3)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(2 / 3)


def _trl_normalize_then_sum(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, group: int
) -> torch.Tensor:
    """TRL 1.16's GRPOTrainer advantages under multi_objective_aggregation="normalize_then_sum" (its lines, with
    its own nanstd), for completions [N, functions] in group order."""
    from trl.trainer.utils import nanstd

    grouped = rewards_per_func.view(-1, group, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True) if group > 1 else torch.zeros_like(mean_k)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
    rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    return (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)


@pytest.mark.parametrize("group", [2, 4])
def test_decoupled_advantages_equal_trls_normalize_then_sum(group):
    from hanzo_gym.loops.rl_math import decoupled_advantages

    generator = torch.Generator().manual_seed(group)
    scores = torch.randint(0, 3, (3 * group, 2), generator=generator).double()  # ties: constant groups too
    scores[:, 1] *= 0.5
    weights = torch.tensor([1.0, 2.0], dtype=torch.float64)
    ours = decoupled_advantages(scores.T.tolist(), weights.tolist(), group)
    assert [len(g) for g in ours] == [group] * 3
    expected = _trl_normalize_then_sum(scores, weights, group).tolist()
    # TRL's nanstd takes its Bessel factor in float32 (count / (count − 1) of integer tensors): 1e-7 apart
    assert [a for g in ours for a in g] == pytest.approx(expected, rel=1e-6)
