import json

import pytest

from hanzo_gym.config import DatasetConfig, parse_config
from hanzo_gym.data.dataset import (
    DatasetStats,
    examples_from_rows,
    format_stats,
    load_examples,
    validation_count,
)
from hanzo_gym.data.sources import Row
from hanzo_gym.data.strategies import StrategyContext
from hanzo_gym.errors import ConfigError, DataError

# The word tokenizer gives one token per word; completion appends eos, so n words -> n + 1 tokens.
ONE_WORD = ["one", "two", "three", "four", "five", "six", "seven"]
TEXTS = ONE_WORD + ["one two", "three four", "a b c d", "", "e f g"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def config(datasets, **keys):
    return parse_config(
        {
            "base_model": "unused",
            "output_dir": "out",
            "adapter": "lora",
            "lora_target_linear": True,
            "datasets": datasets,
            **keys,
        }
    )


def completion_rows(texts=TEXTS):
    return [Row({"text": text}, "texts.jsonl", number) for number, text in enumerate(texts, start=1)]


def test_truncates_and_drops_with_counts(word_tokenizer):
    ds = DatasetConfig(path="texts.jsonl", type="completion")
    kept, stats = examples_from_rows(
        completion_rows(), ds, StrategyContext(word_tokenizer), sequence_len=3, excess_length="truncate"
    )
    assert len(kept) == 11
    # 7 one-word texts of 2 tokens, 2 two-word texts of 3, 2 longer texts cut to 3, the empty one dropped;
    # every token is labelled but each example's first one cannot be predicted, so it is not counted trained
    assert stats == DatasetStats(
        "texts.jsonl",
        examples=11,
        tokens=7 * 2 + 2 * 3 + 2 * 3,
        trained_tokens=26 - 11,
        truncated=2,
        dropped=1,
    )
    assert all(len(example) <= 3 for example in kept)
    # truncation keeps the first tokens: "a b c d" + eos -> "a b c"
    assert word_tokenizer.decode(kept[9].input_ids) == "a b c"


def test_examples_without_trained_tokens_are_dropped(word_tokenizer):
    ctx = StrategyContext(word_tokenizer, chat_template=word_tokenizer.chat_template)
    ds = DatasetConfig(path="chat.jsonl", type="chat_template")
    user = {"role": "user", "content": "hi"}
    assistant = {"role": "assistant", "content": "fine"}
    conversations = [[user], [user, assistant], []]
    rows = [Row({"messages": c}, "chat.jsonl", number) for number, c in enumerate(conversations, start=1)]
    kept, stats = examples_from_rows(rows, ds, ctx, sequence_len=100)
    assert (len(kept), stats.dropped, stats.trained_tokens) == (1, 2, 2)  # "fine" and <|im_end|>


@pytest.mark.parametrize(
    "size, n, expected",
    [
        (0.0, 10, 0),
        (0.2, 10, 2),
        (0.25, 10, 3),
        (0.1, 30, 3),
        (1.0, 10, 10),
        (3.0, 10, 3),
        (3.9, 10, 3),
        (50.0, 10, 10),
    ],
)
def test_validation_count(size, n, expected):
    assert validation_count(size, n) == expected


def test_load_examples_shuffles_deterministically_and_takes_val_from_the_end(tmp_path, word_tokenizer):
    path = write_jsonl(tmp_path / "texts.jsonl", [{"text": t} for t in TEXTS])
    datasets = [{"path": path, "type": "completion"}]

    def load(**keys):
        return load_examples(
            config(datasets, sequence_len=3, excess_length_strategy="truncate", **keys), word_tokenizer
        )

    base = load(val_set_size=0.2)
    # 12 examples: "a b c d" + eos in two pieces of at most 3 tokens, "e f g" + eos as "e f g" (its lone eos
    # too short to train), the empty text dropped; ceil(0.2 * 12) held out
    assert (len(base.train), len(base.val)) == (9, 3)
    again = load(val_set_size=0.2)
    assert [e.input_ids for e in again.train + again.val] == [e.input_ids for e in base.train + base.val]

    everything = [e.input_ids for e in base.train + base.val]
    count = load(val_set_size=3.0)
    assert [e.input_ids for e in count.val] == everything[-3:]
    assert [e.input_ids for e in count.train] == everything[:-3]
    none = load(val_set_size=0.0)
    assert none.val == [] and [e.input_ids for e in none.train] == everything

    in_file_order, _ = examples_from_rows(
        completion_rows(),
        DatasetConfig(path=path, type="completion"),
        StrategyContext(word_tokenizer, sequence_len=3),
        3,
        "truncate",
    )
    unshuffled = [e.input_ids for e in in_file_order]
    assert everything != unshuffled and sorted(everything) == sorted(unshuffled)
    other_seed = load(val_set_size=0.0, seed=7)
    assert [e.input_ids for e in other_seed.train] != everything


def test_load_examples_combines_datasets_and_reports_stats(tmp_path, word_tokenizer):
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": t} for t in TEXTS])

    def chat(question, answer):
        return {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}

    short_chat = chat("hi there", "fine thanks")  # 10 tokens
    # 16 tokens, longer than sequence_len: dropped (excess_length_strategy's default, drop)
    long_chat = chat("one two three four five six seven eight", "fine")
    chats = write_jsonl(tmp_path / "chats.jsonl", [short_chat, short_chat, long_chat, short_chat])
    cfg = config(
        [
            {"path": texts, "type": "completion"},
            {
                "path": chats,
                "type": "chat_template",
                "field_messages": "conversations",
                "message_property_mappings": {"role": "from", "content": "value"},
            },
        ],
        sequence_len=10,
        val_set_size=0.5,
    )
    loaded = load_examples(cfg, word_tokenizer)
    assert (len(loaded.train), len(loaded.val)) == (7, 7)
    assert [s.path for s in loaded.stats] == [texts, chats, "total"]
    long, short = "dropped as longer than sequence_len", "dropped as too short or with nothing to train"
    assert format_stats(loaded.stats).splitlines() == [
        f"{texts}: 11 examples, 29 tokens, 18 trained, 0 truncated, 0 {long}, 1 {short}",
        f"{chats}: 3 examples, 30 tokens, 9 trained, 0 truncated, 1 {long}, 0 {short}",
        f"total: 14 examples, 59 tokens, 27 trained, 0 truncated, 1 {long}, 1 {short}",
    ]
    assert sum(len(e) for e in loaded.train + loaded.val) == 59


def test_templates_are_only_needed_for_chat_datasets(tmp_path, llama32_tokenizer):
    path = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Say hi.", "output": "Hi!"}])
    loaded = load_examples(config([{"path": path, "type": "alpaca"}]), llama32_tokenizer)
    assert len(loaded.train) == 1
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ConfigError, match="no chat template"):
        load_examples(config([{"path": chat, "type": "chat_template"}]), llama32_tokenizer)


def test_bad_row_in_a_file_names_the_file_and_line(tmp_path, word_tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [{"text": "one"}, {"text": "two"}, {"txt": "three"}])
    with pytest.raises(DataError) as error:
        load_examples(config([{"path": path, "type": "completion"}]), word_tokenizer)
    assert str(error.value) == f"{path} row 3: row has no `text` string (field = `text`)"
