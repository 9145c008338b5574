"""Axolotl's kernel plugins and keys (and the old `flash_attention`), regular-expression `lora_target_modules`,
`evals_per_epoch: 0`, its chat template names, `eot_tokens` and `drop_system_message`: each does what
Axolotl does, or fails with the reason."""

from __future__ import annotations

import json

import pytest
from config_files import error_of, load_text, write_tiny_run
from tiny_models import tiny_model

from hanzo_gym.cli import main
from hanzo_gym.config.kernel_keys import CUT_CROSS_ENTROPY, KERNELS, LIGER, kernel_notes
from hanzo_gym.data.sources import Row
from hanzo_gym.data.strategies import StrategyContext, chat_template_example
from hanzo_gym.errors import ConfigError, ModelError
from hanzo_gym.model.load_plan import LoadPlan
from hanzo_gym.model.lora import attach_lora
from hanzo_gym.records import IGNORE_INDEX
from hanzo_gym.renderers.chat_templates import resolve_renderer

BASE = """base_model: m
datasets:
  - path: d.jsonl
    type: chat_template
adapter: lora
lora_target_linear: true
output_dir: out
"""


def test_speed_only_plugins_and_their_keys_load_and_say_what_runs_instead(tmp_path):
    cfg = load_text(
        tmp_path,
        BASE
        + f"plugins:\n  - {CUT_CROSS_ENTROPY}\n  - {LIGER}\n  - {KERNELS}\n"
        + "liger_rms_norm: true\nliger_glu_activation: true\nliger_rope:\nlora_mlp_kernel: true\n"
        + "use_scattermoe: true\n",
    )
    notes = kernel_notes(cfg)
    assert len(notes) == 2
    assert "chunks" in notes[0] and "never held" in notes[0]
    assert notes[1].startswith("liger_rms_norm, liger_glu_activation, lora_mlp_kernel, use_scattermoe:")
    assert "same function" in notes[1]
    assert kernel_notes(load_text(tmp_path, BASE)) == []


def test_axolotls_attention_and_mlp_kernels_load_and_say_what_runs_instead(tmp_path):
    cfg = load_text(tmp_path, BASE + "fused_attn_kernel: true\ngemma4_hybrid_attn_impl: true\n")
    fused, hybrid = kernel_notes(cfg)
    assert fused.startswith("fused_attn_kernel: fused kernels are not applied") and "same function" in fused
    assert hybrid.startswith("gemma4_hybrid_attn_impl: every layer runs sdpa")
    (compiled,) = kernel_notes(
        load_text(tmp_path, BASE + "torch_compile: true\ntorch_compile_mode: max-autotune\n")
    )
    assert compiled.startswith("torch_compile: the model runs eagerly") and "not different" in compiled
    full = load_text(
        tmp_path, BASE.replace("adapter: lora\nlora_target_linear: true\n", "flash_attn_fuse_mlp: true\n")
    )
    assert kernel_notes(full)[0].startswith("flash_attn_fuse_mlp: fused kernels are not applied")
    # older Axolotl's FlashAttention RMSNorm and cross-entropy kernels: the same function, so the same lines
    (older,) = kernel_notes(
        load_text(tmp_path, BASE + "flash_attn_rms_norm: true\nflash_attn_cross_entropy: true\n")
    )
    assert older.startswith("flash_attn_rms_norm, flash_attn_cross_entropy: fused kernels are not applied")


def test_gemma4_hybrid_attention_loads_sdpa_for_every_layer(tmp_path, tiny_base, chat_data, capsys):
    import torch

    from hanzo_gym.config import load_config
    from hanzo_gym.loops.train import build_engine

    config = write_tiny_run(
        tmp_path, tiny_base, chat_data, attn_implementation="flash_attention_2", gemma4_hybrid_attn_impl=True
    )
    cfg = load_config(config)
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32))
    assert engine.model.get_base_model().config._attn_implementation == "sdpa"
    printed = capsys.readouterr().out
    assert "gemma4_hybrid_attn_impl: every layer runs sdpa" in printed and "CUDA only" not in printed


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            "flash_attn_fuse_mlp: true\n",
            "which a LoRA adapter cannot target (Axolotl refuses it with `adapter: lora`",
        ),
        (
            "gemma4_hybrid_attn_impl: true\nattn_implementation: eager\n",
            "Axolotl requires `attn_implementation: flash_attention_2` with it, not eager",
        ),
        ("torch_compile_mode: default\n", "torch_compile_mode says how torch_compile compiles"),
        ("liger_rms_norm: true\n", "`liger_rms_norm` is an option of Axolotl's plugin"),
        ("cut_cross_entropy: true\n", "`cut_cross_entropy` is an option of Axolotl's plugin"),
        (
            "plugins: [axolotl.integrations.kd.KDPlugin]\n",
            "plugin `axolotl.integrations.kd.KDPlugin` (knowledge distillation",
        ),
        ("plugins: [my.own.Plugin]\n", "`my.own.Plugin` is not an Axolotl plugin hanzo-gym knows"),
        ("lora_target_modules: 'q_proj('\n", "not a valid regular expression"),
    ],
)
def test_what_would_do_nothing_or_something_else_is_refused(tmp_path, extra, expected):
    text = BASE.replace("lora_target_linear: true\n", "") if "lora_target_modules" in extra else BASE
    assert expected in error_of(tmp_path, text + extra)


def test_zero_evals_or_saves_per_epoch_ask_for_none_as_in_axolotl(tmp_path):
    cfg = load_text(tmp_path, BASE + "evals_per_epoch: 0\nsaves_per_epoch: 0\neval_steps: 5\n")
    assert (cfg.evals_per_epoch, cfg.saves_per_epoch, cfg.eval_steps) == (None, None, 5)


def test_a_regular_expression_targets_exactly_the_modules_it_matches_as_in_peft():
    model = tiny_model("llama", num_hidden_layers=3)
    regex = r"model.layers.[02].self_attn.(q|v)_proj"
    peft_model = attach_lora(model, r=4, alpha=8.0, dropout=0.0, target_modules=regex, base_model_name="tiny")
    adapted = sorted(
        name.removeprefix("base_model.model.").removesuffix(".lora_A.default")
        for name, _ in peft_model.named_modules()
        if name.endswith("lora_A.default")
    )
    assert adapted == [f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 2) for p in "qv"]
    assert peft_model.peft_config["default"].target_modules == regex  # saved as written, as PEFT does
    with pytest.raises(ModelError, match="at most 16"):  # the rank check sees the matched layers only
        attach_lora(
            tiny_model("llama"),
            r=20,
            alpha=8.0,
            dropout=0.0,
            target_modules=r"model.layers.0.self_attn.k_proj",
            base_model_name="tiny",
        )


def test_a_regular_expression_target_trains_and_is_saved_as_written(tmp_path, tiny_base, chat_data):
    config = write_tiny_run(
        tmp_path,
        tiny_base,
        chat_data,
        lora_target_linear=False,
        lora_target_modules=r"model\.layers\.\d+\.mlp\.(up|down)_proj",
        max_steps=2,
        save_steps=1,
    )
    assert main(["train", str(config)]) == 0
    saved = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert saved["target_modules"] == r"model\.layers\.\d+\.mlp\.(up|down)_proj"


def _two_turns():
    return [
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 plus 3?"},
        {"role": "assistant", "content": "6"},
    ]


# A template whose turns end with a token none of the common chat formats use.
BOX_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|box_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _trained_tokens(tokenizer, renderer) -> list[str]:
    ctx = StrategyContext(tokenizer=tokenizer, chat_template=renderer)
    example = chat_template_example(Row({"messages": _two_turns()}, "d.jsonl", 1), _dataset(), ctx)
    return [
        tokenizer.convert_ids_to_tokens(t)
        for t, lab in zip(example.input_ids, example.labels)
        if lab != IGNORE_INDEX
    ]


def _dataset():
    from hanzo_gym.config.schema import DatasetConfig

    return DatasetConfig(path="d.jsonl", type="chat_template")


def test_eot_tokens_make_an_unusual_turn_end_trained_with_its_turn(qwen3_tokenizer):
    without = _trained_tokens(qwen3_tokenizer, resolve_renderer(BOX_TEMPLATE, qwen3_tokenizer))
    with_eot = _trained_tokens(
        qwen3_tokenizer, resolve_renderer(BOX_TEMPLATE, qwen3_tokenizer, ["<|box_end|>"])
    )
    assert "<|box_end|>" not in without
    assert with_eot.count("<|box_end|>") == 2  # both assistant turns' ends, no user turn's
    assert [t for t in with_eot if t != "<|box_end|>"] == without


def test_eot_tokens_of_a_builtin_renderer_must_be_its_own(qwen3_tokenizer):
    assert resolve_renderer("qwen3", qwen3_tokenizer, ["<|im_end|>"]) is not None
    with pytest.raises(ConfigError, match=r"ends turns with \['<\|im_end\|>'\]"):
        resolve_renderer("qwen3", qwen3_tokenizer, ["<|endoftext|>"])
    with pytest.raises(ConfigError, match="not single tokens of the tokenizer's vocabulary"):
        resolve_renderer(BOX_TEMPLATE, qwen3_tokenizer, ["<turn|>"])


def test_axolotl_template_names_use_the_models_own_template_for_that_family(
    tmp_path, qwen3_tokenizer, chat_data
):
    qwen2 = tmp_path / "tiny-qwen2"
    tiny_model(
        "qwen2", vocab_size=len(qwen3_tokenizer), eos_token_id=qwen3_tokenizer.eos_token_id
    ).save_pretrained(qwen2)
    qwen3_tokenizer.save_pretrained(qwen2)
    config = write_tiny_run(tmp_path, qwen2, chat_data, chat_template="qwen_25", max_steps=1)
    assert main(["train", str(config)]) == 0
    renderer = resolve_renderer("qwen_25", qwen3_tokenizer)
    text = qwen3_tokenizer.apply_chat_template(_two_turns(), tokenize=False)
    assert renderer.render(_two_turns()).tokens() == qwen3_tokenizer.encode(text, add_special_tokens=False)


def test_an_axolotl_template_name_of_another_family_is_refused(
    tmp_path, tiny_base, chat_data, capsys, qwen3_tokenizer
):
    config = write_tiny_run(tmp_path, tiny_base, chat_data, chat_template="gemma3", max_steps=1)
    assert main(["train", str(config)]) != 0
    assert "chat_template: gemma3 is Gemma 3's template, but base_model" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="LLaVA's vision template"):
        resolve_renderer("llava", qwen3_tokenizer)


def test_the_old_flash_attention_switch_means_flash_attention_2(tmp_path):
    assert load_text(tmp_path, BASE + "flash_attention: true\n").attn_implementation == "flash_attention_2"
    assert load_text(tmp_path, BASE + "flash_attention: false\n").attn_implementation is None
    message = error_of(tmp_path, BASE + "flash_attention: true\nattn_implementation: eager\n")
    assert "flash_attention: true means attn_implementation flash_attention_2" in message


def test_drop_system_message_leaves_out_the_leading_system_turn(qwen3_tokenizer):
    from hanzo_gym.config.schema import DatasetConfig
    from hanzo_gym.data.strategies import chat_messages

    turns = [{"role": "system", "content": "Be brief."}, *_two_turns()]
    row = Row({"messages": turns}, "d.jsonl", 1)
    kept = chat_messages(row, DatasetConfig(path="d.jsonl", type="chat_template"))
    dropped = chat_messages(
        row, DatasetConfig(path="d.jsonl", type="chat_template", drop_system_message=True)
    )
    assert kept[0]["role"] == "system" and dropped == kept[1:]
