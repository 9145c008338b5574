"""Axolotl's `push_dataset_to_hub`, with the real huggingface_hub client against the local stand-in of the Hub
(tests/test_hub_push.py): a run pushes its tokenized datasets to a private dataset repo, without a local path in
them; a run elsewhere with the same data reads them back instead of tokenizing; an unreachable Hub costs one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from config_files import refusal_of, write_tiny_run
from test_hub_push import _closed_port, _point_client_at, hub  # noqa: F401 - the stand-in Hub's fixture

from hanzo_gym.cli import main
from hanzo_gym.config import load_config
from hanzo_gym.data.dataset import load_examples
from hanzo_gym.data.prepared import load_prepared
from hanzo_gym.model.hub import load_tokenizer

PUSH = {"push_dataset_to_hub": "prepared-chats", "hf_use_auth_token": True}


def _never(*_):
    raise AssertionError("tokenized again although the Hub holds the prepared datasets")


def _copy_of(chat_data, folder):
    folder.mkdir()
    return Path(shutil.copy(chat_data, folder / "chats.jsonl"))


@pytest.mark.slow  # a whole `gym train` run or two: CI's slow tier
def test_a_run_pushes_its_prepared_datasets_and_another_machine_reads_them(
    tmp_path,
    tiny_base,
    chat_data,
    hub,  # noqa: F811 - the fixture
    capsys,
):
    first = _copy_of(chat_data, tmp_path / "first")
    config = write_tiny_run(tmp_path / "first", tiny_base, first, max_steps=1, **PUSH)
    assert main(["train", str(config)]) == 0
    assert (
        "push_dataset_to_hub: pushed the prepared datasets to hub dataset `tester/prepared-chats`"
        in capsys.readouterr().out
    )
    assert hub.kinds["tester/prepared-chats"] == "dataset" and hub.repos["tester/prepared-chats"]["private"]
    files = hub.files_at("tester/prepared-chats")
    (key,) = {path.split("/")[0] for path in files}
    assert sorted(files) == [f"{key}/inputs.json", f"{key}/prepared.json"]
    assert all(str(tmp_path).encode() not in body for body in files.values())  # nothing of this file system
    assert len(json.loads(files[f"{key}/inputs.json"])["data_files"]) == 1  # known by its content

    # elsewhere: the same data in another folder, no local prepared copy; read from the Hub, not tokenized
    second = _copy_of(chat_data, tmp_path / "second")
    cfg = load_config(write_tiny_run(tmp_path / "second", tiny_base, second, max_steps=1, **PUSH))
    tokenizer = load_tokenizer(cfg.base_model)
    again, note = load_prepared(cfg, tokenizer, _never)
    assert note == "push_dataset_to_hub: read the prepared datasets from hub dataset `prepared-chats`"
    fresh = load_examples(cfg, tokenizer)
    assert (again.train, again.val) == (fresh.train, fresh.val)
    # the statistics name the file the first machine read by its name only
    assert [(s.path, s.examples) for s in again.stats] == [("chats.jsonl", 40), ("total", 40)]
    assert len(hub.commits) == 1  # nothing pushed again

    # other data: another key, tokenized and pushed beside the first
    (tmp_path / "third").mkdir()
    other = tmp_path / "third" / "chats.jsonl"
    other.write_text(first.read_text().replace("make", "makes"))
    cfg = load_config(write_tiny_run(tmp_path / "third", tiny_base, other, max_steps=1, **PUSH))
    _, note = load_prepared(cfg, tokenizer, load_examples)
    assert (
        note.startswith("push_dataset_to_hub: pushed")
        and len({p.split("/")[0] for p in hub.files_at("tester/prepared-chats")}) == 2
    )


def test_an_unreachable_hub_tokenizes_and_trains_with_one_line(
    tmp_path, tiny_base, chat_data, monkeypatch, capsys
):
    _point_client_at(monkeypatch, f"http://127.0.0.1:{_closed_port()}")
    config = write_tiny_run(tmp_path, tiny_base, chat_data, max_steps=1, **PUSH)
    assert main(["train", str(config)]) == 0
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith("push_dataset_to_hub")]
    assert "could not push the prepared datasets to `prepared-chats`" in line and line.endswith(
        "training goes on"
    )


def test_push_dataset_to_hub_needs_hf_use_auth_token_as_in_axolotl():
    assert "set hf_use_auth_token: true with it" in refusal_of(push_dataset_to_hub="me/data")
    assert "not a Hub repo id" in refusal_of(push_dataset_to_hub="me/da ta", hf_use_auth_token=True)


@pytest.fixture(autouse=True)
def _hub_cache(tmp_path, monkeypatch):
    """Downloads land in this test's own cache, so the second run cannot read the first's files locally."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
