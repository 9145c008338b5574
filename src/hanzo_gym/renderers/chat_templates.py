"""The `chat_template` setting: which renderer turns a dataset's conversations into tokens.

- unset or `tokenizer_default`: the tokenizer's own Jinja template (`JinjaRenderer`);
- a renderer name (`qwen3`, `llama3`, `role_colon`, …) or `chatml` (the ChatML of `qwen3_instruct`);
- a named Jinja template (`fastchat_alpaca`, older Axolotl's FastChat `alpaca` conversation);
- `tokenizer_default_fallback_<name>`: the tokenizer's template if it has one, else the renderer `<name>`;
- Axolotl's name of a family's template (`gemma3`, `qwen_25`, …): the tokenizer's own template, once the loop
  has checked that the model is of that family (`renderers/axolotl_templates.py`);
- inline Jinja: that template (`JinjaRenderer`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hanzo_gym.errors import ConfigError
from hanzo_gym.renderers import Renderer, RendererError, get_renderer, renderer_names
from hanzo_gym.renderers.axolotl_templates import axolotl_template_names, family_template_problem
from hanzo_gym.renderers.jinja import JinjaRenderer, tokenizer_template
from hanzo_gym.renderers.mistral_common import MistralCommonRenderer, is_mistral_common

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


def _fastchat_colon_two(system: str, user: str, assistant: str, sep: str) -> str:
    """FastChat's ADD_COLON_TWO conversation as Jinja: the system message (a leading system turn replaces it),
    then `user: text{sep}` and `assistant: text` + the tokenizer's eos (FastChat's "</s>") turns, after the bos
    the tokenizer starts a prompt with, as older Axolotl tokenized it."""
    return (
        f"{{%- set ns = namespace(system={system!r}) -%}}"
        "{%- if messages and messages[0]['role'] == 'system' -%}{%- set ns.system = messages[0]['content'] -%}"
        "{%- endif -%}"
        f"{{{{- (bos_token or '') + ns.system + {sep!r} -}}}}"
        "{%- for message in messages -%}"
        f"{{%- if message['role'] == 'user' -%}}{{{{- {user + ': '!r} + message['content'] + {sep!r} -}}}}"
        f"{{%- elif message['role'] == 'assistant' -%}}{{{{- {assistant + ': '!r} + message['content'] + eos_token -}}}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        f"{{%- if add_generation_prompt -%}}{{{{- {assistant + ':'!r} -}}}}{{%- endif -%}}"
    )


# the system message of older Axolotl's chatml and llama3 conversations (and FastChat's qwen-7b-chat), which
# Axolotl's `default_system_message` replaced
FASTCHAT_SYSTEM = "You are a helpful assistant."
_SYSTEM_TURN_FIRST = (
    "{%- if messages and messages[0]['role'] == 'system' -%}{%- set ns.system = messages[0]['content'] -%}"
    "{%- endif -%}"
)


def fastchat_chatml(system: str = FASTCHAT_SYSTEM) -> str:
    """FastChat's CHATML conversation as Jinja: always a system turn (the conversation's own, else `system`),
    then one ChatML turn per message."""
    return (
        f"{{%- set ns = namespace(system={system!r}) -%}}{_SYSTEM_TURN_FIRST}"
        "{{- '<|im_start|>system\n' + ns.system + '<|im_end|>\n' -}}"
        "{%- for message in messages if message['role'] != 'system' -%}"
        "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
    )


def fastchat_llama3(system: str = FASTCHAT_SYSTEM) -> str:
    """FastChat's LLAMA3 conversation as Jinja: the tokenizer's bos, a system turn unless its message is empty,
    then one Llama 3 turn per message, its text stripped."""
    return (
        f"{{%- set ns = namespace(system={system!r}) -%}}{_SYSTEM_TURN_FIRST}"
        "{{- bos_token or '' -}}"
        "{%- if ns.system -%}"
        "{{- '<|start_header_id|>system<|end_header_id|>\n\n' + ns.system + '<|eot_id|>' -}}{%- endif -%}"
        "{%- for message in messages if message['role'] != 'system' -%}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
        " + '<|eot_id|>' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"
    )


# Named Jinja templates: FastChat's conversations that older Axolotl's `type: sharegpt` rendered with
# (`conversation: alpaca`, chatml, llama3, and `vicuna_v1.1`, its default).
JINJA_TEMPLATES = {
    "fastchat_chatml": fastchat_chatml(),
    "fastchat_llama3": fastchat_llama3(),
    "fastchat_alpaca": _fastchat_colon_two(
        "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
        "### Instruction",
        "### Response",
        "\n\n",
    ),
    "fastchat_vicuna": _fastchat_colon_two(
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, and polite answers to the user's questions.",
        "USER",
        "ASSISTANT",
        " ",
    ),
}
TOKENIZER_DEFAULT = "tokenizer_default"
FALLBACK_PREFIX = "tokenizer_default_fallback_"

NO_TEMPLATE = (
    "no chat template: set `chat_template` (chatml, qwen3, llama3 or inline Jinja) "
    "or use a tokenizer that has one"
)


def resolve_renderer(
    setting: str | None, tokenizer: PreTrainedTokenizerBase, eot_tokens: list[str] | None = None
) -> Renderer:
    """The renderer the `chat_template` config value stands for, ending turns at Axolotl's `eot_tokens` when
    given; ConfigError when there is none."""
    renderer = _renderer_for(setting, tokenizer)
    return with_end_of_turn_tokens(renderer, eot_tokens) if eot_tokens else renderer


def with_end_of_turn_tokens(renderer: Renderer, eot_tokens: list[str]) -> Renderer:
    """Axolotl's `eot_tokens`: the tokens that end a turn, each trained with the turn it ends (Axolotl's
    `train_on_eot`, which follows `train_on_eos`). A Jinja template's turn ends are found by these tokens
    instead of the common ones; a built-in renderer knows its own, which the listed tokens must be."""
    vocabulary = renderer.tokenizer.get_vocab()
    missing = [token for token in eot_tokens if token not in vocabulary]
    if missing:
        raise ConfigError(
            f"eot_tokens {missing}: not single tokens of the tokenizer's vocabulary; list the token(s) that "
            "end a turn in the chat template (e.g. <|im_end|>, <|eot_id|>, <end_of_turn>)"
        )
    ids = frozenset(vocabulary[token] for token in eot_tokens)
    if isinstance(renderer, JinjaRenderer):
        renderer.end_of_turn_ids = ids
        return renderer
    own = {token for token in renderer.get_stop_sequences() if isinstance(token, int)}
    if not ids <= own:
        ends = [renderer.tokenizer.convert_ids_to_tokens(token) for token in sorted(own)]
        raise ConfigError(
            f"eot_tokens {eot_tokens}: the `{type(renderer).__name__}` renderer ends turns with {ends}; "
            "list those, or leave eot_tokens out"
        )
    return renderer


def _renderer_for(setting: str | None, tokenizer: PreTrainedTokenizerBase) -> Renderer:
    if is_mistral_common(tokenizer):  # the config allows no chat_template beside it
        return MistralCommonRenderer(tokenizer)
    try:
        if setting is None or setting == TOKENIZER_DEFAULT:
            if tokenizer_template(tokenizer) is None:
                raise ConfigError(NO_TEMPLATE)
            return JinjaRenderer(tokenizer)
        if setting in axolotl_template_names():
            problem = family_template_problem(setting, tokenizer_template(tokenizer) is not None)
            if problem:
                raise ConfigError(problem)
            return JinjaRenderer(tokenizer)
        if setting.startswith(FALLBACK_PREFIX):
            if tokenizer_template(tokenizer) is not None:
                return JinjaRenderer(tokenizer)
            return _named_or_inline(setting.removeprefix(FALLBACK_PREFIX), tokenizer)
        return _named_or_inline(setting, tokenizer)
    except RendererError as exc:
        raise ConfigError(f"chat_template: {exc}") from None


def template_names() -> list[str]:
    """What `chat_template` may name: the renderers, their aliases and Axolotl's template names."""
    return sorted({*renderer_names(), *ALIASES, *JINJA_TEMPLATES, *axolotl_template_names()})


def is_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def _named_or_inline(name: str, tokenizer: PreTrainedTokenizerBase) -> Renderer:
    if ALIASES.get(name, name) in renderer_names():
        return get_renderer(ALIASES.get(name, name), tokenizer)
    if name in JINJA_TEMPLATES:
        return JinjaRenderer(tokenizer, JINJA_TEMPLATES[name])
    if is_jinja(name):
        return JinjaRenderer(tokenizer, name)
    raise ConfigError(
        f"unknown chat_template `{name}`: use a renderer name ({', '.join(template_names())}), "
        f"`{TOKENIZER_DEFAULT}`, `{FALLBACK_PREFIX}<name>` or an inline Jinja template"
    )
