"""The run config: Axolotl-shaped YAML, every key declared once with its default and its check.

Unknown keys and bad values fail at load with the key's path, its YAML line and the nearest valid name.
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from hanzo_gym.config.axolotl_keys import (
    NOT_YET,
    OTHER_OPTIMIZERS,
    OTHER_SCHEDULERS,
    VALUES_NOT_YET,
    asks_for_nothing,
    close_misspelling,
    known_path,
)
from hanzo_gym.config.dataset_types import DATASET_TYPES, is_user_transform
from hanzo_gym.config.eval_keys import EvalKeys, check_eval_keys
from hanzo_gym.config.kernel_keys import KernelKeys, check_kernel_keys
from hanzo_gym.config.model_quantization_keys import ModelQuantizationKeys, check_model_quantization
from hanzo_gym.config.parameter_patterns import ROW_RANGE, name_pattern
from hanzo_gym.config.peft_keys import PeftKeys, check_peft_keys
from hanzo_gym.config.preference_keys import PAIR_METHODS, PreferenceKeys, check_preference_keys
from hanzo_gym.config.run_shape_keys import check_run_shape_keys
from hanzo_gym.config.tracking import TrackingKeys
from hanzo_gym.config.vllm_keys import VllmSection, VllmTrlKeys, check_vllm_keys
from hanzo_gym.config.yaml_source import load_yaml_file
from hanzo_gym.errors import ConfigError, DataError, GymError
from hanzo_gym.renderers.instruction_formats import ALPACA_STYLES, InstructionFormat

# Axolotl's warmup when the config gives none: 3 % of the run, at most 100 steps.
DEFAULT_WARMUP_RATIO = 0.03
MAX_DEFAULT_WARMUP = 100
# torch, numpy and Python's `random` all take seeds up to 2**32 - 1 (numpy's legacy seeding allows no more).
MAX_SEED = 2**32 - 1


class _Strict(BaseModel):
    # allow_inf_nan=False: `.inf` or `.nan` for any float key is a load error naming the key and its line.
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, allow_inf_nan=False)


class MessagePropertyMappings(_Strict):
    role: str = "role"
    content: str = "content"


class SpecialTokens(_Strict):
    """Axolotl's `special_tokens`: which of the tokenizer's tokens play these roles."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None


class DatasetTypeMapping(_Strict):
    """Axolotl's `type:` given as a mapping: a prompt format of the user's. SFT and GRPO read the instruction
    keys (Axolotl's user-defined instruction format, renderers/instruction_formats.py); `rl: dpo`, ipo, simpo read
    the pair keys and `rl: kto` the KTO keys (Axolotl's user-defined preference formats). Unset keys take
    Axolotl's defaults; a key of another kind of run is refused (Config)."""

    field_system: str = "system"
    # SFT and GRPO
    system_prompt: str | None = None
    field_instruction: str | None = None
    field_input: str | None = None
    field_output: str | None = None
    format: str | None = None
    no_input_format: str | None = None
    system_format: str | None = None
    # preference data: the prompt, then the pair (rl: dpo, ipo, simpo) or one completion and its label (rl: kto)
    field_prompt: str | None = None
    prompt_format: str | None = None
    field_chosen: str | None = None
    field_rejected: str | None = None
    chosen_format: str | None = None
    rejected_format: str | None = None
    field_completion: str | None = None
    field_label: str | None = None
    completion_format: str | None = None

    INSTRUCTION_KEYS: ClassVar = (
        "system_prompt",
        "field_instruction",
        "field_input",
        "field_output",
        "format",
        "no_input_format",
        "system_format",
    )
    PAIR_KEYS: ClassVar = (
        "field_prompt",
        "prompt_format",
        "field_chosen",
        "field_rejected",
        "chosen_format",
        "rejected_format",
    )
    KTO_KEYS: ClassVar = (
        "field_prompt",
        "prompt_format",
        "field_completion",
        "field_label",
        "completion_format",
    )

    # each format string and the placeholders it may hold
    PLACEHOLDERS: ClassVar = {
        "format": {"instruction", "input"},
        "no_input_format": {"instruction"},
        "system_format": {"system"},
        "prompt_format": {"prompt", "system"},
        "chosen_format": {"chosen"},
        "rejected_format": {"rejected"},
        "completion_format": {"completion"},
    }

    @model_validator(mode="after")
    def _placeholders_known(self) -> DatasetTypeMapping:
        for key, known in self.PLACEHOLDERS.items():
            text = getattr(self, key)
            if text is None:
                continue
            try:
                used = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
            except ValueError as error:
                raise ValueError(f"{key}: {error} (write a literal brace as {{{{ or }}}})") from None
            unknown = sorted(used - known)
            if unknown:
                raise ValueError(
                    f"{key}: {{{unknown[0]}}} is not filled; it may hold {', '.join(f'{{{n}}}' for n in sorted(known))}"
                )
        return self

    def foreign_keys(self, allowed: tuple[str, ...]) -> list[str]:
        """The keys set here that a run reading `allowed` does not read."""
        return sorted(self.model_fields_set - {"field_system", *allowed})

    @property
    def instruction_format(self) -> InstructionFormat:
        """Axolotl's user-defined instruction format, its defaults for the unset keys."""
        system = self.system_prompt or ""
        return InstructionFormat(
            self.format or "{instruction} {input} ",
            self.no_input_format or "{instruction} ",
            self.system_format or "{system}",
            system,
            system,
            self.field_system,
        )


class DatasetConfig(_Strict):
    path: str
    # SFT's types (`alpaca:<style>` too), a preference type (config/preference_keys.py) that an `rl: dpo`-family
    # run reads, a transform of the user's (`module.function`), or a format of the user's as a mapping
    type: Annotated[
        # the tags hold brackets so that error paths leave them out (_describe)
        Annotated[str, Tag("str[type]")] | Annotated[DatasetTypeMapping, Tag("mapping[type]")],
        Discriminator(
            lambda value: "mapping[type]" if isinstance(value, dict | DatasetTypeMapping) else "str[type]"
        ),
    ]
    split: str | None = None
    data_files: list[str] | None = None
    # a configuration of the dataset (its card's `configs`), as load_dataset(path, name)
    name: str | None = None
    field_messages: str = "messages"
    drop_system_message: bool = False  # leave out a conversation's leading system turn
    message_property_mappings: MessagePropertyMappings | None = None
    # a turn's reasoning: the message field that holds it, and the name the chat template reads it by
    field_thinking: str = "reasoning_content"
    template_thinking_key: str = "reasoning_content"
    roles_to_train: list[str] = ["assistant"]
    train_on_eos: Literal["turn", "last", "all", "none"] = "turn"
    field_instruction: str = "instruction"
    field_input: str = "input"
    field_output: str = "output"
    field: str = "text"
    field_chosen: str = "chosen"
    field_rejected: str = "rejected"
    # Axolotl's role mapping: the canonical role → the names rows use for it (e.g. assistant: [gpt, bot])
    roles: dict[str, list[str]] | None = None

    @model_validator(mode="before")
    @classmethod
    def _old_message_field_names(cls, data: Any) -> Any:
        """`message_field_role` / `message_field_content`: Axolotl's older names of the two mappings."""
        if not isinstance(data, dict) or not {"message_field_role", "message_field_content"} & set(data):
            return data
        data = dict(data)
        mappings = dict(data.get("message_property_mappings") or {})
        for old, key in (("message_field_role", "role"), ("message_field_content", "content")):
            if old not in data:
                continue
            value = data.pop(old)
            if mappings.get(key, value) != value:
                raise ValueError(
                    f"{old}: {value} and message_property_mappings.{key}: {mappings[key]} disagree; give one"
                )
            mappings[key] = value
        data["message_property_mappings"] = mappings
        return data

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str | DatasetTypeMapping) -> str | DatasetTypeMapping:
        if isinstance(value, str) and value.startswith("alpaca:"):
            style = value.partition(":")[2]
            if style not in ALPACA_STYLES:
                raise ValueError(f"`alpaca:{style}`: Axolotl's alpaca styles are {', '.join(ALPACA_STYLES)}")
            return value
        if isinstance(value, str) and value not in DATASET_TYPES:
            close = close_misspelling(value, list(DATASET_TYPES))
            if close is None and is_user_transform(value):
                # Axolotl's `module.function`: a transform of the user's (data/user_transforms.py)
                return value
            hint = f"did you mean `{close}`? " if close else ""
            raise ValueError(
                f"unknown dataset type; {hint}SFT and GRPO read chat_template, alpaca (alpaca:chat, alpaca:chatml, "
                "alpaca:phi), input_output (SFT) or completion, or a `type:` mapping of your own format; preference "
                "training (rl: dpo, ipo, orpo, simpo, kto) reads chat_template.default, chat_template.argilla_chat, "
                "chat_template.argilla, passthrough, chatml.<variant> or llama3.<variant>"
            )
        return value

    @field_validator("split")
    @classmethod
    def _split_parses(cls, value: str | None) -> str | None:
        if value is not None:
            from hanzo_gym.config.splits import Split

            try:
                Split.parse(value)
            except DataError as exc:  # the parser's message already says what is allowed
                raise ValueError(str(exc)) from None
        return value

    @property
    def mappings(self) -> MessagePropertyMappings:
        return self.message_property_mappings or MessagePropertyMappings()

    @property
    def instruction_format(self) -> InstructionFormat | None:
        """The instruction prompt of `alpaca`, `alpaca:<style>` or a `type:` mapping; None for other types."""
        if isinstance(self.type, DatasetTypeMapping):
            return self.type.instruction_format
        if self.type == "alpaca" or self.type.startswith("alpaca:"):
            return ALPACA_STYLES[self.type.partition(":")[2] or "instruct"]
        return None

    @property
    def instruction_fields(self) -> tuple[str, str, str]:
        """The row fields of the instruction, the input and the output."""
        own = self.type if isinstance(self.type, DatasetTypeMapping) else None
        if own is None:
            return self.field_instruction, self.field_input, self.field_output
        return (
            own.field_instruction or "instruction",
            own.field_input or "input",
            own.field_output or "output",
        )


class TrlConfig(_Strict, VllmTrlKeys):  # the vLLM rollout keys: config/vllm_keys.py
    """GRPO settings under TRL's names (plus Tinker's `loss_fn` and `remove_constant_reward_groups`)."""

    num_generations: int = Field(4, ge=2)
    max_completion_length: int = Field(256, ge=1)
    # Axolotl's data producer protocol; without its async_prefetch (refused) each step's rollouts come from the
    # current policy, which is what GRPO does here anyway
    use_data_producer: bool = False
    beta: float = Field(0.0, ge=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    scale_rewards: Literal["group", "batch", "none", True, False] = True
    # sum the weighted rewards, then normalize (GRPO); or normalize each reward in its group, sum, and normalize
    # the sums over the batch (GDPO, Axolotl's `rl: gdpo`)
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    reward_funcs: list[str] = []
    reward_weights: list[float] = []
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    loss_fn: Literal["ppo", "importance_sampling", "cispo", "dro"] = "ppo"
    epsilon: float = Field(0.2, gt=0)
    epsilon_high: float | None = Field(None, gt=0)
    num_iterations: int = Field(1, ge=1)
    mask_truncated_completions: bool = False
    # TRL's: at each logged step, the completions since the last one (prompt, completion, each reward, advantage)
    # to completions.jsonl and the trackers, and the first num_completions_to_print (None: all) printed
    log_completions: bool = False
    num_completions_to_print: int | None = Field(None, ge=0)
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


class BnbConfigKwargs(_Strict):
    """Axolotl's `bnb_config_kwargs`: the 4-bit quantization settings a QLoRA base loads with (bitsandbytes')."""

    bnb_4bit_use_double_quant: bool = True  # quantize the per-block scales too (QLoRA's double quantization)
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = "nf4"


class CheckpointingKwargs(_Strict):
    """Axolotl's `gradient_checkpointing_kwargs`: which of torch's checkpointing kinds recomputes the layers."""

    use_reentrant: bool = False


# The mixins' keys sit at the top level, as in Axolotl: config/preference_keys.py, tracking.py, kernel_keys.py,
# eval_keys.py.
ATTENTION_KERNELS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
HUB_KERNEL = r"[\w.-]+/[\w.-]+(@[\w.-]+)?(:\w+)?"  # transformers' `owner/repo[@revision][:function]`


class Config(_Strict, PreferenceKeys, TrackingKeys, KernelKeys, EvalKeys, ModelQuantizationKeys, PeftKeys):
    base_model: str
    revision_of_model: str | None = None  # a branch, tag or commit of a hub base_model
    trust_remote_code: bool = False  # let transformers run the model repository's own Python code
    tokenizer_config: str | None = None
    # Mistral's own tokenizer library encodes the chats (Axolotl's default: on for a Magistral model)
    tokenizer_use_mistral_common: bool | None = None
    special_tokens: SpecialTokens | None = None
    chat_template: str | None = None
    # the tokens that end a turn, trained with it (renderers/chat_templates.py)
    eot_tokens: list[str] | None = None
    datasets: list[DatasetConfig] = Field(min_length=1)
    val_set_size: float = Field(0.0, ge=0)
    dataset_prepared_path: str | None = None  # a folder keeping the tokenized datasets (data/prepared.py)
    # Axolotl's: tokenize as training reads the data, no prepared copy kept; the same examples
    skip_prepare_dataset: bool = False
    output_dir: str
    sequence_len: int = Field(2048, gt=1)
    # SFT examples longer than sequence_len: dropped (Axolotl's default), cut to it, or an error
    excess_length_strategy: Literal["drop", "truncate", "raise"] = "drop"
    train_on_inputs: bool = False
    sample_packing: bool = False
    eval_sample_packing: bool | None = None  # None: as sample_packing (Axolotl's rule)
    pad_to_sequence_len: bool = False  # each SFT row padded to sequence_len tokens (fixed shapes)
    save_safetensors: bool = True  # HF's checkpoint format: hanzo-gym writes safetensors only
    group_by_length: bool = False  # HF's length-grouped order: mega-batches sorted by length
    # Axolotl's data order: the merged datasets shuffled at load (false: in config and file order), each epoch in
    # that order rather than shuffled (curriculum_sampling), samples packed in order (sample_packing_sequentially,
    # which is how hanzo-gym packs anyway)
    shuffle_merged_datasets: bool = True
    curriculum_sampling: bool = False
    sample_packing_sequentially: bool = False

    # absent or empty: full fine-tuning (every weight trains), as in Axolotl
    adapter: Literal["lora", "qlora"] | None = None
    load_in_4bit: bool = (
        False  # QLoRA: the frozen base in 4-bit NF4 (bitsandbytes), the adapter in full precision
    )
    load_in_8bit: bool = False  # LoRA on a frozen base in bitsandbytes' 8-bit (LLM.int8()) layers
    resize_token_embeddings_to_32x: bool = False  # Axolotl's: grow the embeddings to a multiple of 32 rows
    tokens: list[str] | None = None  # added to the vocabulary (their embeddings must train)
    quantize_moe_experts: bool = False  # an MoE model's stacked expert weights in NF4 / int8 too
    # Llama 4's routed experts as one linear layer per expert and projection (model/llama4_experts.py)
    llama4_linearized_experts: bool = False
    bnb_config_kwargs: BnbConfigKwargs | None = None
    # full fine-tuning of only the parameters these name patterns match (model/unfreeze.py)
    unfrozen_parameters: list[str] | None = None
    lora_r: int = Field(8, gt=0)
    lora_alpha: float = Field(16.0, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    peft_use_rslora: bool = False  # rank-stabilised LoRA: scale alpha / sqrt(r) instead of alpha / r
    # module names, or one regular expression over full module paths (PEFT's rule: the whole path matches)
    lora_target_modules: list[str] | str = []
    # whole modules trained beside the adapter (Axolotl's; typically [embed_tokens, lm_head]), saved in it
    lora_modules_to_save: list[str] | None = None
    lora_target_linear: bool = False
    # bare parameters adapted too, an MoE layer's 3-D expert stacks (`experts.gate_up_proj`): PEFT's rule, a
    # parameter whose path is the entry or ends in `.entry` (model/parameter_lora.py)
    lora_target_parameters: list[str] | None = None
    lora_model_dir: str | None = None  # start from this PEFT adapter (its own r, alpha and targets)

    micro_batch_size: int = Field(1, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    num_epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    learning_rate: float = Field(2e-4, ge=0)
    lr_scheduler: Literal[
        "cosine",
        "linear",
        "constant",
        "constant_with_warmup",
        "cosine_with_min_lr",
        "polynomial",
        "inverse_sqrt",
    ] = "cosine"
    cosine_min_lr_ratio: float | None = Field(None, ge=0, le=1)
    lr_quadratic_warmup: bool = False  # Axolotl's: the cosine schedule's warmup rises as (step / warmup)²
    optimizer: Literal[
        "adamw_torch",
        "adamw_torch_fused",
        "adamw_bnb_8bit",
        "adamw_8bit",
        "paged_adamw_8bit",
        "paged_adamw_32bit",
        "adamw_torch_4bit",
        "adamw_torch_8bit",
    ] = "adamw_torch_fused"
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_epsilon: float = Field(1e-8, ge=0)
    warmup_steps: int | None = Field(None, ge=0)
    warmup_ratio: float | None = Field(None, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, ge=0)
    logging_steps: int = Field(10, ge=1)
    # Axolotl's loss watchdog: stop when the newest logged loss is above the threshold for `patience` steps
    loss_watchdog_threshold: float | None = None
    loss_watchdog_patience: int | None = Field(None, ge=1)  # Axolotl's default: 3
    eval_steps: int | None = Field(None, ge=1)
    evals_per_epoch: int | None = Field(None, ge=1)  # Axolotl's other way to say eval_steps
    save_steps: int | None = Field(None, ge=1)
    saves_per_epoch: int | None = Field(None, ge=1)  # Axolotl's other way to say save_steps
    save_total_limit: int | None = Field(None, ge=1)  # keep only the newest N checkpoints (None: all)
    resume_from_checkpoint: str | bool | None = None
    seed: int = Field(42, ge=0, le=MAX_SEED)
    # Axolotl's `strict`: whether command-line overrides may add keys the YAML lacks. hanzo-gym takes no
    # overrides (the YAML is the whole config) and refuses unknown keys either way, so both values load.
    strict: bool = False
    # DDP's search for parameters without a gradient (so that it does not wait for them). hanzo-gym's data
    # parallelism reduces every trainable gradient in one flat all-reduce, a missing one as zeros, so no rank
    # ever waits on an unused parameter: both values run the same.
    ddp_find_unused_parameters: bool | None = None
    bf16: Literal["auto", True, False] = "auto"
    # Axolotl's older switch for weights cast to bfloat16: true is `bf16: true` (the base in bf16; LoRA and
    # AdamW stay fp32, as PEFT keeps an adapter on a bf16 base)
    bfloat16: bool | None = None
    # transformers' low-memory loading: the only way transformers 5 loads, so both values load the same
    low_cpu_mem_usage: bool | None = None
    # leave out exact duplicates (equal tokens and labels), the first one kept; validation rows equal to a
    # training row go too
    dataset_exact_deduplication: bool = False
    tf32: Literal["auto", True, False] | None = None  # CUDA's TF32 matmuls; no effect on a CPU
    # a transformers kernel name, or a kernel on the Hub (`kernels-community/flash-attn3`, run through `kernels`)
    attn_implementation: str | None = None
    # Axolotl's older switch: true means attn_implementation flash_attention_2
    flash_attention: bool | None = None
    model_type: str | None = None  # Axolotl's model class, checked against what base_model loads as
    tokenizer_type: str | None = None  # Axolotl's tokenizer class, likewise
    # `offload`: Axolotl's older spelling of true plus activation_offloading
    gradient_checkpointing: bool | Literal["offload"] = False
    gradient_checkpointing_kwargs: CheckpointingKwargs = CheckpointingKwargs()
    # saved activations in host memory until the backward pass; legacy / hidden_states are Axolotl's variants
    activation_offloading: bool | Literal["legacy", "hidden_states"] = False

    rl: Literal["grpo", "dpo", "ipo", "orpo", "simpo", "kto"] | None = None
    trl: TrlConfig = TrlConfig()
    vllm: VllmSection | None = None  # Axolotl's `vllm:` block (GRPO rollouts on vLLM)

    @model_validator(mode="before")
    @classmethod
    def _gdpo_is_grpo_with_decoupled_rewards(cls, data: Any) -> Any:
        """Axolotl's `rl: gdpo`: GRPO whose rewards are normalized one by one before they are summed (TRL's
        multi_objective_aggregation: normalize_then_sum, which Axolotl sets for it)."""
        if not isinstance(data, dict) or data.get("rl") != "gdpo":
            return data
        trl = dict(data.get("trl") or {})
        if trl.get("multi_objective_aggregation") == "sum_then_normalize":
            raise ValueError(
                "rl: gdpo with trl.multi_objective_aggregation: sum_then_normalize is GRPO (Axolotl's rule); use "
                "rl: grpo, or normalize_then_sum"
            )
        trl["multi_objective_aggregation"] = "normalize_then_sum"
        return {**data, "rl": "grpo", "trl": trl}

    @field_validator("attn_implementation")
    @classmethod
    def _known_attention(cls, value: str | None) -> str | None:
        if value is None or value in ATTENTION_KERNELS or re.fullmatch(HUB_KERNEL, value):
            return value
        raise ValueError(
            f"unknown attention kernel; use one of {', '.join(ATTENTION_KERNELS)} or a kernel on the Hub "
            "(`owner/repo`, e.g. kernels-community/flash-attn3)"
        )

    @field_validator("lora_target_parameters", mode="before")
    @classmethod
    def _one_parameter_or_a_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value  # Axolotl takes either

    @field_validator("evals_per_epoch", "saves_per_epoch", mode="before")
    @classmethod
    def _zero_per_epoch_is_unset(cls, value: Any) -> Any:
        # Axolotl tests these counts for truth: 0 asks for nothing, as if the key were absent.
        return None if value == 0 and not isinstance(value, bool) else value

    @field_validator("chat_template")
    @classmethod
    def _known_chat_template(cls, value: str | None) -> str | None:
        from hanzo_gym.renderers.chat_templates import (
            FALLBACK_PREFIX,
            TOKENIZER_DEFAULT,
            is_jinja,
            template_names,
        )

        if value is None or is_jinja(value):
            return value
        name = value.removeprefix(FALLBACK_PREFIX)
        if value != TOKENIZER_DEFAULT and name not in template_names():
            close = close_misspelling(name, template_names())
            hint = f"did you mean `{close}`? " if close else ""
            raise ValueError(
                f"unknown template; {hint}use {TOKENIZER_DEFAULT}, {FALLBACK_PREFIX}<name>, inline Jinja, "
                f"or one of {', '.join(template_names())}"
            )
        return value

    def _check_unfrozen_parameters(self) -> None:
        if self.adapter:
            raise ValueError(
                "`unfrozen_parameters` chooses the weights that full fine-tuning trains; with "
                f"`adapter: {self.adapter}` Axolotl freezes the adapter too (its maintainers: not supported with "
                "LoRA), so nothing would train: remove it, or list whole modules in lora_modules_to_save"
            )
        for entry in self.unfrozen_parameters or []:
            if ROW_RANGE.match(entry):
                raise ValueError(
                    f"unfrozen_parameters: `{entry}`: training only some rows of a parameter (Axolotl's "
                    "[start:end]) is not supported yet; unfreeze the whole parameter"
                )
            try:
                name_pattern(entry)
            except re.error as exc:
                raise ValueError(
                    f"unfrozen_parameters: `{entry}` is not a valid regular expression: {exc}"
                ) from None

    def _check_adapter(self) -> None:
        """The LoRA settings' own rules."""
        if (self.adapter == "qlora") != self.load_in_4bit:
            raise ValueError(
                "adapter: qlora and load_in_4bit: true go together (QLoRA: a LoRA adapter on a 4-bit base); "
                "set both, or `adapter: lora` without load_in_4bit"
            )
        if self.load_in_8bit and self.adapter != "lora":
            raise ValueError(
                "load_in_8bit: true trains a LoRA adapter on an 8-bit base: it goes with `adapter: lora` (a 4-bit "
                "base is `adapter: qlora` with load_in_4bit), not with both"
            )
        if not (self.lora_target_linear or self.lora_target_modules or self.lora_target_parameters):
            raise ValueError(
                "lora needs `lora_target_modules`, `lora_target_linear: true` or `lora_target_parameters`"
            )
        if self.lora_target_parameters and self.lora_dropout:
            raise ValueError(
                f"`lora_target_parameters` with lora_dropout {self.lora_dropout}: LoRA on a bare parameter adds its "
                "ΔW to the weight, so there is no separate input to drop out (PEFT refuses it; Axolotl's examples "
                "set 0): set lora_dropout: 0"
            )
        if self.trl.use_vllm and (self.load_in_4bit or self.load_in_8bit) and self.trl.vllm_mode != "colocate":
            raise ValueError(
                "`trl.use_vllm` in server mode with a 4- or 8-bit base: the server adds each adapter to the "
                "full-precision base it loaded, not to the quantized one the adapter trains on; use "
                "`trl.vllm_mode: colocate` (which hands vLLM the dequantized base) or `adapter: lora`"
            )
        if self.lora_target_parameters and self.trl.use_vllm:
            raise ValueError(
                "`lora_target_parameters` with trl.use_vllm: vLLM loads LoRA adapters of linear layers, not of "
                "bare expert parameters; sample on the training engine (remove use_vllm) or adapt linear layers only"
            )
        if isinstance(self.lora_target_modules, str):
            try:
                re.compile(self.lora_target_modules)
            except re.error as exc:
                raise ValueError(f"lora_target_modules is not a valid regular expression: {exc}") from None
        names = [] if isinstance(self.lora_target_modules, str) else self.lora_target_modules
        untrainable = sorted(set(names) & {"lm_head", "embed_tokens", "wte", "embed_out"})
        if untrainable:
            raise ValueError(
                f"lora_target_modules {untrainable}: LoRA on the embedding or output layer is not supported "
                "(vLLM refuses such adapters); adapt the attention and MLP projections"
            )

    def _check_full_fine_tuning(self) -> None:
        """What full fine-tuning (no adapter) cannot go with, each with the reason."""
        if self.load_in_4bit or self.load_in_8bit:
            raise ValueError(
                "no `adapter` means full fine-tuning, which trains every weight: a 4- or 8-bit base cannot "
                "hold trained weights; set `adapter: qlora` (4-bit) or `adapter: lora` (8-bit)"
            )
        if self.rl == "grpo" and self.trl.use_vllm:
            raise ValueError(
                "full fine-tuning (no `adapter`) with trl.use_vllm: vLLM is handed the trained weights as a LoRA "
                "adapter, and a fully trained model has none; sample on the training engine (remove use_vllm) or "
                "set `adapter: lora`"
            )
        if self.rl in ("dpo", "ipo", "kto"):
            # The reference is the starting model: its log-probs are computed before the first step (TRL's
            # precompute_ref_log_probs), instead of a second copy of the model in memory as TRL keeps. KTO's
            # KL pairs of every planned micro-batch are among them (loops/preference.py).
            self.precompute_ref_log_probs = True
        given = sorted(
            key
            for key in self.model_fields_set
            if (key.startswith("lora_") or key == "peft_use_rslora")
            and getattr(self, key) not in (None, [], False, type(self).model_fields[key].default)
        )
        if given:
            raise ValueError(
                f"{', '.join(given)}: no `adapter` means full fine-tuning, where LoRA settings do nothing; "
                "remove them, or set `adapter: lora`"
            )

    @property
    def full_fine_tuning(self) -> bool:
        return self.adapter is None

    @property
    def bnb_4bit_settings(self) -> dict[str, Any]:
        """The 4-bit settings bnb_config_kwargs changes from QLoRA's (NF4, double quantization)."""
        return self.bnb_config_kwargs.model_dump(exclude_defaults=True) if self.bnb_config_kwargs else {}

    @property
    def lora_targets(self) -> list[str] | str:
        """What the adapter targets: `all-linear`, sorted module names, or the regular expression."""
        if self.lora_target_linear:
            return "all-linear"
        if isinstance(self.lora_target_modules, str):
            return self.lora_target_modules
        return sorted(self.lora_target_modules)

    @model_validator(mode="after")
    def _cross_key_rules(self) -> Config:
        if self.flash_attention:
            if self.attn_implementation not in (None, "flash_attention_2"):
                raise ValueError(
                    f"flash_attention: true means attn_implementation flash_attention_2, and the config also says "
                    f"attn_implementation: {self.attn_implementation}; give one of them"
                )
            self.attn_implementation = "flash_attention_2"  # Axolotl's own normalization of the old switch
        if self.gradient_checkpointing == "offload":  # Axolotl's normalization of its older spelling
            self.gradient_checkpointing, self.activation_offloading = True, True
        if self.activation_offloading and not self.gradient_checkpointing:
            raise ValueError(
                "activation_offloading needs `gradient_checkpointing: true`, as in Axolotl: set it, or remove "
                "activation_offloading"
            )
        if self.bfloat16:
            if self.bf16 is False:
                raise ValueError(
                    "bfloat16: true casts the model to bf16, and the config also says bf16: false"
                )
            self.bf16 = True
        if self.quantize_moe_experts:
            if not (self.load_in_4bit or self.load_in_8bit):
                raise ValueError(
                    "quantize_moe_experts quantizes a 4- or 8-bit base's experts too: it needs load_in_4bit "
                    "(`adapter: qlora`) or load_in_8bit (`adapter: lora`)"
                )
            if self.lora_target_linear:  # Axolotl's rule: a fused expert tensor is no linear layer to adapt
                raise ValueError(
                    "lora_target_linear does not go with quantize_moe_experts (Axolotl refuses it too); name the "
                    "modules in lora_target_modules"
                )
        if self.llama4_linearized_experts and self.quantize_moe_experts:
            raise ValueError(
                "llama4_linearized_experts makes Llama 4's experts linear layers, which load_in_4bit / load_in_8bit "
                "quantize already; remove quantize_moe_experts"
            )
        if self.llama4_linearized_experts and self.trl.use_vllm:
            raise ValueError(
                "llama4_linearized_experts with trl.use_vllm: vLLM loads Llama 4's experts stacked, not as the linear "
                "layers this run trains over; sample on the training engine (remove use_vllm)"
            )
        if self.bnb_config_kwargs is not None and not self.load_in_4bit:
            raise ValueError(
                "bnb_config_kwargs sets how a 4-bit base is quantized; it needs load_in_4bit (`adapter: qlora`)"
            )
        if self.skip_prepare_dataset and self.dataset_prepared_path:
            raise ValueError(
                "skip_prepare_dataset: true keeps no prepared copy of the datasets, and dataset_prepared_path names "
                "a folder for one: give one of them"
            )
        if self.unfrozen_parameters:
            self._check_unfrozen_parameters()
        if self.adapter is None:
            self._check_full_fine_tuning()
        else:
            self._check_adapter()
        if self.lr_scheduler == "polynomial" and self.learning_rate <= 1e-7:
            raise ValueError(
                f"lr_scheduler: polynomial decays to HF's end rate 1e-7, which learning_rate {self.learning_rate} "
                "does not exceed; raise learning_rate or use another schedule"
            )
        if self.lr_scheduler == "cosine_with_min_lr" and self.cosine_min_lr_ratio is None:
            raise ValueError(
                "lr_scheduler: cosine_with_min_lr needs `cosine_min_lr_ratio` (the final lr as a fraction of "
                "learning_rate, e.g. 0.1)"
            )
        if self.lr_quadratic_warmup and (self.lr_scheduler != "cosine" or self.cosine_min_lr_ratio is not None):
            raise ValueError(
                "lr_quadratic_warmup is Axolotl's cosine schedule with a quadratic warmup: it needs "
                "`lr_scheduler: cosine` without cosine_min_lr_ratio (with it, Axolotl drops the minimum); "
                "change or remove one of them"
            )
        if self.cosine_min_lr_ratio is not None and self.lr_scheduler not in ("cosine", "cosine_with_min_lr"):
            raise ValueError(
                f"cosine_min_lr_ratio applies to the cosine schedule, not lr_scheduler: {self.lr_scheduler}; "
                "remove it or use `lr_scheduler: cosine`"
            )
        for steps, per_epoch in (("eval_steps", "evals_per_epoch"), ("save_steps", "saves_per_epoch")):
            if getattr(self, steps) is not None and getattr(self, per_epoch) is not None:
                raise ValueError(f"`{steps}` and `{per_epoch}` say the same thing two ways; give one of them")
        if isinstance(self.resume_from_checkpoint, str) and not Path(self.resume_from_checkpoint).is_dir():
            raise ValueError(f"resume_from_checkpoint: {self.resume_from_checkpoint} is not a directory")
        check_preference_keys(self)
        check_vllm_keys(self.trl, self.vllm, self.rl)
        check_kernel_keys(self, self.adapter, self.attn_implementation)
        check_model_quantization(self, self.load_in_4bit, self.load_in_8bit)
        check_peft_keys(
            self,
            self.adapter,
            self.load_in_4bit or self.load_in_8bit,
            self.trl.use_vllm,
            bool(self.lora_target_parameters),
        )
        check_run_shape_keys(self)  # lora_model_dir, the batching keys: config/run_shape_keys.py
        check_eval_keys(self)
        if self.loss_watchdog_patience is not None and self.loss_watchdog_threshold is None:
            raise ValueError(
                "loss_watchdog_patience needs `loss_watchdog_threshold` (the loss that counts as too high)"
            )
        self._check_type_mappings()
        if self.uses_mistral_common:
            self._check_mistral_common()
        if self.rl == "grpo" and any(ds.type == "input_output" for ds in self.datasets):
            raise ValueError(
                "type: input_output is SFT's (labelled segments have no prompt to answer); rl: grpo reads "
                "chat_template, alpaca, completion or a transform of your own"
            )
        if self.lora_modules_to_save:
            if self.rl == "grpo":
                raise ValueError(
                    "lora_modules_to_save with rl: grpo: the sampler folds only the LoRA deltas into its weights, "
                    "so rollouts would not come from the trained modules; train them with SFT or DPO"
                )
            if self.lora_model_dir is not None:
                raise ValueError(
                    "lora_modules_to_save with lora_model_dir: the adapter directory's own settings govern, so "
                    "the key would do nothing; remove one of them"
                )
        if self.rl == "grpo" and self.loss_watchdog_threshold is not None:
            raise ValueError(
                "loss_watchdog_threshold watches a loss that falls as training works (SFT, DPO and its family), "
                "not rl: grpo's"
            )
        if self.rl == "grpo" and self.excess_length_strategy != "drop":
            raise ValueError(
                f"excess_length_strategy: {self.excess_length_strategy} is implemented for SFT and preference "
                "data, not yet for rl: grpo (its prompts longer than sequence_len are dropped); remove it"
            )
        if not self.save_safetensors:
            raise ValueError(
                "save_safetensors: false asks for pickled .bin checkpoints; hanzo-gym writes safetensors only "
                "(and never unpickles on resume): remove it"
            )
        if (
            self.trl.multi_objective_aggregation == "normalize_then_sum"
            and self.trl.reward_scaling != "group"
        ):
            raise ValueError(
                f"trl.scale_rewards: {self.trl.scale_rewards} with multi_objective_aggregation: normalize_then_sum "
                "(GDPO): each reward is normalized in its group and the sums over the batch, whatever "
                "scale_rewards says (TRL's rule); remove scale_rewards"
            )
        if self.trl.num_completions_to_print is not None and not self.trl.log_completions:
            raise ValueError("trl.num_completions_to_print needs trl.log_completions: true (TRL's rule)")
        if self.rl == "grpo":
            if not self.trl.reward_funcs:
                raise ValueError("rl: grpo needs `trl.reward_funcs`")
            if self.trl.reward_weights and len(self.trl.reward_weights) != len(self.trl.reward_funcs):
                raise ValueError(
                    f"trl.reward_weights has {len(self.trl.reward_weights)} entries for "
                    f"{len(self.trl.reward_funcs)} trl.reward_funcs; give one weight per function"
                )
        return self

    @property
    def shuffles_at_load(self) -> bool:
        """Axolotl's merge: the rows shuffled with the seed once loaded (before the validation split), unless
        shuffle_merged_datasets is false, or curriculum_sampling is on with a single dataset."""
        single_in_order = self.curriculum_sampling and len(self.datasets) == 1
        return self.shuffle_merged_datasets and not single_in_order

    @property
    def uses_mistral_common(self) -> bool:
        """Axolotl's rule: `tokenizer_use_mistral_common`, and when unset, on for a Magistral model."""
        if self.tokenizer_use_mistral_common is not None:
            return self.tokenizer_use_mistral_common
        names = (self.base_model, self.tokenizer_config or "")
        return any("magistral" in name.lower() for name in names)

    def _check_mistral_common(self) -> None:
        """What Axolotl refuses beside mistral-common's tokenizer, whose vocabulary and chat format are its own."""
        refused = {
            "special_tokens": self.special_tokens is not None,
            "tokens": bool(self.tokens),
            "chat_template": self.chat_template is not None,
            "eot_tokens": bool(self.eot_tokens),
        }
        for key, given in refused.items():
            if given:
                raise ValueError(
                    f"`{key}` with tokenizer_use_mistral_common: mistral-common's tokenizer fixes the vocabulary, "
                    "its special tokens and how chats are written (Axolotl refuses this too); remove it"
                )

    def _check_type_mappings(self) -> None:
        """A `type:` mapping holds the keys of this run's kind of data only."""
        if self.rl == "kto":
            kind, allowed = "rl: kto", DatasetTypeMapping.KTO_KEYS
        elif self.rl in PAIR_METHODS:
            kind, allowed = f"rl: {self.rl}", DatasetTypeMapping.PAIR_KEYS
        else:
            kind, allowed = "SFT and GRPO", DatasetTypeMapping.INSTRUCTION_KEYS
        for index, ds in enumerate(self.datasets):
            foreign = ds.type.foreign_keys(allowed) if isinstance(ds.type, DatasetTypeMapping) else []
            if foreign:
                raise ValueError(
                    f"datasets[{index}].type: `{foreign[0]}` is not a key of the format {kind} reads "
                    f"({', '.join(allowed)}, field_system)"
                )

    @property
    def special_token_roles(self) -> dict[str, str]:
        """`special_tokens` as role → token text, the roles set only."""
        return self.special_tokens.model_dump(exclude_none=True) if self.special_tokens else {}

    def warmup(self, total_steps: int) -> int:
        """Warmup steps as Axolotl hands them to HF: `warmup_steps`, else `warmup_ratio` of the run rounded
        down, else Axolotl's default of 3 % of the run (rounded down, at most 100); a warmup of 1 becomes 2, as
        Axolotl sets it."""
        if self.warmup_steps is not None:
            steps = self.warmup_steps
        elif self.warmup_ratio is not None:
            steps = int(self.warmup_ratio * total_steps)
        else:
            steps = min(int(DEFAULT_WARMUP_RATIO * total_steps), MAX_DEFAULT_WARMUP)
        return 2 if steps == 1 else steps


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


_DATASETS_REQUIRED = "`datasets` is required: list at least one dataset, each with its `path` and `type`"


def _describe(error: dict, source: str, lines: dict) -> tuple[int, str]:
    """(line, message) of one pydantic error."""
    # pydantic appends tags such as 'literal[...]' or 'function-after[...]' to loc: keep only real keys.
    loc = tuple(p for p in error["loc"] if isinstance(p, int) or "[" not in p)
    line = (_line_of(lines, loc) if loc else None) or 0
    where = f"{source}:{line}" if line else source
    key = _dotted(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        name = str(loc[-1])
        model = _model_at(loc[:-1])
        valid = sorted(model.model_fields) if model else []
        close = close_misspelling(name, valid)
        hint = f" did you mean `{close}`?" if close else f" valid keys here: {', '.join(valid)}"
        return line, f"{where}: unknown key `{key}`;{hint}"
    if loc == ("datasets",) and kind in ("missing", "too_short"):
        return line, f"{where}: {_DATASETS_REQUIRED}"
    if kind == "missing":
        return line, f"{where}: `{key}` is required"
    value = error.get("input")
    message = error["msg"].removeprefix("Value error, ")
    if kind == "literal_error":
        allowed = error.get("ctx", {}).get("expected", "")
        words = [w.strip(" '") for w in allowed.replace(" or ", ",").split(",") if w.strip(" '")]
        close = close_misspelling(str(value), words)
        hint = f"; did you mean `{close}`?" if close else ""
        return line, f"{where}: `{key}` is {value!r}; allowed: {allowed}{hint}"
    if kind == "finite_number":
        return line, f"{where}: `{key}` = {value!r}: use a finite number"
    if not loc:
        return line, f"{where}: {message}"
    return line, f"{where}: `{key}` = {value!r}: {message}"


def _without_empty_values(value: Any, loc: tuple[str | int, ...] = ()) -> Any:
    """Axolotl reads `key:` (no value) as unset: drop the null-valued keys we declare, at every depth, so
    their defaults apply. An unknown key stays, empty or not, and fails as unknown."""
    if isinstance(value, dict):
        model = _model_at(loc)
        declared = model.model_fields if model else {}
        return {
            k: _without_empty_values(v, (*loc, k))
            for k, v in value.items()
            if not (v is None and k in declared)
        }
    if isinstance(value, list):
        return [_without_empty_values(item, (*loc, i)) for i, item in enumerate(value)]
    return value


def _refuse_known_axolotl_keys(
    data: Any, loc: tuple[str | int, ...], source: str, lines: dict, refusals: list[tuple[int, str]]
) -> Any:
    """`data` without the Axolotl keys we do not implement yet; a refusal sentence for each one that asks for
    something (a key that asks for Axolotl's default, like `deepspeed:` or `fsdp: []`, just drops out)."""
    if isinstance(data, list):
        return [
            _refuse_known_axolotl_keys(item, (*loc, i), source, lines, refusals)
            for i, item in enumerate(data)
        ]
    if not isinstance(data, dict):
        return data
    kept = {}
    for key, value in data.items():
        here = (*loc, key)
        known = NOT_YET.get(known_path(here))
        if known is None:
            kept[key] = _refuse_known_axolotl_keys(value, here, source, lines, refusals)
        elif not asks_for_nothing(value):
            what, instead = known
            line = _line_of(lines, here) or 0
            refusals.append(
                (
                    line,
                    f"{source}:{line}: Axolotl's `{_dotted(here)}` ({what}) is not supported yet; {instead}",
                )
            )
    return kept


def _refuse_values(data: dict, source: str, lines: dict, refusals: list[tuple[int, str]]) -> set[str]:
    """Refusals for values we do not implement yet (`adapter: full`, `rl: dpo`, `optimizer: sgd`); the keys
    they name, whose validation errors would only repeat the refusal."""
    refused = set()
    for key, value in data.items():
        sentence = _value_refusal(key, value)
        if sentence is not None:
            line = _line_of(lines, (key,)) or 0
            refusals.append((line, f"{source}:{line}: {sentence}"))
            refused.add(key)
    return refused


def _value_refusal(key: str, value: Any) -> str | None:
    try:
        sentence = VALUES_NOT_YET.get((key, value))
    except TypeError:  # an unhashable value (a list or mapping): validation says what is wrong with it
        return None
    if sentence is not None:
        return sentence
    if key == "optimizer" and value in OTHER_OPTIMIZERS:
        return (
            f"Axolotl's `optimizer: {value}` (an update rule other than AdamW) is not supported yet; use "
            "adamw_torch_fused, adamw_torch, adamw_bnb_8bit / adamw_8bit, paged_adamw_8bit, paged_adamw_32bit or "
            "adamw_torch_4bit / adamw_torch_8bit"
        )
    if key == "lr_scheduler" and value in OTHER_SCHEDULERS:
        return (
            f"Axolotl's `lr_scheduler: {value}` is not supported yet; use cosine, cosine_with_min_lr (with "
            "cosine_min_lr_ratio), linear, constant, constant_with_warmup, polynomial or inverse_sqrt"
        )
    return None


def parse_config(data: Any, source: str = "<config>", lines: dict | None = None) -> Config:
    """Validate already-parsed YAML data; errors name `source` and, when known, the line. Every problem of
    the file is reported at once, in line order, in one ConfigError."""
    lines = lines or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of config keys at the top level")
    refusals: list[tuple[int, str]] = []
    data = _refuse_known_axolotl_keys(_without_empty_values(data), (), source, lines, refusals)
    refused_keys = _refuse_values(data, source, lines, refusals)
    data = {key: value for key, value in data.items() if key not in refused_keys}
    problems = list(refusals)
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        for error in exc.errors():
            if error["loc"] and error["loc"][0] in refused_keys:
                continue  # `adapter: full` was refused above; "adapter is required" would only repeat it
            problems.append(_describe(error, source, lines))
        config = None
    if problems:
        raise ConfigError("\n".join(message for _, message in sorted(problems, key=lambda p: p[0])))
    return config


def load_config(path: str | Path) -> Config:
    data, lines = load_yaml_file(path)
    return parse_config(data, str(path), lines)
