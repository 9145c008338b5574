"""Axolotl's `pretraining_dataset`: raw text trained in packed windows (or, unpacked, each text cut short) for
max_steps, read as the run's one dataset of type pretrain; the tokenization itself is checked against Axolotl's
own in test_axolotl_formats.py."""

from __future__ import annotations

import json

import pytest
from config_files import parse_minimal, refusal_of, write_tiny_run

from hanzo_gym.cli import main
from hanzo_gym.config.feature import feature_notes

TEXT = "The river rose in spring and the town moved its market up the hill, where it stayed for a century. "


def _text_file(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": TEXT * (n + 1)}) + "\n" for n in range(12)))
    return path


def test_pretraining_dataset_is_the_runs_one_dataset(tmp_path):
    path = _text_file(tmp_path)
    entry = {"path": "json", "data_files": str(path), "type": "pretrain"}
    cfg = parse_minimal(
        datasets=[], pretraining_dataset=[entry], max_steps=3, sample_packing=True, val_set_size=0.1
    )
    (ds,) = cfg.datasets
    assert (ds.path, ds.type, ds.data_files, ds.field, cfg.val_set_size) == (
        "json",
        "pretrain",
        [str(path)],
        "text",
        0,
    )
    notes = feature_notes(cfg)
    assert any(n.startswith("pretraining_dataset: json trains as a dataset of type pretrain") for n in notes)
    assert any(n.startswith("val_set_size: 0.1 changes nothing with pretraining_dataset") for n in notes)
    # one path alone is Axolotl's other spelling; unpacked, every entry is read as Axolotl's stream reads it
    alone = parse_minimal(datasets=[], pretraining_dataset=str(path), max_steps=3)
    assert (alone.datasets[0].path, alone.datasets[0].type) == (str(path), "pretrain")
    completion = parse_minimal(
        datasets=[], pretraining_dataset=[{**entry, "type": "completion"}], max_steps=3
    )
    assert completion.datasets[0].type == "pretrain"


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"sample_packing": True}, "pretraining_dataset needs max_steps"),
        ({"max_steps": 2, "datasets": [{"path": "d.jsonl", "type": "completion"}]}, "give one of them"),
        ({"max_steps": 2, "extra": True}, "Axolotl trains on the first only"),
        ({"max_steps": 2, "skip": 5}, "pretraining_dataset.skip: 5"),
        (
            {"max_steps": 2, "pretraining_sample_concatenation": True},
            "pretraining_sample_concatenation: true",
        ),
    ],
)
def test_what_axolotls_pretraining_reads_otherwise_is_refused(keys, message):
    entry = {"path": "corpus.jsonl"}
    keys = dict(keys)
    if keys.pop("extra", False):
        entry_list = [entry, {"path": "more.jsonl"}]
    else:
        entry_list = [{**entry, **({"skip": keys.pop("skip")} if "skip" in keys else {})}]
    assert message in refusal_of(**{"datasets": [], "pretraining_dataset": entry_list, **keys})


@pytest.mark.parametrize("packed", [True, False])
def test_a_pretraining_run_trains_its_text(tmp_path, tiny_base, chat_data, capsys, packed):
    path = _text_file(tmp_path)
    config = write_tiny_run(
        tmp_path,
        tiny_base,
        chat_data,
        datasets=None,
        pretraining_dataset=[{"path": "json", "data_files": [str(path)]}],
        max_steps=2,
        sample_packing=packed,
    )
    assert main(["train", str(config)]) == 0
    out = capsys.readouterr().out
    assert "pretraining_dataset: json trains as a dataset of type pretrain" in out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]
