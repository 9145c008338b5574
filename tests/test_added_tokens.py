"""Axolotl's `tokens`: tokens added to the vocabulary, matched as written; their embeddings grow and
train (beside an adapter only through lora_modules_to_save, or else the run fails at start naming the modules);
the run's tokenizer keeps them and `gym merge` folds the trained embeddings into a model of the new size."""

from __future__ import annotations

import json

import torch
import yaml
from config_files import write_tiny_run
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hanzo_gym.cli import main

NEW = ["<scratch>", "</scratch>"]


def _chats(tmp_path):
    path = tmp_path / "chats.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"What is {a} plus 2?"},
                      {"role": "assistant", "content": f"<scratch>{a} + 2</scratch> {a + 2}"}]}
        for a in range(8)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_an_adapter_run_needs_its_embeddings_to_train(tmp_path, tiny_base, capsys):
    config = write_tiny_run(tmp_path, tiny_base, _chats(tmp_path), tokens=NEW, max_steps=1)
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "tokens adds 2 to the vocabulary, whose embeddings must train" in err
    assert "add `embed_tokens`, `lm_head` to lora_modules_to_save" in err


def test_added_tokens_train_in_the_saved_modules_and_merge_into_a_larger_model(
    tmp_path, tiny_base, qwen3_tokenizer
):
    keys = {"tokens": NEW, "lora_modules_to_save": ["embed_tokens", "lm_head"], "max_steps": 2}
    config = write_tiny_run(tmp_path, tiny_base, _chats(tmp_path), **keys)
    assert main(["train", str(config)]) == 0
    run = tmp_path / "run"
    tokenizer = AutoTokenizer.from_pretrained(run)  # the run's tokenizer keeps them
    rows = len(qwen3_tokenizer) + 2
    assert len(tokenizer) == rows
    ids = tokenizer.encode("<scratch>3 + 2</scratch>", add_special_tokens=False)
    assert ids[0] == rows - 2 and ids[-1] == rows - 1  # each one token, as written
    saved = load_file(str(run / "adapter_model.safetensors"))
    embedding = next(tensor for name, tensor in saved.items() if "embed_tokens" in name)
    assert embedding.shape[0] == rows

    assert main(["merge", str(config), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.get_input_embeddings().num_embeddings == rows
    torch.testing.assert_close(merged.get_input_embeddings().weight[-2:], embedding[-2:].to(torch.float32))


def test_full_fine_tuning_grows_and_saves_the_vocabulary(tmp_path, tiny_base, qwen3_tokenizer):
    config = write_tiny_run(tmp_path, tiny_base, _chats(tmp_path), tokens=NEW, max_steps=1)
    written = yaml.safe_load(config.read_text())
    for key in ("adapter", "lora_r", "lora_alpha", "lora_dropout", "lora_target_linear"):
        written.pop(key)
    config.write_text(yaml.safe_dump(written))
    assert main(["train", str(config)]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    assert model.get_input_embeddings().num_embeddings == len(qwen3_tokenizer) + 2


def test_special_tokens_the_vocabulary_lacks_train_as_added_tokens(tmp_path, tiny_base, capsys):
    """Axolotl's rule: a special token it adds under an adapter needs lora_modules_to_save (embed_tokens and
    lm_head); with them the run trains and its tokenizer keeps the token."""
    from transformers import AutoTokenizer

    special = {"special_tokens": {"additional_special_tokens": ["<think_more>"]}, "max_steps": 1}
    config = write_tiny_run(tmp_path, tiny_base, _chats(tmp_path), **special)
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "special_tokens adds <think_more> to the vocabulary" in err and "lora_modules_to_save" in err
    config = write_tiny_run(
        tmp_path, tiny_base, _chats(tmp_path), lora_modules_to_save=["embed_tokens", "lm_head"], **special
    )
    assert main(["train", str(config)]) == 0
    saved = AutoTokenizer.from_pretrained(tmp_path / "run")
    assert "<think_more>" in saved.get_vocab()
