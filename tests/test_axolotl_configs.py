"""Axolotl's own preference-training example configs (tests/axolotl_configs/, verbatim): each loads with only its
paths changed, or is refused for exactly the Axolotl features not implemented yet; with those keys taken out,
their dataset types train two steps on a tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from hanzo_gym.cli import main
from hanzo_gym.config import parse_config
from hanzo_gym.data.axolotl_templates import FAMILY_TEMPLATES
from hanzo_gym.errors import ConfigError

CONFIGS = Path(__file__).parent / "axolotl_configs"

# What still blocks each config as written (shrink as the features land: issue 13).
STILL_REFUSED = {
    "llama-3--instruct-dpo-lora-8b.yml": {"load_in_8bit"},
    "llama-3--qlora-1b-kto.yaml": set(),
    # (its special_tokens add <|im_start|> / <|im_end|> to Mistral's vocabulary: refused when the tokenizer loads)
    "mistral--dpo--mistral-dpo-qlora.yml": {"lora_modules_to_save"},
    "mistral--orpo--mistral-qlora-orpo.yml": set(),
    "qwen2--dpo.yaml": {"adapter"},
}
# Keys that name a model of their own (Mistral, Llama classes and tokens): the tiny model is a Qwen3.
OTHER_MODEL_KEYS = ("model_type", "tokenizer_type", "special_tokens")


# One row in the format each config's dataset type reads.
ROWS = {
    "chat_template.default": lambda q, good, bad: {
        "conversation": [{"role": "user", "content": q}],
        "chosen": {"role": "assistant", "content": good},
        "rejected": {"role": "assistant", "content": bad},
    },
    "chat_template.argilla": lambda q, good, bad: {
        "chosen": [{"role": "user", "content": q}, {"role": "assistant", "content": good}],
        "rejected": [{"role": "user", "content": q}, {"role": "assistant", "content": bad}],
    },
    "llama3.ultra": lambda q, good, bad: {"prompt": q, "completion": good, "label": True},
}


def _with_local_paths(name: str, tmp_path: Path, base_model: str) -> dict:
    data = yaml.safe_load((CONFIGS / name).read_text())
    data["base_model"] = base_model
    data["output_dir"] = str(tmp_path / "run")
    if data.get("dataset_prepared_path"):  # relative to the working directory, as in Axolotl
        data["dataset_prepared_path"] = str(tmp_path / data["dataset_prepared_path"])
    for number, ds in enumerate(data["datasets"]):
        path = tmp_path / f"data-{number}.jsonl"
        rows = []
        for a in range(6):
            row = ROWS[ds["type"]](f"What is {a} plus 2?", f"{a + 2}.", f"{a * 5 + 1}, surely.")
            if ds["type"] == "llama3.ultra" and a % 2:
                row = {**row, "completion": f"{a * 5 + 1}, surely.", "label": False}
            rows.append(row)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        ds["path"] = str(path)
        ds.pop("split", None)
    return data


def _refused_keys(message: str) -> set[str]:
    keys = set()
    for line in message.splitlines():
        found = re.search(r"(?:Axolotl's|unknown key|^[^`]*?) `([a-z_0-9.\[\]]+)`", line)
        if found:
            keys.add(found.group(1))
    return keys


@pytest.mark.parametrize("name", sorted(STILL_REFUSED))
def test_each_config_loads_or_names_exactly_the_features_not_there_yet(name, tmp_path):
    data = _with_local_paths(name, tmp_path, "unused")
    if not STILL_REFUSED[name]:
        parse_config(data, name)
        return
    with pytest.raises(ConfigError) as refused:
        parse_config(data, name)
    assert _refused_keys(str(refused.value)) == STILL_REFUSED[name], str(refused.value)


@pytest.mark.parametrize(
    "name", ["llama-3--qlora-1b-kto.yaml", "mistral--orpo--mistral-qlora-orpo.yml", "qwen2--dpo.yaml"]
)
def test_without_the_refused_keys_each_config_trains_two_steps(name, tmp_path, tiny_base):
    data = _with_local_paths(name, tmp_path, str(tiny_base))
    for key in (*STILL_REFUSED[name], *OTHER_MODEL_KEYS):
        data.pop(key, None)
    if data.get("chat_template") in FAMILY_TEMPLATES:  # another family's template than the tiny Qwen3's
        data.pop("chat_template")
    if name == "qwen2--dpo.yaml":  # full fine-tuning is not there yet: the same run with a LoRA adapter
        data.update(adapter="lora", lora_target_linear=True)
    # the tiny model: a rank it has room for, two short steps
    data.update(
        max_steps=2, val_set_size=0, bf16=False, micro_batch_size=2, gradient_accumulation_steps=1, lora_r=8
    )
    data.update(gradient_checkpointing=False, evals_per_epoch=None, saves_per_epoch=None, sequence_len=128)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    assert main(["train", str(path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]
