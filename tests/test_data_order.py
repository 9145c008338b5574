"""Axolotl's data-order keys: shuffle_merged_datasets, curriculum_sampling, sample_packing_sequentially."""

from __future__ import annotations

import json
import random

import pytest
from config_files import parse_minimal, refusal_of, write_tiny_run
from datasets import Dataset

from hanzo_gym.cli import main
from hanzo_gym.data.batching import packed_rows
from hanzo_gym.data.dataset import load_examples
from hanzo_gym.loops import sft


def completion_file(tmp_path, name: str, texts: list[str]) -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return str(path)


WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def texts_of(examples, tokenizer) -> list[str]:
    return [tokenizer.decode(e.input_ids[:-1]) for e in examples]  # without the eos completion adds


def loaded(tmp_path, word_tokenizer, datasets, **keys):
    cfg = parse_minimal(datasets=datasets, **keys)
    return load_examples(cfg, word_tokenizer)


def test_without_shuffling_the_rows_keep_their_order_and_the_last_ones_are_held_out_as_hf_splits(
    tmp_path, word_tokenizer
):
    first, second = (
        completion_file(tmp_path, "a.jsonl", WORDS[:6]),
        completion_file(tmp_path, "b.jsonl", WORDS[6:]),
    )
    datasets = [{"path": first, "type": "completion"}, {"path": second, "type": "completion"}]
    data = loaded(tmp_path, word_tokenizer, datasets, shuffle_merged_datasets=False, val_set_size=0.3)
    # Axolotl splits with datasets' train_test_split(shuffle=False): the held-out rows are the last ones
    split = Dataset.from_dict({"text": WORDS}).train_test_split(test_size=0.3, shuffle=False)
    assert texts_of(data.train, word_tokenizer) == split["train"]["text"]
    assert texts_of(data.val, word_tokenizer) == split["test"]["text"]
    shuffled = loaded(tmp_path, word_tokenizer, datasets, val_set_size=0.3)
    assert texts_of(shuffled.train, word_tokenizer) != split["train"]["text"]  # the default shuffles


def test_curriculum_sampling_keeps_a_single_datasets_order_as_axolotls_merge_does(tmp_path, word_tokenizer):
    single = [{"path": completion_file(tmp_path, "a.jsonl", WORDS), "type": "completion"}]
    assert (
        texts_of(loaded(tmp_path, word_tokenizer, single, curriculum_sampling=True).train, word_tokenizer)
        == WORDS
    )
    # several datasets are still shuffled when merged, unless shuffle_merged_datasets is false (Axolotl's rule)
    two = [
        {"path": completion_file(tmp_path, "b.jsonl", WORDS[:5]), "type": "completion"},
        {"path": completion_file(tmp_path, "c.jsonl", WORDS[5:]), "type": "completion"},
    ]
    assert (
        texts_of(loaded(tmp_path, word_tokenizer, two, curriculum_sampling=True).train, word_tokenizer)
        != WORDS
    )
    in_order = loaded(tmp_path, word_tokenizer, two, curriculum_sampling=True, shuffle_merged_datasets=False)
    assert texts_of(in_order.train, word_tokenizer) == WORDS


def test_curriculum_sampling_trains_every_epoch_in_the_datas_order(tmp_path, word_tokenizer):
    cfg = parse_minimal(curriculum_sampling=True, micro_batch_size=2, gradient_accumulation_steps=2)
    examples = loaded(
        tmp_path,
        word_tokenizer,
        [{"path": completion_file(tmp_path, "a.jsonl", WORDS), "type": "completion"}],
    ).train
    epochs = [sft._windows(cfg, examples, epoch) for epoch in range(3)]
    assert epochs[0] == epochs[1] == epochs[2]
    assert [i for window in epochs[0] for batch in window for i in batch] == list(range(len(WORDS)))
    shuffled = parse_minimal(micro_batch_size=2, gradient_accumulation_steps=2)
    assert sft._windows(shuffled, examples, 0) != sft._windows(shuffled, examples, 1)


def test_packing_is_sequential_as_axolotls_allocator_packs():
    """sample_packing_sequentially: Axolotl's allocate_sequentially (its own code) closes a bin when the next
    example does not fit, which is how hanzo-gym always packs."""
    import numpy as np
    from axolotl.utils.samplers.multipack import allocate_sequentially

    generator = random.Random(0)
    for _ in range(50):
        capacity = generator.randint(4, 64)
        lengths = [generator.randint(1, capacity) for _ in range(generator.randint(1, 40))]
        bins, _, _ = allocate_sequentially(np.array(lengths), 0, capacity, 1)
        assert packed_rows(lengths, list(range(len(lengths))), capacity) == [list(b) for b in bins]


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"sample_packing_sequentially": True}, "without sample_packing: true nothing is packed"),
        ({"curriculum_sampling": True, "group_by_length": True}, "give one"),
        (
            {"curriculum_sampling": True, "rl": "dpo", "datasets": [{"path": "d", "type": "chatml.intel"}]},
            "rl: dpo does not use it",
        ),
    ],
)
def test_data_order_mistakes_are_refused(keys, message):
    assert message in refusal_of(**keys)


def test_gym_train_records_the_data_order_in_its_resume_plan(tmp_path, tiny_base, chat_data):
    path = write_tiny_run(tmp_path, tiny_base, chat_data, curriculum_sampling=True, max_steps=2, save_steps=1)
    assert main(["train", str(path)]) == 0
    state = json.loads((tmp_path / "run" / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["plan"]["curriculum_sampling"] is True and state["plan"]["shuffle_merged_datasets"] is False
