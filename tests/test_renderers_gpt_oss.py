"""gpt_oss_* renderers (Harmony). The o200k_harmony tokenizer is not available offline, so the tests use the
Qwen3 tokenizer with Harmony's special tokens added: the layouts are the format's, text tokenisation is Qwen's."""

from __future__ import annotations

import copy
import datetime

import pytest
from renderer_layout import assert_layout, text, thought, trained_text, user

from hanzo_gym.renderers import ParseTermination, RendererError, TrainOnWhat, get_renderer
from hanzo_gym.renderers.gpt_oss import GptOssRenderer

HARMONY_SPECIALS = [
    "<|start|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CALL_TEXT = (
    ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)


def system_preamble(effort: str, date: str) -> str:
    return (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {date}\n\nReasoning: {effort}\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    )


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer):
    tokenizer = copy.deepcopy(qwen3_tokenizer)  # the fixture is shared by the whole session
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_SPECIALS})
    return tokenizer


@pytest.fixture(scope="module")
def harmony(tokenizer):
    return GptOssRenderer(tokenizer)  # gpt_oss_no_sysprompt


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
    {"role": "tool", "name": "get_weather", "tool_call_id": "call_1", "content": "Sunny"},
    {"role": "assistant", "content": "It is sunny."},
]


def test_single_turn_without_system_prompt(harmony, tokenizer):
    assert_layout(
        tokenizer,
        harmony.render([user("Hi"), {"role": "assistant", "content": "Hello"}]).tokens(),
        "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Hello<|return|>",
    )


def test_multi_turn_with_developer_instructions_and_reasoning(harmony, tokenizer):
    # every assistant message keeps its analysis; only the last one ends with <|return|>
    assert_layout(
        tokenizer,
        harmony.render(CHAT).tokens(),
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"
        "<|start|>user<|message|>Hi<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>greet<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello! 你好<|end|>"
        "<|start|>user<|message|>2+2?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>add<|end|>"
        "<|start|>assistant<|channel|>final<|message|>4<|return|>",
    )


def test_reasoning_effort_system_message(tokenizer):
    fixed = GptOssRenderer(tokenizer, reasoning_effort="high", current_date="2025-01-02")
    assert_layout(
        tokenizer,
        fixed.build_generation_prompt([user("Hi")]).to_ints(),
        system_preamble("high", "2025-01-02") + "<|start|>user<|message|>Hi<|end|><|start|>assistant",
    )
    today = GptOssRenderer(tokenizer, reasoning_effort="low")
    assert f"Current date: {datetime.date.today().isoformat()}\n" in text(tokenizer, today.bos_tokens)
    with pytest.raises(RendererError, match="reasoning_effort"):
        GptOssRenderer(tokenizer, reasoning_effort="max")


def test_tool_calls_and_results(harmony, tokenizer):
    assert_layout(
        tokenizer,
        harmony.render(TOOL_CHAT).tokens(),
        "<|start|>user<|message|>Weather?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>need data<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"  # a preamble
        f"<|start|>assistant{CALL_TEXT}"
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>Sunny<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
    )
    two_calls = {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]}
    assert text(tokenizer, harmony.render([user("?"), two_calls]).tokens()).endswith(
        f"<|start|>assistant{CALL_TEXT}<|start|>assistant{CALL_TEXT}"
    )
    with pytest.raises(RendererError, match="needs `name`"):
        harmony.render([user("?"), two_calls, {"role": "tool", "content": "Sunny"}])


def test_generation_prompt(harmony, tokenizer):
    assert text(
        tokenizer, harmony.build_generation_prompt(CHAT[:4], prefill="<|channel|>").to_ints()
    ).endswith("<|start|>user<|message|>2+2?<|end|><|start|>assistant<|channel|>")


def test_supervised_weights(tokenizer):
    renderer = GptOssRenderer(tokenizer, reasoning_effort="medium", current_date="2025-01-02")
    last = "<|channel|>analysis<|message|>add<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>"
    assert trained_text(renderer, CHAT, TrainOnWhat.LAST_ASSISTANT_MESSAGE) == last
    assert trained_text(renderer, CHAT, TrainOnWhat.ALL_ASSISTANT_MESSAGES) == (
        "<|channel|>analysis<|message|>greet<|end|><|start|>assistant<|channel|>final<|message|>Hello! 你好<|end|>"
        + last
    )
    assert trained_text(renderer, TOOL_CHAT, TrainOnWhat.LAST_ASSISTANT_TURN).endswith(
        f"{CALL_TEXT}<|channel|>final<|message|>It is sunny.<|return|>"
    )
    # the system preamble is fixed, like a BOS token: never trained, not even under ALL_TOKENS
    model_input, weights = renderer.build_supervised_example(CHAT, TrainOnWhat.ALL_TOKENS)
    preamble = len(renderer.bos_tokens)
    assert weights[:preamble].sum() == 0 and weights[preamble:].tolist() == [1.0] * (
        model_input.length - preamble
    )


@pytest.mark.parametrize("messages", [CHAT, TOOL_CHAT, TOOL_CHAT[:2]], ids=["chat", "tools", "tool-call"])
def test_observation_equals_generation_prompt(tokenizer, messages):
    renderer = GptOssRenderer(tokenizer, reasoning_effort="low", current_date="2025-01-02")
    model_input, weights = renderer.build_supervised_example(messages)
    first_trained = weights.tolist().index(1.0)
    assert model_input.to_ints()[:first_trained] == renderer.build_generation_prompt(messages[:-1]).to_ints()


def test_stop_sequences(harmony, tokenizer):
    assert harmony.get_stop_sequences() == tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": "Hello! 你好"},
        {"role": "assistant", "content": thought("add", "4")},
        {"role": "assistant", "content": thought("need data", "Checking."), "tool_calls": [CALL]},
        {"role": "assistant", "content": [], "tool_calls": [CALL]},
    ],
    ids=["final", "analysis", "preamble-tool-call", "tool-call"],
)
def test_parse_round_trip(harmony, message):
    rendered = harmony.render_message(1, [user("?"), message])
    assert harmony.parse_response(rendered.output) == (message, ParseTermination.STOP_SEQUENCE)


def test_parse_reports_bad_tool_json_truncation_and_double_stop(harmony, tokenizer):
    bad = tokenizer.encode(
        " to=functions.f<|channel|>commentary <|constrain|>json<|message|>{oops<|call|>",
        add_special_tokens=False,
    )
    message, termination = harmony.parse_response(bad)
    assert termination is ParseTermination.STOP_SEQUENCE
    assert message["content"] == [] and "tool_calls" not in message
    assert "invalid JSON" in message["unparsed_tool_calls"][0]["error"]

    cut = tokenizer.encode("<|channel|>analysis<|message|>let me", add_special_tokens=False)
    message, termination = harmony.parse_response(cut)
    assert termination is ParseTermination.MALFORMED
    assert message["content"] == [{"type": "thinking", "thinking": "let me"}]

    message, termination = harmony.parse_response(tokenizer.encode("no header", add_special_tokens=False))
    assert (message, termination) == (
        {"role": "assistant", "content": "no header"},
        ParseTermination.MALFORMED,
    )

    # sampled past a tool call into an answer: the stop tokens were not passed to the sampler
    overrun = "<|channel|>final<|message|>x<|return|>" + CALL_TEXT
    with pytest.raises(RendererError, match="2 stop tokens"):
        harmony.parse_response(tokenizer.encode(overrun, add_special_tokens=False))


def test_lacking_special_tokens_is_a_clear_error(qwen3_tokenizer):
    with pytest.raises(RendererError, match=r"<\|start\|>"):
        GptOssRenderer(qwen3_tokenizer)


@pytest.mark.parametrize(
    "name, effort",
    [
        ("gpt_oss_no_sysprompt", None),
        ("gpt_oss_low_reasoning", "low"),
        ("gpt_oss_medium_reasoning", "medium"),
        ("gpt_oss_high_reasoning", "high"),
    ],
)
def test_registry_names(tokenizer, name, effort):
    renderer = get_renderer(name, tokenizer)
    assert type(renderer) is GptOssRenderer and renderer.reasoning_effort == effort
    assert bool(renderer.bos_tokens) == (effort is not None)
