"""Axolotl's LoRA+ (`loraplus_lr_ratio`): the steps equal those of PEFT's own `create_loraplus_optimizer` over
torch's AdamW, as Axolotl builds it (no weight decay in any group), under a schedule that scales every group."""

from __future__ import annotations

import copy

import pytest
import torch
from config_files import parse_minimal, refusal_of, write_tiny_run
from peft.optimizers import create_loraplus_optimizer
from tiny_models import tiny_model

from hanzo_gym.cli import main
from hanzo_gym.config.feature import feature_notes
from hanzo_gym.engine import Engine
from hanzo_gym.engine.optimizers import plain_adamw, with_loraplus
from hanzo_gym.model.lora import attach_lora
from hanzo_gym.records import AdamParams, Datum, ModelInput

ROWS = [[3, 9, 14, 2, 7, 30, 5], [11, 4, 8, 21, 6]]


def _lora():
    torch.manual_seed(0)
    return attach_lora(
        tiny_model("llama"), r=4, alpha=8, dropout=0.0, target_modules="all-linear", base_model_name="t"
    )


def test_steps_equal_peft_loraplus_optimizer_as_axolotl_calls_it():
    ours_model = _lora()
    peft_model = copy.deepcopy(ours_model)
    engine = Engine(ours_model, optimizer_factory=with_loraplus(plain_adamw, ours_model, 16.0))
    peft_optimizer = create_loraplus_optimizer(
        peft_model,
        torch.optim.AdamW,
        lr=1e-3,
        loraplus_lr_ratio=16.0,
        loraplus_lr_embedding=1e-6,
        betas=(0.9, 0.999),
        eps=1e-8,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(peft_optimizer, lambda step: 1.0 / (step + 1))
    datums = [
        Datum(ModelInput.from_ints(r[:-1]), {"target_tokens": r[1:], "weights": [0.1] * (len(r) - 1)})
        for r in ROWS
    ]
    trained = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    for step in range(3):
        engine.forward_backward(datums, "cross_entropy")
        grads = {n: p.grad.clone() for n, p in ours_model.named_parameters() if p.requires_grad}
        # weight_decay set: LoRA+ as Axolotl builds it decays nothing, PEFT's groups neither
        adam = AdamParams(learning_rate=1e-3 / (step + 1), beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
        engine.optim_step(adam)
        for name, param in peft_model.named_parameters():
            if param.requires_grad:
                param.grad = grads[name]
        peft_optimizer.step()
        scheduler.step()
        peft_optimizer.zero_grad()
        ours = dict(ours_model.named_parameters())
        for name in trained:
            torch.testing.assert_close(
                ours[name], dict(peft_model.named_parameters())[name], atol=1e-7, rtol=1e-6
            )
    # two groups, as PEFT's: the B matrices at 16 times the rate
    assert {g["lr_scale"] for g in engine.optimizer.param_groups} == {1.0, 16.0}


def test_the_keys_load_with_their_notes_and_refusals():
    cfg = parse_minimal(loraplus_lr_ratio=16, loraplus_lr_embedding=1e-6, weight_decay=0.01)
    notes = feature_notes(cfg)
    assert any("LoRA+ trains without weight decay" in n for n in notes)
    assert any("loraplus_lr_embedding changes nothing here" in n for n in notes)
    assert "needs `adapter: lora` or qlora" in refusal_of(loraplus_lr_ratio=16, adapter=None, lora_target_linear=None)
    alone = parse_minimal(loraplus_lr_embedding=1e-6)  # Axolotl reads it only beside the ratio
    assert any("loraplus_lr_embedding changes nothing here" in n for n in feature_notes(alone))


@pytest.mark.slow  # a whole `gym train` run or two: CI's slow tier
def test_gym_train_with_loraplus_trains_and_resumes(tmp_path, tiny_base, chat_data):
    config = write_tiny_run(tmp_path, tiny_base, chat_data, max_steps=4, save_steps=2, loraplus_lr_ratio=8)
    assert main(["train", str(config)]) == 0
    resumed = write_tiny_run(
        tmp_path,
        tiny_base,
        chat_data,
        max_steps=4,
        save_steps=2,
        loraplus_lr_ratio=8,
        output_dir=str(tmp_path / "again"),
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"),
    )
    assert main(["train", str(resumed)]) == 0
    first = (tmp_path / "run" / "adapter_model.safetensors").read_bytes()
    assert (tmp_path / "again" / "adapter_model.safetensors").read_bytes() == first
