"""Axolotl's own example configs (tests/axolotl_configs/, verbatim): each loads with only its paths changed, or is
refused for exactly the Axolotl features not implemented yet (expected.yaml); a few that load train two steps on
a tiny model with only their paths and model-specific keys changed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from hanzo_gym.cli import main
from hanzo_gym.config import parse_config
from hanzo_gym.config.yaml_source import load_yaml
from hanzo_gym.errors import ConfigError

CONFIGS = Path(__file__).parent / "axolotl_configs"
# config file → the keys its refusal names ([] = it loads). Shrinks as the features land.
EXPECTED: dict[str, list[str]] = yaml.safe_load((CONFIGS / "expected.yaml").read_text())
NAMES = sorted(
    p.name for p in CONFIGS.iterdir() if p.suffix in (".yml", ".yaml") and p.name != "expected.yaml"
)
# Keys that name a model of its own (Llama classes, tokens of its vocabulary, a commit of its hub repo): the tiny model is a Qwen3 (a
# Qwen3-MoE for an MoE config).
OTHER_MODEL_KEYS = ("model_type", "tokenizer_type", "special_tokens", "eot_tokens", "revision_of_model")


def _chat(ds: dict, q: str, a: str) -> dict:
    mapping = ds.get("message_property_mappings") or {}  # or Axolotl's older message_field_* keys
    role = mapping.get("role", ds.get("message_field_role", "role"))
    content = mapping.get("content", ds.get("message_field_content", "content"))
    turns = [{role: "user", content: q}, {role: "assistant", content: a}]
    return {ds.get("field_messages", "messages"): turns}


# One row in the format each dataset type reads.
ROWS = {
    "alpaca": lambda ds, q, good, bad: {"instruction": q, "input": "", "output": good},
    "chat_template": lambda ds, q, good, bad: _chat(ds, q, good),
    "chat_template.default": lambda ds, q, good, bad: {
        "conversation": [{"role": "user", "content": q}],
        "chosen": {"role": "assistant", "content": good},
        "rejected": {"role": "assistant", "content": bad},
    },
    "chat_template.argilla": lambda ds, q, good, bad: {
        "chosen": [{"role": "user", "content": q}, {"role": "assistant", "content": good}],
        "rejected": [{"role": "user", "content": q}, {"role": "assistant", "content": bad}],
    },
    "llama3.ultra": lambda ds, q, good, bad: {"prompt": q, "completion": good, "label": True},
    "rewards.prompt_transform": lambda ds, q, good, bad: {
        "question": q,
        "answer": f"So {good}\n#### {good[:-1]}",
    },
}


def _with_local_paths(name: str, tmp_path: Path, base_model: str) -> dict:
    data, _ = load_yaml(
        (CONFIGS / name).read_text(), name
    )  # YAML 1.2 numbers (`5e-5`), as gym train reads them
    data["base_model"] = base_model
    data["output_dir"] = str(tmp_path / "run")
    if data.get("dataset_prepared_path"):  # relative to the working directory, as in Axolotl
        data["dataset_prepared_path"] = str(tmp_path / data["dataset_prepared_path"])
    for number, ds in enumerate(data.get("datasets") or []):
        path = tmp_path / f"data-{number}.jsonl"
        make_row = ROWS.get(ds.get("type"), ROWS["alpaca"])
        rows = []
        for a in range(8):
            row = make_row(ds, f"What is {a} plus 2?", f"{a + 2}.", f"{a * 5 + 1}, surely.")
            if ds.get("type") == "llama3.ultra" and a % 2:
                row = {**row, "completion": f"{a * 5 + 1}, surely.", "label": False}
            rows.append(row)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        ds["path"] = str(path)
        ds.pop("split", None)
        ds.pop("name", None)  # a hub dataset's configuration, like split part of its address
    return data


# unknown keys of Axolotl's examples → the key each means (the GPTQ example's adam_eps does nothing in Axolotl)
SAME_MEANING = {("adam_eps", "adam_epsilon"), ("context_parapllel_size", "context_parallel_size")}


def _refused_keys(message: str) -> list[str]:
    """The key each refusal line names: its first backticked name, without a value written after it."""
    keys = set()
    for line in message.splitlines():
        found = re.search(r"`([^`]+)`", line)
        if found:
            keys.add(re.split(r"[: =]", found.group(1), maxsplit=1)[0])
    return sorted(keys)


def test_every_config_in_the_folder_has_its_expectation():
    assert sorted(EXPECTED) == NAMES


@pytest.fixture(autouse=True)
def _users_reward_module(monkeypatch):
    """The `rewards.py` Axolotl's GRPO quick-start has its user write in the working directory."""
    monkeypatch.syspath_prepend(str(CONFIGS / "grpo-quickstart"))


@pytest.mark.parametrize("name", NAMES)
def test_each_config_loads_or_names_exactly_the_features_not_there_yet(name, tmp_path):
    data = _with_local_paths(name, tmp_path, "unused")
    if not EXPECTED[name]:
        parse_config(data, name)
        return
    with pytest.raises(ConfigError) as refused:
        parse_config(data, name)
    assert _refused_keys(str(refused.value)) == sorted(EXPECTED[name]), str(refused.value)
    # a guess only where the key written is a shortening of the key meant
    guesses = re.findall(r"unknown key `([^`]+)`; did you mean (?:Axolotl's )?`([^`]+)`", str(refused.value))
    assert all(pair in SAME_MEANING for pair in guesses), guesses
    assert str(refused.value).count("did you mean") == len(guesses)


def test_most_text_model_lora_and_qlora_examples_load():
    loading = [name for name, refused in EXPECTED.items() if not refused]
    assert len(loading) >= 81, loading


TRAINED_IN_THE_FAST_SUITE = [
    "llama-3--lora-1b.yml",  # alpaca, sample packing, cosine, adamw_bnb_8bit
    "olmo3--olmo3-7b-qlora.yaml",  # QLoRA, chat_template rows, Cut Cross Entropy, dataset_prepared_path
    "llama-3--lora-1b-kernels.yml",  # Axolotl's LoRA kernels
    "llama-3--qlora-1b-kto.yaml",
    "mistral--orpo--mistral-qlora-orpo.yml",
    "llama-2--lora.yml",  # LoRA on an 8-bit base
    "llama-3--instruct-dpo-lora-8b.yml",  # DPO on an 8-bit base, chat_template.default with roles
    "llama-3--lora-1b-deduplicate-dpo.yml",  # dataset_exact_deduplication
    "mistral--dpo--mistral-dpo-qlora.yml",  # DPO on a 4-bit base, lora_modules_to_save embed_tokens, lm_head
    "llama-3--fft-8b.yaml",  # full fine-tuning (no adapter)
    "qwen2--dpo.yaml",  # full fine-tuning with DPO: the reference scored before the first step
    "qwen3--8b-lora-fused-attn.yaml",  # Axolotl's fused RMSNorm + RoPE kernel, the old flash_attention key
    "LiquidAI--lfm2-350m-fft.yaml",  # full fine-tuning with bf16: true (mixed precision; fp32 in this test)
    "phi--phi-ft.yml",  # full fine-tuning, embeddings grown to a multiple of 32, reentrant checkpointing
    "glm45--glm-45-air-qlora.yaml",  # QLoRA on an MoE model with its experts in NF4 (quantize_moe_experts)
    "llama-2--loftq.yml",  # LoftQ: the adapter started from the NF4 rounding error of the base
    "devstral--devstral-small-qlora.yml",  # mistral-common's tokenizer and chat encoding, QLoRA
    # LoRA on Gemma 4's NF4 expert stacks (lora_target_parameters) and its text layers by a regex
    "gemma4--26b-a4b-moe-qlora.yaml",
    "gemma4--26b-a4b-moe-bnb-lora.yaml",
    # gpt-oss's MXFP4 experts dequantized as they load, a FlashAttention kernel on the Hub, field_thinking
    "gpt-oss--gpt-oss-20b-sft-lora-singlegpu.yaml",
    # Llama 4's routed experts as linear layers, quantized to NF4 with the rest of the base (Meta's stacked layout)
    "llama-4--do-no-use-fa2--scout-qlora-single-h100.yaml",
    "llama-4--scout-qlora-single-h100-flex.yaml",  # and flex attention (sdpa on a CPU, which it says)
]
LOADING = [name for name in NAMES if not EXPECTED[name]]


@pytest.mark.parametrize(
    "name",
    [
        *TRAINED_IN_THE_FAST_SUITE,
        *(
            pytest.param(name, marks=pytest.mark.slow)
            for name in LOADING
            # the GRPO quick-start samples from its vLLM server: the test below trains it on the built-in sampler;
            # Mistral 4's unfrozen `embed_tokens` matches no parameter of the model (its embeddings are
            # model.language_model.embed_tokens, which another entry trains), which `gym train` refuses at load;
            # Mixtral 8x22B's `block_sparse_moe` entries name transformers 4's modules, refused alike (test below)
            if name
            not in (
                *TRAINED_IN_THE_FAST_SUITE,
                "docs--grpo-quickstart.yaml",
                "mistral4--fft-text.yml",
                "mistral--mixtral--mixtral_22.yml",
            )
        ),
    ],
)
def test_a_loading_config_trains_two_steps_with_only_its_paths_and_model_keys_changed(
    name,
    tmp_path,
    tiny_base,
    tiny_moe_base,
    tiny_gemma4_moe_base,
    tiny_gpt_oss_mxfp4,
    tiny_mistral,
    tiny_llama4_base,
    capsys,
):
    assert not EXPECTED[name]
    text = (CONFIGS / name).read_text()
    moe, mistral = "quantize_moe_experts: true" in text, "tokenizer_use_mistral_common: true" in text
    base = tiny_moe_base if moe else tiny_mistral if mistral else tiny_base
    keys = yaml.safe_load(text)
    targets, unfrozen = keys.get("lora_target_modules"), keys.get("unfrozen_parameters") or []
    if "experts" in str(keys.get("lora_target_parameters")):  # LoRA on the stacked expert weights
        base = tiny_moe_base
    if (keys.get("model_config") or {}).get("output_router_logits"):  # a router's load-balancing loss
        base = tiny_moe_base
    if (
        name.startswith("gemma4--")
        or (isinstance(targets, str) and "language_model" in targets)
        or any("language_model" in entry for entry in unfrozen)
    ):
        base = tiny_gemma4_moe_base  # a multimodal class whose text layers are `model.language_model.layers`
    if name.startswith("gpt-oss--"):
        base = tiny_gpt_oss_mxfp4.path
    if name.startswith("llama-4--"):
        base = tiny_llama4_base
    data = _with_local_paths(name, tmp_path, str(base))
    for key in OTHER_MODEL_KEYS:
        data.pop(key, None)
    if data.get("chat_template") not in (None, "tokenizer_default", "chatml"):  # another model's format
        data.pop("chat_template")
    # the tiny model: a rank it has room for, two short steps
    data.update(max_steps=2, val_set_size=0, bf16=False, micro_batch_size=2, gradient_accumulation_steps=1)
    data.update(logging_steps=1)
    if data.get("adapter"):
        data["lora_r"] = 8
    data.update(evals_per_epoch=None, saves_per_epoch=None, sequence_len=128)
    if data.get("early_stopping_patience") or data.get("do_causal_lm_eval"):  # which read held-out rows
        data.update(val_set_size=0.25, eval_steps=1)
    data.pop("bfloat16", None)  # Axolotl's older bf16 switch: this test runs in fp32
    if data.get("adapter"):
        # the real vocabularies are multiples of 32 already; the tiny model's (Qwen3's 151669) would grow rows
        # that only a trained embedding can fill
        data.pop("resize_token_embeddings_to_32x", None)
    if not data.get("activation_offloading"):  # which needs checkpointing (a CPU keeps the activations)
        data["gradient_checkpointing"] = False
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    assert main(["train", str(path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]
    if data.get("dataset_prepared_path"):
        assert "saved the prepared datasets" in capsys.readouterr().out


def test_the_grpo_quick_start_trains_with_its_reward_module_on_the_built_in_sampler(tmp_path, tiny_base):
    """Axolotl's GRPO quick-start (its docs' config and the rewards.py it has the user write): the user's prompt
    transform and reward functions, weighted, as Axolotl calls them. Its vLLM keys are left out here: the main
    suite has no vLLM (tests/test_vllm_rollouts.py runs GRPO on one)."""
    data = _with_local_paths("docs--grpo-quickstart.yaml", tmp_path, str(tiny_base))
    data.pop("vllm")
    for key in ("use_vllm", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_lora_sync"):
        data["trl"].pop(key)
    data.pop("special_tokens")  # Qwen2.5's pad token; the tiny model is a Qwen3 with its own
    data.update(max_steps=2, bf16=False, micro_batch_size=2, gradient_accumulation_steps=1, sequence_len=128)
    data.update(gradient_checkpointing=False, attn_implementation=None, optimizer="adamw_torch")
    data["trl"].update(num_generations=2, max_completion_length=8)
    data.update(lora_r=8, lora_alpha=16)  # a rank the tiny model has room for
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["train", str(path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2]
    assert all("reward" in key for key in ("reward",)) and any(k.startswith("reward") for k in steps[0]), (
        steps[0]
    )


def test_phi3_ft_trains_with_its_generation_eval_early_stopping_and_debug_print(tmp_path, tiny_base, capsys):
    """phi--phi3-ft.yml: alpaca:phi data, perplexity of greedy completions at each eval, a table of 2
    predictions, early stopping, debug: its eval keys as written, the run made short."""
    data = _with_local_paths("phi--phi3-ft.yml", tmp_path, str(tiny_base))
    # Phi-3's template, and its 32064 embedding rows already a multiple of 32: the tiny model is a Qwen3
    for key in (*OTHER_MODEL_KEYS, "chat_template", "resize_token_embeddings_to_32x"):
        data.pop(key, None)
    data.update(max_steps=2, bf16=False, micro_batch_size=2, lora_r=8, gradient_checkpointing=False)
    data.update(sequence_len=128, val_set_size=2, eval_steps=1, save_steps=2, eval_max_new_tokens=4)
    path = tmp_path / "phi3-ft.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["train", str(path)]) == 0
    assert "debug: the first training example:" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [row for row in rows if "eval/loss" in row]
    assert [row["step"] for row in evals] == [0, 1, 2] and all(row["eval/perplexity"] > 1 for row in evals)
    predictions = (tmp_path / "run" / "eval_predictions.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in predictions] == [0, 0, 1, 1, 2, 2]


GDPO_REWARDS = """
def gsm8k_transform(cfg, *args, **kwargs):
    def transform(row, tokenizer=None):
        return {"prompt": [{"role": "user", "content": row["question"]}], "answer": row["answer"].split("#### ")[-1]}

    return transform


def format_reward(completions, **kwargs):
    return [1.0 if c[0]["content"].strip() else 0.0 for c in completions]


def correctness_reward(completions, answer, **kwargs):
    return [2.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]
"""


def test_the_gdpo_example_trains_with_the_reward_module_its_user_writes(
    tmp_path, tiny_base, monkeypatch, capsys
):
    """llama-3--qlora-1b-gdpo.yaml: rl: gdpo (GRPO with each reward normalized before the sum), its two weighted
    rewards, log_completions; its `rwd` module is the user's (Axolotl ships none), written here as a user would."""
    (tmp_path / "rwd.py").write_text(GDPO_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = _with_local_paths("llama-3--qlora-1b-gdpo.yaml", tmp_path, str(tiny_base))
    rows = [{"question": f"What is {a} plus 2?", "answer": f"So {a + 2}.\n#### {a + 2}"} for a in range(8)]
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    data["datasets"][0]["path"] = str(tmp_path / "gsm8k.jsonl")
    for key in ("chat_template", "special_tokens"):  # Llama 3's: the tiny model is a Qwen3
        data.pop(key)
    data.update(max_steps=2, bf16=False, gradient_accumulation_steps=1, sequence_len=128, lora_r=8)
    data.update(
        gradient_checkpointing=False, attn_implementation=None, optimizer="adamw_torch", warmup_steps=0
    )
    data["trl"].update(max_completion_length=8)
    path = tmp_path / "gdpo.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["train", str(path)]) == 0
    assert " completion: " in capsys.readouterr().out  # log_completions, num_completions_to_print: 3
    resolved = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert resolved["rl"] == "grpo" and resolved["trl"]["multi_objective_aggregation"] == "normalize_then_sum"
    records = (tmp_path / "run" / "completions.jsonl").read_text().splitlines()
    assert {"rwd.format_reward", "rwd.correctness_reward", "advantage"} <= json.loads(records[0]).keys()


def test_mixtral_22s_unfrozen_parameters_name_modules_transformers_5_no_longer_has(
    tmp_path, qwen3_tokenizer, capsys
):
    """Its entries name `block_sparse_moe`, transformers 4's module; Mixtral's experts are now `mlp.experts`, so
    they would freeze every weight: refused at start, naming the key."""
    from tiny_models import tiny_model

    from hanzo_gym.cli import main

    base = tmp_path / "tiny-mixtral"
    tiny_model(
        "mixtral", vocab_size=len(qwen3_tokenizer), eos_token_id=qwen3_tokenizer.eos_token_id
    ).save_pretrained(base)
    qwen3_tokenizer.save_pretrained(base)
    assert any(".mlp.experts." in name for name, _ in tiny_model("mixtral").named_parameters())
    data = _with_local_paths("mistral--mixtral--mixtral_22.yml", tmp_path, str(base))
    data.update(max_steps=1, sequence_len=64, val_set_size=0, bf16=False)
    for key in OTHER_MODEL_KEYS:
        data.pop(key, None)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["train", str(path)]) == 2
    assert "unfrozen_parameters: `model.layers.4[4-9]+.block_sparse_moe.experts`" in capsys.readouterr().err
