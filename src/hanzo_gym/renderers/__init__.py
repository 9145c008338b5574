"""Tinker-compatible renderers: `get_renderer(name, tokenizer)` and the model → renderer table."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hanzo_gym.renderers.base import (
    Message,
    ParseTermination,
    RenderedConversation,
    RenderedMessage,
    Renderer,
    RendererError,
    TrainOnWhat,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


__all__ = [
    "Message",
    "ParseTermination",
    "RenderedConversation",
    "RenderedMessage",
    "Renderer",
    "RendererError",
    "TrainOnWhat",
    "get_recommended_renderer_name",
    "get_renderer",
    "register_renderer",
    "renderer_names",
]

# name → (module, class, keyword arguments). Modules load on first use so that importing one format's
# renderer never pays for the others.
_BUILT_IN: dict[str, tuple[str, str, dict[str, Any]]] = {
    "role_colon": ("hanzo_gym.renderers.role_colon", "RoleColonRenderer", {}),
    # Whatever chat template the tokenizer carries (SmolLM2's ChatML, say), rendered through Jinja.
    "chat_template": ("hanzo_gym.renderers.jinja", "JinjaRenderer", {}),
    "llama3": ("hanzo_gym.renderers.llama3", "Llama3Renderer", {}),
    "qwen3": ("hanzo_gym.renderers.qwen3", "Qwen3Renderer", {}),
    "qwen3_disable_thinking": ("hanzo_gym.renderers.qwen3", "Qwen3DisableThinkingRenderer", {}),
    "qwen3_instruct": ("hanzo_gym.renderers.qwen3", "Qwen3InstructRenderer", {}),
    "deepseekv3": ("hanzo_gym.renderers.deepseek", "DeepSeekV3Renderer", {}),
    "deepseekv3_disable_thinking": ("hanzo_gym.renderers.deepseek", "DeepSeekV3Renderer", {}),
    "deepseekv3_thinking": ("hanzo_gym.renderers.deepseek", "DeepSeekV3ThinkingRenderer", {}),
    "kimi_k2": ("hanzo_gym.renderers.kimi", "KimiK2Renderer", {}),
    "gpt_oss_no_sysprompt": ("hanzo_gym.renderers.gpt_oss", "GptOssRenderer", {"reasoning_effort": None}),
    "gpt_oss_low_reasoning": ("hanzo_gym.renderers.gpt_oss", "GptOssRenderer", {"reasoning_effort": "low"}),
    "gpt_oss_medium_reasoning": (
        "hanzo_gym.renderers.gpt_oss",
        "GptOssRenderer",
        {"reasoning_effort": "medium"},
    ),
    "gpt_oss_high_reasoning": ("hanzo_gym.renderers.gpt_oss", "GptOssRenderer", {"reasoning_effort": "high"}),
}
_CUSTOM: dict[str, Callable[[PreTrainedTokenizerBase], Renderer]] = {}


def register_renderer(name: str, factory: Callable[[PreTrainedTokenizerBase], Renderer]) -> None:
    _CUSTOM[name] = factory


def renderer_names() -> list[str]:
    return sorted({*_BUILT_IN, *_CUSTOM})


def get_renderer(name: str, tokenizer: PreTrainedTokenizerBase) -> Renderer:
    if name in _CUSTOM:
        return _CUSTOM[name](tokenizer)
    if name not in _BUILT_IN:
        raise RendererError(f"unknown renderer `{name}`; choose one of {', '.join(renderer_names())}")
    module, cls, kwargs = _BUILT_IN[name]
    return getattr(importlib.import_module(module), cls)(tokenizer, **kwargs)


def get_recommended_renderer_name(model_name: str) -> str:
    from hanzo_gym.renderers.recommended import recommended_renderer_name

    return recommended_renderer_name(model_name)
