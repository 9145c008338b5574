"""Loading a config written into a test's temporary folder, or the one-message error it gives."""

from __future__ import annotations

import pytest
import yaml

from hanzo_gym.config import load_config, parse_config
from hanzo_gym.errors import ConfigError

# The fewest keys a LoRA SFT config needs, for tests of other keys' rules (nothing is loaded).
MINIMAL = {
    "base_model": "unused",
    "datasets": [{"path": "data.jsonl", "type": "chat_template"}],
    "output_dir": "out",
    "adapter": "lora",
    "lora_target_linear": True,
}


def parse_minimal(**keys):
    """MINIMAL with `keys` over it, parsed as gym train parses a file."""
    return parse_config({**MINIMAL, **keys}, "run.yaml")


def refusal_of(**keys) -> str:
    """The ConfigError MINIMAL with `keys` over it fails with."""
    with pytest.raises(ConfigError) as error:
        parse_minimal(**keys)
    return str(error.value)


def load_text(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return load_config(path)


def error_of(tmp_path, text) -> str:
    with pytest.raises(ConfigError) as caught:
        load_text(tmp_path, text)
    return str(caught.value)


def write_tiny_run(tmp_path, base_model, data, name="run", **overrides):
    """A two-core-fast LoRA SFT run config on `base_model` and the chat dataset `data`, written to a YAML file."""
    cfg = {
        "base_model": str(base_model),
        "datasets": [{"path": str(data), "type": "chat_template"}],
        "val_set_size": 0,
        "output_dir": str(tmp_path / name),
        "sequence_len": 64,
        "adapter": "lora",
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "lora_target_linear": True,
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "learning_rate": 5e-3,
        "logging_steps": 1,
        "bf16": False,
        "seed": 7,
    }
    cfg.update(overrides)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
