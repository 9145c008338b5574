"""kimi_k2 renderer. Kimi's own (tiktoken) tokenizer is not available offline, so the tests use the Qwen3
tokenizer with Kimi's special tokens added: the layouts are the format's, the tokenisation of text is Qwen's."""

from __future__ import annotations

import copy

import pytest
from renderer_layout import assert_layout, text, thought, trained_text, user

from hanzo_gym.renderers import ParseTermination, RendererError, TrainOnWhat, get_renderer
from hanzo_gym.renderers.kimi import KimiK2Renderer

KIMI_SPECIALS = [
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]  # `<|im_end|>`, `<think>`, `</think>` are already Qwen3 tokens
DEFAULT_SYSTEM = (
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
)
CALL = {
    "id": "functions.get_weather:0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
CALL_TEXT = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer):
    tokenizer = copy.deepcopy(qwen3_tokenizer)  # the fixture is shared by the whole session
    tokenizer.add_special_tokens({"additional_special_tokens": KIMI_SPECIALS})
    return tokenizer


@pytest.fixture(scope="module")
def kimi(tokenizer):
    return KimiK2Renderer(tokenizer)


CHAT = [
    {"role": "system", "content": "Be brief."},
    user("Hi"),
    {"role": "assistant", "content": thought("greet", "Hello! 你好")},
    user("2+2?"),
    {"role": "assistant", "reasoning_content": "add", "content": "4"},
]
TOOL_CHAT = [
    user("Weather?"),
    {"role": "assistant", "content": thought("need data", "Checking."), "tool_calls": [CALL]},
    {"role": "tool", "name": "get_weather", "tool_call_id": "functions.get_weather:0", "content": "Sunny"},
    {"role": "assistant", "content": thought("it said sunny", "It is sunny.")},
]


def test_default_system_message_is_inserted(kimi, tokenizer):
    assert_layout(
        tokenizer,
        kimi.render([user("Hi"), {"role": "assistant", "content": "Hello"}]).tokens(),
        f"{DEFAULT_SYSTEM}<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello<|im_end|>",
    )
    assert_layout(
        tokenizer,
        kimi.build_generation_prompt([]).to_ints(),
        f"{DEFAULT_SYSTEM}<|im_assistant|>assistant<|im_middle|>",
    )
    # after a leading tool declaration, before everything else
    declare = {"role": "tool_declare", "content": "[]"}
    assert text(tokenizer, kimi.render([declare, user("Hi")]).tokens()) == (
        f"<|im_system|>tool_declare<|im_middle|>[]<|im_end|>{DEFAULT_SYSTEM}<|im_user|>user<|im_middle|>Hi<|im_end|>"
    )


def test_multi_turn_history_gets_an_empty_think_block(kimi, tokenizer):
    assert_layout(
        tokenizer,
        kimi.render(CHAT).tokens(),
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello! 你好<|im_end|>"
        "<|im_user|>user<|im_middle|>2+2?<|im_end|><|im_assistant|>assistant<|im_middle|><think>add</think>4<|im_end|>",
    )
    keeping = KimiK2Renderer(tokenizer, strip_thinking_from_history=False)
    assert "<think>greet</think>Hello! 你好" in text(tokenizer, keeping.render(CHAT).tokens())
    assert keeping.has_extension_property and not kimi.has_extension_property


def test_tool_calls_and_results(kimi, tokenizer):
    # the whole last turn (tool-call message included) keeps its reasoning
    assert_layout(
        tokenizer,
        kimi.render(TOOL_CHAT).tokens(),
        f"{DEFAULT_SYSTEM}<|im_user|>user<|im_middle|>Weather?<|im_end|>"
        f"<|im_assistant|>assistant<|im_middle|><think>need data</think>Checking.{CALL_TEXT}<|im_end|>"
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\nSunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>it said sunny</think>It is sunny.<|im_end|>",
    )
    # a tool call without id gets `functions.{name}:{index}`; dict arguments are serialised
    no_id = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    rendered = kimi.render([user("?"), {"role": "assistant", "content": "", "tool_calls": [CALL, no_id]}])
    assert "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>" in text(
        tokenizer, rendered.tokens()
    )


def test_tool_declarations_precede_the_system_message(kimi, tokenizer):
    tool = {"name": "get_weather", "parameters": {"type": "object"}, "description": "Wetter"}
    prefix = kimi.create_conversation_prefix_with_tools([tool])
    assert prefix == [
        {
            "role": "tool_declare",
            "content": '[{"function":{"description":"Wetter","name":"get_weather","parameters":{"type":"object"}},'
            '"type":"function"}]',
        },
        {"role": "system", "content": KimiK2Renderer.DEFAULT_SYSTEM_PROMPT},
    ]
    assert text(tokenizer, kimi.render(prefix).tokens()).count("You are Kimi") == 1
    assert kimi.create_conversation_prefix_with_tools([], "Be brief.") == [
        {"role": "system", "content": "Be brief."}
    ]


def test_generation_prompt(kimi, tokenizer):
    prompt = kimi.build_generation_prompt(CHAT[:4], prefill="Sure")
    assert text(tokenizer, prompt.to_ints()).endswith(
        "<|im_user|>user<|im_middle|>2+2?<|im_end|><|im_assistant|>assistant<|im_middle|>Sure"
    )


def test_supervised_weights(kimi, tokenizer):
    assert trained_text(kimi, CHAT, TrainOnWhat.LAST_ASSISTANT_MESSAGE) == "<think>add</think>4<|im_end|>"
    assert trained_text(kimi, CHAT, TrainOnWhat.ALL_ASSISTANT_MESSAGES) == (
        "<think></think>Hello! 你好<|im_end|><think>add</think>4<|im_end|>"
    )
    assert trained_text(kimi, TOOL_CHAT, TrainOnWhat.LAST_ASSISTANT_TURN) == (
        f"<think>need data</think>Checking.{CALL_TEXT}<|im_end|><think>it said sunny</think>It is sunny.<|im_end|>"
    )
    # the inserted default system message is header: trained only when everything is
    assert "Moonshot" not in trained_text(kimi, TOOL_CHAT, TrainOnWhat.ALL_MESSAGES)
    model_input, weights = kimi.build_supervised_example(TOOL_CHAT, TrainOnWhat.ALL_TOKENS)
    assert weights.tolist() == [1.0] * model_input.length
    _, weights = kimi.build_supervised_example(TOOL_CHAT)
    assert weights[: len(tokenizer.encode(DEFAULT_SYSTEM, add_special_tokens=False))].sum() == 0


@pytest.mark.parametrize("messages", [CHAT, TOOL_CHAT, TOOL_CHAT[:2]], ids=["chat", "tools", "tool-call"])
def test_observation_equals_generation_prompt(kimi, messages):
    model_input, weights = kimi.build_supervised_example(messages)
    first_trained = weights.tolist().index(1.0)
    assert model_input.to_ints()[:first_trained] == kimi.build_generation_prompt(messages[:-1]).to_ints()


def test_stop_sequences(kimi, tokenizer):
    assert kimi.get_stop_sequences() == [tokenizer.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": "Hello! 你好"},
        {"role": "assistant", "content": thought("add", "4")},
        {"role": "assistant", "content": thought("need data", "Checking."), "tool_calls": [CALL]},
        {"role": "assistant", "content": [], "tool_calls": [CALL, {**CALL, "id": "functions.get_weather:1"}]},
    ],
    ids=["text", "reasoning", "tool-call", "two-tool-calls"],
)
def test_parse_round_trip(kimi, message):
    rendered = kimi.render_message(1, [user("?"), message])
    assert kimi.parse_response(rendered.output) == (message, ParseTermination.STOP_SEQUENCE)


def test_parse_reports_bad_tool_json_truncation_and_double_stop(kimi, tokenizer):
    bad = tokenizer.encode(
        "<think></think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        "{oops<|tool_call_end|><|tool_calls_section_end|><|im_end|>",
        add_special_tokens=False,
    )
    message, termination = kimi.parse_response(bad)
    assert termination is ParseTermination.STOP_SEQUENCE
    assert message["content"] == [] and "tool_calls" not in message
    assert "invalid JSON" in message["unparsed_tool_calls"][0]["error"]

    cut = tokenizer.encode("<think>let me see", add_special_tokens=False)
    message, termination = kimi.parse_response(cut)
    assert termination is ParseTermination.MALFORMED
    assert message["content"] == [{"type": "thinking", "thinking": "let me see"}]

    cut_call = tokenizer.encode(
        "<think></think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{",
        add_special_tokens=False,
    )
    message, termination = kimi.parse_response(cut_call)
    assert termination is ParseTermination.MALFORMED and message["unparsed_tool_calls"][0]["error"]

    with pytest.raises(RendererError, match="2 stop tokens"):
        kimi.parse_response(tokenizer.encode("Hi<|im_end|>Again<|im_end|>", add_special_tokens=False))


def test_lacking_special_tokens_is_a_clear_error(qwen3_tokenizer):
    with pytest.raises(RendererError, match=r"<\|im_system\|>"):
        KimiK2Renderer(qwen3_tokenizer)


def test_registry_name(tokenizer):
    assert type(get_renderer("kimi_k2", tokenizer)) is KimiK2Renderer
