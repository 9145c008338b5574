"""fp16: Axolotl's float16 mixed precision, with HF's dynamic loss scaling (torch's GradScaler and its defaults).

Scaling the loss by a power of two and dividing the gradients back is exact in floating point, so a run with loss
scaling and one without take bit-identical steps until a gradient overflows; an overflowing step is skipped and
the scale halved, as GradScaler does, and the scale survives a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from config_files import parse_minimal, refusal_of, write_tiny_run
from tiny_models import tiny_lora_engine

from hanzo_gym.cli import main
from hanzo_gym.config.feature import feature_notes
from hanzo_gym.engine.state_files import load_engine_state, save_engine_state
from hanzo_gym.model import hub
from hanzo_gym.records import AdamParams, Datum, ModelInput

ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)


def _datums() -> list[Datum]:
    tokens = [[1, 5, 9, 12, 7, 3, 8], [2, 6, 4, 11, 10]]
    return [
        Datum(ModelInput.from_ints(row[:-1]), {"target_tokens": row[1:], "weights": [1.0] * (len(row) - 1)})
        for row in tokens
    ]


def _engine(loss_scaling: bool):
    engine = tiny_lora_engine(torch.float32)
    engine._loss_scaling = loss_scaling
    engine.reset_optimizer()
    return engine


def test_fp16_resolves_as_axolotl_resolves_it():
    assert parse_minimal(fp16=True).fp16 is True  # bf16: auto gives way to it
    both = parse_minimal(fp16=True, bf16=True)
    assert (both.fp16, both.bf16) == (False, True)
    assert feature_notes(both) == [
        "fp16: true with bf16: true: the run computes in bf16, as Axolotl resolves the two (fp16 turned off)"
    ]
    assert "fp16: true computes in float16, and bfloat16: true" in refusal_of(fp16=True, bfloat16=True)
    precision = hub.choose_precision("auto", fp16=True)
    assert (precision.dtype, precision.name) == (torch.float16, "fp16")
    assert precision.describe().startswith("precision: fp16 (fp16: true, with dynamic loss scaling")


def test_loss_scaling_takes_the_same_steps_bit_for_bit():
    plain, scaled = _engine(False), _engine(True)
    assert plain.loss_scaler is None and scaled.loss_scaler.get_scale() == 65536.0  # GradScaler's default
    for _ in range(3):
        out_plain = plain.forward_backward(_datums())
        out_scaled = scaled.forward_backward(_datums())
        assert (
            out_scaled.loss_sum == out_plain.loss_sum
        )  # the loss reported is the loss, not its scaled value
        stats_plain, stats_scaled = plain.optim_step(ADAM), scaled.optim_step(ADAM)
        assert stats_scaled["grad_norm"] == stats_plain["grad_norm"] > 0
        assert stats_scaled["loss_scale"] == 65536.0  # grows only after 2000 good steps
    for a, b in zip(plain.trainable, scaled.trainable, strict=True):
        assert torch.equal(a, b)


def test_an_overflowing_step_is_skipped_and_the_scale_halved_as_gradscaler_does():
    engine = _engine(True)
    engine.forward_backward(_datums())
    engine.optim_step(ADAM)  # one good step, so that AdamW has a step count to keep
    before = [p.detach().clone() for p in engine.trainable]
    steps_before = [engine.optimizer.state[p]["step"].item() for p in engine.trainable]
    engine.forward_backward(_datums())
    engine.trainable[0].grad.view(-1)[0] = float("inf")  # what an fp16 overflow leaves
    stats = engine.optim_step(ADAM)
    assert (
        stats["grad_norm"] == 0.0
        and stats["loss_scale"] == 65536.0 * torch.amp.GradScaler("cpu").get_backoff_factor()
    )
    assert all(torch.equal(a, b) for a, b in zip(before, engine.trainable, strict=True))
    assert [engine.optimizer.state[p]["step"].item() for p in engine.trainable] == steps_before
    assert all(p.grad is None for p in engine.trainable)


def test_the_loss_scale_survives_a_checkpoint(tmp_path):
    engine = _engine(True)
    engine.forward_backward(_datums())
    engine.trainable[0].grad.view(-1)[0] = float("nan")
    engine.optim_step(ADAM)
    save_engine_state(engine, tmp_path)
    fresh = _engine(True)
    assert fresh.loss_scaler.get_scale() == 65536.0
    load_engine_state(fresh, tmp_path)
    assert fresh.loss_scaler.state_dict() == engine.loss_scaler.state_dict()
    assert fresh.loss_scaler.get_scale() == 32768.0


def test_a_float16_plan_builds_an_engine_that_scales_its_loss(tmp_path, tiny_base, chat_data):
    from hanzo_gym.config import load_config
    from hanzo_gym.loops.train import build_engine
    from hanzo_gym.model.load_plan import LoadPlan

    cfg = load_config(write_tiny_run(tmp_path, tiny_base, chat_data, fp16=True))
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float16))
    frozen = {p.dtype for p in engine.model.parameters() if not p.requires_grad}
    assert frozen == {torch.float16} and {p.dtype for p in engine.trainable} == {torch.float32}
    assert engine.autocast_dtype == torch.float16 and engine.loss_scaler is not None
    fp32 = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32))
    assert fp32.loss_scaler is None


@pytest.mark.parametrize("adapter", ["lora", None])
def test_an_fp16_run_trains_in_float16_with_loss_scaling(tmp_path, tiny_base, chat_data, capsys, adapter):
    keys = {"adapter": adapter} if adapter else {
        "adapter": None, "lora_r": None, "lora_alpha": None, "lora_dropout": None, "lora_target_linear": None
    }  # fmt: skip
    config = write_tiny_run(
        tmp_path, tiny_base, chat_data, fp16=True, max_steps=2, learning_rate=1e-3, **keys
    )
    assert main(["train", str(config)]) == 0
    out = capsys.readouterr().out
    assert "precision: fp16 (fp16: true, with dynamic loss scaling" in out
    if adapter is None:
        assert "fp32 weights and AdamW state, fp16 matmuls (autocast)" in out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses)


def test_a_cpu_without_native_fp16_is_told_that_its_fp16_matmuls_are_emulated(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_fp16": False, "amx_fp16": False})
    assert (
        "fp16 matmuls are emulated and many times slower than fp32"
        in hub.choose_precision("auto", True).reason
    )
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_fp16": False, "amx_fp16": True})
    assert hub.choose_precision("auto", True).reason == "fp16: true, with dynamic loss scaling"
