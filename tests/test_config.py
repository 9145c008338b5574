import pytest
import yaml
from config_files import error_of, load_text

from hanzo_gym.config import load_config, parse_config
from hanzo_gym.config.feature import feature_notes
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


_load, _error = load_text, error_of


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
    assert "run.yaml:8" in message and "'cosine', 'linear', 'constant'" in message and "`cosine`" in message
    message = _error(tmp_path, BASE.replace("type: chat_template", "type: sharegtp"))
    assert "run.yaml:7" in message and "datasets[0].type" in message and "chat_template, alpaca" in message
    assert "did you mean `sharegpt`?" in message


def test_wrong_type_and_range_name_key_and_line(tmp_path):
    message = _error(tmp_path, BASE + "micro_batch_size: 0\nlora_r: many\n")
    assert "run.yaml:8: `micro_batch_size` = 0" in message and "greater than or equal to 1" in message
    assert "run.yaml:9: `lora_r` = 'many'" in message


def test_a_key_written_twice_is_read_as_yaml_readers_read_it_the_last_value_and_said(tmp_path):
    cfg = _load(
        tmp_path, BASE + "lora_r: 8\nlora_r: 16\ndatasets:\n  - path: other.jsonl\n    type: alpaca\n"
    )
    assert cfg.lora_r == 16 and [d.path for d in cfg.datasets] == ["other.jsonl"]
    assert cfg.lora_r == yaml.safe_load((tmp_path / "run.yaml").read_text())["lora_r"]
    notes = feature_notes(cfg)
    assert (
        f"{tmp_path}/run.yaml:9: key `lora_r` appears twice (first on line 8): the last value, 16, is read"
        in (notes[0])
    )
    assert "key `datasets` appears twice (first on line 5): the last value, a list, is read" in notes[1]
    # the same value twice, or two ways of saying nothing, is one setting: nothing to say
    assert (
        feature_notes(_load(tmp_path, BASE + "lora_r: 8\nlora_r: 8\nhub_model_id:\nhub_model_id: null\n"))
        == []
    )


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            "trl:\n  async_prefetch: true\n",
            "Axolotl's `trl.async_prefetch` (generating the next rollouts in the background",
        ),
        ("float16: true\n", "Axolotl's `float16` (loading the model in float16) is not supported yet"),
    ],
)
def test_features_we_do_not_have_fail_at_load_with_a_sentence(tmp_path, extra, expected):
    assert expected in _error(tmp_path, BASE + extra)


def test_qlora_needs_both_keys_and_full_finetune_fails_at_load(tmp_path):
    cfg = _load(tmp_path, BASE.replace("adapter: lora", "adapter: qlora") + "load_in_4bit: true\n")
    assert (cfg.adapter, cfg.load_in_4bit) == ("qlora", True)
    together = "adapter: qlora and load_in_4bit: true go together"
    assert together in _error(tmp_path, BASE.replace("adapter: lora", "adapter: qlora"))
    older = _load(tmp_path, BASE + "load_in_4bit: true\n")  # older Axolotl's spelling: LoRA on an FP4 base
    assert (older.adapter, older.bnb_4bit_settings) == (
        "qlora",
        {"bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": False},
    )
    assert "adapter: lora with load_in_4bit: true trains LoRA on a 4-bit FP4 base" in feature_notes(older)[0]
    assert "`adapter` left out (or empty)" in _error(tmp_path, BASE.replace("adapter: lora", "adapter: none"))


def test_datasets_are_required_and_no_adapter_is_full_fine_tuning(tmp_path):
    # Axolotl reads a missing or empty `adapter` as full fine-tuning; the LoRA keys then say they do nothing.
    for text in (BASE.replace("adapter: lora\n", ""), BASE.replace("adapter: lora\n", "adapter:\n")):
        assert "lora_target_linear: no `adapter` means full fine-tuning" in _error(tmp_path, text)
        no_lora = text.replace("lora_target_linear: true\n", "")
        assert _load(tmp_path, no_lora).full_fine_tuning
    required = "`datasets` is required: list at least one dataset, each with its `path` and `type`"
    for datasets in ("", "datasets:\n", "datasets: []\n"):
        assert _error(tmp_path, BASE.split("datasets:")[0] + datasets).endswith(required)


def test_cross_key_rules(tmp_path):
    assert "lora_target_modules" in _error(tmp_path, BASE.replace("lora_target_linear: true\n", ""))
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


def test_a_cadence_given_two_ways_is_refused(tmp_path):
    message = _error(tmp_path, BASE + "eval_steps: 5\nevals_per_epoch: 2\n")
    assert "`eval_steps` and `evals_per_epoch` say the same thing two ways" in message
    message = _error(tmp_path, BASE + "save_steps: 5\nsaves_per_epoch: 2\n")
    assert "`save_steps` and `saves_per_epoch`" in message
    loaded = _load(tmp_path, BASE + "evals_per_epoch: 4\nsaves_per_epoch: 1\nsave_total_limit: 3\n")
    assert (loaded.evals_per_epoch, loaded.saves_per_epoch, loaded.save_total_limit) == (4, 1, 3)


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


def test_empty_values_mean_unset_as_in_axolotl(tmp_path):
    text = BASE + "    roles_to_train:\n    train_on_eos:\n"  # datasets[0]'s keys, written empty
    text += (
        "sample_packing:\nwarmup_steps:\nlearning_rate:\nwandb_project:\nwandb_entity:\nspecial_tokens:\n"
        "lora_model_dir:\ndataset_prepared_path:\ntrl:\noptimizer:\n"
    )
    cfg = _load(tmp_path, text)
    assert (cfg.sample_packing, cfg.warmup_steps, cfg.learning_rate, cfg.optimizer) == (
        False,
        None,
        2e-4,
        "adamw_torch_fused",
    )
    assert cfg.trl.num_generations == 4
    assert (cfg.datasets[0].roles_to_train, cfg.datasets[0].train_on_eos) == (["assistant"], "turn")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("use_onebitllms: true\n", "`use_onebitllms` (1-bit (BitNet) layers)"),
        ("float16: true\n", "`float16` (loading the model in float16)"),
        (
            "plugins: [axolotl.integrations.diffusion.DiffusionPlugin]\n",
            "plugin `axolotl.integrations.diffusion.DiffusionPlugin` (diffusion",
        ),
        ("lisa_n_layers: 4\n", "`lisa_n_layers` (LISA (training a few sampled layers))"),
        ("    shards: 4\n", "`datasets[0].shards` (training on a shard of the dataset)"),
        (
            "trl:\n  vllm_enable_sleep_mode: true\n",
            "`trl.vllm_enable_sleep_mode` (freeing a colocated vLLM's",
        ),
    ],
)
def test_known_axolotl_keys_name_their_feature_never_another_key(tmp_path, extra, expected):
    message = _error(tmp_path, BASE + extra)
    assert f"Axolotl's {expected}" in message and "is not supported yet" in message
    assert "did you mean" not in message and message.count("\n") == 0


def test_did_you_mean_only_for_close_misspellings(tmp_path):
    assert "did you mean `lr_scheduler`?" in _error(tmp_path, BASE + "lr_schedular: cosine\n")
    assert "did you mean `micro_batch_size`?" in _error(tmp_path, BASE + "micro_batchsize: 2\n")
    # a shortening of one key (Axolotl's GPTQ example writes it) is that key
    assert "did you mean `adam_epsilon`?" in _error(tmp_path, BASE + "adam_eps: 1.0e-6\n")
    message = _error(tmp_path, BASE.replace("type: chat_template", "type: chat_template\n    field_m: 2"))
    assert "unknown key `datasets[0].field_m`; valid keys here: chat_template, conversation," in message
    assert "did you mean" not in _error(tmp_path, BASE + "lora_ta: 2\n")  # the start of three keys


def test_every_refusal_of_a_file_is_listed_together_in_line_order(tmp_path):
    text = BASE + (
        "xformers_attention: true\n"  # 8
        "lora_alpah: 32\n"  # 9
        "micro_batch_size: 0\n"  # 10
        "float16: true\n"  # 11
        "relora: true\n"  # 12
        "optimizer: sgd\n"  # 13
    )
    lines = _error(tmp_path, text).splitlines()
    assert [line.split(": ", 1)[0].rsplit(":", 1)[1] for line in lines] == ["8", "9", "10", "11", "12", "13"]
    assert (
        "`xformers_attention`" in lines[0] and "`lora_alpah`" in lines[1] and "`micro_batch_size`" in lines[2]
    )
    assert "`float16`" in lines[3] and "`relora`" in lines[4] and "optimizer: sgd" in lines[5]


def test_a_key_neither_we_nor_axolotl_read_loads_as_axolotl_reads_it_left_out_and_said(tmp_path):
    """Axolotl's schema ignores keys it does not declare (a fork's, a launcher's, a script's own); a key near one
    of ours is a misspelling and is refused, and a key of Axolotl's that is not read here is refused by name."""
    for text in ("frobnicate: true\n", "frobnicate:\n", "adam_gamma: 0.5\n"):
        cfg = _load(tmp_path, BASE + text)
        key = text.split(":")[0]
        assert key not in cfg.model_dump() and feature_notes(cfg) == [
            f"{tmp_path}/run.yaml:8: `{key}` is no key of Axolotl 0.19's, which ignores it, and so does this run"
        ]
    assert "did you mean `learning_rate`?" in _error(tmp_path, BASE + "learning_rat: 1e-4\n")
    message = _error(tmp_path, BASE + "use_ray: true\n")
    assert message.startswith(f"{tmp_path}/run.yaml:8: Axolotl's `use_ray`") and "not supported yet" in message


def test_optimizer_and_adam_keys(tmp_path):
    cfg = _load(tmp_path, BASE)
    assert (cfg.optimizer, cfg.adam_beta1, cfg.adam_beta2, cfg.adam_epsilon) == (
        "adamw_torch_fused",
        0.9,
        0.999,
        1e-8,
    )
    cfg = _load(
        tmp_path,
        BASE + "optimizer: paged_adamw_8bit\nadam_beta1: 0.8\nadam_beta2: 0.95\nadam_epsilon: 1e-6\n",
    )
    assert (cfg.optimizer, cfg.adam_beta1, cfg.adam_beta2, cfg.adam_epsilon) == (
        "paged_adamw_8bit",
        0.8,
        0.95,
        1e-6,
    )
    from hanzo_gym.loops.schedule import adam_params

    adam = adam_params(cfg, 0, 10)
    assert (adam.beta1, adam.beta2, adam.eps) == (0.8, 0.95, 1e-6)
    for other in ("sgd", "adafactor", "lion_8bit"):
        message = _error(tmp_path, BASE + f"optimizer: {other}\n")
        assert f"run.yaml:8: Axolotl's `optimizer: {other}` (an update rule other than AdamW)" in message
    assert "less than 1" in _error(tmp_path, BASE + "adam_beta2: 1.0\n")


def test_lr_scheduler_variants_and_min_lr_ratio(tmp_path):
    cfg = _load(tmp_path, BASE + "lr_scheduler: cosine\ncosine_min_lr_ratio: 0.1\n")
    assert cfg.cosine_min_lr_ratio == 0.1
    assert (
        _load(tmp_path, BASE + "lr_scheduler: constant_with_warmup\n").lr_scheduler == "constant_with_warmup"
    )
    assert "needs `cosine_min_lr_ratio`" in _error(tmp_path, BASE + "lr_scheduler: cosine_with_min_lr\n")
    assert "applies to the cosine schedule" in _error(
        tmp_path, BASE + "lr_scheduler: linear\ncosine_min_lr_ratio: 0.1\n"
    )
    assert "`lr_scheduler: rex` is not supported yet" in _error(tmp_path, BASE + "lr_scheduler: rex\n")
    assert _load(tmp_path, BASE + "lr_scheduler: cosine\nlr_quadratic_warmup: true\n").lr_quadratic_warmup
    for other in ("lr_scheduler: linear\n", "lr_scheduler: cosine\ncosine_min_lr_ratio: 0.1\n"):
        assert "needs `lr_scheduler: cosine` without" in _error(
            tmp_path, BASE + other + "lr_quadratic_warmup: true\n"
        )


@pytest.mark.parametrize(
    ("keys", "total", "expected"),
    [
        ("", 10, 0),  # Axolotl's default, 3 % of the run rounded down
        ("", 50, 2),  # 3 % of 50 is 1, which Axolotl makes 2
        ("", 1000, 30),
        ("", 10_000, 100),  # the default's cap
        ("warmup_ratio: 0.1\n", 15, 2),  # 1.5 rounded down is 1, made 2
        ("warmup_ratio: 0.1\n", 29, 2),  # rounded down, not to the nearest
        ("warmup_ratio: 0.0\n", 1000, 0),
        ("warmup_steps: 1\n", 100, 2),
        ("warmup_steps: 0\n", 1000, 0),
        ("warmup_steps: 7\nwarmup_ratio: 0.5\n", 100, 7),  # steps win
    ],
)
def test_warmup_steps_are_axolotls(tmp_path, keys, total, expected):
    assert load_text(tmp_path, BASE + keys).warmup(total) == expected


def test_every_feature_of_the_config_is_a_base_of_config_and_checked(monkeypatch):
    """A feature module whose keys class is left out of Config's bases would neither load its keys nor check
    them; and each registered feature's own check runs exactly once per load."""
    import importlib
    import pkgutil

    import hanzo_gym.config as config_package
    from hanzo_gym.config.feature import Feature
    from hanzo_gym.config.schema import Config

    for module in pkgutil.iter_modules(config_package.__path__):
        importlib.import_module(f"hanzo_gym.config.{module.name}")
    features = {cls for cls in _subclasses(Feature) if cls is not Config}
    assert features, "no features found"
    assert features <= set(Config.__mro__), sorted(f.__name__ for f in features - set(Config.__mro__))

    calls = []
    for feature in features:
        if "check" in vars(feature):
            original = vars(feature)["check"]
            monkeypatch.setattr(
                feature, "check", lambda self, _f=feature, _o=original: (calls.append(_f), _o(self))[1]
            )
    parse_config(load_yaml(BASE, "run.yaml")[0])
    checked = [f for f in features if "check" in vars(f)]
    assert sorted(c.__name__ for c in calls) == sorted(f.__name__ for f in checked)


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)
