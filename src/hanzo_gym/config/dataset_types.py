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
SFT_TYPES = ("chat_template", "alpaca", "input_output", "completion")
# Older Axolotl's SFT types, read as the type each became (config/dataset_keys.py converts them): ShareGPT
# conversations (`from` / `value` turns; `load_role`: `role` / `content`) and OpenAssistant's INSTRUCTION /
# RESPONSE rows in the alpaca prompt.
SHAREGPT_TYPES = ("sharegpt", "sharegpt:chat", "sharegpt.load_role")
OLDER_TYPES = (*SHAREGPT_TYPES, "oasst")
# Axolotl's own prompt strategies named by module and function (renderers/instruction_formats.py runs them)
AXOLOTL_STRATEGY_TYPES = ("alpaca_chat.load_qa", "alpaca_w_system.load_open_orca")
DATASET_TYPES = tuple(
    dict.fromkeys((*SFT_TYPES, *PAIR_TYPES, *KTO_TYPES, *OLDER_TYPES, *AXOLOTL_STRATEGY_TYPES))
)


def is_user_transform(dataset_type: object) -> bool:
    """Axolotl's `type: module.function` (e.g. `rewards.prompt_transform`)."""
    return (
        isinstance(dataset_type, str)
        and dataset_type not in DATASET_TYPES
        and not dataset_type.startswith("alpaca:")
        and is_dotted_name(dataset_type)
    )
