from types import SimpleNamespace

import pytest
from jinja2 import TemplateError

from hanzo_gym.data.chat_templates import (
    CHATML,
    LLAMA3,
    NO_TEMPLATE,
    QWEN3,
    render_chat,
    resolve_chat_template,
    tokenizer_template,
)
from hanzo_gym.errors import ConfigError

GREETING = [
    {"role": "system", "content": "be good"},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "fine thanks"},
]


def test_chatml_renders_the_reference_string(qwen3_tokenizer):
    assert render_chat(qwen3_tokenizer, GREETING, CHATML) == (
        "<|im_start|>system\nbe good<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n"
        "<|im_start|>assistant\nfine thanks<|im_end|>\n"
    )


def test_chatml_generation_prompt(qwen3_tokenizer):
    text = render_chat(qwen3_tokenizer, GREETING[:2], CHATML, add_generation_prompt=True)
    assert text.endswith("hi there<|im_end|>\n<|im_start|>assistant\n")


def test_chatml_matches_smollm2_own_template_after_its_system_turn(smollm2_tokenizer):
    assert render_chat(smollm2_tokenizer, GREETING, CHATML) == render_chat(
        smollm2_tokenizer, GREETING, smollm2_tokenizer.chat_template
    )


QWEN3_CONVERSATIONS = {
    "single user": [{"role": "user", "content": "What is 2+2?"}],
    "system user assistant": GREETING,
    "multi-turn": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "well, thanks"},
    ],
    "reasoning key in past and final turns": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "two plus two"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "\nthree plus three\n"},
    ],
    "inline think in past and final turns": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\ntwo plus two\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "<think>three plus three</think>6"},
    ],
    "two assistant turns after the last query": [
        {"role": "user", "content": "count"},
        {"role": "assistant", "content": "one", "reasoning_content": "start"},
        {"role": "assistant", "content": "two"},
        {"role": "assistant", "content": "\n\nthree"},
    ],
    "ends with a user turn": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>x</think>hello"},
        {"role": "user", "content": "bye"},
    ],
    "no user turn": [
        {"role": "system", "content": "s"},
        {"role": "assistant", "content": "<think>r</think>a"},
    ],
    "late system turn": [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "new rules"},
        {"role": "assistant", "content": "ok"},
    ],
}


@pytest.mark.parametrize("enable_thinking", [None, True, False])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", list(QWEN3_CONVERSATIONS))
def test_builtin_qwen3_is_token_identical_to_the_qwen3_tokenizer_template(
    qwen3_tokenizer, name, add_generation_prompt, enable_thinking
):
    messages = QWEN3_CONVERSATIONS[name]
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    own_template = qwen3_tokenizer.chat_template
    ours = render_chat(qwen3_tokenizer, messages, QWEN3, add_generation_prompt, **extra)
    theirs = render_chat(qwen3_tokenizer, messages, own_template, add_generation_prompt, **extra)
    assert ours == theirs
    encode = qwen3_tokenizer.encode
    assert encode(ours, add_special_tokens=False) == encode(theirs, add_special_tokens=False)


def test_qwen3_strips_past_reasoning_and_keeps_final_reasoning(qwen3_tokenizer):
    text = render_chat(qwen3_tokenizer, QWEN3_CONVERSATIONS["reasoning key in past and final turns"], QWEN3)
    assert "two plus two" not in text
    assert "<|im_start|>assistant\n4<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\nthree plus three\n</think>\n\n6<|im_end|>\n")


def test_qwen3_generation_prompt_with_and_without_thinking(qwen3_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    thinking = render_chat(qwen3_tokenizer, messages, QWEN3, True, enable_thinking=True)
    not_thinking = render_chat(qwen3_tokenizer, messages, QWEN3, True, enable_thinking=False)
    assert thinking.endswith("hi<|im_end|>\n<|im_start|>assistant\n")
    assert not_thinking.endswith("hi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_builtin_refuses_tool_turns(qwen3_tokenizer):
    messages = [{"role": "user", "content": "weather?"}, {"role": "tool", "content": "sunny"}]
    with pytest.raises(TemplateError, match="no tool support"):
        render_chat(qwen3_tokenizer, messages, QWEN3)


def test_llama3_format_with_one_bos_and_stripped_content(llama32_tokenizer):
    messages = [
        {"role": "system", "content": "be good"},
        {"role": "user", "content": "  hi there\n"},
        {"role": "assistant", "content": "fine thanks "},
    ]
    text = render_chat(llama32_tokenizer, messages, LLAMA3, add_generation_prompt=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe good<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nfine thanks<|eot_id|>"
    )
    ids = llama32_tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == llama32_tokenizer.bos_token_id and ids.count(llama32_tokenizer.bos_token_id) == 1
    assert ids.count(llama32_tokenizer.convert_tokens_to_ids("<|eot_id|>")) == 3


def test_llama3_generation_prompt(llama32_tokenizer):
    text = render_chat(llama32_tokenizer, GREETING[:2], LLAMA3, add_generation_prompt=True)
    assert text.endswith("hi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_extra_message_keys_reach_the_template(qwen3_tokenizer):
    template = "{% for m in messages %}{{ m.role }}:{{ m.content }}/{{ m.mood }};{% endfor %}"
    messages = [{"role": "user", "content": "hi", "mood": "happy"}]
    assert render_chat(qwen3_tokenizer, messages, template) == "user:hi/happy;"


def test_raise_exception_in_a_template_raises(qwen3_tokenizer):
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('needs a system turn') }}{% endif %}"
    with pytest.raises(TemplateError, match="needs a system turn"):
        render_chat(qwen3_tokenizer, [{"role": "user", "content": "hi"}], template)


# --- resolution ---


@pytest.mark.parametrize("setting", [None, "tokenizer_default"])
def test_default_is_the_tokenizer_template(qwen3_tokenizer, setting):
    assert resolve_chat_template(setting, qwen3_tokenizer) == qwen3_tokenizer.chat_template


@pytest.mark.parametrize("setting", [None, "tokenizer_default"])
def test_default_without_a_tokenizer_template_is_an_error(llama32_tokenizer, setting):
    with pytest.raises(ConfigError) as error:
        resolve_chat_template(setting, llama32_tokenizer)
    assert str(error.value) == NO_TEMPLATE
    assert "chatml, qwen3, llama3 or inline Jinja" in str(error.value)


@pytest.mark.parametrize("name, template", [("chatml", CHATML), ("qwen3", QWEN3), ("llama3", LLAMA3)])
def test_builtin_names(llama32_tokenizer, name, template):
    assert resolve_chat_template(name, llama32_tokenizer) == template


def test_fallback_prefers_the_tokenizer_template(qwen3_tokenizer):
    resolved = resolve_chat_template("tokenizer_default_fallback_chatml", qwen3_tokenizer)
    assert resolved == qwen3_tokenizer.chat_template


def test_fallback_uses_the_builtin_when_the_tokenizer_has_none(llama32_tokenizer):
    assert resolve_chat_template("tokenizer_default_fallback_llama3", llama32_tokenizer) == LLAMA3


def test_fallback_to_an_unknown_name_is_an_error(llama32_tokenizer):
    with pytest.raises(ConfigError, match="unknown chat_template `gemma`"):
        resolve_chat_template("tokenizer_default_fallback_gemma", llama32_tokenizer)


def test_inline_jinja_is_used_as_is(llama32_tokenizer):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    assert resolve_chat_template(template, llama32_tokenizer) == template
    assert render_chat(llama32_tokenizer, GREETING[:1], template) == "[system] be good\n"


def test_unknown_name_lists_the_builtins(llama32_tokenizer):
    with pytest.raises(ConfigError) as error:
        resolve_chat_template("gemma", llama32_tokenizer)
    message = str(error.value)
    assert "`gemma`" in message
    assert all(name in message for name in ("chatml", "qwen3", "llama3"))


def test_inline_template_syntax_error_fails_at_resolution(llama32_tokenizer):
    with pytest.raises(ConfigError, match="Jinja syntax error"):
        resolve_chat_template("{% for m in messages %}{{ m.content }}", llama32_tokenizer)


def test_named_templates_pick_default():
    tokenizer = SimpleNamespace(chat_template={"default": "{{ 'd' }}", "tool_use": "{{ 't' }}"})
    assert tokenizer_template(tokenizer) == "{{ 'd' }}"
    assert tokenizer_template(SimpleNamespace(chat_template=None)) is None
