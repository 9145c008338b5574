import pytest

from hanzo_gym.config import DatasetConfig
from hanzo_gym.data.sources import Row
from hanzo_gym.data.strategies import (
    StrategyContext,
    chat_messages,
    row_to_example,
    row_to_examples,
)
from hanzo_gym.errors import ConfigError, DataError
from hanzo_gym.records import IGNORE_INDEX
from hanzo_gym.renderers.instruction_formats import ALPACA_STYLES
from hanzo_gym.renderers.jinja import end_of_turn_ids

alpaca_prompt = ALPACA_STYLES["instruct"].prompt


def dataset(type_: str = "chat_template", **keys) -> DatasetConfig:
    return DatasetConfig(path="data/train.jsonl", type=type_, **keys)


def row(data, line: int = 7) -> Row:
    return Row(data, "data/train.jsonl", line)


def labelled_positions(example) -> set[int]:
    return {i for i, label in enumerate(example.labels) if label != IGNORE_INDEX}


def labelled_texts(tokenizer, example) -> list[str]:
    """Each run of consecutive labelled tokens, decoded."""
    runs, run = [], []
    for token, label in zip(example.input_ids, example.labels):
        if label != IGNORE_INDEX:
            assert label == token, "a label must be its own input id (unshifted)"
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return [tokenizer.decode(r, skip_special_tokens=False, clean_up_tokenization_spaces=False) for r in runs]


# --- chat_template: the reference label sets (word tokenizer: one token per word, newlines vanish) ---

FIVE_TURNS = [
    {"role": "system", "content": "be good"},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "fine thanks"},
    {"role": "user", "content": "how are you"},
    {"role": "assistant", "content": "doing well"},
]


def chatml_example(word_tokenizer, train_on_inputs=False, messages=FIVE_TURNS, **keys):
    ctx = StrategyContext(word_tokenizer, train_on_inputs, word_tokenizer.chat_template)
    return row_to_example(row({"messages": messages}), dataset(**keys), ctx)


def test_reference_fixture_layout(word_tokenizer):
    example = chatml_example(word_tokenizer)
    assert len(example) == 26
    im_end = word_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert [i for i, token in enumerate(example.input_ids) if token == im_end] == [4, 9, 14, 20, 25]


@pytest.mark.parametrize(
    "train_on_eos, expected",
    [
        ("turn", {12, 13, 14, 23, 24, 25}),
        ("all", {4, 9, 12, 13, 14, 20, 23, 24, 25}),
        ("last", {12, 13, 23, 24, 25}),
        ("none", {12, 13, 23, 24}),
    ],
)
def test_train_on_eos_reference_sets(word_tokenizer, train_on_eos, expected):
    example = chatml_example(word_tokenizer, train_on_eos=train_on_eos)
    assert labelled_positions(example) == expected
    assert all(example.labels[i] == example.input_ids[i] for i in expected)


def test_train_on_inputs_reference_set(word_tokenizer):
    example = chatml_example(word_tokenizer, train_on_inputs=True)
    assert labelled_positions(example) == {2, 3, 4, 7, 8, 9, 12, 13, 14, 17, 18, 19, 20, 23, 24, 25}


def test_roles_to_train_are_canonicalised_reference_set(word_tokenizer):
    example = chatml_example(word_tokenizer, roles_to_train=["gpt", "human"])
    assert labelled_positions(example) == {7, 8, 9, 12, 13, 14, 17, 18, 19, 20, 23, 24, 25}


def test_sharegpt_roles_in_data_are_canonicalised(word_tokenizer):
    aliases = {"user": "human", "assistant": "gpt"}
    sharegpt = [{"role": aliases.get(m["role"], m["role"]), "content": m["content"]} for m in FIVE_TURNS]
    assert labelled_positions(chatml_example(word_tokenizer, messages=sharegpt)) == {12, 13, 14, 23, 24, 25}


def test_content_sharing_characters_with_the_dummy_is_fully_labelled(qwen3_tokenizer):
    content = "[[x]] and [[dummy_message]]"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]
    ctx = StrategyContext(qwen3_tokenizer, chat_template=qwen3_tokenizer.chat_template)
    example = row_to_example(row({"messages": messages}), dataset(train_on_eos="none"), ctx)
    assert labelled_texts(qwen3_tokenizer, example) == ["<think>\n\n</think>\n\n" + content]


def test_template_without_end_tokens_labels_only_the_content(qwen3_tokenizer):
    template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    messages = [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Tell me a joke"},
        {"role": "assistant", "content": "No."},
    ]
    ctx = StrategyContext(qwen3_tokenizer, chat_template=template)
    example = row_to_example(row({"messages": messages}), dataset(), ctx)
    # BPE merges the space before and the newline after into the content's tokens; nothing more is labelled
    labelled = [text.strip() for text in labelled_texts(qwen3_tokenizer, example)]
    assert labelled == ["Hi, how can I help?", "No."]


# --- chat_template on real tokenizers ---

REASONING_CONVERSATIONS = {
    "reasoning_content key": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4.", "reasoning_content": "Two plus two makes four."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "It is 6.", "reasoning_content": "Three plus three makes six."},
    ],
    "inline think": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nTwo plus two makes four.\n</think>\n\nIt is 4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nThree plus three makes six.\n</think>\n\nIt is 6."},
    ],
}


@pytest.mark.parametrize("template", ["tokenizer", "builtin"])
@pytest.mark.parametrize("name", list(REASONING_CONVERSATIONS))
def test_qwen3_multi_turn_with_reasoning_labels_what_the_template_renders(qwen3_tokenizer, name, template):
    chat_template = qwen3_tokenizer.chat_template if template == "tokenizer" else "qwen3"
    ctx = StrategyContext(qwen3_tokenizer, chat_template=chat_template)
    messages = REASONING_CONVERSATIONS[name]

    spans = row_to_example(row({"messages": messages}), dataset(train_on_eos="none"), ctx)
    # The template strips the past turn's reasoning, so it is neither in the sequence nor labelled; the past
    # turn's label is exactly its answer (rendering prefixes was off by a `<think>` block here).
    assert labelled_texts(qwen3_tokenizer, spans) == [
        "It is 4.",
        "<think>\nThree plus three makes six.\n</think>\n\nIt is 6.",
    ]
    full_text = qwen3_tokenizer.decode(spans.input_ids, skip_special_tokens=False)
    assert "Two plus two" not in full_text

    with_ends = row_to_example(row({"messages": messages}), dataset(train_on_eos="turn"), ctx)
    assert with_ends.input_ids == spans.input_ids
    assert labelled_texts(qwen3_tokenizer, with_ends) == [
        "It is 4.<|im_end|>",
        "<think>\nThree plus three makes six.\n</think>\n\nIt is 6.<|im_end|>",
    ]


def test_qwen3_final_turn_without_reasoning_trains_the_empty_think_block(qwen3_tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ctx = StrategyContext(qwen3_tokenizer, chat_template=qwen3_tokenizer.chat_template)
    example = row_to_example(row({"messages": messages}), dataset(), ctx)
    assert labelled_texts(qwen3_tokenizer, example) == ["<think>\n\n</think>\n\nhello<|im_end|>"]


def test_qwen3_consecutive_assistant_turns_keep_their_reasoning(qwen3_tokenizer):
    messages = [
        {"role": "user", "content": "count"},
        {"role": "assistant", "content": "one", "reasoning_content": "start low"},
        {"role": "assistant", "content": "two"},
    ]
    ctx = StrategyContext(qwen3_tokenizer, chat_template=qwen3_tokenizer.chat_template)
    example = row_to_example(row({"messages": messages}), dataset(train_on_eos="none"), ctx)
    assert labelled_texts(qwen3_tokenizer, example) == [
        "<think>\nstart low\n</think>\n\none",
        "<think>\n\n</think>\n\ntwo",
    ]


LLAMA_TURNS = [
    {"role": "system", "content": "Be good."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": " Fine, thanks! "},
    {"role": "user", "content": "How are you?"},
    {"role": "assistant", "content": "Doing well."},
]


@pytest.mark.parametrize(
    "train_on_eos, expected",
    [
        ("turn", ["Fine, thanks!<|eot_id|>", "Doing well.<|eot_id|>"]),
        ("last", ["Fine, thanks!", "Doing well.<|eot_id|>"]),
        ("none", ["Fine, thanks!", "Doing well."]),
        (
            "all",
            ["<|eot_id|>", "<|eot_id|>", "Fine, thanks!<|eot_id|>", "<|eot_id|>", "Doing well.<|eot_id|>"],
        ),
    ],
)
def test_llama3_labels_end_with_eot_not_eos(llama32_tokenizer, train_on_eos, expected):
    ctx = StrategyContext(llama32_tokenizer, chat_template="llama3")
    example = row_to_example(row({"messages": LLAMA_TURNS}), dataset(train_on_eos=train_on_eos), ctx)
    assert labelled_texts(llama32_tokenizer, example) == expected
    assert example.input_ids[0] == llama32_tokenizer.bos_token_id
    assert llama32_tokenizer.eos_token_id not in example.input_ids  # `<|end_of_text|>` never appears


def test_llama3_train_on_inputs_labels_every_turn(llama32_tokenizer):
    ctx = StrategyContext(llama32_tokenizer, train_on_inputs=True, chat_template="llama3")
    example = row_to_example(row({"messages": LLAMA_TURNS}), dataset(), ctx)
    assert labelled_texts(llama32_tokenizer, example) == [
        "Be good.<|eot_id|>",
        "Hi there<|eot_id|>",
        "Fine, thanks!<|eot_id|>",
        "How are you?<|eot_id|>",
        "Doing well.<|eot_id|>",
    ]


def test_smollm2_template_with_its_default_system_prompt(smollm2_tokenizer):
    ctx = StrategyContext(smollm2_tokenizer, chat_template=smollm2_tokenizer.chat_template)
    messages = [{"role": "user", "content": "What is 12+7?"}, {"role": "assistant", "content": "It is 19."}]
    example = row_to_example(row({"messages": messages}), dataset(roles_to_train=["user", "assistant"]), ctx)
    text = smollm2_tokenizer.decode(example.input_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert labelled_texts(smollm2_tokenizer, example) == ["What is 12+7?<|im_end|>", "It is 19.<|im_end|>"]


# --- messages from rows ---


SHAREGPT = {"role": "from", "content": "value"}


def test_property_mappings_field_messages_and_system_field():
    data = {
        "conversations": [
            {"from": "human", "value": "hi", "weight": 0},
            {"from": "gpt", "value": "hello", "reasoning_content": "greet back"},
        ],
        "system": "be good",
    }
    ds = dataset(field_messages="conversations", message_property_mappings=SHAREGPT)
    assert chat_messages(row(data), ds) == [
        {"role": "system", "content": "be good"},
        {"role": "user", "content": "hi", "weight": 0},
        {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
    ]


def test_system_field_is_not_prepended_before_an_existing_system_turn():
    messages = [{"role": "system", "content": "own"}, {"role": "user", "content": "hi"}]
    data = {"messages": messages, "system": "x"}
    assert [m["content"] for m in chat_messages(row(data), dataset())] == ["own", "hi"]


def test_mapped_rows_render_and_label(word_tokenizer):
    conversations = [{"from": m["role"], "value": m["content"]} for m in FIVE_TURNS[1:]]
    data = {"conversations": conversations, "system": "be good"}
    ds = dataset(field_messages="conversations", message_property_mappings=SHAREGPT)
    ctx = StrategyContext(word_tokenizer, chat_template=word_tokenizer.chat_template)
    assert labelled_positions(row_to_example(row(data), ds, ctx)) == {12, 13, 14, 23, 24, 25}


def test_text_content_parts_are_joined():
    parts = [{"type": "text", "text": "hi "}, {"type": "text", "text": "you"}]
    data = {"messages": [{"role": "user", "content": parts}]}
    assert chat_messages(row(data), dataset())[0]["content"] == "hi you"


def test_image_content_is_refused():
    parts = [{"type": "text", "text": "what is this?"}, {"type": "image", "url": "cat.png"}]
    data = {"messages": [{"role": "user", "content": parts}]}
    expected = r"^data/train.jsonl row 7: message 1 has a `image` content part.*text-only for now"
    with pytest.raises(DataError, match=expected):
        chat_messages(row(data), dataset())


@pytest.mark.parametrize(
    "data, keys, message",
    [
        ({"turns": []}, {}, "row has no `messages` list (field_messages = `messages`)"),
        (
            {"messages": [{"from": "human", "value": "hi"}, {"from": "gpt", "text": "x"}]},
            {"message_property_mappings": SHAREGPT},
            "message 2 has no `content` string (message_property_mappings.content = `value`)",
        ),
        (
            {"messages": [{"content": "hi"}]},
            {},
            "message 1 has no `role` string (message_property_mappings.role = `role`)",
        ),
        ({"messages": ["hi"]}, {}, "message 1 is not an object"),
    ],
)
def test_bad_chat_rows_name_file_row_and_field(word_tokenizer, data, keys, message):
    ctx = StrategyContext(word_tokenizer, chat_template=word_tokenizer.chat_template)
    with pytest.raises(DataError) as error:
        row_to_example(row(data), dataset(**keys), ctx)
    assert str(error.value) == "data/train.jsonl row 7: " + message


def test_template_errors_name_file_and_row(word_tokenizer):
    template = "{{ raise_exception('conversations must start with a system turn') }}"
    ctx = StrategyContext(word_tokenizer, chat_template=template)
    expected = r"^data/train.jsonl row 3: chat template failed: .*must start with a system"
    with pytest.raises(DataError, match=expected):
        row_to_example(row({"messages": FIVE_TURNS}, line=3), dataset(), ctx)


def test_only_untrained_turns_leave_no_labels(word_tokenizer):
    example = chatml_example(word_tokenizer, messages=FIVE_TURNS[:2])
    assert len(example) == 10 and example.trained_tokens == 0


# --- alpaca ---


def test_alpaca_prompts_are_byte_exact():
    assert alpaca_prompt("Add 2 and 3.", "2, 3") == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n### Instruction:\nAdd 2 and 3.\n\n"
        "### Input:\n2, 3\n\n### Response:\n"
    )
    assert alpaca_prompt("Say hi.") == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\nSay hi.\n\n### Response:\n"
    )
    assert alpaca_prompt("Say hi.", "") == alpaca_prompt("Say hi.")


def test_alpaca_mask_on_qwen3(qwen3_tokenizer):
    ctx = StrategyContext(qwen3_tokenizer)
    data = {"instruction": "Add 2 and 3.", "input": "2, 3", "output": "5"}
    example = row_to_example(row(data), dataset("alpaca"), ctx)
    prompt_ids = qwen3_tokenizer.encode(alpaca_prompt("Add 2 and 3.", "2, 3"))
    assert example.input_ids[: len(prompt_ids)] == prompt_ids
    assert example.labels[: len(prompt_ids)] == [IGNORE_INDEX] * len(prompt_ids)
    assert labelled_texts(qwen3_tokenizer, example) == ["5<|im_end|>"]
    assert example.input_ids[-1] == qwen3_tokenizer.eos_token_id


def test_alpaca_on_llama_keeps_one_bos_and_one_eos(llama32_tokenizer):
    ctx = StrategyContext(llama32_tokenizer)
    example = row_to_example(row({"instruction": "Say hi.", "output": "Hi!"}), dataset("alpaca"), ctx)
    bos, eos = llama32_tokenizer.bos_token_id, llama32_tokenizer.eos_token_id
    assert example.input_ids[0] == bos and example.input_ids.count(bos) == 1
    assert example.input_ids[-1] == eos and example.input_ids.count(eos) == 1
    assert labelled_texts(llama32_tokenizer, example) == ["Hi!<|end_of_text|>"]
    text = llama32_tokenizer.decode(
        example.input_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    assert text == alpaca_prompt("Say hi.") + "Hi!"


def test_alpaca_train_on_inputs_and_custom_fields(qwen3_tokenizer):
    ctx = StrategyContext(qwen3_tokenizer, train_on_inputs=True)
    ds = dataset("alpaca", field_instruction="q", field_input="ctx", field_output="a")
    example = row_to_example(row({"q": "Say hi.", "ctx": 3, "a": "Hi!"}), ds, ctx)
    assert example.labels == example.input_ids
    # a non-string input counts as no input
    assert qwen3_tokenizer.decode(example.input_ids).startswith(alpaca_prompt("Say hi."))


def test_alpaca_output_already_ending_with_eos_gets_no_second_one(qwen3_tokenizer):
    ctx = StrategyContext(qwen3_tokenizer)
    example = row_to_example(row({"instruction": "x", "output": "done<|im_end|>"}), dataset("alpaca"), ctx)
    assert example.input_ids.count(qwen3_tokenizer.eos_token_id) == 1


@pytest.mark.parametrize(
    "data, message",
    [
        ({"output": "x"}, "row has no `instruction` string (field_instruction = `instruction`)"),
        ({"instruction": "x", "output": None}, "row has no `output` string (field_output = `output`)"),
    ],
)
def test_alpaca_bad_rows(qwen3_tokenizer, data, message):
    with pytest.raises(DataError) as error:
        row_to_example(row(data), dataset("alpaca"), StrategyContext(qwen3_tokenizer))
    assert str(error.value) == "data/train.jsonl row 7: " + message


# --- completion ---


def test_completion_labels_everything_and_appends_eos(qwen3_tokenizer):
    ctx = StrategyContext(qwen3_tokenizer)
    (example,) = row_to_examples(row({"text": "The sky is blue."}), dataset("completion"), ctx)
    assert example.input_ids == qwen3_tokenizer.encode("The sky is blue.") + [qwen3_tokenizer.eos_token_id]
    assert example.labels == example.input_ids


def test_completion_on_llama_has_bos_and_a_single_eos(llama32_tokenizer):
    ctx = StrategyContext(llama32_tokenizer)
    (example,) = row_to_examples(
        row({"body": "Hello<|end_of_text|>"}), dataset("completion", field="body"), ctx
    )
    assert example.input_ids[0] == llama32_tokenizer.bos_token_id
    assert example.input_ids[-1] == llama32_tokenizer.eos_token_id
    assert example.input_ids.count(llama32_tokenizer.eos_token_id) == 1
    assert example.trained_tokens == len(example) - 1  # all labelled; position 0 is never a target


def test_completion_missing_field(qwen3_tokenizer):
    ctx = StrategyContext(qwen3_tokenizer)
    expected = r"^data/train.jsonl row 7: row has no `body` string \(field = `body`\)$"
    with pytest.raises(DataError, match=expected):
        row_to_examples(row({"text": "x"}), dataset("completion", field="body"), ctx)


def test_tokenizer_without_eos_is_a_config_error(word_tokenizer):
    from copy import deepcopy

    tokenizer = deepcopy(word_tokenizer)
    tokenizer.eos_token = None
    with pytest.raises(ConfigError, match="no eos_token"):
        row_to_examples(row({"text": "hi"}), dataset("completion"), StrategyContext(tokenizer))


def test_end_of_turn_ids_only_include_tokens_in_the_vocabulary(llama32_tokenizer, qwen3_tokenizer):
    llama_ids = end_of_turn_ids(llama32_tokenizer)
    ids_of = llama32_tokenizer.convert_tokens_to_ids
    assert {ids_of("<|eot_id|>"), ids_of("<|eom_id|>"), llama32_tokenizer.eos_token_id} <= llama_ids
    assert None not in llama_ids and len(llama_ids) == 3
    qwen_ids = end_of_turn_ids(qwen3_tokenizer)
    assert qwen_ids == {qwen3_tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
