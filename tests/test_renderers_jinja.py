"""The Jinja renderer: HF's tokens by construction, spans measured to agree with the built-in renderers."""

import pytest

from hanzo_gym.renderers import ParseTermination, RendererError, TrainOnWhat, get_renderer
from hanzo_gym.renderers.jinja import JinjaRenderer

CONVERSATIONS = {
    "system and multi-turn": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ],
    "reasoning in past and final turns": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "two plus two"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "<think>\nthree plus three\n</think>\n\n6"},
    ],
    "unicode and empty content": [
        {"role": "user", "content": "日本語 🎉"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "naïve — ✓"},
        {"role": "assistant", "content": "Über"},
    ],
    "consecutive assistant turns": [
        {"role": "user", "content": "count"},
        {"role": "assistant", "content": "one", "reasoning_content": "start low"},
        {"role": "assistant", "content": "two"},
    ],
}


def hf_tokens(tokenizer, messages, add_generation_prompt=False, **extra):
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )
    return tokenizer.encode(text, add_special_tokens=False)


def spans(conversation):
    return [(m.header, m.content, m.end) for m in conversation.messages]


# Under enable_thinking=False a final turn with reasoning is no valid target (qwen3_disable_thinking refuses
# to train it), and its span is not measured: that pairing is left out.
SPAN_CASES = [("qwen3", True, name) for name in CONVERSATIONS] + [
    ("qwen3_disable_thinking", False, name)
    for name in CONVERSATIONS
    if name != "reasoning in past and final turns"
]


@pytest.mark.parametrize("builtin, enable_thinking, conversation", SPAN_CASES)
def test_spans_agree_with_the_builtin_qwen3_renderer(qwen3_tokenizer, builtin, enable_thinking, conversation):
    messages = CONVERSATIONS[conversation]
    jinja = JinjaRenderer(qwen3_tokenizer, enable_thinking=enable_thinking).render(messages)
    ours = get_renderer(builtin, qwen3_tokenizer).render(messages)
    assert jinja.tokens() == ours.tokens() == hf_tokens(qwen3_tokenizer, messages)
    assert spans(jinja) == spans(ours)
    assert (jinja.bos, jinja.trailer) == (ours.bos, ours.trailer)


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("enable_thinking", [True, False])
def test_generation_prompts_are_the_templates(qwen3_tokenizer, conversation, enable_thinking):
    renderer = JinjaRenderer(qwen3_tokenizer, enable_thinking=enable_thinking)
    messages = CONVERSATIONS[conversation]
    for end in range(1, len(messages) + 1):
        expected = hf_tokens(qwen3_tokenizer, messages[:end], True, enable_thinking=enable_thinking)
        assert renderer.build_generation_prompt(messages[:end]).to_ints() == expected


def test_smollm2_template_with_and_without_a_system_message(smollm2_tokenizer):
    renderer = JinjaRenderer(smollm2_tokenizer)
    for messages in CONVERSATIONS.values():
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        conversation = renderer.render(messages)
        assert conversation.tokens() == hf_tokens(smollm2_tokenizer, messages)
        assert renderer.build_generation_prompt(messages[:-1]).to_ints() == hf_tokens(
            smollm2_tokenizer, messages[:-1], True
        )
        # SmolLM2's bos is `<|im_start|>`, which opens every turn: it is no BOS, so nothing goes to `bos`
        assert conversation.bos == []


def test_smollm2_builtin_chatml_equals_its_template_given_a_system_message(smollm2_tokenizer):
    chatml = get_renderer("qwen3_instruct", smollm2_tokenizer)
    jinja = JinjaRenderer(smollm2_tokenizer)
    for messages in CONVERSATIONS.values():
        plain = [
            {"role": m["role"], "content": m["content"]} for m in messages if "reasoning_content" not in m
        ]
        with_system = (
            plain if plain[0]["role"] == "system" else [{"role": "system", "content": "Be kind."}, *plain]
        )
        assert chatml.render(with_system).tokens() == hf_tokens(smollm2_tokenizer, with_system)
        assert spans(chatml.render(with_system)) == spans(jinja.render(with_system))
        assert chatml.build_generation_prompt(with_system).to_ints() == hf_tokens(
            smollm2_tokenizer, with_system, True
        )


def test_a_template_that_writes_a_bos_puts_it_in_bos(llama32_tokenizer):
    template = (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
        "{{ m.content | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )
    renderer = JinjaRenderer(llama32_tokenizer, template)
    messages = CONVERSATIONS["system and multi-turn"]
    conversation = renderer.render(messages)
    assert conversation.bos == [llama32_tokenizer.bos_token_id]
    # the same format as the built-in llama3 renderer, span for span
    builtin = get_renderer("llama3", llama32_tokenizer).render(messages)
    assert conversation.tokens() == builtin.tokens()
    assert spans(conversation) == spans(builtin)
    _, weights = renderer.build_supervised_example(messages, TrainOnWhat.ALL_TOKENS)
    assert weights[0] == 0 and weights[1:].min() == 1
    assert renderer.get_stop_sequences() == [llama32_tokenizer.convert_tokens_to_ids("<|eot_id|>")]


def test_parse_response_stops_at_the_templates_end_of_turn(qwen3_tokenizer):
    renderer = JinjaRenderer(qwen3_tokenizer)
    assert renderer.get_stop_sequences() == [qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    final = renderer.render(CONVERSATIONS["system and multi-turn"]).messages[-1]
    parsed, termination = renderer.parse_response(final.output)
    assert termination is ParseTermination.STOP_SEQUENCE
    assert parsed == {"role": "assistant", "content": "<think>\n\n</think>\n\n6"}  # the template's own text
    assert renderer.parse_response(final.content)[1] is ParseTermination.MALFORMED


def test_only_assistant_turns_can_be_opened(qwen3_tokenizer):
    with pytest.raises(RendererError, match="only opens assistant turns, not `user`"):
        JinjaRenderer(qwen3_tokenizer).build_generation_prompt(
            [{"role": "user", "content": "hi"}], role="user"
        )


def test_template_errors_become_renderer_errors(qwen3_tokenizer):
    renderer = JinjaRenderer(qwen3_tokenizer, "{{ raise_exception('needs a system turn') }}")
    with pytest.raises(RendererError, match="chat template failed: needs a system turn"):
        renderer.render([{"role": "user", "content": "hi"}])


def test_a_syntax_error_fails_at_construction(qwen3_tokenizer):
    with pytest.raises(RendererError, match="Jinja syntax error on line 1"):
        JinjaRenderer(qwen3_tokenizer, "{% for m in messages %}")


def test_tokenizer_without_a_template(llama32_tokenizer):
    with pytest.raises(RendererError, match="no chat template"):
        JinjaRenderer(llama32_tokenizer)
