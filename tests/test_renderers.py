"""Renderer registry, TrainOnWhat weighting, Axolotl labels, role_colon, llama3 and the model → renderer table."""

import pytest

from hanzo_gym.records import IGNORE_INDEX
from hanzo_gym.renderers import (
    ParseTermination,
    RendererError,
    TrainOnWhat,
    get_recommended_renderer_name,
    get_renderer,
)
from hanzo_gym.renderers.base import axolotl_labels
from hanzo_gym.renderers.jinja import JinjaRenderer
from hanzo_gym.renderers.llama3 import Llama3Renderer
from hanzo_gym.renderers.qwen3 import Qwen3DisableThinkingRenderer, Qwen3InstructRenderer, Qwen3Renderer
from hanzo_gym.renderers.recommended import recommended_renderer_names
from hanzo_gym.renderers.role_colon import RoleColonRenderer


def decode(tokenizer, tokens):
    return tokenizer.decode(list(tokens), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def trained_runs(tokenizer, model_input, weights):
    """Each run of consecutive weight-1 tokens, decoded."""
    runs, run = [], []
    for token, weight in zip(model_input.to_ints(), weights.tolist()):
        assert weight in (0.0, 1.0)
        if weight:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    return [decode(tokenizer, r) for r in runs + ([run] if run else [])]


# --- registry ---


@pytest.mark.parametrize(
    "name, kind",
    [
        ("role_colon", RoleColonRenderer),
        ("llama3", Llama3Renderer),
        ("qwen3", Qwen3Renderer),
        ("qwen3_disable_thinking", Qwen3DisableThinkingRenderer),
        ("qwen3_instruct", Qwen3InstructRenderer),
    ],
)
def test_get_renderer_builds_each_name(qwen3_tokenizer, llama32_tokenizer, name, kind):
    tokenizer = llama32_tokenizer if name in ("llama3", "role_colon") else qwen3_tokenizer
    renderer = get_renderer(name, tokenizer)
    assert type(renderer) is kind and renderer.tokenizer is tokenizer


def test_unknown_renderer_name_lists_the_known_ones(qwen3_tokenizer):
    with pytest.raises(RendererError, match="unknown renderer `qwen9`.*qwen3_instruct"):
        get_renderer("qwen9", qwen3_tokenizer)


def test_a_renderer_needs_its_special_tokens(qwen3_tokenizer):
    with pytest.raises(RendererError, match="Llama3Renderer needs the special token '<\\|begin_of_text\\|>'"):
        get_renderer("llama3", qwen3_tokenizer)


# --- TrainOnWhat ---

AGENT = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "U2"},
    {"role": "assistant", "content": "A2", "tool_calls": [{"name": "f", "arguments": {}}]},
    {"role": "tool", "content": "T"},
    {"role": "assistant", "content": "A3"},
]
OUTPUTS = {
    "S": "S<|im_end|>",
    "U1": "U1<|im_end|>",
    "A1": "A1<|im_end|>",
    "U2": "U2<|im_end|>",
    "A2": 'A2\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>',
    "T": "<tool_response>\nT\n</tool_response><|im_end|>",
    "A3": "A3<|im_end|>",
}


@pytest.mark.parametrize(
    "mode, trained",
    [
        (TrainOnWhat.LAST_ASSISTANT_MESSAGE, ["A3"]),
        (TrainOnWhat.LAST_ASSISTANT_TURN, ["A2", "A3"]),  # everything the assistant did after the last query
        (TrainOnWhat.ALL_ASSISTANT_MESSAGES, ["A1", "A2", "A3"]),
        (TrainOnWhat.ALL_MESSAGES, ["S", "U1", "A1", "U2", "A2", "T", "A3"]),
        (TrainOnWhat.ALL_USER_AND_SYSTEM_MESSAGES, ["S", "U1", "U2"]),
    ],
)
def test_train_on_what_weights_message_outputs(qwen3_tokenizer, mode, trained):
    renderer = get_renderer("qwen3_instruct", qwen3_tokenizer)
    model_input, weights = renderer.build_supervised_example(AGENT, train_on_what=mode.value)
    assert model_input.to_ints() == renderer.render(AGENT).tokens()
    assert len(weights) == model_input.length
    assert trained_runs(qwen3_tokenizer, model_input, weights) == [OUTPUTS[name] for name in trained]


def test_all_tokens_trains_headers_too_but_not_bos(llama32_tokenizer):
    renderer = get_renderer("llama3", llama32_tokenizer)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    model_input, weights = renderer.build_supervised_example(messages, TrainOnWhat.ALL_TOKENS)
    assert model_input.to_ints()[0] == llama32_tokenizer.bos_token_id and weights[0] == 0
    assert weights[1:].tolist() == [1.0] * (model_input.length - 1)


def test_last_assistant_message_trains_nothing_when_the_conversation_ends_with_the_user(qwen3_tokenizer):
    renderer = get_renderer("qwen3_instruct", qwen3_tokenizer)
    _, weights = renderer.build_supervised_example(AGENT[:4])
    assert weights.sum() == 0


def test_customized_trains_the_flagged_messages(qwen3_tokenizer):
    renderer = get_renderer("qwen3_instruct", qwen3_tokenizer)
    flags = [False, True, False, False, True, False, False]
    flagged = [{**message, "trainable": flag} for message, flag in zip(AGENT, flags)]
    model_input, weights = renderer.build_supervised_example(flagged, TrainOnWhat.CUSTOMIZED)
    assert trained_runs(qwen3_tokenizer, model_input, weights) == [OUTPUTS["U1"], OUTPUTS["A2"]]
    with pytest.raises(RendererError, match="needs `trainable` on every message; message 0"):
        renderer.build_supervised_example(AGENT, TrainOnWhat.CUSTOMIZED)
    with pytest.raises(RendererError, match="only train_on_what=customized reads"):
        renderer.build_supervised_example(flagged, TrainOnWhat.ALL_MESSAGES)


def test_observation_before_the_target_is_the_generation_prompt(llama32_tokenizer):
    renderer = get_renderer("llama3", llama32_tokenizer)
    model_input, weights = renderer.build_supervised_example(AGENT[:3])
    prompt = renderer.build_generation_prompt(AGENT[:2]).to_ints()
    first_trained = weights.tolist().index(1.0)
    assert model_input.to_ints()[:first_trained] == prompt


# --- Axolotl labels over the same spans ---


def test_axolotl_labels_train_role_colon_stop_overlap_as_the_end(llama32_tokenizer):
    renderer = get_renderer("role_colon", llama32_tokenizer)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    conversation = renderer.render(messages)

    def labelled(train_on_eos):
        labels = axolotl_labels(conversation, messages, {"assistant"}, train_on_eos, train_on_inputs=False)
        assert len(labels) == len(conversation.tokens())
        return decode(llama32_tokenizer, [label for label in labels if label != IGNORE_INDEX])

    assert labelled("turn") == " hello\n\nUser:"
    assert labelled("none") == " hello\n\n"


def test_axolotl_labels_match_tinker_weights_for_assistant_turns(qwen3_tokenizer):
    # roles_to_train=[assistant], train_on_eos=turn is ALL_ASSISTANT_MESSAGES: the same tokens, the same mask
    renderer = get_renderer("qwen3", qwen3_tokenizer)
    messages = AGENT[:5]
    _, weights = renderer.build_supervised_example(messages, TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    labels = axolotl_labels(renderer.render(messages), messages, {"assistant"}, "turn", False)
    assert [label != IGNORE_INDEX for label in labels] == [bool(w) for w in weights.tolist()]


def test_axolotl_labels_refuse_an_unknown_train_on_eos(qwen3_tokenizer):
    renderer = get_renderer("qwen3", qwen3_tokenizer)
    with pytest.raises(RendererError, match="train_on_eos must be"):
        axolotl_labels(renderer.render(AGENT[:3]), AGENT[:3], {"assistant"}, "sometimes", False)


# --- text only ---

IMAGE_MESSAGE = {
    "role": "user",
    "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "What is this?"}],
}


@pytest.mark.parametrize("name", ["role_colon", "llama3", "qwen3", "jinja"])
def test_image_parts_fail_with_a_text_only_error(qwen3_tokenizer, llama32_tokenizer, name):
    if name == "jinja":
        renderer = JinjaRenderer(qwen3_tokenizer)
    else:
        renderer = get_renderer(name, qwen3_tokenizer if name == "qwen3" else llama32_tokenizer)
    with pytest.raises(RendererError, match="message 0 has a `image` content part: renderers are text-only"):
        renderer.build_generation_prompt([IMAGE_MESSAGE])
    with pytest.raises(RendererError, match="text-only"):
        renderer.build_supervised_example([IMAGE_MESSAGE, {"role": "assistant", "content": "a cat"}])


def test_text_parts_are_joined(llama32_tokenizer):
    renderer = get_renderer("llama3", llama32_tokenizer)
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "this?"}]
    as_parts = renderer.render([{"role": "user", "content": parts}]).tokens()
    assert as_parts == renderer.render([{"role": "user", "content": "What is this?"}]).tokens()


# --- role_colon ---

GREETING = [
    {"role": "system", "content": "be good"},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "Fine, thanks!"},
]


def test_role_colon_format(llama32_tokenizer):
    renderer = get_renderer("role_colon", llama32_tokenizer)
    text = decode(llama32_tokenizer, renderer.render(GREETING).tokens())
    assert text == "<|begin_of_text|>System: be good\n\nUser: hi there\n\nAssistant: Fine, thanks!\n\nUser:"
    prompt = decode(llama32_tokenizer, renderer.build_generation_prompt(GREETING[:2]).to_ints())
    assert prompt == "<|begin_of_text|>System: be good\n\nUser: hi there\n\nAssistant:"
    assert renderer.get_stop_sequences() == ["\n\nUser:"]


def test_role_colon_trains_the_answer_and_the_user_overlap(llama32_tokenizer):
    renderer = get_renderer("role_colon", llama32_tokenizer)
    model_input, weights = renderer.build_supervised_example(GREETING)
    assert trained_runs(llama32_tokenizer, model_input, weights) == [" Fine, thanks!\n\nUser:"]


def test_role_colon_without_bos_token(qwen3_tokenizer):
    renderer = get_renderer("role_colon", qwen3_tokenizer)  # Qwen's tokenizer defines no bos
    assert decode(qwen3_tokenizer, renderer.render(GREETING[:1]).tokens()) == "System: be good\n\n"


def test_role_colon_round_trip(llama32_tokenizer):
    renderer = get_renderer("role_colon", llama32_tokenizer)
    final = renderer.render(GREETING).messages[-1]
    parsed, termination = renderer.parse_response(final.output + final.stop_overlap)
    assert parsed == {"role": "assistant", "content": "Fine, thanks!"}
    assert termination is ParseTermination.STOP_SEQUENCE


@pytest.mark.parametrize(
    "text, eos, content, termination",
    [
        (" 4\n\nUser:", False, "4", ParseTermination.STOP_SEQUENCE),
        (" 4", True, "4", ParseTermination.EOS),
        (" 4\n\n", True, "4", ParseTermination.EOS),
        (" 4", False, "4", ParseTermination.MALFORMED),  # cut off
        (" 4\n\nUser:", True, "4", ParseTermination.MALFORMED),
        (" 4\n\nUser: 5\n\nUser:", False, "4", ParseTermination.MALFORMED),
    ],
)
def test_role_colon_parse_terminations(llama32_tokenizer, text, eos, content, termination):
    renderer = get_renderer("role_colon", llama32_tokenizer)
    tokens = llama32_tokenizer.encode(text, add_special_tokens=False) + (
        [llama32_tokenizer.eos_token_id] if eos else []
    )
    parsed, got = renderer.parse_response(tokens)
    assert (parsed["content"], got) == (content, termination)
    assert got.is_clean == (termination is not ParseTermination.MALFORMED)


def test_role_colon_has_no_tools(llama32_tokenizer):
    renderer = get_renderer("role_colon", llama32_tokenizer)
    with pytest.raises(RendererError, match="has no tool-calling format"):
        renderer.create_conversation_prefix_with_tools([{"name": "f", "description": "", "parameters": {}}])
    with pytest.raises(RendererError, match="renders text only"):
        renderer.render(
            [{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {}}]}]
        )


# --- llama3 ---

LLAMA3_CONVERSATIONS = {
    "single user": [{"role": "user", "content": "What is 2+2?"}],
    "system and multi-turn": [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6, of course."},
    ],
    "whitespace is trimmed": [
        {"role": "user", "content": "  hi there\n"},
        {"role": "assistant", "content": "\n\n Fine, thanks! "},
    ],
    "empty contents": [
        {"role": "system", "content": ""},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
    ],
    "unicode": [
        {"role": "user", "content": "日本語で 🎉 — naïve café"},
        {"role": "assistant", "content": "はい ✓\nÜber alles"},
    ],
    "code and newlines": [
        {"role": "user", "content": "Write code"},
        {"role": "assistant", "content": "```python\ndef f(x):\n    return x's\n```"},
    ],
}


def documented_llama3(messages, generation_prompt=False):
    """The Llama 3 instruct format as Meta documents it (content trimmed), without the date preamble."""
    text = "<|begin_of_text|>" + "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
        for m in messages
    )
    return text + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if generation_prompt else "")


@pytest.mark.parametrize("conversation", list(LLAMA3_CONVERSATIONS))
def test_llama3_matches_the_documented_format(llama32_tokenizer, conversation):
    renderer = get_renderer("llama3", llama32_tokenizer)
    messages = LLAMA3_CONVERSATIONS[conversation]
    encode = llama32_tokenizer.encode
    assert renderer.render(messages).tokens() == encode(documented_llama3(messages), add_special_tokens=False)
    for end in range(len(messages) + 1):
        expected = encode(documented_llama3(messages[:end], generation_prompt=True), add_special_tokens=False)
        assert renderer.build_generation_prompt(messages[:end]).to_ints() == expected
    text = decode(llama32_tokenizer, renderer.build_generation_prompt(messages).to_ints())
    assert "Cutting Knowledge Date" not in text and text.count("<|begin_of_text|>") == 1


def test_llama3_round_trip_and_truncation(llama32_tokenizer):
    renderer = get_renderer("llama3", llama32_tokenizer)
    messages = LLAMA3_CONVERSATIONS["system and multi-turn"]
    output = renderer.render(messages).messages[-1].output
    assert renderer.parse_response(output) == (
        {"role": "assistant", "content": "6, of course."},
        ParseTermination.STOP_SEQUENCE,
    )
    parsed, termination = renderer.parse_response(output[:-1])
    assert parsed["content"] == "6, of course." and termination is ParseTermination.MALFORMED
    with pytest.raises(RendererError, match="2 stop tokens"):
        renderer.parse_response(output + output)
    assert renderer.get_stop_sequences() == [llama32_tokenizer.convert_tokens_to_ids("<|eot_id|>")]


def test_llama3_refuses_tool_calls_and_reasoning(llama32_tokenizer):
    renderer = get_renderer("llama3", llama32_tokenizer)
    with pytest.raises(RendererError, match="no tool-calling format"):
        renderer.render(
            [{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {}}]}]
        )
    with pytest.raises(RendererError, match="no reasoning format"):
        renderer.render([{"role": "assistant", "content": "4", "reasoning_content": "2+2"}])


# --- model → renderer ---


@pytest.mark.parametrize(
    "model, renderer",
    [
        ("meta-llama/Llama-3.1-8B-Instruct", "llama3"),
        ("meta-llama/Llama-3.3-70B-Instruct", "llama3"),
        ("meta-llama/Llama-3.2-1B", "role_colon"),
        ("meta-llama/Llama-3.1-70B", "role_colon"),
        ("Qwen/Qwen3-8B", "qwen3"),
        ("Qwen/Qwen3-30B-A3B", "qwen3"),
        ("Qwen/Qwen3-8B-Base", "role_colon"),
        ("Qwen/Qwen3-4B-Instruct-2507", "qwen3_instruct"),
        ("qwen/qwen3-235b-a22b-instruct-2507", "qwen3_instruct"),  # names compare case-insensitively
        ("Qwen/Qwen3-32B:peft:1234", "qwen3"),  # a `:suffix` is ignored
        ("deepseek-ai/DeepSeek-V3.1-Base", "role_colon"),
    ],
)
def test_recommended_renderer_name(model, renderer):
    assert get_recommended_renderer_name(model) == renderer


def test_recommended_renderer_names_list_the_alternatives():
    assert recommended_renderer_names("Qwen/Qwen3-8B") == ("qwen3", "qwen3_disable_thinking")
    assert recommended_renderer_names("openai/gpt-oss-20b") == (
        "gpt_oss_no_sysprompt",
        "gpt_oss_medium_reasoning",
    )
    assert recommended_renderer_names("deepseek-ai/DeepSeek-V3.1") == ("deepseekv3", "deepseekv3_thinking")
    assert recommended_renderer_names("moonshotai/Kimi-K2-Thinking") == ("kimi_k2",)
    assert recommended_renderer_names("thinkingmachines/Inkling-Small") == ("tml_v0",)


def test_unknown_model_names_the_model():
    with pytest.raises(RendererError, match="no recommended renderer for model `acme/Unknown-7B`"):
        get_recommended_renderer_name("acme/Unknown-7B")


def test_model_whose_renderer_is_not_implemented_says_so():
    with pytest.raises(
        RendererError, match="`Qwen/Qwen3-VL-30B-A3B-Instruct` uses the `qwen3_vl_instruct` renderer"
    ):
        get_recommended_renderer_name("Qwen/Qwen3-VL-30B-A3B-Instruct")
