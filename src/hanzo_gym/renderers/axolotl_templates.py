"""Axolotl's chat-template names (`chat_template: gemma3`, `qwen_25`, `phi_3`, …).

Each of Axolotl's named templates is its copy of one model family's own template. hanzo-gym renders with the
tokenizer's own template instead (tokens exactly `apply_chat_template`'s), provided that the base model is of
that family and its tokenizer carries a template; anything else is refused with the reason, because the
tokenizer's template of another family would silently train a format the config did not name. The names
`chatml`, `llama3` and `qwen3` are built-in renderers (`renderers/chat_templates.py`) and never reach this module.
"""

from __future__ import annotations

from hanzo_gym.errors import ConfigError

# Axolotl name → (the family in words, the config.json `model_type`s of that family's models)
FAMILY_TEMPLATES: dict[str, tuple[str, tuple[str, ...]]] = {
    "gemma": ("Gemma", ("gemma", "gemma2")),
    "gemma3": ("Gemma 3", ("gemma3", "gemma3_text")),
    "gemma3n": ("Gemma 3n", ("gemma3n", "gemma3n_text")),
    "gemma4": ("Gemma 4", ("gemma4", "gemma4_text")),
    "gemma4_unified": ("Gemma 4 unified", ("gemma4_unified", "gemma4_unified_text")),
    "qwen_25": ("Qwen2.5", ("qwen2", "qwen2_moe")),
    "qwen3_5": ("Qwen3.5", ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")),
    "phi_3": ("Phi-3", ("phi3",)),
    "phi_35": ("Phi-3.5", ("phi3", "phimoe")),
    "phi_4": ("Phi-4", ("phi3",)),
    "llama4": ("Llama 4", ("llama4", "llama4_text")),
    "falcon_h1": ("Falcon-H1", ("falcon_h1",)),
    "cohere": ("Command R", ("cohere",)),
    "aya": ("Aya", ("cohere", "cohere2")),
    "command_a": ("Command A", ("cohere2",)),
    "jamba": ("Jamba", ("jamba",)),
    "deepseek_v2": ("DeepSeek-V2", ("deepseek_v2",)),
    "deepseek_v3": ("DeepSeek-V3", ("deepseek_v3",)),
    "exaone": ("EXAONE", ("exaone",)),
    "exaone4": ("EXAONE 4", ("exaone4",)),
    "nemotron_h": ("Nemotron-H", ("nemotron_h",)),
    "mistral_v1": ("Mistral", ("mistral", "mixtral")),
    "mistral_v2v3": ("Mistral", ("mistral", "mixtral")),
    "mistral_v3_tekken": ("Mistral (Tekken)", ("mistral", "mixtral", "ministral")),
    "mistral_v7_tekken": ("Mistral (Tekken v7)", ("mistral", "mistral3", "ministral", "ministral3")),
}
# Axolotl names that are not one text family's own template: what each is, for the refusal.
OTHER_TEMPLATES = {
    "alpaca": "Alpaca's instruction format as a chat template (use a `type: alpaca` dataset)",
    "metharme": "the Metharme role-token format",
    "command_a_rag": "Command A's retrieval-augmented prompt",
    "command_a_tool_use": "Command A's tool-use prompt",
    "llava": "LLaVA's vision template",
    "pixtral": "Pixtral's vision template",
    "qwen2_vl": "Qwen2-VL's vision template",
    "llama3_2_vision": "Llama 3.2 Vision's template",
}


def axolotl_template_names() -> list[str]:
    return sorted({*FAMILY_TEMPLATES, *OTHER_TEMPLATES})


def check_template_family(name: str | None, model_type: str | None, base_model: str) -> None:
    """ConfigError when `chat_template` is Axolotl's name of another family's template than base_model's (the
    loop checks this once it knows the model's type; the data layer never loads a model)."""
    if name not in FAMILY_TEMPLATES:
        return
    family, model_types = FAMILY_TEMPLATES[name]
    if model_type not in model_types:
        raise ConfigError(
            f"chat_template: {name} is {family}'s template, but base_model `{base_model}` is a "
            f"{model_type or 'model without a model_type'}; use `tokenizer_default` (the model's own template), "
            "chatml, llama3, qwen3 or inline Jinja"
        )


def family_template_problem(name: str, has_template: bool) -> str | None:
    """Why Axolotl's template `name` cannot render with this tokenizer, or None when it can."""
    if name in OTHER_TEMPLATES:
        return (
            f"Axolotl's `chat_template: {name}` ({OTHER_TEMPLATES[name]}) is not supported yet; use the "
            "tokenizer's own template (`tokenizer_default`), a built-in one or inline Jinja"
        )
    if not has_template:
        family = FAMILY_TEMPLATES[name][0]
        return (
            f"chat_template: {name} renders with {family}'s own template, and the tokenizer carries none; give "
            "the template as inline Jinja in `chat_template`, or point `tokenizer_config` at the instruct "
            "model's tokenizer"
        )
    return None
