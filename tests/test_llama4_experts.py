"""Axolotl's `llama4_linearized_experts`: Llama 4's routed experts as linear layers compute what transformers'
stacked experts compute, load from either checkpoint layout (quantized as transformers quantizes linear layers),
train with LoRA, and `gym merge` writes them stacked again."""

from __future__ import annotations

import pytest
import torch
from config_files import refusal_of, write_tiny_run
from peft import PeftModel
from transformers import AutoModelForCausalLM

from hanzo_gym.cli import main
from hanzo_gym.errors import ModelError
from hanzo_gym.model.hub import load_causal_lm
from hanzo_gym.model.llama4_experts import (
    LinearizedLlama4Experts,
    delinearized,
    linearize_experts,
    loading_linearized_experts,
)
from hanzo_gym.model.load_plan import BaseModelPlan, Quantization

TOKENS = torch.tensor([[9707, 11, 1879, 0, 42, 77, 5, 300, 12, 6]])


def _experts(model) -> list:
    return [m for m in model.modules() if isinstance(m, LinearizedLlama4Experts)]


def test_linear_experts_compute_what_the_stacked_experts_compute_and_join_back(tiny_llama4_base):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama4_base)
    stacked_state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        expected = model(TOKENS).logits
    assert linearize_experts(model) == 2
    assert len(_experts(model)) == 2 and not any("gate_up_proj" in k for k in model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS).logits, expected, rtol=1e-5, atol=1e-6)
    assert delinearized(model) == 2
    state = model.state_dict()
    assert sorted(state) == sorted(stacked_state)
    for key, value in stacked_state.items():
        assert torch.equal(state[key], value), key


def test_the_linear_layers_are_axolotls_own_layout(tiny_llama4_base):
    """Axolotl's patched expert module (installed --no-deps) takes our layers' weights under the same names and
    computes the same output: its linearized checkpoints load into ours and ours into it."""
    from axolotl.monkeypatch.models.llama4.modeling import Llama4TextExperts as AxolotlExperts
    from tiny_models import tiny_config

    config = tiny_config("llama4")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama4_base)
    linearize_experts(model)
    ours = _experts(model)[0]
    theirs = AxolotlExperts(config)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    rows = torch.randn(config.num_local_experts * 3, config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(rows), theirs(rows), rtol=0, atol=0)


def _linearized_checkpoint(tiny_llama4_base, directory):
    """Axolotl's layout: the same model saved with its experts as linear layers."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama4_base)
    linearize_experts(model)
    model.save_pretrained(directory)
    (directory / "tokenizer.json").write_bytes((tiny_llama4_base / "tokenizer.json").read_bytes())
    (directory / "tokenizer_config.json").write_bytes(
        (tiny_llama4_base / "tokenizer_config.json").read_bytes()
    )
    return directory


def test_both_layouts_load_to_the_same_4bit_layers_transformers_makes(tiny_llama4_base, tmp_path):
    """From Meta's stacked layout the experts are split and quantized after the load; from Axolotl's linearized
    layout transformers' own bitsandbytes loading quantizes them: the packed weights and scales are equal."""
    from bitsandbytes.nn import Linear4bit

    linearized = _linearized_checkpoint(tiny_llama4_base, tmp_path / "linearized")
    from_stacked = load_causal_lm(
        BaseModelPlan.of(
            str(tiny_llama4_base),
            torch.float32,
            quantization=Quantization(bits=4),
            linearized_llama4_experts=True,
        )
    )
    from_linear = load_causal_lm(
        BaseModelPlan.of(
            str(linearized), torch.float32, quantization=Quantization(bits=4), linearized_llama4_experts=True
        )
    )
    for ours, theirs in zip(_experts(from_stacked), _experts(from_linear), strict=True):
        for a, b in zip(
            [*ours.gate_projs, *ours.up_projs, *ours.down_projs],
            [*theirs.gate_projs, *theirs.up_projs, *theirs.down_projs],
        ):
            assert isinstance(a, Linear4bit) and isinstance(b, Linear4bit)
            assert torch.equal(a.weight.data, b.weight.data)
            state_a, state_b = a.weight.quant_state, b.weight.quant_state
            assert (
                (state_a.quant_type, state_a.nested) == (state_b.quant_type, state_b.nested) == ("nf4", True)
            )
            assert torch.equal(state_a.absmax, state_b.absmax)
    with torch.no_grad():
        torch.testing.assert_close(from_stacked(TOKENS).logits, from_linear(TOKENS).logits, rtol=0, atol=0)


def test_an_8bit_base_holds_the_linear_experts_as_transformers_makes_them(tiny_llama4_base, tmp_path):
    from bitsandbytes.nn import Linear8bitLt

    linearized = _linearized_checkpoint(tiny_llama4_base, tmp_path / "linearized")
    models = [
        load_causal_lm(
            BaseModelPlan.of(
                str(path), torch.float32, quantization=Quantization(bits=8), linearized_llama4_experts=True
            )
        )
        for path in (tiny_llama4_base, linearized)
    ]
    ours, theirs = (_experts(model)[0] for model in models)
    for a, b in zip([*ours.gate_projs, *ours.down_projs], [*theirs.gate_projs, *theirs.down_projs]):
        assert isinstance(a, Linear8bitLt) and isinstance(b, Linear8bitLt)
        assert a.weight.dtype == torch.int8 and torch.equal(a.weight.data, b.weight.data)
        assert torch.equal(a.weight.SCB, b.weight.SCB)
    with torch.no_grad():
        torch.testing.assert_close(models[0](TOKENS).logits, models[1](TOKENS).logits, rtol=0, atol=0)


def test_a_model_that_is_not_llama4_is_refused(tiny_base):
    with pytest.raises(ModelError, match="not a Llama 4 model"):
        load_causal_lm(BaseModelPlan.of(str(tiny_base), torch.float32, linearized_llama4_experts=True))


def test_the_context_restores_transformers_layer():
    from tiny_models import tiny_config
    from transformers.models.llama4 import modeling_llama4

    config = tiny_config("llama4")
    with loading_linearized_experts():
        assert isinstance(modeling_llama4.Llama4TextMoe(config).experts, LinearizedLlama4Experts)
    assert isinstance(modeling_llama4.Llama4TextMoe(config).experts, modeling_llama4.Llama4TextExperts)


def test_lora_on_the_expert_layers_trains_and_merges_to_the_stacked_layout(
    tmp_path, tiny_llama4_base, chat_data
):
    path = write_tiny_run(
        tmp_path,
        tiny_llama4_base,
        chat_data,
        llama4_linearized_experts=True,
        lora_target_linear=False,
        # what Axolotl's example names (the routed experts commented out there): a LoRA pair per expert too
        lora_target_modules=r".*(q_proj|shared_expert\.gate_proj|experts\.gate_projs\.[0-9]+)$",
        gradient_accumulation_steps=1,
        max_steps=3,
        learning_rate=2e-2,
    )
    assert main(["train", str(path)]) == 0
    assert main(["merge", str(path), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")  # transformers' own stacked class
    assert "model.layers.0.feed_forward.experts.gate_up_proj" in merged.state_dict()
    trained = AutoModelForCausalLM.from_pretrained(tiny_llama4_base)
    linearize_experts(trained)
    trained = PeftModel.from_pretrained(trained, str(tmp_path / "run"))
    assert any("experts.gate_projs.3" in k for k in trained.state_dict() if "lora_B" in k)
    with torch.no_grad():
        expected = trained(TOKENS).logits
        before = AutoModelForCausalLM.from_pretrained(tiny_llama4_base)(TOKENS).logits
        assert not torch.allclose(expected, before, atol=1e-3)  # the adapter did something
        torch.testing.assert_close(merged(TOKENS).logits, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "overrides, refusal",
    [
        (
            {
                "adapter": "qlora",
                "load_in_4bit": True,
                "quantize_moe_experts": True,
                "lora_target_linear": False,  # which Axolotl refuses with quantize_moe_experts
                "lora_target_modules": ["q_proj"],
            },
            "remove quantize_moe_experts",
        ),
        ({"rl": "grpo", "trl": {"use_vllm": True}}, "vLLM loads Llama 4's experts stacked"),
    ],
)
def test_what_it_cannot_go_with_is_refused(overrides, refusal):
    assert refusal in refusal_of(llama4_linearized_experts=True, **overrides)
