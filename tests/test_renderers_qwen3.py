"""Qwen3 renderers against the Qwen3 tokenizer's own chat template: token parity, thinking, tools, parsing."""

import json

import pytest

from hanzo_gym.renderers import ParseTermination, RendererError, TrainOnWhat, get_renderer

TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather in a city — über-precise",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    {"name": "get_time", "description": "Local time", "parameters": {"type": "object", "properties": {}}},
]


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
    "single user": [{"role": "user", "content": "What is 2+2?"}],
    "system user assistant": [
        {"role": "system", "content": "be good"},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "fine thanks"},
    ],
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
    "empty contents": [
        {"role": "system", "content": ""},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": ""},
    ],
    "unicode": [
        {"role": "user", "content": "日本語で答えて 🎉 — naïve café"},
        {"role": "assistant", "content": "はい、わかりました ✓", "reasoning_content": "Ünïcödé thoughts 🤔"},
    ],
    "leading and trailing whitespace": [
        {"role": "user", "content": "\nhi\n"},
        {"role": "assistant", "content": "\n\n  hello  "},
        {"role": "user", "content": " \t spaced"},
        {"role": "assistant", "content": "\n\nfinal\n", "reasoning_content": "\n\n"},
    ],
    "tool call and parallel tool responses": [
        {"role": "user", "content": "Weather and time in Paris?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "I need both tools.",
            "tool_calls": [call("get_weather", {"city": "Paris"}), call("get_time", "{}")],
        },
        {"role": "tool", "content": '{"sky": "sunny"}'},
        {"role": "tool", "content": "14:05"},
        {"role": "assistant", "content": "Sunny, and it is 14:05.", "reasoning_content": "Both came back."},
    ],
    "tool call without content, then a new query": [
        {"role": "user", "content": "Weather in Köln?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Köln"}}],
        },
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "It rains."},
        {"role": "user", "content": "Thanks!"},
    ],
    "tool response wrapped as a user turn": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "calling", "tool_calls": [call("get_time", {})]},
        {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"},
        {"role": "assistant", "content": "noon", "reasoning_content": "read the tool"},
    ],
}


def hf_tokens(tokenizer, messages, add_generation_prompt=False, **extra):
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )
    return tokenizer.encode(text, add_special_tokens=False)


def decode(tokenizer, tokens):
    return tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)


RENDERER_THINKING = [("qwen3", True), ("qwen3_disable_thinking", False)]


@pytest.mark.parametrize("name, enable_thinking", RENDERER_THINKING)
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_full_conversation_is_token_identical_to_the_hf_template(
    qwen3_tokenizer, name, enable_thinking, conversation
):
    messages = CONVERSATIONS[conversation]
    renderer = get_renderer(name, qwen3_tokenizer)
    expected = hf_tokens(qwen3_tokenizer, messages, enable_thinking=enable_thinking)
    assert renderer.render(messages).tokens() == expected


@pytest.mark.parametrize("name, enable_thinking", RENDERER_THINKING)
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_generation_prompt_after_every_prefix_is_token_identical(
    qwen3_tokenizer, name, enable_thinking, conversation
):
    messages = CONVERSATIONS[conversation]
    renderer = get_renderer(name, qwen3_tokenizer)
    for end in range(1, len(messages) + 1):  # HF refuses an empty conversation
        prefix = messages[:end]
        expected = hf_tokens(
            qwen3_tokenizer, prefix, add_generation_prompt=True, enable_thinking=enable_thinking
        )
        assert renderer.build_generation_prompt(prefix).to_ints() == expected, f"prefix of {end} messages"


@pytest.mark.parametrize("name, enable_thinking", RENDERER_THINKING)
def test_tool_declarations_match_the_hf_tools_argument(qwen3_tokenizer, name, enable_thinking):
    renderer = get_renderer(name, qwen3_tokenizer)
    hf_tools = [{"type": "function", "function": tool} for tool in TOOLS]
    for system_prompt in ("", "You are a weather bot."):
        for conversation in (
            "tool call and parallel tool responses",
            "tool call without content, then a new query",
        ):
            messages = CONVERSATIONS[conversation]
            ours = renderer.create_conversation_prefix_with_tools(TOOLS, system_prompt) + messages
            with_system = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + messages
            expected = hf_tokens(
                qwen3_tokenizer, with_system, tools=hf_tools, enable_thinking=enable_thinking
            )
            assert renderer.render(ours).tokens() == expected
            expected_prompt = hf_tokens(
                qwen3_tokenizer, with_system[:-1], True, tools=hf_tools, enable_thinking=enable_thinking
            )
            assert renderer.build_generation_prompt(ours[:-1]).to_ints() == expected_prompt


def test_generation_prompts_differ_by_the_empty_think_block(qwen3_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    thinking = decode(
        qwen3_tokenizer, get_renderer("qwen3", qwen3_tokenizer).build_generation_prompt(messages).to_ints()
    )
    no_thinking = get_renderer("qwen3_disable_thinking", qwen3_tokenizer).build_generation_prompt(messages)
    assert thinking.endswith("hi<|im_end|>\n<|im_start|>assistant\n")
    assert decode(qwen3_tokenizer, no_thinking.to_ints()).endswith(
        "hi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_prefill_is_appended_to_the_prompt(qwen3_tokenizer):
    renderer = get_renderer("qwen3", qwen3_tokenizer)
    prompt = renderer.build_generation_prompt([{"role": "user", "content": "hi"}], prefill="<think>\nHmm")
    assert decode(qwen3_tokenizer, prompt.to_ints()).endswith("<|im_start|>assistant\n<think>\nHmm")


# --- reasoning ---

PAST_AND_FINAL = CONVERSATIONS["reasoning key in past and final turns"]


def test_past_reasoning_is_stripped_and_final_reasoning_kept(qwen3_tokenizer):
    text = decode(qwen3_tokenizer, get_renderer("qwen3", qwen3_tokenizer).render(PAST_AND_FINAL).tokens())
    assert "two plus two" not in text
    assert "<|im_start|>assistant\n4<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\nthree plus three\n</think>\n\n6<|im_end|>\n")


@pytest.mark.parametrize(
    "final",
    [
        {"role": "assistant", "content": "6", "reasoning_content": "three plus three"},
        {
            "role": "assistant",
            "content": [{"type": "thinking", "thinking": "three plus three"}, {"type": "text", "text": "6"}],
        },
        {"role": "assistant", "content": "<think>\nthree plus three\n</think>\n\n6"},
    ],
    ids=["reasoning_content", "thinking parts", "inline think"],
)
def test_the_three_ways_to_give_reasoning_render_alike(qwen3_tokenizer, final):
    renderer = get_renderer("qwen3", qwen3_tokenizer)
    reference = [
        *PAST_AND_FINAL[:-1],
        {"role": "assistant", "content": "6", "reasoning_content": "three plus three"},
    ]
    assert renderer.render([*PAST_AND_FINAL[:-1], final]).tokens() == renderer.render(reference).tokens()


def trained_text(tokenizer, model_input, weights):
    tokens = model_input.to_ints()
    return decode(tokenizer, [token for token, weight in zip(tokens, weights.tolist()) if weight])


def test_qwen3_trains_the_think_block_of_the_final_turn(qwen3_tokenizer):
    renderer = get_renderer("qwen3", qwen3_tokenizer)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    model_input, weights = renderer.build_supervised_example(messages)
    # no reasoning still gets the empty block, and the model (prompted with `assistant\n`) must write it
    assert trained_text(qwen3_tokenizer, model_input, weights) == "<think>\n\n</think>\n\nhello<|im_end|>"


def test_disable_thinking_puts_the_empty_block_in_the_untrained_header(qwen3_tokenizer):
    renderer = get_renderer("qwen3_disable_thinking", qwen3_tokenizer)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    model_input, weights = renderer.build_supervised_example(messages)
    assert trained_text(qwen3_tokenizer, model_input, weights) == "hello<|im_end|>"
    # the observation is exactly the generation prompt, which already closed the think block
    prompt = renderer.build_generation_prompt(messages[:1]).to_ints()
    first_trained = weights.tolist().index(1.0)
    assert model_input.to_ints()[:first_trained] == prompt


def test_disable_thinking_refuses_a_target_with_reasoning(qwen3_tokenizer):
    renderer = get_renderer("qwen3_disable_thinking", qwen3_tokenizer)
    with pytest.raises(RendererError, match="message 4 has reasoning.*use the qwen3 renderer"):
        renderer.build_supervised_example(PAST_AND_FINAL)
    # the past turn's reasoning is stripped anyway, so training only on it is fine
    past_only = [*PAST_AND_FINAL[:-1], {"role": "assistant", "content": "6"}]
    renderer.build_supervised_example(past_only, TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    # and reasoning in the context of a generation prompt is no target
    renderer.build_generation_prompt(PAST_AND_FINAL)


def test_disable_thinking_needs_a_user_message_before_a_trained_turn(qwen3_tokenizer):
    renderer = get_renderer("qwen3_disable_thinking", qwen3_tokenizer)
    messages = [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(RendererError, match="needs a user message"):
        renderer.build_supervised_example(messages)


def test_instruct_renders_plain_chatml_and_refuses_reasoning(qwen3_tokenizer):
    renderer = get_renderer("qwen3_instruct", qwen3_tokenizer)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    text = decode(qwen3_tokenizer, renderer.render(messages).tokens())
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    prompt = renderer.build_generation_prompt(messages[:1]).to_ints()
    assert decode(qwen3_tokenizer, prompt).endswith("<|im_start|>assistant\n")
    with pytest.raises(RendererError, match="renders no reasoning"):
        renderer.render([messages[0], {**messages[1], "reasoning_content": "r"}])


def test_unknown_roles_are_refused(qwen3_tokenizer):
    with pytest.raises(RendererError, match="no role `developer`"):
        get_renderer("qwen3", qwen3_tokenizer).render([{"role": "developer", "content": "x"}])


# --- parsing ---


def response_tokens(renderer, messages):
    """What the model samples for the final message: the trained tokens right after the generation prompt."""
    model_input, weights = renderer.build_supervised_example(messages, TrainOnWhat.LAST_ASSISTANT_MESSAGE)
    prompt = renderer.build_generation_prompt(messages[:-1]).to_ints()
    tokens, trained = model_input.to_ints(), [bool(w) for w in weights.tolist()]
    assert tokens[: len(prompt)] == prompt and not any(trained[: len(prompt)])
    response = [token for token, is_trained in zip(tokens, trained) if is_trained]
    assert tokens[len(prompt) : len(prompt) + len(response)] == response
    return response


def reasoning_of(message):
    content = message["content"]
    if isinstance(content, str):
        return message.get("reasoning_content") or ""
    return "".join(part["thinking"] for part in content if part["type"] == "thinking")


def text_of(message):
    content = message["content"]
    return content if isinstance(content, str) else "".join(p["text"] for p in content if p["type"] == "text")


def calls_of(message):
    calls = []
    for tool_call in message.get("tool_calls", []):
        function = tool_call.get("function", tool_call)
        arguments = function["arguments"]
        calls.append((function["name"], json.loads(arguments) if isinstance(arguments, str) else arguments))
    return calls


ROUND_TRIPS = {
    "plain": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, there!"}],
    "reasoning": CONVERSATIONS["reasoning key in past and final turns"],
    "unicode reasoning": CONVERSATIONS["unicode"],
    "tool calls with reasoning": CONVERSATIONS["tool call and parallel tool responses"][:2],
    "tool call without content": CONVERSATIONS["tool call without content, then a new query"][:2],
    "multi-line content": [
        {"role": "user", "content": "poem"},
        {
            "role": "assistant",
            "content": "roses\nare red\n\nviolets",
            "reasoning_content": "line one\n\nline two",
        },
    ],
}


@pytest.mark.parametrize("conversation", list(ROUND_TRIPS))
def test_parse_response_round_trips_the_final_message(qwen3_tokenizer, conversation):
    renderer = get_renderer("qwen3", qwen3_tokenizer)
    messages = ROUND_TRIPS[conversation]
    parsed, termination = renderer.parse_response(response_tokens(renderer, messages))
    assert termination is ParseTermination.STOP_SEQUENCE
    original = messages[-1]
    assert parsed["role"] == "assistant"
    assert text_of(parsed) == text_of(original)
    assert reasoning_of(parsed) == reasoning_of(original).strip("\n")
    assert calls_of(parsed) == calls_of(original)
    assert "unparsed_tool_calls" not in parsed


def test_parse_response_under_disable_thinking_round_trips(qwen3_tokenizer):
    renderer = get_renderer("qwen3_disable_thinking", qwen3_tokenizer)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]
    parsed, termination = renderer.parse_response(response_tokens(renderer, messages))
    assert (parsed, termination) == (
        {"role": "assistant", "content": "Hello!"},
        ParseTermination.STOP_SEQUENCE,
    )


def test_truncated_response_is_malformed(qwen3_tokenizer):
    renderer = get_renderer("qwen3", qwen3_tokenizer)
    tokens = response_tokens(renderer, ROUND_TRIPS["reasoning"])
    parsed, termination = renderer.parse_response(tokens[:-1])  # no <|im_end|>
    assert termination is ParseTermination.MALFORMED and not termination.is_clean
    assert text_of(parsed) == "6"
    cut_while_thinking, termination = renderer.parse_response(qwen3_tokenizer.encode("<think>\nstill going"))
    assert termination is ParseTermination.MALFORMED
    assert reasoning_of(cut_while_thinking) == "still going" and text_of(cut_while_thinking) == ""


def test_more_than_one_stop_token_is_an_error(qwen3_tokenizer):
    renderer = get_renderer("qwen3", qwen3_tokenizer)
    tokens = qwen3_tokenizer.encode("a<|im_end|>b<|im_end|>")
    with pytest.raises(RendererError, match="2 stop tokens"):
        renderer.parse_response(tokens)


def test_tokens_after_the_stop_token_are_ignored(qwen3_tokenizer):
    renderer = get_renderer("qwen3_instruct", qwen3_tokenizer)
    parsed, termination = renderer.parse_response(qwen3_tokenizer.encode("done<|im_end|>\n<|endoftext|>"))
    assert parsed == {"role": "assistant", "content": "done"}
    assert termination.is_stop_sequence


def test_bad_tool_call_json_is_reported_not_raised(qwen3_tokenizer):
    renderer = get_renderer("qwen3", qwen3_tokenizer)
    text = (
        'ok\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{not json}\n</tool_call>\n<tool_call>\n{"name": "cut'
    )
    parsed, termination = renderer.parse_response(qwen3_tokenizer.encode(text + "<|im_end|>"))
    assert termination is ParseTermination.STOP_SEQUENCE  # a content failure, not a structural one
    assert parsed["content"] == "ok"
    assert calls_of(parsed) == [("get_time", {})]
    errors = [item["error"] for item in parsed["unparsed_tool_calls"]]
    assert errors[0].startswith("bad tool call JSON") and errors[1] == "unclosed <tool_call>"
    assert parsed["unparsed_tool_calls"][0]["raw_text"] == "<tool_call>\n{not json}\n</tool_call>"


def test_stop_sequences_are_im_end(qwen3_tokenizer):
    im_end = qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for name in ("qwen3", "qwen3_disable_thinking", "qwen3_instruct"):
        assert get_renderer(name, qwen3_tokenizer).get_stop_sequences() == [im_end]
