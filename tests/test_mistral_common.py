"""tokenizer_use_mistral_common: Mistral's tokenizer (a real tekken.json, shipped in mistral-common's wheel) through
transformers' MistralCommonBackend, chats encoded by mistral-common, labelled as Axolotl's MistralStrategy labels
them (checked against Axolotl's own strategy)."""

from __future__ import annotations

import builtins
import json

import pytest
from axolotl.prompt_strategies.chat_template import StrategyLoader
from axolotl.utils.dict import DictDefault
from axolotl.utils.mistral import HFMistralTokenizer
from config_files import parse_minimal, refusal_of

from hanzo_gym.cli import main
from hanzo_gym.config import DatasetConfig
from hanzo_gym.data.sources import Row
from hanzo_gym.data.strategies import StrategyContext, row_to_example
from hanzo_gym.errors import ModelError
from hanzo_gym.model.hub import load_tokenizer
from hanzo_gym.records import IGNORE_INDEX
from hanzo_gym.renderers.chat_templates import resolve_renderer
from hanzo_gym.renderers.mistral_common import MistralCommonRenderer

CHATS = [
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": " six, I think\n"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ],
]
MULTI_TURN_WITH_SYSTEM = [{"role": "system", "content": "Be brief."}, *CHATS[1]]


@pytest.fixture(scope="module")
def mistral_tokenizer(tiny_mistral):
    return load_tokenizer(str(tiny_mistral), mistral_common=True)


def ours(tokenizer, messages, **keys):
    ds = DatasetConfig(path="chats.jsonl", type="chat_template", **keys)
    return row_to_example(Row({"messages": messages}, "chats.jsonl", 1), ds, StrategyContext(tokenizer))


def test_the_tokenizer_is_mistral_commons_and_the_renderer_encodes_with_it(mistral_tokenizer):
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    assert type(mistral_tokenizer).__name__ == "MistralCommonBackend" and len(mistral_tokenizer) == 131072
    renderer = resolve_renderer(None, mistral_tokenizer)
    assert isinstance(renderer, MistralCommonRenderer)
    prompt = renderer.build_generation_prompt(CHATS[0][:1]).to_ints()
    served = mistral_tokenizer.tokenizer.encode_chat_completion(ChatCompletionRequest(messages=CHATS[0][:1]))
    assert prompt == served.tokens  # the generation prompt: mistral-common's own serving encoding
    assert mistral_tokenizer.decode(prompt) == "<s>[INST]2+2?[/INST]"
    assert renderer.get_stop_sequences() == [mistral_tokenizer.eos_token_id]


@pytest.mark.parametrize("messages", CHATS, ids=["one-turn", "two-turns", "system"])
@pytest.mark.parametrize("train_on_inputs", [False])  # with true, Axolotl 0.19's strategy fails on every chat
def test_chats_tokenize_and_label_as_axolotls_mistral_strategy(
    tiny_mistral, mistral_tokenizer, messages, train_on_inputs
):
    cfg = DictDefault(tokenizer_use_mistral_common=True, train_on_inputs=train_on_inputs, sequence_len=2048)
    strategy = StrategyLoader()(
        HFMistralTokenizer.from_pretrained(str(tiny_mistral)), cfg, {"field_messages": "messages"}
    )
    theirs = strategy.tokenize_prompt({"messages": messages})
    ds = DatasetConfig(path="chats.jsonl", type="chat_template")
    example = row_to_example(
        Row({"messages": messages}, "chats.jsonl", 1),
        ds,
        StrategyContext(mistral_tokenizer, train_on_inputs=train_on_inputs),
    )
    assert (example.input_ids, example.labels) == (theirs["input_ids"], theirs["labels"])


def test_train_on_inputs_trains_the_users_turns_too(mistral_tokenizer):
    def trained(train_on_inputs):
        example = row_to_example(
            Row({"messages": CHATS[1]}, "chats.jsonl", 1),
            DatasetConfig(path="chats.jsonl", type="chat_template"),
            StrategyContext(mistral_tokenizer, train_on_inputs=train_on_inputs),
        )
        return mistral_tokenizer.decode(
            [t for t, label in zip(example.input_ids, example.labels) if label != -100]
        )

    assert trained(False) == "4</s> six, I think\n</s>"
    assert trained(True) == "2+2?4</s>and 3+3? six, I think\n</s>"


def test_a_system_prompt_inside_a_later_turn_leaves_every_answer_trained(mistral_tokenizer):
    """Version 3 writes the system prompt into the last user turn. Axolotl's strategy then labels a token of the
    system prompt and none of the first answer; here the answers and their eos are what is trained."""
    example = ours(mistral_tokenizer, MULTI_TURN_WITH_SYSTEM)
    assert mistral_tokenizer.decode(example.input_ids) == (
        "<s>[INST]2+2?[/INST]4</s>[INST]Be brief.\n\nand 3+3?[/INST] six, I think\n</s>"
    )
    trained = [token for token, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX]
    expected = [*mistral_tokenizer.encode("4", add_special_tokens=False), mistral_tokenizer.eos_token_id]
    expected += [
        *mistral_tokenizer.encode(" six, I think\n", add_special_tokens=False),
        mistral_tokenizer.eos_token_id,
    ]
    assert trained == expected


def test_config_rules_of_mistral_common():
    for key, value in (
        ("special_tokens", {"pad_token": "<pad>"}),
        ("tokens", ["<x>"]),
        ("chat_template", "chatml"),
        ("eot_tokens", ["</s>"]),
    ):
        assert f"`{key}` with tokenizer_use_mistral_common" in refusal_of(
            tokenizer_use_mistral_common=True, **{key: value}
        )
    # Axolotl's default: on for a Magistral model unless the config says otherwise
    assert parse_minimal(base_model="mistralai/Magistral-Small-2507").uses_mistral_common
    assert not parse_minimal(
        base_model="mistralai/Magistral-Small-2507", tokenizer_use_mistral_common=False
    ).uses_mistral_common
    assert not parse_minimal(base_model="mistralai/Mistral-7B-v0.1").uses_mistral_common


def test_without_mistral_common_installed_the_error_names_the_extra(tiny_mistral, monkeypatch):
    real_import = builtins.__import__

    def no_mistral_common(name, *args, **kwargs):
        if name == "mistral_common":
            raise ImportError("No module named 'mistral_common'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mistral_common)
    with pytest.raises(ModelError, match=r"pip install 'hanzo-gym\[mistral\]'"):
        load_tokenizer(str(tiny_mistral), mistral_common=True)


def test_gym_train_trains_on_mistral_commons_chats(tmp_path, tiny_mistral):
    rows = [
        [{"role": "user", "content": f"{a}+2?"}, {"role": "assistant", "content": f"{a + 2}."}]
        for a in range(8)
    ]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    config = tmp_path / "run.yaml"
    config.write_text(
        f"base_model: {tiny_mistral}\ntokenizer_use_mistral_common: true\ndatasets:\n  - path: {data}\n    type: chat_template\n"
        f"output_dir: {tmp_path / 'run'}\nadapter: lora\nlora_r: 4\nlora_alpha: 8\nlora_target_linear: true\n"
        "micro_batch_size: 2\nmax_steps: 2\nlogging_steps: 1\nlearning_rate: 0.01\nbf16: false\nsequence_len: 64\n"
    )
    assert main(["train", str(config)]) == 0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics if "loss" in row] == [1, 2]
    assert (tmp_path / "run" / "tekken.json").is_file()  # the tokenizer saved beside the adapter, as it loads
