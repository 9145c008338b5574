"""The model card a push writes as the repo's README.md: the front matter the Hub reads (`base_model`,
`library_name`, `tags`), what the model is, its final numbers, how to load it, and its training config as a user
would write it, every local path replaced (loops/hub_paths.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from hanzo_gym import __version__
from hanzo_gym.config import Config
from hanzo_gym.config.schema import pydantic_model_in
from hanzo_gym.loops.hub_paths import Scrub
from hanzo_gym.loops.run_dir import RUN_CONFIG


@dataclass
class RunView:
    """What a push reads from the run directory (never uploaded as such): its config and metrics."""

    run_dir: Path
    config: dict = field(default_factory=dict)
    metrics: list[dict] = field(default_factory=list)

    @classmethod
    def read(cls, run_dir: Path) -> RunView:
        config_file, metrics_file = run_dir / RUN_CONFIG, run_dir / "metrics.jsonl"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        metrics = []
        if metrics_file.is_file():
            for line in metrics_file.read_text(encoding="utf-8").splitlines():
                try:
                    metrics.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a torn last line
        return cls(run_dir, config, metrics)


def training_method(config: dict) -> str:
    return config.get("rl") or "sft"


def model_card(
    view: RunView, scrub: Scrub, repo_id: str, full_model: bool, progress: str | None = None
) -> str:
    """README.md: YAML front matter the Hub reads, what the model is, its final numbers and its training config."""
    config = view.config
    method = training_method(config)
    adapter = config.get("adapter")
    tags = ["hanzo-gym", *(["qlora", "lora"] if adapter == "qlora" else [adapter] if adapter else []), method]
    front: dict[str, Any] = {}
    if scrub.base_model:
        front["base_model"] = scrub.base_model
    front.update(
        library_name="transformers" if full_model else "peft", pipeline_tag="text-generation", tags=tags
    )
    base = config.get("base_model")
    if scrub.base_model:
        shown_base = f"[{scrub.base_model}](https://huggingface.co/{scrub.base_model})"
    else:
        shown_base = f"`{scrub.text(base)}` (a local model)" if base else "its base model"
    kind = "fine-tuned in full" if full_model else f"with a {_ADAPTER_NAMES.get(adapter, 'LoRA')} adapter"
    name = repo_id.split("/")[-1]
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False, allow_unicode=True).rstrip(),
        "---",
        "",
        f"# {name}",
        "",
        f"{shown_base} {kind}, trained with hanzo-gym ({method.upper()}).",
    ]
    if progress:
        lines += ["", f"Training in progress: {progress}."]
    results = _final_numbers(view.metrics)
    if results:
        lines += ["", "## Results", "", "| metric | value | step |", "|---|---|---|"]
        lines += [f"| {key} | {value:.4f} | {step} |" for key, (value, step) in results.items()]
    loader = "AutoModelForCausalLM" if full_model else "AutoPeftModelForCausalLM"
    package = "transformers" if full_model else "peft"
    lines += [
        "",
        "## Use",
        "",
        "```python",
        f"from {package} import {loader}",
        "",
        f'model = {loader}.from_pretrained("{repo_id}")',
        "```",
    ]
    if config:
        lines += [
            "",
            "## Training config",
            "",
            f"The keys of the run's resolved config that are not at their hanzo-gym {__version__} defaults:",
            "",
            "```yaml",
            yaml.safe_dump(scrub.value(config_shown(config)), sort_keys=False, allow_unicode=True).rstrip(),
            "```",
        ]
    return "\n".join(lines) + "\n"


_ADAPTER_NAMES = {"lora": "LoRA", "qlora": "QLoRA"}
_FIRST_KEYS = ("base_model", "revision_of_model", "adapter", "rl", "datasets")


def config_shown(config: dict) -> dict:
    """The resolved config as a user would write it: the keys away from their defaults, at every depth (unset
    ones, `null`, left out too, as an empty key is unset), the model, method and data first."""
    shown = _away_from_defaults(config, Config)
    first = {key: shown.pop(key) for key in _FIRST_KEYS if key in shown}
    return {**first, **shown}


def _away_from_defaults(values: dict, model: type[BaseModel] | None) -> dict:
    kept = {}
    for key, value in values.items():
        field = model.model_fields.get(key) if model is not None else None
        if value is None:
            continue
        if field is not None and not field.is_required():
            default = to_jsonable_python(field.get_default(call_default_factory=True))
            if _without_nulls(value) == _without_nulls(default):
                continue
        inner = pydantic_model_in(field.annotation) if field is not None else None
        if isinstance(value, dict):
            value = _away_from_defaults(value, inner)
        elif isinstance(value, list):
            value = [_away_from_defaults(item, inner) if isinstance(item, dict) else item for item in value]
        kept[key] = value
    return kept


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _final_numbers(metrics: list[dict]) -> dict[str, tuple[float, int]]:
    """The newest value of the headline metrics: the train loss, the eval loss, GRPO's reward."""
    found: dict[str, tuple[float, int]] = {}
    for row in metrics:
        for key in ("loss", "eval/loss", "reward"):
            if isinstance(row.get(key), int | float):
                found[key] = (float(row[key]), int(row.get("step", 0)))
    return found
