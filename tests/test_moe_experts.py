"""Axolotl's `quantize_moe_experts`: an MoE model's stacked expert weights quantized as they load, to
NF4 beside QLoRA's 4-bit linear layers or to int8 rows beside an 8-bit base; the frozen experts compute what
bitsandbytes' own round trip of them computes."""

from __future__ import annotations

import bitsandbytes.functional as bnb_functional
import pytest
import torch
from config_files import refusal_of, write_tiny_run
from tiny_models import tiny_model

from hanzo_gym.cli import main
from hanzo_gym.errors import ModelError
from hanzo_gym.model.hub import load_causal_lm
from hanzo_gym.model.load_plan import BaseModelPlan, LoadPlan, Quantization

EXPERT_TENSORS = [
    f"model.layers.{i}.mlp.experts.{name}" for i in (0, 1) for name in ("gate_up_proj", "down_proj")
]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory, word_tokenizer):
    """A tiny random Qwen3-MoE with the word tokenizer, saved as transformers saves it (one tensor per expert)."""
    model = tiny_model("qwen3_moe", vocab_size=len(word_tokenizer), eos_token_id=word_tokenizer.eos_token_id)
    directory = tmp_path_factory.mktemp("tiny-moe")
    model.save_pretrained(directory)
    word_tokenizer.save_pretrained(directory)
    return directory, model


def test_the_experts_load_as_nf4_of_their_saved_values(tiny_moe):
    directory, saved = tiny_moe
    model = load_causal_lm(
        BaseModelPlan.of(str(directory), torch.float32, quantization=Quantization(bits=4, moe_experts=True))
    )
    for name in EXPERT_TENSORS:
        path, _, tensor = name.rpartition(".")
        experts = model.get_submodule(path)
        assert experts.parametrizations[tensor].original.dtype == torch.uint8  # packed 4-bit, two per byte
        original = saved.get_parameter(name).detach()
        packed, state = bnb_functional.quantize_4bit(original, quant_type="nf4", compress_statistics=True)
        torch.testing.assert_close(
            getattr(experts, tensor), bnb_functional.dequantize_4bit(packed, state), rtol=0, atol=0
        )
    plain = load_causal_lm(BaseModelPlan.of(str(directory), torch.float32, quantization=Quantization(bits=4)))
    assert plain.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32  # what the key changes


def test_beside_an_8bit_base_the_experts_are_int8_rows_dequantized_once_per_forward(tiny_moe, monkeypatch):
    from hanzo_gym.model import moe_quant

    directory, saved = tiny_moe
    model = load_causal_lm(
        BaseModelPlan.of(str(directory), torch.float32, quantization=Quantization(bits=8, moe_experts=True))
    )
    for name in EXPERT_TENSORS:
        path, _, tensor = name.rpartition(".")
        experts = model.get_submodule(path)
        assert experts.parametrizations[tensor].original.dtype == torch.int8
        original = saved.get_parameter(name).detach()
        rows = original.reshape(-1, original.shape[-1]).to(torch.float16)
        int8, stats, _ = bnb_functional.int8_vectorwise_quant(rows)
        expected = bnb_functional.int8_vectorwise_dequant(int8, stats).reshape(original.shape)
        torch.testing.assert_close(getattr(experts, tensor), expected, rtol=0, atol=0)
    calls = []
    forward = moe_quant.Int8Rows.forward
    monkeypatch.setattr(moe_quant.Int8Rows, "forward", lambda self, q: calls.append(1) or forward(self, q))
    with torch.no_grad():
        model(torch.tensor([list(range(3, 40))]))
    assert len(calls) == len(EXPERT_TENSORS)  # each expert tensor once, not once per expert read


def test_a_dense_model_has_no_experts_to_quantize(tiny_dir):
    with pytest.raises(
        ModelError, match=r"quantize_moe_experts: base_model .* has no stacked MoE expert weights"
    ):
        load_causal_lm(
            BaseModelPlan.of(tiny_dir, torch.float32, quantization=Quantization(bits=4, moe_experts=True))
        )


@pytest.mark.parametrize(
    "keys",
    [{"adapter": "qlora", "load_in_4bit": True}, {"adapter": "lora", "load_in_8bit": True}],
    ids=["nf4", "int8"],
)
def test_lora_with_quantized_experts_trains_and_its_gradients_are_the_dequantized_models(
    keys, tiny_moe, tmp_path, chat_data
):
    from torch.nn.utils import parametrize

    from hanzo_gym.config import load_config
    from hanzo_gym.loops.train import build_engine
    from hanzo_gym.records import Datum, ModelInput

    directory, _ = tiny_moe
    keys = {**keys, "quantize_moe_experts": True, "lora_target_linear": None}
    config = write_tiny_run(
        tmp_path, directory, chat_data, lora_target_modules=["q_proj", "v_proj"], **keys, max_steps=2
    )
    assert main(["train", str(config)]) == 0
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()

    tokens = list(range(5, 30))
    datum = Datum(ModelInput.from_ints(tokens[:-1]), {"target_tokens": tokens[1:], "weights": [1.0] * 24})
    grads = []
    for materialize in (False, True):
        cfg = load_config(config)
        engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32))
        if materialize:  # the same NF4 values as plain fp32 tensors: what the parametrization must compute
            for name in EXPERT_TENSORS:
                path, _, tensor = name.rpartition(".")
                experts = engine.model.get_base_model().get_submodule(path)
                values = getattr(experts, tensor).detach().clone()
                parametrize.remove_parametrizations(experts, tensor, leave_parametrized=False)
                setattr(experts, tensor, torch.nn.Parameter(values, requires_grad=False))
        engine.forward_backward([datum])
        grads.append([p.grad.clone() for p in engine.trainable])
    for quantized, dequantized in zip(*grads, strict=True):
        torch.testing.assert_close(quantized, dequantized, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({"quantize_moe_experts": True}, "quantize_moe_experts quantizes a 4- or 8-bit base's experts too"),
        (
            {"quantize_moe_experts": True, "load_in_4bit": True, "adapter": "qlora"},
            "lora_target_linear does not go with quantize_moe_experts",
        ),
    ],
)
def test_what_quantize_moe_experts_cannot_go_with(keys, expected):
    assert expected in refusal_of(**keys)
