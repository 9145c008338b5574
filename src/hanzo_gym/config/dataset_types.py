"""The dataset types a config may name: SFT's, the preference pairs' and KTO's (each `rl` reads its own), and
Axolotl's `module.function`, a transform of the user's."""

from __future__ import annotations

from hanzo_gym.rewards.user_code import is_dotted_name

_STRING_VARIANTS = ("default", "argilla_chat", "icr", "intel", "prompt_pairs", "ultra")
_KTO_VARIANTS = ("argilla", "argilla_chat", "intel", "prompt_pairs", "ultra")
# Dataset types of chosen/rejected pairs: Axolotl's string formats (chatml.*, llama3.*), its chat-template
# formats, and `passthrough` (rows already in TRL's prompt / chosen / rejected shape).
PAIR_TYPES = (
    *(f"{family}.{variant}" for family in ("chatml", "llama3") for variant in _STRING_VARIANTS),
    "chat_template.default",
    "chat_template.argilla_chat",
    "chat_template.argilla",
    "passthrough",
)
# Dataset types of KTO's unpaired examples (prompt, completion, label).
KTO_TYPES = (
    *(f"{family}.{variant}" for family in ("chatml", "llama3") for variant in _KTO_VARIANTS),
    "passthrough",
)
# `pretrain`: Axolotl's pretraining windows of raw text (what `pretraining_dataset` entries read)
SFT_TYPES = ("chat_template", "alpaca", "input_output", "completion", "pretrain")
# Older Axolotl's SFT types, read as the type each became (config/dataset_keys.py converts them): ShareGPT
# conversations (`from` / `value` turns; `load_role`: `role` / `content`) and OpenAssistant's INSTRUCTION /
# RESPONSE rows in the alpaca prompt.
SHAREGPT_TYPES = ("sharegpt", "sharegpt:chat", "sharegpt.load_role")
OLDER_TYPES = (*SHAREGPT_TYPES, "oasst")
# Axolotl's own prompt strategies named by module and function (renderers/instruction_formats.py runs them)
AXOLOTL_STRATEGY_TYPES = (
    "alpaca_chat.load_qa",
    "alpaca_w_system.load_open_orca",
    "alpaca_instruct.load",
    "alpaca_instruct.load_no_prompt",
    "context_qa.load",
    "context_qa.load_v2",
    "context_qa.load_404",
)
# The modules of Axolotl's prompt strategies (axolotl.prompt_strategies, its dpo and kto packages): a type that
# names one of them is Axolotl's, not the user's
AXOLOTL_STRATEGY_MODULES = (
    *("alpaca_chat", "alpaca_instruct", "alpaca_w_system", "bradley_terry", "chat_template", "completion"),
    *(
        "context_qa",
        "creative_acr",
        "input_output",
        "llama2_chat",
        "messages",
        "metharme",
        "orcamini",
        "orpo",
    ),
    *(
        "pretrain",
        "pygmalion",
        "stepwise_supervised",
        "user_defined",
        "chatml",
        "llama3",
        "zephyr",
        "passthrough",
    ),
)
DATASET_TYPES = tuple(
    dict.fromkeys((*SFT_TYPES, *PAIR_TYPES, *KTO_TYPES, *OLDER_TYPES, *AXOLOTL_STRATEGY_TYPES))
)


def is_user_transform(dataset_type: object) -> bool:
    """Axolotl's `type: module.function` (e.g. `rewards.prompt_transform`) of a module of the user's."""
    return (
        isinstance(dataset_type, str)
        and dataset_type not in DATASET_TYPES
        and not dataset_type.startswith("alpaca:")
        and is_dotted_name(dataset_type)
        and not is_axolotl_strategy(dataset_type)
    )


def is_axolotl_strategy(dataset_type: str) -> bool:
    """A `module.function` type naming one of Axolotl's own prompt strategy modules."""
    return "." in dataset_type and dataset_type.split(".", 1)[0] in AXOLOTL_STRATEGY_MODULES
