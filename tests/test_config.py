import pytest

from hanzo_gym.config import load_config, parse_config
from hanzo_gym.config.yaml_source import load_yaml
from hanzo_gym.errors import ConfigError

BASE = """\
base_model: Qwen/Qwen3-0.6B
output_dir: out
adapter: lora
lora_target_linear: true
datasets:
  - path: data.jsonl
    type: chat_template
"""


def _load(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return load_config(path)


def _error(tmp_path, text) -> str:
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, text)
    return str(caught.value)


def test_defaults_match_the_original(tmp_path):
    cfg = _load(tmp_path, BASE)
    assert (cfg.sequence_len, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout) == (2048, 8, 16.0, 0.0)
    assert (cfg.micro_batch_size, cfg.gradient_accumulation_steps, cfg.num_epochs) == (1, 1, 1)
    assert (cfg.learning_rate, cfg.lr_scheduler, cfg.weight_decay, cfg.max_grad_norm) == (
        2e-4,
        "cosine",
        0.0,
        1.0,
    )
    assert (cfg.logging_steps, cfg.seed, cfg.bf16, cfg.val_set_size) == (10, 42, "auto", 0.0)
    ds = cfg.datasets[0]
    assert (ds.field_messages, ds.roles_to_train, ds.train_on_eos, ds.field) == (
        "messages",
        ["assistant"],
        "turn",
        "text",
    )
    assert (ds.mappings.role, ds.mappings.content) == ("role", "content")
    trl = cfg.trl
    assert (trl.num_generations, trl.max_completion_length, trl.beta, trl.temperature, trl.scale_rewards) == (
        4,
        256,
        0.0,
        1.0,
        True,
    )
    assert cfg.lora_target_linear and cfg.lora_target_modules == []


def test_axolotl_finetome_config_parses(tmp_path):
    cfg = _load(
        tmp_path,
        """\
base_model: Qwen/Qwen3-0.6B
chat_template: qwen3
datasets:
  - path: mlabonne/FineTome-100k
    type: chat_template
    field_messages: conversations
    message_property_mappings:
      role: from
      content: value
output_dir: ./outputs/qwen3-lora
sequence_len: 2048
adapter: lora
lora_r: 16
lora_alpha: 32
lora_target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj]
micro_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 2e-4
warmup_ratio: 0.03
gradient_checkpointing: true
sample_packing: true
""",
    )
    assert cfg.learning_rate == 2e-4 and isinstance(cfg.learning_rate, float)
    assert cfg.lora_alpha / cfg.lora_r == 2.0 and len(cfg.lora_target_modules) == 6
    assert cfg.warmup(100) == 3 and cfg.datasets[0].mappings.role == "from"
    assert cfg.gradient_checkpointing and cfg.sample_packing


@pytest.mark.parametrize("text", ["2e-4", "1.0e-4", "-3E+2", ".5", "1_000.0"])
def test_yaml_numbers_follow_yaml_1_2(text):
    data, _ = load_yaml(f"x: {text}", "t")
    if "_" in text:
        assert data["x"] == text  # YAML 1.2 has no underscores in numbers: stays a string
    else:
        assert data["x"] == float(text)


def test_unknown_key_names_line_and_nearest_key(tmp_path):
    message = _error(tmp_path, BASE + "lora_alpah: 32\n")
    assert "run.yaml:8" in message and "`lora_alpah`" in message and "did you mean `lora_alpha`?" in message


def test_unknown_nested_key_names_its_path(tmp_path):
    message = _error(tmp_path, BASE + "    field_mesages: conversations\n")
    assert (
        "run.yaml:8" in message and "datasets[0].field_mesages" in message and "`field_messages`" in message
    )
    message = _error(tmp_path, BASE + "trl:\n  num_generation: 8\n")
    assert "run.yaml:9" in message and "trl.num_generation" in message and "`num_generations`" in message


def test_bad_enum_value_lists_what_is_allowed(tmp_path):
    message = _error(tmp_path, BASE + "lr_scheduler: cosin\n")
    assert "run.yaml:8" in message and "'cosine', 'linear' or 'constant'" in message and "`cosine`" in message
    message = _error(tmp_path, BASE.replace("type: chat_template", "type: sharegpt"))
    assert "run.yaml:7" in message and "datasets[0].type" in message and "'alpaca'" in message


def test_wrong_type_and_range_name_key_and_line(tmp_path):
    message = _error(tmp_path, BASE + "micro_batch_size: 0\nlora_r: many\n")
    assert "run.yaml:8: `micro_batch_size` = 0" in message and "greater than or equal to 1" in message
    assert "run.yaml:9: `lora_r` = 'many'" in message


def test_duplicate_key_is_an_error(tmp_path):
    message = _error(tmp_path, BASE + "lora_r: 8\nlora_r: 16\n")
    assert "run.yaml:9" in message and "appears twice" in message and "line 8" in message


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("load_in_8bit: true\n", "8-bit loading is not supported yet"),
        ("rl: dpo\n", "DPO family) is not supported yet"),
    ],
)
def test_features_we_do_not_have_fail_at_load_with_a_sentence(tmp_path, extra, expected):
    assert expected in _error(tmp_path, BASE + extra)


def test_qlora_needs_both_keys_and_full_finetune_fails_at_load(tmp_path):
    cfg = _load(tmp_path, BASE.replace("adapter: lora", "adapter: qlora") + "load_in_4bit: true\n")
    assert (cfg.adapter, cfg.load_in_4bit) == ("qlora", True)
    together = "adapter: qlora and load_in_4bit: true go together"
    assert together in _error(tmp_path, BASE.replace("adapter: lora", "adapter: qlora"))
    assert together in _error(tmp_path, BASE + "load_in_4bit: true\n")
    assert "full fine-tuning" in _error(tmp_path, BASE.replace("adapter: lora", "adapter: none"))


def test_adapter_and_datasets_are_required(tmp_path):
    # Neither has a default that could validate: leaving one out says so, rather than failing on the default.
    assert _error(tmp_path, BASE.replace("adapter: lora\n", "")).endswith("`adapter` is required")
    assert _error(tmp_path, BASE.split("datasets:")[0]).endswith("`datasets` is required")


def test_cross_key_rules(tmp_path):
    assert "lora_target_modules" in _error(tmp_path, BASE.replace("lora_target_linear: true\n", ""))
    assert "at least 1 item" in _error(tmp_path, BASE.split("datasets:")[0] + "datasets: []\n")
    assert "needs `trl.reward_funcs`" in _error(tmp_path, BASE + "rl: grpo\n")
    message = _error(
        tmp_path, BASE + "rl: grpo\ntrl:\n  reward_funcs: [exact_match]\n  reward_weights: [1, 2]\n"
    )
    assert "give one weight per function" in message
    assert "greater than or equal to 2" in _error(tmp_path, BASE + "trl:\n  num_generations: 1\n")


def test_bad_split_fails_at_load(tmp_path):
    message = _error(tmp_path, BASE + "    split: train[1]\n")
    assert "run.yaml:8" in message and "datasets[0].split" in message


def test_not_yaml_and_missing_file(tmp_path):
    assert "run.yaml:2" in _error(tmp_path, "a: 1\n  b: [\n")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        parse_config(["a"])


def test_axolotl_defaults_for_unsupported_features_are_accepted(tmp_path):
    cfg = _load(tmp_path, BASE + "load_in_4bit: false\nload_in_8bit: false\ndeepspeed:\n")
    assert cfg.adapter == "lora"


def test_lora_on_embedding_or_output_layer_is_refused(tmp_path):
    message = _error(tmp_path, BASE + "lora_target_modules: [q_proj, lm_head]\n")
    assert "lm_head" in message and "not supported" in message


def test_chat_template_names_are_checked_at_load(tmp_path):
    message = _error(tmp_path, BASE + "chat_template: qwen33\n")
    assert "run.yaml:8" in message and "did you mean `qwen3`?" in message
    assert _load(tmp_path, BASE + "chat_template: tokenizer_default_fallback_chatml\n").chat_template
    assert _load(tmp_path, BASE + "chat_template: \"{{ messages[0]['content'] }}\"\n").chat_template


def test_resume_path_must_exist(tmp_path):
    assert "is not a directory" in _error(tmp_path, BASE + f"resume_from_checkpoint: {tmp_path / 'nope'}\n")


def test_anchors_aliases_and_merge_keys_still_load(tmp_path):
    cfg = _load(
        tmp_path,
        """\
base_model: Qwen/Qwen3-0.6B
output_dir: out
adapter: lora
lora_target_modules: &targets [q_proj, v_proj]
datasets:
  - &chat {path: a.jsonl, type: chat_template, field_messages: conversations, roles_to_train: [assistant, tool]}
  - <<: *chat
    path: b.jsonl
  - *chat
""",
    )
    first, merged, aliased = cfg.datasets
    assert (merged.path, merged.field_messages, merged.roles_to_train) == (
        "b.jsonl",
        "conversations",
        ["assistant", "tool"],
    )
    assert aliased == first and cfg.lora_target_modules == ["q_proj", "v_proj"]


def test_aliases_may_repeat_a_few_thousand_values(tmp_path):
    """The alias budget sits well above what a config repeats: 9 × 9 × 9 aliased values load."""
    text = "a: &a [1, 2, 3, 4, 5, 6, 7, 8, 9]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    data, _ = load_yaml(text + "c: [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n", "t")
    assert sum(len(inner) for outer in data["c"] for inner in outer) == 729
    nine_times = "[" + ", ".join(["*{}"] * 9) + "]\n"
    deeper = "c: &c " + nine_times.format(*"b" * 9) + "d: &d " + nine_times.format(*"c" * 9) + "e: [*d]\n"
    with pytest.raises(ConfigError, match=r"^t:5: aliases repeat more than 10000 values"):
        load_yaml(text + deeper, "t")


def test_a_config_nested_a_hundred_levels_is_refused_and_ninety_load(tmp_path):
    assert load_yaml("x: " + "[" * 90 + "]" * 90, "t")[0]["x"]
    with pytest.raises(ConfigError, match=r"^t:1: nested more than 100 levels deep"):
        load_yaml("x: " + "[" * 101 + "]" * 101, "t")
    with pytest.raises(ConfigError, match=r"^t:2: alias `\*a` nests the value more than 100 levels deep"):
        load_yaml("a: &a " + "[" * 60 + "]" * 60 + "\nb: " + "[" * 50 + "*a" + "]" * 50, "t")


@pytest.mark.parametrize(
    "key", ["learning_rate", "lora_alpha", "val_set_size", "weight_decay", "max_grad_norm"]
)
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_floats_are_refused_with_key_and_line(tmp_path, key, value):
    message = _error(tmp_path, BASE + f"{key}: {value}\n")
    assert message.startswith(f"{tmp_path / 'run.yaml'}:8: `{key}`") and "finite" in message
