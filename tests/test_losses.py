"""Each RL loss against a hand-written per-token formula, values and gradients."""

import math

import pytest
import torch

from hanzo_gym.engine.losses import LOSS_FNS

LP = [-0.5, -1.2, -0.1, -2.0, -0.7]
Q = [-0.6, -1.0, -0.1, -1.0, -900.0]  # the last position is a prompt token with a wild sampler value
A = [1.5, -0.5, 2.0, 0.8, 0.0]


def _per_token_reference(name, lp, q, a, config):
    """Python floats, one token at a time, straight from the formulas."""
    total = 0.0
    for lp_t, q_t, a_t in zip(lp, q, a):
        if a_t == 0:
            continue
        ratio = math.exp(lp_t - q_t)
        if name == "importance_sampling":
            total += -ratio * a_t
        elif name == "ppo":
            clipped = min(
                max(ratio, config.get("clip_low_threshold", 0.8)), config.get("clip_high_threshold", 1.2)
            )
            total += -min(ratio * a_t, clipped * a_t)
        elif name == "cispo":
            clipped = min(
                max(ratio, config.get("clip_low_threshold", 0.0)), config.get("clip_high_threshold", 4.0)
            )
            total += -clipped * lp_t * a_t
        elif name == "dro":
            total += -(lp_t * a_t - 0.5 * config.get("beta", 0.05) * (lp_t - q_t) ** 2)
    return total


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("importance_sampling", {}),
        ("ppo", {}),
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
        ("cispo", {}),
        ("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        ("dro", {"beta": 0.3}),
    ],
)
def test_loss_value_and_gradient_match_the_formula(name, config):
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    inputs = {
        "logprobs": torch.tensor(Q, dtype=torch.float64),
        "advantages": torch.tensor(A, dtype=torch.float64),
    }
    loss = LOSS_FNS[name](lp, inputs, config)
    assert loss.item() == pytest.approx(_per_token_reference(name, LP, Q, A, config), rel=1e-9)
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    eps = 1e-6
    for t in range(len(LP)):  # central differences of the reference, except cispo's stop-gradient ratio
        up, down = list(LP), list(LP)
        up[t] += eps
        down[t] -= eps
        if name == "cispo" and A[t] == 0:
            expected = 0.0
        elif name == "cispo":
            ratio = min(
                max(math.exp(LP[t] - Q[t]), config.get("clip_low_threshold", 0.0)),
                config.get("clip_high_threshold", 4.0),
            )
            expected = -ratio * A[t]
        else:
            expected = (
                _per_token_reference(name, up, Q, A, config) - _per_token_reference(name, down, Q, A, config)
            ) / (2 * eps)
        assert lp.grad[t].item() == pytest.approx(expected, rel=1e-5, abs=1e-8), t


def test_importance_sampling_at_ratio_one_is_reinforce():
    lp = torch.tensor(LP, requires_grad=True)
    inputs = {"logprobs": torch.tensor(LP), "advantages": torch.tensor(A)}
    LOSS_FNS["importance_sampling"](lp, inputs, {}).backward()
    torch.testing.assert_close(lp.grad, -torch.tensor(A))


def test_kl_penalty_is_k3_against_the_reference_and_zero_at_match():
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-0.4, -1.5, -0.1, -2.5, -3.0], dtype=torch.float64)
    kl_weights = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.0], dtype=torch.float64)
    zero_adv = torch.zeros(5, dtype=torch.float64)
    inputs = {"logprobs": lp.detach(), "advantages": zero_adv, "ref_logprobs": ref, "kl_weights": kl_weights}
    loss = LOSS_FNS["importance_sampling"](lp, inputs, {})
    expected = sum(
        w * (math.exp(r - p) - (r - p) - 1) for p, r, w in zip(LP, ref.tolist(), kl_weights.tolist())
    )
    assert loss.item() == pytest.approx(expected, rel=1e-9) and loss.item() > 0
    same = dict(inputs, ref_logprobs=lp.detach())
    assert LOSS_FNS["ppo"](lp, same, {}).item() == pytest.approx(0.0, abs=1e-12)
