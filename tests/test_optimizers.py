"""The `optimizer` / `adam_*` keys: which implementation each name runs on this device, that the engine's
step is torch's AdamW with the configured betas and eps, and that an 8-bit state resumes exactly."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from hanzo_gym.engine import Engine
from hanzo_gym.engine.optimizers import build_optimizer_factory, is_bitsandbytes
from hanzo_gym.engine.state_files import load_engine_state, save_engine_state
from hanzo_gym.errors import GymError
from hanzo_gym.model.lora import attach_lora
from hanzo_gym.records import AdamParams, Datum, ModelInput

CPU = torch.device("cpu")
ADAM = AdamParams(learning_rate=2e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.05, grad_clip_norm=0.0)
SEQUENCES = [[3, 8, 9, 12, 13, 14, 15], [3, 20, 21, 22, 23]]


def _engine(optimizer: str = "adamw_torch", seed: int = 0) -> Engine:
    """A tiny model whose LoRA matrices (64 × 64) are big enough for bitsandbytes' 8-bit moments."""
    torch.manual_seed(0)
    base = tiny_model("llama", hidden_size=64, intermediate_size=128)
    torch.manual_seed(seed)
    model = attach_lora(base, r=64, alpha=64, dropout=0.0, target_modules=["q_proj"], base_model_name="tiny")
    factory, _ = build_optimizer_factory(optimizer, CPU)
    return Engine(model, optimizer_factory=factory)


def _step(engine: Engine) -> None:
    datums = [
        Datum(ModelInput.from_ints(s[:-1]), {"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)})
        for s in SEQUENCES
    ]
    engine.forward_backward(datums)
    engine.optim_step(ADAM)


def test_engine_step_is_torch_adamw_with_the_given_betas_and_eps():
    engine = _engine()
    reference_params = [p.detach().clone().requires_grad_(True) for p in engine.trainable]
    reference = torch.optim.AdamW(
        reference_params, lr=ADAM.learning_rate, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05
    )
    for _ in range(3):
        datums = [
            Datum(ModelInput.from_ints(s[:-1]), {"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)})
            for s in SEQUENCES
        ]
        engine.forward_backward(datums)
        for mine, theirs in zip(engine.trainable, reference_params):
            theirs.grad = mine.grad.detach().clone()
        engine.optim_step(ADAM)
        reference.step()
    for mine, theirs in zip(engine.trainable, reference_params):
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)
    assert engine.optimizer.param_groups[0]["betas"] == (0.8, 0.95)


def test_fused_adamw_runs_where_torch_has_it_and_falls_back_with_one_line():
    factory, note = build_optimizer_factory("adamw_torch_fused", CPU)  # torch ≥ 2.4 fuses AdamW on CPU
    assert note is None and factory([torch.nn.Parameter(torch.zeros(3))]).param_groups[0]["fused"]
    factory, note = build_optimizer_factory("adamw_torch_fused", torch.device("meta"))
    assert "no fused AdamW on meta" in note and "plain AdamW" in note
    assert not factory([torch.nn.Parameter(torch.zeros(3))]).param_groups[0]["fused"]


def test_fused_and_plain_adamw_take_the_same_steps():
    plain, fused = _engine("adamw_torch"), _engine("adamw_torch_fused")
    for _ in range(2):
        _step(plain)
        _step(fused)
    # The fused kernel sums in another order; each step moves a weight by about lr, so lr / 1000 is tight.
    for a, b in zip(plain.trainable, fused.trainable):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=ADAM.learning_rate * 1e-3)


@pytest.mark.parametrize("name", ["adamw_torch_4bit", "adamw_torch_8bit"])
def test_torchaos_low_bit_names_run_plain_adamw_and_say_so(name):
    factory, note = build_optimizer_factory(name, CPU)
    assert type(factory([torch.nn.Parameter(torch.zeros(3))])) is torch.optim.AdamW
    assert note.startswith(f"optimizer {name}: torchao's") and "the same update" in note
    plain, low_bit = _engine("adamw_torch"), _engine(name)
    for _ in range(2):
        _step(plain)
        _step(low_bit)
    for a, b in zip(plain.trainable, low_bit.trainable):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0)


def test_bitsandbytes_names_on_cpu():
    # bitsandbytes 0.50 runs its 8-bit AdamW on CPU but pages state only on CUDA.
    factory, note = build_optimizer_factory("adamw_bnb_8bit", CPU)
    assert note is None and is_bitsandbytes(factory([torch.nn.Parameter(torch.zeros(4096))]))
    factory, note = build_optimizer_factory("paged_adamw_8bit", CPU)
    assert "pages optimizer state only on CUDA" in note
    optimizer = factory([torch.nn.Parameter(torch.zeros(4096))])
    assert is_bitsandbytes(optimizer) and not optimizer.is_paged
    factory, note = build_optimizer_factory("paged_adamw_32bit", CPU)
    assert (
        "plain torch AdamW" in note
        and type(factory([torch.nn.Parameter(torch.zeros(3))])) is torch.optim.AdamW
    )


def test_8bit_adamw_follows_adamw_within_quantisation_error():
    plain, eight_bit = _engine("adamw_torch"), _engine("adamw_8bit")
    start = [p.detach().clone() for p in plain.trainable]
    for _ in range(3):
        _step(plain)
        _step(eight_bit)
    assert eight_bit.optimizer.state[eight_bit.trainable[0]]["state1"].dtype == torch.uint8  # really 8-bit
    for before, a, b in zip(start, plain.trainable, eight_bit.trainable):
        moved = (a.detach() - before).norm()
        assert moved > 0 and (a.detach() - b.detach()).norm() < 0.05 * moved


def test_8bit_state_resumes_exactly_through_the_checkpoint_files(tmp_path):
    original = _engine("adamw_bnb_8bit")
    for _ in range(2):
        _step(original)
    save_engine_state(original, tmp_path)
    resumed = _engine("adamw_bnb_8bit", seed=3)  # another initial adapter: all it continues with is the files
    load_engine_state(resumed, tmp_path)
    _step(original)
    _step(resumed)
    for a, b in zip(original.trainable, resumed.trainable):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0)


def test_a_state_of_another_optimizer_kind_is_refused(tmp_path):
    original = _engine("adamw_bnb_8bit")
    _step(original)
    save_engine_state(original, tmp_path)
    with pytest.raises(GymError, match="written by bitsandbytes' AdamW, but this run uses torch's AdamW"):
        load_engine_state(_engine("adamw_torch"), tmp_path)
