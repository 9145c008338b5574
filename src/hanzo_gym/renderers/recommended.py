"""Which renderer a model was trained with: Tinker's model → renderer table (`model_info`), first = default."""

from __future__ import annotations

from hanzo_gym.renderers.base import RendererError

_QWEN3_5 = ("qwen3_5", "qwen3_5_disable_thinking")
_NEMOTRON3 = ("nemotron3", "nemotron3_disable_thinking", "nemotron3_preserve_thinking")
_NEMOTRON3_ULTRA = (
    "nemotron3_ultra",
    "nemotron3_ultra_disable_thinking",
    "nemotron3_ultra_medium_thinking",
    "nemotron3_ultra_preserve_thinking",
)

# Exact model names (compared case-insensitively); base models get the plain `role_colon` format.
RECOMMENDED: dict[str, tuple[str, ...]] = {
    "meta-llama/Llama-3.1-8B-Instruct": ("llama3",),
    "meta-llama/Llama-3.3-70B-Instruct": ("llama3",),
    "meta-llama/Llama-3.2-1B": ("role_colon",),
    "meta-llama/Llama-3.2-3B": ("role_colon",),
    "meta-llama/Llama-3.1-8B": ("role_colon",),
    "meta-llama/Llama-3.1-70B": ("role_colon",),
    "Qwen/Qwen3-8B": ("qwen3", "qwen3_disable_thinking"),
    "Qwen/Qwen3-32B": ("qwen3", "qwen3_disable_thinking"),
    "Qwen/Qwen3-30B-A3B": ("qwen3", "qwen3_disable_thinking"),
    "Qwen/Qwen3-8B-Base": ("role_colon",),
    "Qwen/Qwen3-30B-A3B-Base": ("role_colon",),
    "Qwen/Qwen3-4B-Instruct-2507": ("qwen3_instruct",),
    "Qwen/Qwen3-30B-A3B-Instruct-2507": ("qwen3_instruct",),
    "Qwen/Qwen3-235B-A22B-Instruct-2507": ("qwen3_instruct",),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": ("qwen3_vl_instruct",),
    "Qwen/Qwen3-VL-235B-A22B-Instruct": ("qwen3_vl_instruct",),
    "Qwen/Qwen3.5-4B": _QWEN3_5,
    "Qwen/Qwen3.5-9B": _QWEN3_5,
    "Qwen/Qwen3.5-27B": _QWEN3_5,
    "Qwen/Qwen3.5-35B-A3B": _QWEN3_5,
    "Qwen/Qwen3.5-397B-A17B": _QWEN3_5,
    "Qwen/Qwen3.6-27B": _QWEN3_5,
    "Qwen/Qwen3.6-35B-A3B": _QWEN3_5,
    "Qwen/Qwen3.5-9B-Base": ("role_colon",),
    "Qwen/Qwen3.5-35B-A3B-Base": ("role_colon",),
    "Qwen/Qwen3.8-27B": (
        "qwen3_8_xhigh_reasoning",
        "qwen3_8_disable_thinking",
        "qwen3_8_medium_reasoning",
        "qwen3_8_low_reasoning",
    ),
    "deepseek-ai/DeepSeek-V3.1": ("deepseekv3", "deepseekv3_thinking"),
    "deepseek-ai/DeepSeek-V3.1-Base": ("role_colon",),
    "openai/gpt-oss-20b": ("gpt_oss_no_sysprompt", "gpt_oss_medium_reasoning"),
    "openai/gpt-oss-120b": ("gpt_oss_no_sysprompt", "gpt_oss_medium_reasoning"),
    "moonshotai/Kimi-K2-Thinking": ("kimi_k2",),
    "moonshotai/Kimi-K2.5": ("kimi_k25", "kimi_k25_disable_thinking"),
    "moonshotai/Kimi-K2.6": ("kimi_k26", "kimi_k26_disable_thinking", "kimi_k26_preserve_thinking"),
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": _NEMOTRON3,
    "nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16": _NEMOTRON3_ULTRA,
}
# Model families named by prefix.
RECOMMENDED_PREFIXES: dict[str, tuple[str, ...]] = {"thinkingmachines/Inkling": ("tml_v0",)}

_BY_LOWER_NAME = {name.lower(): renderers for name, renderers in RECOMMENDED.items()}


def recommended_renderer_names(model_name: str) -> tuple[str, ...]:
    """The renderers a model supports, the default first. `org/Model[:suffix]`: the suffix is ignored."""
    name = model_name.split(":", 1)[0].lower()
    if name in _BY_LOWER_NAME:
        return _BY_LOWER_NAME[name]
    for prefix, renderers in RECOMMENDED_PREFIXES.items():
        if name.startswith(prefix.lower()):
            return renderers
    raise RendererError(
        f"no recommended renderer for model `{model_name}`: it is not in the model table; "
        "choose a renderer by name (e.g. qwen3, llama3, role_colon)"
    )


def recommended_renderer_name(model_name: str) -> str:
    """The default renderer of `model_name`; an error when hanzo-gym does not implement that renderer yet."""
    from hanzo_gym.renderers import renderer_names

    name = recommended_renderer_names(model_name)[0]
    if name not in renderer_names():
        raise RendererError(
            f"model `{model_name}` uses the `{name}` renderer, which hanzo-gym does not implement yet "
            f"(available: {', '.join(renderer_names())})"
        )
    return name
