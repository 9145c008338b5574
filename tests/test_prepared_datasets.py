"""Axolotl's `dataset_prepared_path`: `gym preprocess` fills it, `gym train` reads it instead of
tokenizing again, and a changed data file, tokenizer or data key prepares a new entry instead of reading a
stale one."""

from __future__ import annotations

import json
import shutil

import pytest
from config_files import write_tiny_run

from hanzo_gym.cli import main
from hanzo_gym.config import load_config
from hanzo_gym.data import prepared
from hanzo_gym.data.dataset import load_examples
from hanzo_gym.data.preference import load_preferences
from hanzo_gym.data.prepared import load_prepared
from hanzo_gym.data.prompts import load_prompts
from hanzo_gym.errors import DataError
from hanzo_gym.model.hub import load_tokenizer


def _entries(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _never(*_):
    raise AssertionError("tokenized again although a prepared entry exists")


@pytest.fixture
def own_data(tmp_path, chat_data):
    path = tmp_path / "chats.jsonl"
    shutil.copy(chat_data, path)
    return path


def test_preprocess_fills_it_and_train_reads_it_back_unchanged(tmp_path, tiny_base, own_data, capsys):
    folder = tmp_path / "prepared"
    config = write_tiny_run(tmp_path, tiny_base, own_data, dataset_prepared_path=str(folder), max_steps=1)
    assert main(["preprocess", str(config)]) == 0
    assert "saved the prepared datasets to" in capsys.readouterr().out
    (entry,) = _entries(folder)
    assert sorted(p.name for p in (folder / entry).iterdir()) == ["inputs.json", "prepared.json"]
    inputs = json.loads((folder / entry / "inputs.json").read_text())
    assert list(inputs["data_files"]) == [str(own_data)] and inputs["config"]["sequence_len"] == 64

    cfg = load_config(config)
    tokenizer = load_tokenizer(cfg.base_model)
    fresh = load_examples(cfg, tokenizer)
    again, note = load_prepared(cfg, tokenizer, _never)
    assert note == f"dataset_prepared_path: read the prepared datasets from {folder / entry}"
    assert again == fresh  # every example's ids and labels, the split and the stats

    assert main(["train", str(config)]) == 0
    assert "read the prepared datasets from" in capsys.readouterr().out
    assert _entries(folder) == [entry]


def test_a_changed_data_file_tokenizer_or_data_key_prepares_a_new_entry(tmp_path, tiny_base, own_data):
    folder = tmp_path / "prepared"
    cfg = load_config(write_tiny_run(tmp_path, tiny_base, own_data, dataset_prepared_path=str(folder)))
    tokenizer = load_tokenizer(cfg.base_model)
    load_prepared(cfg, tokenizer, load_examples)
    first = _entries(folder)

    with own_data.open("a") as handle:  # the same path, one more row
        handle.write(
            json.dumps(
                {"messages": [{"role": "user", "content": "1?"}, {"role": "assistant", "content": "1."}]}
            )
            + "\n"
        )
    data, note = load_prepared(cfg, tokenizer, load_examples)
    assert "saved" in note and len(data.train) == 41
    second = _entries(folder)
    assert len(second) == 2

    other_eos = load_tokenizer(cfg.base_model, special_tokens={"eos_token": "<|endoftext|>"})
    load_prepared(cfg, other_eos, load_examples)
    assert len(_entries(folder)) == 3

    shorter = cfg.model_copy(update={"sequence_len": 16})
    data, _ = load_prepared(shorter, tokenizer, load_examples)
    assert len(_entries(folder)) == 4 and data.stats[-1].too_long > 0
    assert set(first) < set(second)


def test_a_damaged_entry_names_itself_and_a_crash_leaves_nothing_half_written(
    tmp_path, tiny_base, own_data, monkeypatch
):
    folder = tmp_path / "prepared"
    cfg = load_config(write_tiny_run(tmp_path, tiny_base, own_data, dataset_prepared_path=str(folder)))
    tokenizer = load_tokenizer(cfg.base_model)

    def crash(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepared, "_write", crash)
    with pytest.raises(KeyboardInterrupt):
        load_prepared(cfg, tokenizer, load_examples)
    assert _entries(folder) == []  # neither the entry nor its temporary folder
    monkeypatch.undo()

    load_prepared(cfg, tokenizer, load_examples)
    (entry,) = _entries(folder)
    data_file = folder / entry / "prepared.json"
    data_file.write_text(data_file.read_text()[:-40])
    with pytest.raises(DataError, match=f"{data_file} is damaged.*delete {folder / entry}"):
        load_prepared(cfg, tokenizer, _never)


def _pairs_file(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"{a} plus 2?", "chosen": f"{a + 2}.", "rejected": f"{a * 3}."} for a in range(6)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize(
    ("rl", "dataset_type", "load"),
    [
        ("dpo", "passthrough", load_preferences),
        ("kto", None, load_preferences),
        ("grpo", "alpaca", load_prompts),
    ],
)
def test_preference_pairs_kto_examples_and_prompts_come_back_equal(
    tmp_path, tiny_base, rl, dataset_type, load
):
    if rl == "kto":
        path = tmp_path / "kto.jsonl"
        rows = [{"prompt": f"{a}?", "completion": f"{a}.", "label": a % 2 == 0} for a in range(6)]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        dataset_type = "passthrough"
    elif rl == "grpo":
        path = tmp_path / "prompts.jsonl"
        rows = [{"instruction": f"What is {a} plus 2?", "output": str(a + 2)} for a in range(6)]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        path = _pairs_file(tmp_path)
    extra = {"micro_batch_size": 2} if rl == "kto" else {}
    if rl == "grpo":
        extra["trl"] = {"num_generations": 2, "max_completion_length": 8, "reward_funcs": ["format:four"]}
    config = write_tiny_run(
        tmp_path,
        tiny_base,
        path,
        rl=rl,
        datasets=[{"path": str(path), "type": dataset_type}],
        dataset_prepared_path=str(tmp_path / "prepared"),
        val_set_size=0.34,
        **extra,
    )
    cfg = load_config(config)
    tokenizer = load_tokenizer(cfg.base_model)
    saved, note = load_prepared(cfg, tokenizer, load)
    assert "saved" in note
    again, note = load_prepared(cfg, tokenizer, _never)
    assert "read" in note and again == saved == load(cfg, tokenizer)
    assert saved.val and saved.train
