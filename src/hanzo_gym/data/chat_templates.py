"""Chat templates: which Jinja template a run uses (`chat_template` key) and rendering messages through it.

Rendering goes through the tokenizer's `apply_chat_template`, so templates get transformers' sandboxed Jinja,
`raise_exception`, `bos_token`/`eos_token` and any extra variables (e.g. `enable_thinking`).
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError
from transformers import PreTrainedTokenizerBase

from hanzo_gym.errors import ConfigError

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3 instruct format without the "Cutting Knowledge Date" preamble that the 3.1+ templates add.
LLAMA3 = (
    "{{- bos_token if bos_token else '<|begin_of_text|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Qwen3's thinking rules without tool calls: reasoning (a `reasoning_content` key, or a `<think>...</think>`
# prefix of the content) is kept only on assistant turns after the last user query; the final turn always gets
# a `<think>` block; `enable_thinking=false` pre-fills an empty one in the generation prompt.
QWEN3 = """
{%- set ns = namespace(last_query=messages | length - 1) %}
{%- for message in messages %}
    {%- set tool_response = message.content.startswith('<tool_response>')
                             and message.content.endswith('</tool_response>') %}
    {%- if message.role == 'user' and not tool_response %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'tool' or message.tool_calls %}
        {{- raise_exception('the built-in qwen3 chat template has no tool support; '
                            + 'use chat_template: tokenizer_default') }}
    {%- elif message.role == 'user' or message.role == 'system' %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n')
                                       .split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
            {{- content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception('the built-in qwen3 chat template has no role `' + message.role + '`') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
""".strip()

BUILTIN_TEMPLATES: dict[str, str] = {"chatml": CHATML, "qwen3": QWEN3, "llama3": LLAMA3}

TOKENIZER_DEFAULT = "tokenizer_default"
FALLBACK_PREFIX = "tokenizer_default_fallback_"

NO_TEMPLATE = (
    "no chat template: set `chat_template` (chatml, qwen3, llama3 or inline Jinja) "
    "or use a tokenizer that has one"
)


def resolve_chat_template(setting: str | None, tokenizer: PreTrainedTokenizerBase) -> str:
    """The Jinja source the `chat_template` config value stands for; ConfigError when there is none."""
    if setting is None or setting == TOKENIZER_DEFAULT:
        template = tokenizer_template(tokenizer)
        if template is None:
            raise ConfigError(NO_TEMPLATE)
    elif setting.startswith(FALLBACK_PREFIX):
        template = tokenizer_template(tokenizer) or _named_or_inline(setting.removeprefix(FALLBACK_PREFIX))
    else:
        template = _named_or_inline(setting)
    _check_syntax(template, tokenizer)
    return template


def tokenizer_template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The tokenizer's own template; of several named ones, the one called `default`."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    return template or None


def is_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    template: str,
    add_generation_prompt: bool = False,
    **template_vars: Any,
) -> str:
    """Render `messages` (dicts with `role`, `content` and any extra keys, passed through) as text."""
    return tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **template_vars,
    )


def _named_or_inline(name: str) -> str:
    if name in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name]
    if is_jinja(name):
        return name
    raise ConfigError(
        f"unknown chat_template `{name}`: use one of the built-ins ({', '.join(BUILTIN_TEMPLATES)}), "
        f"`{TOKENIZER_DEFAULT}`, `{FALLBACK_PREFIX}<name>` or an inline Jinja template"
    )


def _check_syntax(template: str, tokenizer: PreTrainedTokenizerBase) -> None:
    # A syntax error in an inline template should fail at load, not on the first row. Other errors (a template
    # that insists on a system turn, say) are about the conversation and surface per row.
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    try:
        render_chat(tokenizer, probe, template)
    except TemplateSyntaxError as exc:
        raise ConfigError(f"chat_template: Jinja syntax error on line {exc.lineno}: {exc.message}") from None
    except (TemplateError, TypeError):
        pass
