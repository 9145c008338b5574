"""Axolotl's other dataset formats, each checked against Axolotl's own code (axolotl 0.19.0, installed without
its dependencies: its prompters and prompt strategies import with ours): `alpaca:<style>`, a `type:` mapping
(its user-defined instruction, DPO and KTO formats), `input_output`, an SFT prompt strategy of the user's
(`type: package.module`) and a preference transform of the user's (`type: module.function`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from axolotl.prompt_strategies import input_output as axolotl_input_output
from axolotl.prompt_strategies import user_defined as axolotl_user_defined
from axolotl.prompt_strategies.dpo import user_defined as axolotl_dpo_user_defined
from axolotl.prompt_strategies.kto import user_defined as axolotl_kto_user_defined
from axolotl.prompt_tokenizers import AlpacaPromptTokenizingStrategy
from axolotl.prompters import AlpacaPrompter
from config_files import error_of, parse_minimal, write_tiny_run

from hanzo_gym.cli import main
from hanzo_gym.config import DatasetConfig
from hanzo_gym.data.dataset import load_examples
from hanzo_gym.data.preference import load_preferences
from hanzo_gym.data.prompts import prompt_from_row
from hanzo_gym.data.sources import Row
from hanzo_gym.data.strategies import StrategyContext, row_to_example, row_to_examples
from hanzo_gym.errors import ConfigError, DataError

SEQUENCE_LEN = 2048
INSTRUCTION_ROWS = [
    {"instruction": "Add 2 and 3.", "input": "2, 3", "output": "5"},
    {"instruction": "Say hi.", "output": "Hi there!"},
    {"instruction": "Say hi.", "input": "", "output": "Hello."},
]


def row(data, line: int = 3) -> Row:
    return Row(dict(data), "data/train.jsonl", line)


def axolotl_cfg(train_on_inputs: bool = False) -> SimpleNamespace:
    return SimpleNamespace(train_on_inputs=train_on_inputs, sequence_len=SEQUENCE_LEN)


def ours(data, dataset_type, tokenizer, train_on_inputs=False):
    ds = DatasetConfig(path="data/train.jsonl", type=dataset_type)
    example = row_to_example(row(data), ds, StrategyContext(tokenizer, train_on_inputs=train_on_inputs))
    return example.input_ids, example.labels


def theirs(strategy, data):
    tokenized = strategy.tokenize_prompt(dict(data))
    return tokenized["input_ids"], tokenized["labels"]


@pytest.mark.parametrize("style", ["instruct", "chat", "chatml", "phi"])
@pytest.mark.parametrize("train_on_inputs", [False, True])
@pytest.mark.parametrize("tokenizer_name", ["qwen3_tokenizer", "llama32_tokenizer"])
def test_alpaca_styles_tokenize_as_axolotl(request, style, train_on_inputs, tokenizer_name):
    tokenizer = request.getfixturevalue(tokenizer_name)
    strategy = AlpacaPromptTokenizingStrategy(AlpacaPrompter(style), tokenizer, train_on_inputs, SEQUENCE_LEN)
    dataset_type = "alpaca" if style == "instruct" else f"alpaca:{style}"
    for data in INSTRUCTION_ROWS:
        assert ours(data, dataset_type, tokenizer, train_on_inputs) == theirs(strategy, data)


def test_alpaca_phi_prompt_text_is_axolotls_quirks_included(qwen3_tokenizer):
    prompt = next(AlpacaPrompter("phi").build_prompt("Add.", "2, 3"))
    assert prompt.endswith("<|user|>\nAdd.<|end|>2, 3<|assistant|>")  # no newline around the input: Axolotl's
    ids, _ = ours(INSTRUCTION_ROWS[0], "alpaca:phi", qwen3_tokenizer)
    assert qwen3_tokenizer.decode(ids).startswith(prompt.replace("Add.", "Add 2 and 3."))


MAPPINGS = [
    {},  # Axolotl's defaults throughout
    {"format": "[INST] {instruction} {input} [/INST]", "no_input_format": "[INST] {instruction} [/INST]"},
    {
        "system_prompt": "Be brief.",
        "system_format": "<<SYS>>{system}<</SYS>>\n",
        "field_instruction": "question",
        "field_input": "context",
        "field_output": "answer",
        "format": "Q: {instruction}\nC: {input}\nA: ",
        "no_input_format": "Q: {instruction}\nA: ",
    },
    {
        "system_format": "System: {system}\n",
        "field_system": "persona",
        "format": "{instruction} / {input} ->",
    },
]
MAPPED_ROWS = [
    {"question": "Add 2 and 3.", "context": "2, 3", "answer": "5", "instruction": "Add.", "output": "5"},
    {
        "question": "Say hi.",
        "answer": "Hi!",
        "instruction": "Say hi.",
        "output": "Hi!",
        "system": "Rows' own.",
    },
    {
        "instruction": "Hi?",
        "input": "x",
        "output": "Hi.",
        "question": "Hi?",
        "answer": "Hi.",
        "persona": "Pirate.",
    },
    {"instruction": "Hi?", "output": "Hi.", "question": "Hi?", "answer": "Hi.", "persona": ""},
]


@pytest.mark.parametrize("mapping", MAPPINGS, ids=["defaults", "inst", "own-fields", "row-system"])
@pytest.mark.parametrize("train_on_inputs", [False, True])
def test_a_type_mapping_tokenizes_as_axolotls_user_defined_format(
    llama32_tokenizer, mapping, train_on_inputs
):
    ds_cfg = axolotl_user_defined.UserDefinedDatasetConfig(**mapping)
    strategy = axolotl_user_defined.load(llama32_tokenizer, axolotl_cfg(train_on_inputs), ds_cfg=ds_cfg)
    for data in MAPPED_ROWS:
        assert ours(data, mapping, llama32_tokenizer, train_on_inputs) == theirs(strategy, data), data


SEGMENTS = {
    "segments": [
        {"label": True, "text": "<|begin_of_text|>Hello\n"},
        {"label": True, "text": "hi there!. "},
        {"label": False, "text": "goodbye "},
        {"label": True, "text": "farewell<|end_of_text|>"},
    ]
}


@pytest.mark.parametrize("train_on_inputs", [False, True])
def test_input_output_tokenizes_as_axolotl(llama32_tokenizer, train_on_inputs):
    strategy = axolotl_input_output.load(llama32_tokenizer, axolotl_cfg(train_on_inputs))
    ids, labels = ours(SEGMENTS, "input_output", llama32_tokenizer, train_on_inputs)
    assert (ids, labels) == theirs(strategy, SEGMENTS)
    assert ids.count(llama32_tokenizer.bos_token_id) == 1  # the segments' own, nothing added
    assert (-100 in labels) is not train_on_inputs


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"text": "no segments"}, "row has no `segments` list"),
        ({"segments": [{"label": True}]}, "segment 1 has no `text` string"),
        ({"segments": [{"text": "a", "label": "yes"}]}, "segment 1 has no `label` true/false"),
    ],
)
def test_input_output_rows_without_segments_name_the_row(word_tokenizer, data, message):
    with pytest.raises(DataError, match=message) as error:
        ours(data, "input_output", word_tokenizer)
    assert "data/train.jsonl row 3" in str(error.value)


@pytest.mark.parametrize(
    ("dataset_type", "message"),
    [
        ("alpaca:vicuna", "Axolotl's alpaca styles are instruct, chat, chatml, phi"),
        (
            {"format": "{instruction} {question}"},
            "format: {question} is not filled; it may hold {input}, {instruction}",
        ),
        ({"prompt_format": "{prompt} {"}, "prompt_format: Single '{' encountered"),
        ({"field_instruction": 3}, "Input should be a valid string"),
    ],
)
def test_bad_formats_fail_at_load_naming_the_key(tmp_path, dataset_type, message):
    text = json.dumps(
        {"base_model": "x", "datasets": [{"path": "d.jsonl", "type": dataset_type}], "output_dir": "o"}
    )
    error = error_of(tmp_path, text)
    assert message in error and "datasets[0].type" in error and "run.yaml:" in error


def config(datasets, **keys):
    return parse_minimal(datasets=datasets, **keys)


def test_a_mapping_holds_the_keys_of_its_run_kind_only():
    with pytest.raises(ConfigError, match="`chosen_format` is not a key of the format SFT and GRPO reads"):
        config([{"path": "d.jsonl", "type": {"chosen_format": "{chosen}"}}])
    with pytest.raises(ConfigError, match="`format` is not a key of the format rl: dpo reads"):
        config([{"path": "d.jsonl", "type": {"format": "{instruction}"}}], rl="dpo")
    with pytest.raises(ConfigError, match="`field_chosen` is not a key of the format rl: kto reads"):
        config([{"path": "d.jsonl", "type": {"field_chosen": "good"}}], rl="kto", micro_batch_size=2)
    with pytest.raises(ConfigError, match="type: input_output is SFT's"):
        config(
            [{"path": "d.jsonl", "type": "input_output"}], rl="grpo", trl={"reward_funcs": ["exact_match"]}
        )


def test_grpo_asks_a_styled_alpaca_prompt_as_its_text(qwen3_tokenizer):
    ds = DatasetConfig(path="d.jsonl", type="alpaca:chatml")
    prompt = prompt_from_row(row(INSTRUCTION_ROWS[1]), ds, qwen3_tokenizer, renderer=None)
    expected = next(AlpacaPrompter("chatml").build_prompt("Say hi."))
    assert prompt.text == expected and prompt.answer == "Hi there!"
    assert prompt.tokens == qwen3_tokenizer.encode(expected)


# -- preference formats --------------------------------------------------------------------------------------

PAIR_ROWS = [
    {"question": "2+2?", "sys": "Be exact.", "good": "4", "bad": "5"},
    {"question": "Capital of France?", "good": "Paris", "bad": "Lyon"},
]
PAIR_MAPPING = {
    "field_prompt": "question",
    "field_system": "sys",
    "field_chosen": "good",
    "field_rejected": "bad",
    "prompt_format": "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n"
    "<|im_start|>assistant\n",
    "chosen_format": "{chosen}<|im_end|>",
    "rejected_format": "{rejected}<|im_end|>",
}


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def pairs_of(cfg, tokenizer):
    loaded = load_preferences(cfg, tokenizer)
    return sorted((p.prompt, p.chosen, p.rejected) for p in loaded.train)


def test_a_dpo_mapping_gives_the_pairs_of_axolotls_user_defined_transform(tmp_path, qwen3_tokenizer):
    transform = axolotl_dpo_user_defined.default({"datasets": [{"type": PAIR_MAPPING}]}, dataset_idx=0)
    trl_rows = [{k: transform(dict(r))[k] for k in ("prompt", "chosen", "rejected")} for r in PAIR_ROWS]
    mapped = config([{"path": write_jsonl(tmp_path / "a.jsonl", PAIR_ROWS), "type": PAIR_MAPPING}], rl="dpo")
    passthrough = config(
        [{"path": write_jsonl(tmp_path / "b.jsonl", trl_rows), "type": "passthrough"}], rl="dpo"
    )
    assert pairs_of(mapped, qwen3_tokenizer) == pairs_of(passthrough, qwen3_tokenizer)
    assert len(pairs_of(mapped, qwen3_tokenizer)) == 2


def test_a_kto_mapping_gives_the_examples_of_axolotls_user_defined_transform(tmp_path, qwen3_tokenizer):
    mapping = {
        "field_prompt": "q",
        "field_completion": "a",
        "field_label": "ok",
        "prompt_format": "Q: {prompt}\nA: ",
    }
    rows = [{"q": "2+2?", "a": "4", "ok": True}, {"q": "2+2?", "a": "5", "ok": False}]
    transform = axolotl_kto_user_defined.default({"datasets": [{"type": mapping}]}, dataset_idx=0)
    trl_rows = [{k: transform(dict(r))[k] for k in ("prompt", "completion", "label")} for r in rows]

    def examples(path, dataset_type):
        cfg = config([{"path": path, "type": dataset_type}], rl="kto", micro_batch_size=2)
        return sorted(
            (e.prompt, e.completion, e.desirable) for e in load_preferences(cfg, qwen3_tokenizer).train
        )

    ours_ = examples(write_jsonl(tmp_path / "a.jsonl", rows), mapping)
    assert ours_ == examples(write_jsonl(tmp_path / "b.jsonl", trl_rows), "passthrough")
    assert [desirable for *_, desirable in ours_] == [True, False]


def test_a_mapped_row_without_its_field_is_named(tmp_path, qwen3_tokenizer):
    cfg = config(
        [{"path": write_jsonl(tmp_path / "a.jsonl", [{"question": "q", "good": "g"}]), "type": PAIR_MAPPING}],
        rl="dpo",
    )
    with pytest.raises(DataError, match=r"a.jsonl row 1: row has no `bad` string \(field_rejected = `bad`\)"):
        load_preferences(cfg, qwen3_tokenizer)


def test_axolotls_own_dpo_transform_reads_as_our_built_in_type(tmp_path, qwen3_tokenizer):
    """`type: module.function` through Axolotl's chatml.intel transform (its own code) gives the pairs our built-in
    `chatml.intel` gives."""
    rows = [
        {"system": "Be exact.", "question": "2+2?", "chosen": "4", "rejected": "5"},
        {"question": "Capital of France?", "chosen": "Paris", "rejected": "Lyon"},
    ]
    path = write_jsonl(tmp_path / "intel.jsonl", rows)
    theirs_ = config([{"path": path, "type": "axolotl.prompt_strategies.dpo.chatml.intel"}], rl="dpo")
    built_in = config([{"path": path, "type": "chatml.intel"}], rl="dpo")
    assert pairs_of(theirs_, qwen3_tokenizer) == pairs_of(built_in, qwen3_tokenizer)


# -- SFT prompt strategies of the user's ---------------------------------------------------------------------

STRATEGY_MODULE = """
from axolotl.prompt_tokenizers import AlpacaPromptTokenizingStrategy
from axolotl.prompters import AlpacaPrompter


def load(tokenizer, cfg, ds_cfg=None):
    return AlpacaPromptTokenizingStrategy(AlpacaPrompter("chat"), tokenizer, cfg.train_on_inputs, cfg.sequence_len)


def load_fields(tokenizer, cfg, ds_cfg=None):
    class Strategy:
        def tokenize_prompt(self, prompt):
            ids = tokenizer.encode(prompt[ds_cfg.field] + " " + prompt["output"])
            return {"input_ids": ids, "labels": ids, "attention_mask": [1] * len(ids)}

    return Strategy()


def load_broken(tokenizer, cfg):
    class Strategy:
        def tokenize_prompt(self, prompt):
            return {"input_ids": [1, 2, 3], "labels": [1, 2]}

    return Strategy()


def load_nothing(tokenizer, cfg):
    return 42
"""


@pytest.fixture
def strategies(tmp_path, monkeypatch):
    package = tmp_path / "my_strategies"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "alpaca_chat.py").write_text(STRATEGY_MODULE)
    monkeypatch.chdir(tmp_path)
    yield write_jsonl(tmp_path / "rows.jsonl", [{**r, "text": r["instruction"]} for r in INSTRUCTION_ROWS])
    for name in [name for name in sys.modules if name.startswith("my_strategies")]:
        del sys.modules[name]


def sft_examples(data, dataset_type, tokenizer, **keys):
    cfg = config([{"path": data, "type": dataset_type, **keys}], val_set_size=0, sequence_len=SEQUENCE_LEN)
    return sorted((e.input_ids, e.labels) for e in load_examples(cfg, tokenizer).train)


def test_a_strategy_module_of_the_users_tokenizes_as_axolotl_does(strategies, qwen3_tokenizer):
    """`type: package.module` calls the module's load(); here it returns Axolotl's own alpaca-chat strategy."""
    assert sft_examples(strategies, "my_strategies.alpaca_chat", qwen3_tokenizer) == sft_examples(
        strategies, "alpaca:chat", qwen3_tokenizer
    )


def test_a_strategy_function_gets_the_dataset_entry(strategies, qwen3_tokenizer):
    examples = sft_examples(
        strategies, "my_strategies.alpaca_chat.load_fields", qwen3_tokenizer, field="text"
    )
    assert sorted(qwen3_tokenizer.decode(ids) for ids, _ in examples) == [
        "Add 2 and 3. 5",
        "Say hi. Hello.",
        "Say hi. Hi there!",
    ]


@pytest.mark.parametrize(
    ("name", "error", "message"),
    [
        (
            "my_strategies.alpaca_chat.load_broken",
            DataError,
            "rows.jsonl row 1: .*two lists of ints of one length",
        ),
        ("my_strategies.alpaca_chat.load_nothing", ConfigError, "returned int, which has no tokenize_prompt"),
        (
            "my_strategies.alpaca_chat.load_missing",
            ConfigError,
            "my_strategies.alpaca_chat has no function load_missing",
        ),
        (
            "my_strategies.nowhere",
            ConfigError,
            r"an SFT prompt strategy: package.module.*cannot import module",
        ),
    ],
)
def test_a_broken_strategy_is_named(strategies, word_tokenizer, name, error, message):
    with pytest.raises(error, match=message):
        sft_examples(strategies, name, word_tokenizer)


def test_gym_train_trains_an_alpaca_phi_and_a_mapping_dataset(tmp_path, tiny_base):
    rows = write_jsonl(tmp_path / "rows.jsonl", INSTRUCTION_ROWS * 4)
    datasets = [
        {"path": rows, "type": "alpaca:phi"},
        {"path": rows, "type": {"format": "Q: {instruction} {input}\nA: "}},
    ]
    path = write_tiny_run(tmp_path, tiny_base, rows, datasets=datasets, max_steps=2)
    assert main(["train", str(path)]) == 0
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r] == [1, 2]
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("tokenizer_name", ["qwen3_tokenizer", "llama32_tokenizer"])
@pytest.mark.parametrize("train_on_inputs", [False, True])
def test_axolotls_own_strategies_named_by_module_tokenize_as_axolotl(
    request, tokenizer_name, train_on_inputs
):
    """`type: alpaca_chat.load_qa`, `alpaca_w_system.load_open_orca`, `context_qa.load` and the like, which users'
    configs name: Axolotl's prompt strategies, run here without Axolotl, token for token and label for label."""
    from axolotl.prompt_strategies import alpaca_chat, alpaca_instruct, alpaca_w_system, context_qa

    tokenizer = request.getfixturevalue(tokenizer_name)
    cases = {
        "alpaca_chat.load_qa": (
            alpaca_chat.load_qa,
            [
                {"question": "What is 2 + 3?", "answer": "5."},
                {"question": "Say hi.", "answer": "Hi!", "input": "x"},
            ],
        ),
        "alpaca_instruct.load_no_prompt": (alpaca_instruct.load_no_prompt, INSTRUCTION_ROWS),
        "alpaca_instruct.load": (alpaca_instruct.load, INSTRUCTION_ROWS),
        "alpaca_w_system.load_open_orca": (
            alpaca_w_system.load_open_orca,
            [
                {"system_prompt": "You are terse.", "question": "Add 2 and 3.", "response": "5"},
                {"system_prompt": "", "question": "Say hi.", "response": "Hi there!"},
            ],
        ),
        "context_qa.load": (
            context_qa.load,
            [{"article": "The shop opens at 9.", "question": "When does it open?", "answer": "At 9."}],
        ),
        "context_qa.load_v2": (
            context_qa.load_v2,
            [{"context": "The shop opens at 9.", "question": "When does it open?", "answer": "At 9."}],
        ),
        "context_qa.load_404": (
            context_qa.load_404,
            [{"article": "The shop opens at 9.", "unanswerable_question": "Who owns it?"}],
        ),
    }
    for dataset_type, (load, rows) in cases.items():
        strategy = load(tokenizer, axolotl_cfg(train_on_inputs))
        for data in rows:
            assert ours(data, dataset_type, tokenizer, train_on_inputs) == theirs(strategy, data), (
                dataset_type
            )


# -- completion and pretrain: a long text in pieces ---------------------------------------------------------

LONG_TEXT = " ".join(f"Sentence {n} of a long document about the weather in town {n % 7}." for n in range(60))


@pytest.mark.parametrize("tokenizer_name", ["qwen3_tokenizer", "llama32_tokenizer"])
@pytest.mark.parametrize("sequence_len", [16, 64, 4096])
def test_completion_cuts_a_long_text_as_axolotl(request, tokenizer_name, sequence_len):
    from axolotl.prompt_strategies.completion import load

    tokenizer = request.getfixturevalue(tokenizer_name)
    cfg = SimpleNamespace(train_on_inputs=False, sequence_len=sequence_len)
    strategy = load(tokenizer, cfg, {"field": "text"})
    tokenized = strategy.tokenize_prompt({"text": [LONG_TEXT]})  # Axolotl's batched form
    ds = DatasetConfig(path="data/train.jsonl", type="completion")
    examples = row_to_examples(
        row({"text": LONG_TEXT}), ds, StrategyContext(tokenizer, sequence_len=sequence_len)
    )
    assert [e.input_ids for e in examples] == tokenized["input_ids"]
    assert [e.labels for e in examples] == tokenized["labels"]
    assert (len(examples) > 1) == (sequence_len < 1000)


@pytest.mark.parametrize("tokenizer_name", ["qwen3_tokenizer", "llama32_tokenizer"])
@pytest.mark.parametrize("sequence_len", [16, 64, 700, 4096])
def test_pretrain_windows_are_axolotls(request, tokenizer_name, sequence_len):
    from axolotl.prompt_strategies.pretrain import load

    tokenizer = request.getfixturevalue(tokenizer_name)
    cfg = SimpleNamespace(
        train_on_inputs=False, sequence_len=sequence_len, pretraining_dataset=[{"text_column": "body"}]
    )
    tokenized = load(tokenizer, cfg).tokenize_prompt({"body": LONG_TEXT})
    ds = DatasetConfig(path="data/train.jsonl", type="pretrain", field="body")
    ctx = StrategyContext(tokenizer, sequence_len=sequence_len, sample_packing=True)
    examples = row_to_examples(row({"body": LONG_TEXT}), ds, ctx)
    assert [e.input_ids for e in examples] == tokenized["input_ids"]
    assert all(e.labels == e.input_ids and len(e) <= sequence_len for e in examples)
    assert (len(examples) > 1) == (sequence_len < 1000)


def _axolotl_function(module_path: str, name: str):
    """One function of Axolotl's, run from its own source: its module imports what the test extra leaves out
    (Axolotl's telemetry), the function itself only torch and typing."""
    import ast
    import importlib.util
    import typing

    import torch

    source = (Path(importlib.util.find_spec("axolotl").origin).parent / module_path).read_text()
    (node,) = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name]
    namespace = {"torch": torch, **{k: getattr(typing, k) for k in ("Dict", "List", "Optional", "Callable")}}
    exec(compile(ast.Module([node], []), module_path, "exec"), namespace)  # noqa: S102 - Axolotl's code, as reference
    return namespace[name]


@pytest.mark.parametrize("tokenizer_name", ["qwen3_tokenizer", "llama32_tokenizer"])
def test_unpacked_pretraining_text_is_axolotls_stream_without_concatenation(request, tokenizer_name):
    encode_streaming = _axolotl_function("utils/data/streaming.py", "encode_streaming")
    tokenizer = request.getfixturevalue(tokenizer_name)
    texts = [LONG_TEXT, "A short one."]
    theirs = encode_streaming(
        {"body": texts}, tokenizer, max_tokens=64, text_column="body", concatenate=False
    )
    ds = DatasetConfig(path="data/train.jsonl", type="pretrain", field="body")
    ctx = StrategyContext(tokenizer, sequence_len=64, sample_packing=False)
    examples = [e for text in texts for e in row_to_examples(row({"body": text}), ds, ctx)]
    assert [e.input_ids for e in examples] == theirs["input_ids"]
    assert [e.labels for e in examples] == theirs["labels"]
