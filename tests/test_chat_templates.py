from types import SimpleNamespace

import pytest

from hanzo_gym.errors import ConfigError
from hanzo_gym.renderers import RendererError
from hanzo_gym.renderers.chat_templates import CHATML, NO_TEMPLATE, resolve_renderer
from hanzo_gym.renderers.jinja import JinjaRenderer, tokenizer_template
from hanzo_gym.renderers.llama3 import Llama3Renderer
from hanzo_gym.renderers.qwen3 import Qwen3InstructRenderer, Qwen3Renderer
from hanzo_gym.renderers.role_colon import RoleColonRenderer

GREETING = [
    {"role": "system", "content": "be good"},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "fine thanks"},
]
CHATML_GREETING = (
    "<|im_start|>system\nbe good<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n"
    "<|im_start|>assistant\nfine thanks<|im_end|>\n"
)


def decode(tokenizer, tokens) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)


# --- chatml ---


def test_chatml_renders_the_reference_string(qwen3_tokenizer):
    renderer = resolve_renderer("chatml", qwen3_tokenizer)
    tokens = renderer.render(GREETING).tokens()
    assert decode(qwen3_tokenizer, tokens) == CHATML_GREETING
    assert tokens == qwen3_tokenizer.encode(CHATML_GREETING, add_special_tokens=False)
    # the plain ChatML Jinja template renders the same tokens
    assert JinjaRenderer(qwen3_tokenizer, CHATML).render(GREETING).tokens() == tokens


def test_chatml_generation_prompt(qwen3_tokenizer):
    prompt = resolve_renderer("chatml", qwen3_tokenizer).build_generation_prompt(GREETING[:2])
    assert decode(qwen3_tokenizer, prompt.to_ints()).endswith("hi there<|im_end|>\n<|im_start|>assistant\n")


def test_chatml_matches_smollm2_own_template_after_its_system_turn(smollm2_tokenizer):
    renderer = resolve_renderer("chatml", smollm2_tokenizer)
    theirs = smollm2_tokenizer.apply_chat_template(GREETING, tokenize=False)
    assert renderer.render(GREETING).tokens() == smollm2_tokenizer.encode(theirs, add_special_tokens=False)


def test_chatml_needs_its_special_tokens(llama32_tokenizer):
    # Llama 3 has no <|im_start|>: rendering it as plain text would train on garbage, so resolution fails.
    with pytest.raises(ConfigError, match="needs the special token '<\\|im_start\\|>'"):
        resolve_renderer("chatml", llama32_tokenizer)


# --- resolution ---


@pytest.mark.parametrize("setting", [None, "tokenizer_default"])
def test_default_is_the_tokenizer_template(qwen3_tokenizer, setting):
    renderer = resolve_renderer(setting, qwen3_tokenizer)
    assert isinstance(renderer, JinjaRenderer)
    assert renderer.template == qwen3_tokenizer.chat_template


@pytest.mark.parametrize("setting", [None, "tokenizer_default"])
def test_default_without_a_tokenizer_template_is_an_error(llama32_tokenizer, setting):
    with pytest.raises(ConfigError) as error:
        resolve_renderer(setting, llama32_tokenizer)
    assert str(error.value) == NO_TEMPLATE
    assert "chatml, qwen3, llama3 or inline Jinja" in str(error.value)


@pytest.mark.parametrize(
    "name, tokenizer, kind",
    [
        ("chatml", "qwen3_tokenizer", Qwen3InstructRenderer),
        ("qwen3", "qwen3_tokenizer", Qwen3Renderer),
        ("qwen3_instruct", "qwen3_tokenizer", Qwen3InstructRenderer),
        ("llama3", "llama32_tokenizer", Llama3Renderer),
        ("role_colon", "llama32_tokenizer", RoleColonRenderer),
    ],
)
def test_builtin_names_pick_renderers(request, name, tokenizer, kind):
    renderer = resolve_renderer(name, request.getfixturevalue(tokenizer))
    assert type(renderer) is kind


def test_chatml_is_qwen3_instruct_without_thinking(qwen3_tokenizer):
    # `chatml` must not frame turns in <think> blocks the way `qwen3` does
    assert type(resolve_renderer("chatml", qwen3_tokenizer)) is not Qwen3Renderer


def test_fallback_prefers_the_tokenizer_template(qwen3_tokenizer):
    renderer = resolve_renderer("tokenizer_default_fallback_chatml", qwen3_tokenizer)
    assert isinstance(renderer, JinjaRenderer) and renderer.template == qwen3_tokenizer.chat_template


def test_fallback_uses_the_builtin_when_the_tokenizer_has_none(llama32_tokenizer):
    renderer = resolve_renderer("tokenizer_default_fallback_llama3", llama32_tokenizer)
    assert type(renderer) is Llama3Renderer


def test_fallback_to_an_unknown_name_is_an_error(llama32_tokenizer):
    with pytest.raises(ConfigError, match="unknown chat_template `gemma`"):
        resolve_renderer("tokenizer_default_fallback_gemma", llama32_tokenizer)


def test_inline_jinja_is_used_as_is(llama32_tokenizer):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    renderer = resolve_renderer(template, llama32_tokenizer)
    assert isinstance(renderer, JinjaRenderer) and renderer.template == template
    assert renderer.render_text(GREETING[:1]) == "[system] be good\n"


def test_unknown_name_lists_the_builtins(llama32_tokenizer):
    with pytest.raises(ConfigError) as error:
        resolve_renderer("no_such_template", llama32_tokenizer)
    message = str(error.value)
    assert "`no_such_template`" in message
    assert all(name in message for name in ("chatml", "qwen3", "llama3", "role_colon"))


def test_inline_template_syntax_error_fails_at_resolution(llama32_tokenizer):
    with pytest.raises(ConfigError, match="Jinja syntax error on line 1"):
        resolve_renderer("{% for m in messages %}{{ m.content }}", llama32_tokenizer)


def test_a_template_that_rejects_the_probe_still_resolves(llama32_tokenizer):
    # Errors about the conversation (here: no system turn) surface per row, not at resolution.
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('needs a system turn') }}{% endif %}"
    renderer = resolve_renderer(template, llama32_tokenizer)
    with pytest.raises(RendererError, match="chat template failed: needs a system turn"):
        renderer.render([{"role": "user", "content": "hi"}])


def test_extra_message_keys_reach_the_template(qwen3_tokenizer):
    template = "{% for m in messages %}{{ m.role }}:{{ m.content }}/{{ m.mood }};{% endfor %}"
    messages = [{"role": "user", "content": "hi", "mood": "happy"}]
    assert JinjaRenderer(qwen3_tokenizer, template).render_text(messages) == "user:hi/happy;"


def test_named_templates_pick_default():
    tokenizer = SimpleNamespace(chat_template={"default": "{{ 'd' }}", "tool_use": "{{ 't' }}"})
    assert tokenizer_template(tokenizer) == "{{ 'd' }}"
    assert tokenizer_template(SimpleNamespace(chat_template=None)) is None
