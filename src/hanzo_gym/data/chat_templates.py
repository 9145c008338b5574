"""The `chat_template` setting: which renderer turns a dataset's conversations into tokens.

- unset or `tokenizer_default`: the tokenizer's own Jinja template (`JinjaRenderer`);
- a renderer name (`qwen3`, `llama3`, `role_colon`, …) or `chatml` (the ChatML of `qwen3_instruct`);
- `tokenizer_default_fallback_<name>`: the tokenizer's template if it has one, else the renderer `<name>`;
- inline Jinja: that template (`JinjaRenderer`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hanzo_gym.errors import ConfigError
from hanzo_gym.renderers import Renderer, RendererError, get_renderer, renderer_names
from hanzo_gym.renderers.jinja import JinjaRenderer, tokenizer_template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A plain ChatML Jinja template, for tokenizers that should carry one of their own.
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

ALIASES = {"chatml": "qwen3_instruct"}
TOKENIZER_DEFAULT = "tokenizer_default"
FALLBACK_PREFIX = "tokenizer_default_fallback_"

NO_TEMPLATE = (
    "no chat template: set `chat_template` (chatml, qwen3, llama3 or inline Jinja) "
    "or use a tokenizer that has one"
)


def resolve_renderer(setting: str | None, tokenizer: PreTrainedTokenizerBase) -> Renderer:
    """The renderer the `chat_template` config value stands for; ConfigError when there is none."""
    try:
        if setting is None or setting == TOKENIZER_DEFAULT:
            if tokenizer_template(tokenizer) is None:
                raise ConfigError(NO_TEMPLATE)
            return JinjaRenderer(tokenizer)
        if setting.startswith(FALLBACK_PREFIX):
            if tokenizer_template(tokenizer) is not None:
                return JinjaRenderer(tokenizer)
            return _named_or_inline(setting.removeprefix(FALLBACK_PREFIX), tokenizer)
        return _named_or_inline(setting, tokenizer)
    except RendererError as exc:
        raise ConfigError(f"chat_template: {exc}") from None


def template_names() -> list[str]:
    return sorted({*renderer_names(), *ALIASES})


def is_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def _named_or_inline(name: str, tokenizer: PreTrainedTokenizerBase) -> Renderer:
    if ALIASES.get(name, name) in renderer_names():
        return get_renderer(ALIASES.get(name, name), tokenizer)
    if is_jinja(name):
        return JinjaRenderer(tokenizer, name)
    raise ConfigError(
        f"unknown chat_template `{name}`: use a renderer name ({', '.join(template_names())}), "
        f"`{TOKENIZER_DEFAULT}`, `{FALLBACK_PREFIX}<name>` or an inline Jinja template"
    )
