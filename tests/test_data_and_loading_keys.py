"""Axolotl's `dataset_exact_deduplication`, `bfloat16`, `low_cpu_mem_usage` and `revision_of_model`:
each does what Axolotl does, or fails at load with the reason."""

from __future__ import annotations

import json

import pytest
from config_files import parse_minimal

from hanzo_gym.data.dataset import load_examples
from hanzo_gym.data.preference import load_preferences
from hanzo_gym.data.prompts import load_prompts
from hanzo_gym.errors import ConfigError

_parse = parse_minimal


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _chat(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def test_duplicate_examples_are_left_out_before_the_split(tmp_path, qwen3_tokenizer):
    rows = [_chat(f"q{i % 4}", f"a{i % 4}") for i in range(10)]  # 4 distinct conversations, 6 repeats
    rows.append(_chat("q0", "another answer"))  # the same question with another answer is not a duplicate
    data = _write(tmp_path / "chats.jsonl", rows)
    keys = {"datasets": [{"path": data, "type": "chat_template"}], "val_set_size": 0.4, "sequence_len": 64}

    plain = load_examples(_parse(**keys), qwen3_tokenizer)
    assert len(plain.train) + len(plain.val) == 11 and plain.duplicates == 0
    unique = load_examples(_parse(**keys, dataset_exact_deduplication=True), qwen3_tokenizer)
    assert unique.duplicates == 6 and len(unique.train) + len(unique.val) == 5
    seen = [tuple(e.input_ids) + tuple(e.labels) for e in unique.train + unique.val]
    assert len(set(seen)) == 5  # no repeat inside a split, and no validation example is a training one
    assert {tuple(e.input_ids) for e in unique.train + unique.val} == {
        tuple(e.input_ids) for e in plain.train + plain.val
    }


def test_duplicate_pairs_and_prompts_are_left_out_too(tmp_path, qwen3_tokenizer):
    pair = {"prompt": "2 + 2?", "chosen": "4", "rejected": "5"}
    other = {"prompt": "2 + 2?", "chosen": "4", "rejected": "22"}
    data = _write(tmp_path / "pairs.jsonl", [pair, other, pair, pair])
    keys = {"rl": "dpo", "datasets": [{"path": data, "type": "passthrough"}], "val_set_size": 0}
    loaded = load_preferences(_parse(**keys, dataset_exact_deduplication=True), qwen3_tokenizer)
    assert loaded.duplicates == 2 and len(loaded.train) == 2

    prompts = _write(tmp_path / "prompts.jsonl", [{"text": "1 + 1?", "answer": "2"}] * 3)
    prompts_keys = {"rl": "grpo", "datasets": [{"path": prompts, "type": "completion"}], "val_set_size": 0}
    prompts_keys["trl"] = {"reward_funcs": ["math_equal"]}
    grpo = load_prompts(_parse(**prompts_keys, dataset_exact_deduplication=True), qwen3_tokenizer)
    assert grpo.duplicates == 2 and len(grpo.train) == 1


def test_bfloat16_is_bf16_and_low_cpu_mem_usage_loads():
    assert _parse(bfloat16=True).bf16 is True
    assert _parse(bfloat16=True, bf16=True).bf16 is True
    assert _parse(bfloat16=False).bf16 == "auto"
    with pytest.raises(ConfigError, match="bf16: false"):
        _parse(bfloat16=True, bf16=False)
    for value in (True, False):
        assert _parse(low_cpu_mem_usage=value).low_cpu_mem_usage is value


def test_the_old_message_field_names_are_the_property_mappings():
    def dataset(**keys):
        return _parse(datasets=[{"path": "d.jsonl", "type": "chat_template", **keys}]).datasets[0]

    old = dataset(message_field_role="from", message_field_content="value")
    assert (old.message_property_mappings.role, old.message_property_mappings.content) == ("from", "value")
    both = dataset(message_field_role="from", message_property_mappings={"role": "from", "content": "text"})
    assert (both.message_property_mappings.role, both.message_property_mappings.content) == ("from", "text")
    with pytest.raises(ConfigError, match="disagree"):
        dataset(message_field_role="from", message_property_mappings={"role": "speaker"})


def test_skip_prepare_dataset_keeps_no_prepared_copy_so_it_cannot_name_one():
    from config_files import parse_minimal, refusal_of

    assert parse_minimal(skip_prepare_dataset=True).skip_prepare_dataset
    message = refusal_of(skip_prepare_dataset=True, dataset_prepared_path="prepared")
    assert "skip_prepare_dataset: true keeps no prepared copy of the datasets" in message
