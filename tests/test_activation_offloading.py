"""Axolotl's `activation_offloading` and `gradient_checkpointing: offload`: saved activations in host
memory until the backward pass, with the gradients of a run that keeps them on the device."""

from __future__ import annotations

import pytest
import torch
from config_files import parse_minimal, refusal_of
from tiny_models import VOCAB, tiny_model

from hanzo_gym.engine import Engine
from hanzo_gym.engine import engine as engine_module
from hanzo_gym.engine.offload import HostOffload
from hanzo_gym.model.load_plan import activation_memory_plan
from hanzo_gym.model.lora import attach_lora
from hanzo_gym.records import Datum, ModelInput


def test_offloaded_activations_give_the_same_gradients_and_are_counted():
    torch.manual_seed(0)
    weight = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(256, 64)

    def loss():
        return ((x @ weight).tanh() @ weight).square().sum()

    (expected,) = torch.autograd.grad(loss(), weight)
    hooks = HostOffload(pin_memory=False, min_bytes=1024)
    with hooks:
        value = loss()
    (got,) = torch.autograd.grad(value, weight)
    assert hooks.offloaded >= 2  # the activations x @ weight and its tanh; the weight itself stays
    # The hooks only move tensors, but the CPU's GEMM may block a product differently from one call to the next
    # (a process's first products once differed in the last bit): fp32's tolerance, not bit equality.
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    small = HostOffload(pin_memory=False, min_bytes=1 << 30)
    with small:  # nothing that big: nothing moves
        loss()
    assert small.offloaded == 0


def _datums(seed: int) -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (24, 40)]
    return [
        Datum(ModelInput.from_ints(t[:-1]), {"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)})
        for t in tokens
    ]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_an_offloading_engine_trains_to_the_same_gradients(checkpointing, monkeypatch):
    contexts: list[HostOffload] = []

    class Recorded(HostOffload):
        def __init__(self, **kwargs):
            super().__init__(min_bytes=1024, **kwargs)
            contexts.append(self)

    monkeypatch.setattr(engine_module, "HostOffload", Recorded)
    grads = []
    for offloading in (False, True):
        model = attach_lora(
            tiny_model("llama", hidden_size=64),
            r=4,
            alpha=8.0,
            dropout=0.0,
            target_modules="all-linear",
            base_model_name="tiny",
        )
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        engine = Engine(model, activation_offloading=offloading)
        engine.forward_backward(_datums(1))
        grads.append([p.grad.clone() for p in engine.trainable])
    assert contexts and sum(c.offloaded for c in contexts) > 0  # with checkpointing: the layers' inputs
    for offloaded, kept in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(offloaded, kept, rtol=1e-6, atol=1e-7)
    engine.forward(_datums(2))  # scoring saves nothing for a backward pass: no offloading context
    assert len(contexts) == 1


def test_axolotls_spellings_and_what_each_run_offloads():
    older = parse_minimal(gradient_checkpointing="offload")
    assert (older.gradient_checkpointing, older.activation_offloading) == (True, True)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    lora = parse_minimal(gradient_checkpointing=True, activation_offloading=True)
    assert activation_memory_plan(lora, cuda) == (True, False, None)  # offloading instead of recomputing
    offloading, checkpointing, note = activation_memory_plan(lora, cpu)
    assert (offloading, checkpointing) == (False, True) and "host memory already" in note
    hidden = parse_minimal(gradient_checkpointing=True, activation_offloading="hidden_states")
    assert activation_memory_plan(hidden, cuda) == (True, True, None)
    full = parse_minimal(
        gradient_checkpointing=True, activation_offloading="legacy", adapter=None, lora_target_linear=None
    )
    assert activation_memory_plan(full, cuda)[:2] == (True, True)
    assert activation_memory_plan(parse_minimal(gradient_checkpointing=True), cuda) == (False, True, None)


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({"activation_offloading": True}, "activation_offloading needs `gradient_checkpointing: true`"),
        ({"gradient_checkpointing": True, "activation_offloading": "disk"}, "`activation_offloading: disk`"),
        (
            {"gradient_checkpointing": "offload_disk"},
            "`gradient_checkpointing: offload_disk` (activations kept",
        ),
    ],
)
def test_offloading_without_checkpointing_or_to_disk_is_refused(keys, expected):
    assert expected in refusal_of(**keys)


def test_gym_train_with_axolotls_offload_spelling_trains_and_says_what_moves(
    tmp_path, tiny_base, chat_data, capsys
):
    from config_files import write_tiny_run

    from hanzo_gym.cli import main

    config = write_tiny_run(tmp_path, tiny_base, chat_data, gradient_checkpointing="offload", max_steps=2)
    assert main(["train", str(config)]) == 0
    assert (
        "activation_offloading: on cpu the activations are in host memory already" in capsys.readouterr().out
    )
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()
