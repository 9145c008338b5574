"""Axolotl's semantics of how long a run is and what it trains on: `max_steps` overrides `num_epochs` and loops
the data (HF's Trainer), over-long examples are dropped or truncated (`excess_length_strategy`), and the loss
watchdog stops a run whose loss stays above a threshold."""

from __future__ import annotations

import json

import pytest
import yaml

from hanzo_gym.cli import main
from hanzo_gym.config import DatasetConfig, parse_config
from hanzo_gym.data.dataset import examples_from_rows
from hanzo_gym.data.sources import Row
from hanzo_gym.data.strategies import StrategyContext
from hanzo_gym.errors import ConfigError, DataError
from hanzo_gym.loops.schedule import lr_at
from hanzo_gym.loops.tail import LoopTail, planned_steps

BASE = {
    "base_model": "some/model",
    "datasets": [{"path": "train.jsonl", "type": "chat_template"}],
    "output_dir": "out",
    "adapter": "lora",
    "lora_target_linear": True,
}


def test_max_steps_overrides_num_epochs_both_ways():
    assert planned_steps(parse_config({**BASE, "num_epochs": 3}), 5) == (15, 3)
    assert planned_steps(parse_config({**BASE, "num_epochs": 3, "max_steps": 4}), 5) == (4, 1)
    assert planned_steps(parse_config({**BASE, "num_epochs": 1, "max_steps": 12}), 5) == (12, 3)
    assert planned_steps(parse_config({**BASE, "num_epochs": 1, "max_steps": 10}), 5) == (10, 2)


def _config(tmp_path, tiny_base, data, **overrides):
    cfg = {
        "base_model": str(tiny_base),
        "datasets": [{"path": str(data), "type": "chat_template"}],
        "val_set_size": 0.1,
        "output_dir": str(tmp_path / "run"),
        "sequence_len": 64,
        "adapter": "lora",
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_target_linear": True,
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "num_epochs": 1,
        "learning_rate": 5e-3,
        "warmup_steps": 2,
        "logging_steps": 1,
        "seed": 7,
        **overrides,
    }
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"run-{len(list(tmp_path.glob('*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_max_steps_past_one_epoch_loops_the_data_and_resumes_exactly(tmp_path, tiny_base, chat_data):
    # 40 rows → 36 train → 9 micro-batches of 4 → 5 windows of 2 per epoch; max_steps 12 runs 2.4 epochs
    path = _config(tmp_path, tiny_base, chat_data, max_steps=12, save_steps=4)
    assert main(["train", str(path)]) == 0
    rows = [row for row in _rows(tmp_path / "run") if "loss" in row]
    assert [row["step"] for row in rows] == list(range(1, 13))
    assert [row["epoch"] for row in rows][4::5] == [1.0, 2.0] and rows[-1]["epoch"] == 2.4
    # the schedule spans max_steps: HF's cosine over 12 steps after 2 warmup steps
    assert [row["lr"] for row in rows] == pytest.approx([lr_at(s, 12, 5e-3, 2, "cosine") for s in range(12)])
    assert sum(row["trained_tokens"] for row in rows[:5]) == sum(row["trained_tokens"] for row in rows[5:10])
    evals = [row["epoch"] for row in _rows(tmp_path / "run") if "eval/loss" in row]
    assert evals == [0.0, 1.0, 2.0, 2.4]  # before training, at each epoch's end, at the last step

    # checkpoint-8 sits in the second pass over the data (epoch 1, window 3): resuming there gives the same run
    resumed = _config(
        tmp_path,
        tiny_base,
        chat_data,
        max_steps=12,
        save_steps=4,
        output_dir=str(tmp_path / "resumed"),
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-8"),
    )
    assert main(["train", str(resumed)]) == 0
    again = [row for row in _rows(tmp_path / "resumed") if "loss" in row]
    assert [row["step"] for row in again] == [9, 10, 11, 12]
    for new, old in zip(again, rows[8:]):
        assert new["loss"] == pytest.approx(old["loss"], rel=1e-6, abs=1e-7)
        assert (new["epoch"], new["lr"], new["trained_tokens"]) == (
            old["epoch"],
            old["lr"],
            old["trained_tokens"],
        )


# ---- excess_length_strategy --------------------------------------------------------------------------------


def _completion_rows(texts):
    return [Row({"text": text}, "texts.jsonl", number) for number, text in enumerate(texts, start=1)]


TEXTS = ["one", "one two", "a b c d", "e f g", "two"]  # + eos: 2, 3, 5, 4, 2 tokens


@pytest.mark.parametrize(
    ("strategy", "lengths", "truncated", "too_long"),
    [("drop", [2, 3, 2], 0, 2), ("truncate", [2, 3, 3, 3, 2], 2, 0)],
)
def test_over_long_examples_are_dropped_by_default_or_truncated(
    word_tokenizer, strategy, lengths, truncated, too_long
):
    ds = DatasetConfig(path="texts.jsonl", type="completion")
    kept, stats = examples_from_rows(
        _completion_rows(TEXTS), ds, StrategyContext(word_tokenizer), 3, strategy
    )
    assert [len(example) for example in kept] == lengths
    assert (stats.examples, stats.truncated, stats.too_long, stats.dropped) == (
        len(lengths),
        truncated,
        too_long,
        0,
    )
    if strategy == "truncate":  # the first sequence_len tokens stay, as in Axolotl's truncate_long_seq
        assert word_tokenizer.decode(kept[2].input_ids) == "a b c"


def test_excess_length_raise_names_the_row(word_tokenizer):
    ds = DatasetConfig(path="texts.jsonl", type="completion")
    with pytest.raises(DataError, match=r"texts.jsonl row 3 is 5 tokens, longer than sequence_len 3"):
        examples_from_rows(_completion_rows(TEXTS), ds, StrategyContext(word_tokenizer), 3, "raise")


def test_excess_length_strategy_config():
    assert parse_config(BASE).excess_length_strategy == "drop"  # Axolotl's default
    assert parse_config({**BASE, "excess_length_strategy": "truncate"}).excess_length_strategy == "truncate"
    with pytest.raises(ConfigError, match="allowed: 'drop', 'truncate' or 'raise'"):
        parse_config({**BASE, "excess_length_strategy": "cut"})
    grpo = {**BASE, "rl": "grpo", "trl": {"reward_funcs": ["exact_match"]}}
    with pytest.raises(ConfigError, match="not yet for rl: grpo"):
        parse_config({**grpo, "excess_length_strategy": "truncate"})
    assert parse_config({**grpo, "excess_length_strategy": "drop"}).rl == "grpo"


def test_gym_train_says_how_many_examples_were_too_long(tmp_path, tiny_base, chat_data, capsys):
    rows = chat_data.read_text().splitlines()
    long_turn = {"role": "assistant", "content": " ".join(["many words"] * 40)}
    long_rows = [json.dumps({"messages": [{"role": "user", "content": "talk"}, long_turn]})] * 3
    data = tmp_path / "with-long.jsonl"
    data.write_text("\n".join(rows + long_rows) + "\n")
    path = _config(tmp_path, tiny_base, data, max_steps=1, val_set_size=0)
    assert main(["train", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "dropped 3 examples longer than sequence_len 64 (excess_length_strategy: drop" in printed
    assert "train 40 examples" in printed
    assert main(["preprocess", str(path)]) == 0  # gym preprocess counts them per dataset
    assert (
        "40 examples" in (counted := capsys.readouterr().out)
        and "3 dropped as longer than sequence_len" in counted
    )
    path = _config(
        tmp_path,
        tiny_base,
        data,
        max_steps=1,
        val_set_size=0,
        excess_length_strategy="truncate",
        output_dir=str(tmp_path / "truncated"),
    )
    assert main(["train", str(path)]) == 0
    printed = capsys.readouterr().out
    assert (
        "truncated 3 examples longer than sequence_len 64 to it" in printed and "train 43 examples" in printed
    )


# ---- loss_watchdog_threshold / loss_watchdog_patience ------------------------------------------------------


def _watchdog(threshold, patience=None):
    tail = LoopTail.__new__(LoopTail)  # only the watchdog's state: no engine needed
    tail.cfg = parse_config(
        {**BASE, "loss_watchdog_threshold": threshold, "loss_watchdog_patience": patience}
    )
    tail.step, tail.stopped, tail._logged_loss, tail._violations, said = 0, False, None, 0, []
    tail.say = said.append
    return tail, said


def test_the_watchdog_counts_steps_above_the_threshold_and_resets_below():
    tail, said = _watchdog(2.0)  # patience: Axolotl's default 3
    # the newest logged loss at each step's end; None: nothing logged yet, or the newest row is an eval row
    for loss in [None, 3.0, 3.0, 1.0, 3.0, None, 3.0]:
        tail.step += 1
        tail._logged_loss = loss
        tail._watch_loss()
        assert not tail.stopped, tail.step
    tail.step += 1
    tail._logged_loss = 2.5
    tail._watch_loss()  # the third step above 2.0 since the reset (the eval row's step did not count)
    assert tail.stopped and tail.done
    stop = "step 8: loss 2.5000 above loss_watchdog_threshold 2 for 3 steps: stopping the run here (Axolotl's"
    assert said == [stop + " loss watchdog)"]
    once, _ = _watchdog(2.0, patience=1)
    once._logged_loss = 2.0  # not above: equal does not count
    once._watch_loss()
    assert not once.stopped


def test_watchdog_config():
    with pytest.raises(ConfigError, match="loss_watchdog_patience needs `loss_watchdog_threshold`"):
        parse_config({**BASE, "loss_watchdog_patience": 3})
    grpo = {**BASE, "rl": "grpo", "trl": {"reward_funcs": ["exact_match"]}}
    with pytest.raises(ConfigError, match="not rl: grpo's"):
        parse_config({**grpo, "loss_watchdog_threshold": 5.0})
    assert parse_config({**BASE, "loss_watchdog_threshold": 5.0}).loss_watchdog_patience is None


def test_gym_train_stops_when_the_loss_stays_above_the_watchdog_threshold(
    tmp_path, tiny_base, chat_data, capsys
):
    path = _config(
        tmp_path, tiny_base, chat_data, max_steps=8, loss_watchdog_threshold=0.0, loss_watchdog_patience=2
    )
    assert main(["train", str(path)]) == 0
    printed = capsys.readouterr().out
    # step 1: nothing logged yet; steps 2 and 3 see the rows of steps 1 and 2 above 0: the run stops at step 3
    assert "step 3: loss" in printed and "for 2 steps: stopping the run here" in printed
    rows = _rows(tmp_path / "run")
    assert [row["step"] for row in rows if "loss" in row] == [1, 2, 3]
    assert [row["step"] for row in rows if "eval/loss" in row] == [0, 3]  # the stop step is evaluated
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()  # a finished run, as in Axolotl
