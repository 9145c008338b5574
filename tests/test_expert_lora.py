"""Axolotl's `lora_target_parameters`: LoRA on an MoE layer's stacked 3-D expert weights through PEFT's
`target_parameters`, beside LoRA on linear layers, over full-precision or quantized experts; and
`experts_implementation`. The adapter is PEFT's own format: PEFT loads it and `gym merge` folds it."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from config_files import parse_minimal, refusal_of, write_tiny_run
from peft import PeftModel
from safetensors.torch import load_file
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM

from hanzo_gym.cli import main
from hanzo_gym.engine.decoding import decoding
from hanzo_gym.errors import ModelError
from hanzo_gym.model.hub import load_causal_lm
from hanzo_gym.model.load_plan import BaseModelPlan, LoadPlan, Quantization
from hanzo_gym.model.lora import attach_lora
from hanzo_gym.rollout.policy_weights import merged_weights

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
EXPERT_PATHS = sorted(
    f"model.layers.{i}.mlp.experts.{name}" for i in (0, 1) for name in ("gate_up_proj", "down_proj")
)
TOKENS = torch.tensor([list(range(5, 40))])


def _with_random_b(peft_model, seed: int = 1) -> None:
    """A trained-looking adapter: every B (zero at initialisation) random, so each ΔW counts."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)


def _expert_lora(model, **keys):
    torch.manual_seed(0)  # the A matrices
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = attach_lora(
            model,
            r=4,
            alpha=8,
            dropout=0.0,
            target_modules=["q_proj"],
            base_model_name="tiny",
            target_parameters=EXPERTS,
            **keys,
        )
    _with_random_b(peft_model)
    return peft_model


def test_a_run_trains_the_experts_adapter_and_peft_and_gym_merge_read_it_as_trained(
    tmp_path, tiny_moe_base, chat_data
):
    config = write_tiny_run(
        tmp_path,
        tiny_moe_base,
        chat_data,
        lora_target_linear=None,
        lora_target_modules=["q_proj", "v_proj"],
        lora_target_parameters=EXPERTS,
        max_steps=3,
    )
    assert main(["train", str(config)]) == 0
    run = tmp_path / "run"
    saved = json.loads((run / "adapter_config.json").read_text())
    assert sorted(saved["target_parameters"]) == EXPERT_PATHS  # full paths: they match quantized experts too
    weights = load_file(run / "adapter_model.safetensors")
    expert_b = [key for key in weights if ".experts." in key and "lora_B" in key]
    assert len(expert_b) == 4  # two tensors in each of two layers (one nested wrapper per tensor)
    assert all(weights[key].abs().max() > 0 for key in expert_b)  # trained away from their zero start

    base = AutoModelForCausalLM.from_pretrained(tiny_moe_base, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(TOKENS).logits
        peft_model = PeftModel.from_pretrained(base, str(run))
        peft_logits = peft_model(TOKENS).logits
        with peft_model.disable_adapter():
            torch.testing.assert_close(peft_model(TOKENS).logits, base_logits)
        for key, value in peft_model.named_parameters():  # without the experts' ΔW: other logits
            if ".experts." in key and "lora_B" in key:
                value.zero_()
        without_experts = peft_model(TOKENS).logits
    assert (peft_logits - without_experts).abs().max() > 1e-4

    assert main(["merge", str(config)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(run / "merged", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged(TOKENS).logits, peft_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_over_quantized_experts_the_adapter_computes_what_it_does_over_their_dequantized_values(
    bits, tiny_moe_base
):
    """The quantized stacks are parametrized already, so LoRA's parametrization stacks on top of them; each
    forward must add it once and take it away again (PEFT 0.21.2 left one behind per forward)."""
    from torch.nn.utils import parametrize

    plan = BaseModelPlan.of(
        str(tiny_moe_base), torch.float32, quantization=Quantization(bits, moe_experts=True)
    )
    quantized = _expert_lora(load_causal_lm(plan))
    plain = _expert_lora(load_causal_lm(plan))
    for path in EXPERT_PATHS:  # the same quantized values, as plain tensors
        owner, _, name = path.rpartition(".")
        experts = plain.get_base_model().get_submodule(owner).get_base_layer()
        values = getattr(experts, name).detach().clone()
        parametrize.remove_parametrizations(experts, name, leave_parametrized=False)
        setattr(experts, name, torch.nn.Parameter(values, requires_grad=False))

    results = []
    for model in (quantized, plain):
        runs = []
        for _ in range(3):
            model.zero_grad()
            output = model(TOKENS, labels=TOKENS)
            output.loss.backward()
            runs.append(
                (output.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad})
            )
        for logits, grads in runs[1:]:  # a fourth ΔW would make the third forward differ from the first
            torch.testing.assert_close(logits, runs[0][0], rtol=0, atol=0)
        results.append(runs[0])
        stack = model.get_base_model().model.layers[0].mlp.experts.get_base_layer()
        depth = [
            len(stack.parametrizations[n]) if parametrize.is_parametrized(stack, n) else 0
            for n in ("gate_up_proj", "down_proj")
        ]
        assert depth == ([1, 1] if model is quantized else [0, 0])  # the quantization alone stays
    (q_logits, q_grads), (p_logits, p_grads) = results
    torch.testing.assert_close(q_logits, p_logits, rtol=1e-5, atol=1e-5)
    assert q_grads.keys() == p_grads.keys()
    assert sum(".experts." in name for name in q_grads) == 8  # A and B of four expert stacks
    for name, grad in q_grads.items():
        torch.testing.assert_close(grad, p_grads[name], rtol=1e-4, atol=1e-6)


def test_the_sampler_folds_the_experts_delta_and_puts_the_stacks_back(tiny_moe_base):
    model = _expert_lora(load_causal_lm(BaseModelPlan.of(str(tiny_moe_base), torch.float32)))
    stack = model.get_base_model().model.layers[0].mlp.experts.get_base_layer()
    originals = (stack.gate_up_proj, stack.down_proj)
    with torch.no_grad():
        adapter_branch = model(TOKENS).logits
        with decoding(model):
            assert stack.gate_up_proj is not originals[0]  # folded: W + ΔW in a temporary copy
            folded = model(TOKENS).logits
    torch.testing.assert_close(folded, adapter_branch, rtol=1e-5, atol=1e-5)
    assert (stack.gate_up_proj, stack.down_proj) == originals


def test_the_policy_weights_for_vllm_hold_the_experts_delta_as_peft_merges_it(tiny_moe_base):
    model = _expert_lora(load_causal_lm(BaseModelPlan.of(str(tiny_moe_base), torch.float32)))
    streamed = dict(merged_weights(model, torch.float32))
    reference = model.merge_and_unload().state_dict()
    assert streamed.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(streamed[key], value, rtol=1e-6, atol=1e-6)


def test_what_the_adapter_cannot_target():
    def attach(r, modules, parameters):
        return attach_lora(
            tiny_model("qwen3_moe"),
            r=r,
            alpha=8,
            dropout=0.0,
            target_modules=modules,
            base_model_name="tiny",
            target_parameters=parameters,
        )

    with pytest.raises(
        ModelError, match=r"`experts.up_proj` names no parameter of tiny \(its expert parameters "
    ):
        attach(4, ["q_proj"], ["experts.up_proj"])
    with pytest.raises(ModelError, match=r"lora_r \(LoRA rank\) 40 is larger .* a side of 32; set lora_r"):
        attach(40, [], EXPERTS)
    with pytest.raises(ModelError, match=r"input_layernorm.weight is a 1-D parameter"):
        attach(4, ["q_proj"], ["input_layernorm.weight"])


def test_the_config_keys():
    assert parse_minimal(lora_target_parameters="experts.down_proj").lora_target_parameters == [
        "experts.down_proj"
    ]
    # the experts alone are enough to adapt
    assert parse_minimal(lora_target_linear=None, lora_target_parameters=EXPERTS).lora_target_modules == []
    assert "set lora_dropout: 0" in refusal_of(lora_target_parameters=EXPERTS, lora_dropout=0.05)
    assert "vLLM loads LoRA adapters of linear layers" in refusal_of(
        lora_target_parameters=EXPERTS, rl="grpo", trl={"use_vllm": True, "vllm_mode": "server"}
    )
    assert "experts_implementation" in refusal_of(experts_implementation="triton")


@pytest.mark.parametrize(
    ("written", "runs"), [("eager", "eager"), ("batched_mm", "batched_mm"), ("scattermoe", None)]
)
def test_experts_implementation_reaches_transformers(
    written, runs, tmp_path, tiny_moe_base, chat_data, capsys
):
    from hanzo_gym.config import load_config
    from hanzo_gym.loops.train import build_engine

    extra = {"plugins": ["axolotl.integrations.kernels.KernelsPlugin"], "use_scattermoe": True}
    config = write_tiny_run(
        tmp_path, tiny_moe_base, chat_data, experts_implementation=written, **(extra if runs is None else {})
    )
    cfg = load_config(config)
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32))
    chosen = engine.model.get_base_model().config._experts_implementation
    assert chosen == (runs or "grouped_mm")  # transformers' default where torch has grouped_mm
    if runs is None:
        assert "experts_implementation: scattermoe is a CUDA kernel" in capsys.readouterr().out
