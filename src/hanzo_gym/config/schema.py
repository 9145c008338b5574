"""The run config: Axolotl-shaped YAML, every key declared once with its default and its check.

Unknown keys and bad values fail at load with the key's path, its YAML line and the nearest valid name.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hanzo_gym.config.yaml_source import load_yaml_file
from hanzo_gym.errors import ConfigError, DataError, GymError

# torch, numpy and Python's `random` all take seeds up to 2**32 - 1 (numpy's legacy seeding allows no more).
MAX_SEED = 2**32 - 1


class _Strict(BaseModel):
    # allow_inf_nan=False: `.inf` or `.nan` for any float key is a load error naming the key and its line.
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, allow_inf_nan=False)


class MessagePropertyMappings(_Strict):
    role: str = "role"
    content: str = "content"


class DatasetConfig(_Strict):
    path: str
    type: Literal["chat_template", "alpaca", "completion"]
    split: str | None = None
    data_files: list[str] | None = None
    field_messages: str = "messages"
    message_property_mappings: MessagePropertyMappings | None = None
    roles_to_train: list[str] = ["assistant"]
    train_on_eos: Literal["turn", "last", "all", "none"] = "turn"
    field_instruction: str = "instruction"
    field_input: str = "input"
    field_output: str = "output"
    field: str = "text"

    @field_validator("split")
    @classmethod
    def _split_parses(cls, value: str | None) -> str | None:
        if value is not None:
            from hanzo_gym.data.sources import Split

            try:
                Split.parse(value)
            except DataError as exc:  # the parser's message already says what is allowed
                raise ValueError(str(exc)) from None
        return value

    @property
    def mappings(self) -> MessagePropertyMappings:
        return self.message_property_mappings or MessagePropertyMappings()


class TrlConfig(_Strict):
    """GRPO settings under TRL's names (plus Tinker's `loss_fn` and `remove_constant_reward_groups`)."""

    num_generations: int = Field(4, ge=2)
    max_completion_length: int = Field(256, ge=1)
    beta: float = Field(0.0, ge=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    scale_rewards: Literal["group", "batch", "none", True, False] = True
    reward_funcs: list[str] = []
    reward_weights: list[float] = []
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    loss_fn: Literal["ppo", "importance_sampling", "cispo", "dro"] = "ppo"
    epsilon: float = Field(0.2, gt=0)
    epsilon_high: float | None = Field(None, gt=0)
    num_iterations: int = Field(1, ge=1)
    mask_truncated_completions: bool = False
    remove_constant_reward_groups: bool = False

    @property
    def reward_scaling(self) -> str:
        """`scale_rewards` with TRL's boolean aliases resolved: true → group, false → none."""
        return {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)

    @field_validator("reward_funcs")
    @classmethod
    def _rewards_parse(cls, specs: list[str]) -> list[str]:
        from hanzo_gym.rewards import parse_reward

        for spec in specs:
            try:
                parse_reward(spec)
            except GymError as exc:
                raise ValueError(str(exc)) from None
        return specs


class Config(_Strict):
    base_model: str
    tokenizer_config: str | None = None
    chat_template: str | None = None
    datasets: list[DatasetConfig] = Field(min_length=1)
    val_set_size: float = Field(0.0, ge=0)
    output_dir: str
    sequence_len: int = Field(2048, gt=1)
    train_on_inputs: bool = False
    sample_packing: bool = False

    adapter: Literal["lora", "qlora", "none"]
    load_in_4bit: bool = (
        False  # QLoRA: the frozen base in 4-bit NF4 (bitsandbytes), the adapter in full precision
    )
    lora_r: int = Field(8, gt=0)
    lora_alpha: float = Field(16.0, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_modules: list[str] = []
    lora_target_linear: bool = False

    micro_batch_size: int = Field(1, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    num_epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    learning_rate: float = Field(2e-4, ge=0)
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int | None = Field(None, ge=0)
    warmup_ratio: float | None = Field(None, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, ge=0)
    logging_steps: int = Field(10, ge=1)
    eval_steps: int | None = Field(None, ge=1)
    save_steps: int | None = Field(None, ge=1)
    resume_from_checkpoint: str | bool | None = None
    seed: int = Field(42, ge=0, le=MAX_SEED)
    bf16: Literal["auto", True, False] = "auto"
    gradient_checkpointing: bool = False

    rl: Literal["grpo"] | None = None
    trl: TrlConfig = TrlConfig()

    @field_validator("chat_template")
    @classmethod
    def _known_chat_template(cls, value: str | None) -> str | None:
        from hanzo_gym.data.chat_templates import FALLBACK_PREFIX, TOKENIZER_DEFAULT, is_jinja, template_names

        if value is None or is_jinja(value):
            return value
        name = value.removeprefix(FALLBACK_PREFIX)
        if value != TOKENIZER_DEFAULT and name not in template_names():
            close = difflib.get_close_matches(name, template_names(), n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            raise ValueError(
                f"unknown template; {hint}use {TOKENIZER_DEFAULT}, {FALLBACK_PREFIX}<name>, inline Jinja, "
                f"or one of {', '.join(template_names())}"
            )
        return value

    @model_validator(mode="after")
    def _cross_key_rules(self) -> Config:
        if self.adapter == "none":
            raise ValueError("full fine-tuning (adapter: none) is not supported yet; set `adapter: lora`")
        if (self.adapter == "qlora") != self.load_in_4bit:
            raise ValueError(
                "adapter: qlora and load_in_4bit: true go together (QLoRA: a LoRA adapter on a 4-bit base); "
                "set both, or `adapter: lora` without load_in_4bit"
            )
        if not (self.lora_target_linear or self.lora_target_modules):
            raise ValueError("lora needs `lora_target_modules` or `lora_target_linear: true`")
        untrainable = sorted(set(self.lora_target_modules) & {"lm_head", "embed_tokens", "wte", "embed_out"})
        if untrainable:
            raise ValueError(
                f"lora_target_modules {untrainable}: LoRA on the embedding or output layer is not supported "
                "(vLLM refuses such adapters); adapt the attention and MLP projections"
            )
        if isinstance(self.resume_from_checkpoint, str) and not Path(self.resume_from_checkpoint).is_dir():
            raise ValueError(f"resume_from_checkpoint: {self.resume_from_checkpoint} is not a directory")
        if self.rl == "grpo":
            if not self.trl.reward_funcs:
                raise ValueError("rl: grpo needs `trl.reward_funcs`")
            if self.trl.reward_weights and len(self.trl.reward_weights) != len(self.trl.reward_funcs):
                raise ValueError(
                    f"trl.reward_weights has {len(self.trl.reward_weights)} entries for "
                    f"{len(self.trl.reward_funcs)} trl.reward_funcs; give one weight per function"
                )
        return self

    def warmup(self, total_steps: int) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.warmup_ratio is not None:
            return round(total_steps * self.warmup_ratio)
        return 0


# Keys users bring from Axolotl that name features we do not have yet: say so plainly instead of "unknown key".
_NOT_YET: dict[str, str] = {
    "load_in_8bit": "8-bit loading is not supported yet; remove `load_in_8bit` and train with `adapter: lora`",
    "deepspeed": "DeepSpeed is not supported; multi-process training runs under torchrun",
    "fsdp": "FSDP is not supported yet",
    "fsdp_config": "FSDP is not supported yet",
}
_VALUES_NOT_YET: dict[tuple[str, Any], str] = {
    ("adapter", "full"): "full fine-tuning is not supported yet; use `adapter: lora`",
    **{
        (
            "rl",
            name,
        ): f"rl: {name} (DPO family) is not supported yet; hanzo-gym trains `rl: grpo` or SFT (no `rl` key)"
        for name in ("dpo", "ipo", "kto", "orpo", "simpo")
    },
}


def _model_at(loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The pydantic model that holds the keys at `loc` (a path of keys and list indices)."""
    model: type[BaseModel] = Config
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        inner = _pydantic_model_in(field.annotation)
        if inner is None:
            return None
        model = inner
    return model


def _pydantic_model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _pydantic_model_in(arg)
        if found is not None:
            return found
    return None


def _dotted(loc: tuple[str | int, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _line_of(lines: dict, loc: tuple) -> int | None:
    while loc:
        if loc in lines:
            return lines[loc]
        loc = loc[:-1]
    return lines.get(())


def _describe(error: dict, source: str, lines: dict) -> str:
    # pydantic appends tags such as 'literal[...]' or 'function-after[...]' to loc: keep only real keys.
    loc = tuple(p for p in error["loc"] if isinstance(p, int) or "[" not in p)
    line = _line_of(lines, loc) if loc else None
    where = f"{source}:{line}" if line else source
    key = _dotted(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        name = str(loc[-1])
        if name in _NOT_YET and len(loc) == 1:
            return f"{where}: `{name}`: {_NOT_YET[name]}"
        model = _model_at(loc[:-1])
        valid = sorted(model.model_fields) if model else []
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
        hint = f" did you mean `{close[0]}`?" if close else f" valid keys here: {', '.join(valid)}"
        return f"{where}: unknown key `{key}`;{hint}"
    if kind == "missing":
        return f"{where}: `{key}` is required"
    value = error.get("input")
    message = error["msg"].removeprefix("Value error, ")
    if kind == "literal_error":
        allowed = error.get("ctx", {}).get("expected", "")
        words = [w.strip(" '") for w in allowed.replace(" or ", ",").split(",") if w.strip(" '")]
        close = difflib.get_close_matches(str(value), words, n=1, cutoff=0.6)
        hint = f"; did you mean `{close[0]}`?" if close else ""
        return f"{where}: `{key}` is {value!r}; allowed: {allowed}{hint}"
    if kind == "finite_number":
        return f"{where}: `{key}` = {value!r}: use a finite number"
    if not loc:
        return f"{where}: {message}"
    return f"{where}: `{key}` = {value!r}: {message}"


def _reject_not_yet(data: dict, source: str, lines: dict) -> None:
    for (key, value), sentence in _VALUES_NOT_YET.items():
        if data.get(key) == value:
            raise ConfigError(f"{source}:{_line_of(lines, (key,))}: {sentence}")


def parse_config(data: Any, source: str = "<config>", lines: dict | None = None) -> Config:
    """Validate already-parsed YAML data; errors name `source` and, when known, the line."""
    lines = lines or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of config keys at the top level")
    # `load_in_4bit: false` and friends say what Axolotl does by default: nothing to reject.
    data = {key: value for key, value in data.items() if not (key in _NOT_YET and value in (False, None))}
    _reject_not_yet(data, source, lines)
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        errors = sorted(exc.errors(), key=lambda e: _line_of(lines, e["loc"]) or 0)
        raise ConfigError("\n".join(_describe(error, source, lines) for error in errors)) from None


def load_config(path: str | Path) -> Config:
    data, lines = load_yaml_file(path)
    return parse_config(data, str(path), lines)
