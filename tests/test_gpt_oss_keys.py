"""The keys of Axolotl's gpt-oss examples: `model_quantization_config: Mxfp4Config` with `dequantize:
true` (the MXFP4 experts decoded as they load), an attention kernel on the Hub, `experimental_skip_move_to_device`,
and a dataset's `field_thinking` / `template_thinking_key`."""

from __future__ import annotations

import json

import pytest
import torch
from config_files import parse_minimal, refusal_of, write_tiny_run

from hanzo_gym.cli import main
from hanzo_gym.config import DatasetConfig
from hanzo_gym.data.sources import Row
from hanzo_gym.data.strategies import StrategyContext, chat_template_example
from hanzo_gym.errors import ModelError
from hanzo_gym.model.hub import load_causal_lm
from hanzo_gym.model.load_plan import BaseModelPlan, Quantization
from hanzo_gym.model.loader_keys import attention_kernel

MXFP4 = {"model_quantization_config": "Mxfp4Config", "model_quantization_config_kwargs": {"dequantize": True}}


def test_the_mxfp4_experts_load_as_the_values_the_format_encodes(tiny_gpt_oss_mxfp4):
    model = load_causal_lm(
        BaseModelPlan.of(
            str(tiny_gpt_oss_mxfp4.path), torch.float32, quantization=Quantization(mxfp4={"dequantize": True})
        )
    )
    assert len(tiny_gpt_oss_mxfp4.expert_values) == 4
    for name, values in tiny_gpt_oss_mxfp4.expert_values.items():
        torch.testing.assert_close(model.get_parameter(name), values, rtol=0, atol=0)


def test_lora_trains_over_the_dequantized_experts_and_gym_says_what_runs(
    tmp_path, tiny_gpt_oss_mxfp4, chat_data, capsys
):
    config = write_tiny_run(
        tmp_path,
        tiny_gpt_oss_mxfp4.path,
        chat_data,
        max_steps=2,
        attn_implementation="kernels-community/vllm-flash-attn3",
        experimental_skip_move_to_device=True,
        lora_target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        **MXFP4,
    )
    assert main(["train", str(config)]) == 0
    out = capsys.readouterr().out
    assert (
        "attn_implementation: kernels-community/vllm-flash-attn3 runs on CUDA only; using sdpa (eager where the model has no sdpa) on cpu"
        in out
    )
    assert "experimental_skip_move_to_device: no effect here" in out
    saved = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert len(saved["target_parameters"]) == 4


def test_mxfp4_refusals(tiny_base, tmp_path, chat_data):
    assert "set model_quantization_config_kwargs: {dequantize: true}" in refusal_of(
        model_quantization_config="Mxfp4Config"
    )
    assert "FineGrainedFP8Config` (a base stored in block-scaled FP8) is not supported yet" in refusal_of(
        model_quantization_config="FineGrainedFP8Config"
    )
    assert "quantize the base two ways" in refusal_of(**MXFP4, adapter="qlora", load_in_4bit=True)
    assert "not arguments of Mxfp4Config" in refusal_of(
        model_quantization_config="Mxfp4Config", model_quantization_config_kwargs={"dequantise": True}
    )
    assert "without model_quantization_config" in refusal_of(
        model_quantization_config_kwargs={"dequantize": True}
    )
    with pytest.raises(ModelError, match=r"Mxfp4Config reads a checkpoint stored in MXFP4 .* is not one"):
        load_causal_lm(
            BaseModelPlan.of(
                str(tiny_base), torch.float32, quantization=Quantization(mxfp4={"dequantize": True})
            )
        )


@pytest.mark.parametrize(
    ("name", "device", "expected"),
    [
        (
            "kernels-community/flash-attn3",
            "cpu",
            (None, "runs on CUDA only; using sdpa (eager where the model has no sdpa) on cpu"),
        ),
        ("kernels-community/flash-attn3@v1:flash_attn", "cpu", (None, "runs on CUDA only")),
        ("sdpa", "cpu", ("sdpa", None)),
    ],
)
def test_a_hub_attention_kernel_falls_back_to_sdpa_off_cuda(name, device, expected):
    kernel, note = attention_kernel(name, torch.device(device))
    assert kernel == expected[0]
    assert (note is None) if expected[1] is None else expected[1] in note
    assert parse_minimal(attn_implementation=name).attn_implementation == name


def test_an_attention_name_that_is_neither_refused():
    assert "unknown attention kernel" in refusal_of(attn_implementation="flash-attn")


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.thinking %}[{{ m.thinking }}]{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
)
ROW = {
    "messages": [
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "4.", "thinking": "two and two make four"},
    ]
}


def _rendered(qwen3_tokenizer, template, **keys):
    ds = DatasetConfig(path="unused", type="chat_template", **keys)
    ctx = StrategyContext(qwen3_tokenizer, chat_template=template)
    example = chat_template_example(Row(ROW, "data.jsonl", 1), ds, ctx)
    trained = [t for t, label in zip(example.input_ids, example.labels, strict=True) if label != -100]
    return qwen3_tokenizer.decode(example.input_ids), qwen3_tokenizer.decode(trained)


def test_the_reasoning_reaches_the_template_under_the_name_it_reads_and_is_trained(qwen3_tokenizer):
    text, trained = _rendered(
        qwen3_tokenizer, THINKING_TEMPLATE, field_thinking="thinking", template_thinking_key="thinking"
    )
    assert "[two and two make four]4." in text
    assert "[two and two make four]4." in trained  # generated by the model: part of its turn

    # gpt-oss's field read by Qwen3's own template, which reads `reasoning_content`: its <think> block, as
    # transformers renders the same conversation
    text, _ = _rendered(qwen3_tokenizer, "tokenizer_default", field_thinking="thinking")
    reference = [
        dict(ROW["messages"][0]),
        {"role": "assistant", "content": "4.", "reasoning_content": "two and two make four"},
    ]
    assert text == qwen3_tokenizer.apply_chat_template(reference, tokenize=False)
    assert "<think>\ntwo and two make four\n</think>" in text
