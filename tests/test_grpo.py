"""GRPO end to end on a tiny random model: the rewarded behaviour becomes more likely, the run directory holds
the metrics users know, KL and resume work."""

import json
import re
import sys

import pytest
import torch
import yaml
from conftest import save_tiny_word_model

from hanzo_gym.cli import main
from hanzo_gym.errors import ConfigError


@pytest.fixture(scope="module")
def tiny_word_base(tmp_path_factory, word_tokenizer):
    return save_tiny_word_model(tmp_path_factory.mktemp("tiny-word-llama"), word_tokenizer)


@pytest.fixture(scope="module")
def counting_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "count.jsonl"
    starts = ["one two three", "two three four", "five six seven", "a b c", "d e f", "six seven eight"]
    with open(path, "w") as handle:
        handle.writelines(json.dumps({"text": text, "answer": "four"}) + "\n" for text in starts * 4)
    return path


def _config(tmp_path, base, data, **overrides):
    cfg = {
        "base_model": str(base),
        "datasets": [{"path": str(data), "type": "completion"}],
        "output_dir": str(tmp_path / "run"),
        "sequence_len": 32,
        "adapter": "lora",
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_target_linear": True,
        "rl": "grpo",
        "trl": {"num_generations": 8, "max_completion_length": 3, "reward_funcs": ["format:four"]},
        "micro_batch_size": 4,
        "num_epochs": 20,
        "max_steps": 24,
        "learning_rate": 3e-2,
        "lr_scheduler": "constant",
        "logging_steps": 1,
        "seed": 3,
    }
    for key, value in overrides.items():
        if key == "trl":
            cfg["trl"].update(value)
        else:
            cfg[key] = value
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_toy_reward_rises_and_metrics_are_logged(tmp_path, tiny_word_base, counting_prompts):
    path = _config(tmp_path, tiny_word_base, counting_prompts)
    assert main(["train", str(path)]) == 0
    rows = [r for r in _rows(tmp_path / "run") if "reward" in r]
    assert [r["step"] for r in rows] == list(range(1, 25))
    early = sum(r["reward"] for r in rows[:6]) / 6
    late = sum(r["reward"] for r in rows[-6:]) / 6
    assert late > early + 0.3, (early, late)
    for key in (
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "rewards/format:four/mean",
        "completions/mean_length",
        "completions/clipped_ratio",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "ac_tokens_per_turn",
        "optim/kl_sample_train_v1",
        "optim/kl_sample_train_v2",
        "time/sample",
        "time/train",
        "step",
        "elapsed_s",
        "lr",
        "grad_norm",
        "loss",
    ):
        assert key in rows[0], key
    assert "kl" not in rows[0]
    # sampler and learner agree: one update per batch, same weights
    assert abs(rows[0]["optim/kl_sample_train_v1"]) < 1e-3
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()


def test_kl_against_the_frozen_base_is_logged_and_grows_from_zero(tmp_path, tiny_word_base, counting_prompts):
    path = _config(
        tmp_path, tiny_word_base, counting_prompts, max_steps=6, trl={"beta": 0.1, "num_iterations": 2}
    )
    assert main(["train", str(path)]) == 0
    rows = [r for r in _rows(tmp_path / "run") if "reward" in r]
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the adapter starts at zero: policy == base
    assert max(r["kl"] for r in rows[1:]) > 1e-5  # a real KL: it moves once the adapter trains


def test_eval_and_resume_match_an_uninterrupted_run(tmp_path, tiny_word_base, counting_prompts):
    path = _config(tmp_path, tiny_word_base, counting_prompts, max_steps=6, save_steps=3, val_set_size=4)
    assert main(["train", str(path)]) == 0
    rows = _rows(tmp_path / "run")
    evals = [r for r in rows if "eval/reward" in r]
    assert evals[0]["step"] == 0 and "eval/accuracy" in evals[0]
    full = {r["step"]: r["reward"] for r in rows if "reward" in r}

    resumed = _config(
        tmp_path,
        tiny_word_base,
        counting_prompts,
        max_steps=6,
        save_steps=3,
        val_set_size=4,
        output_dir=str(tmp_path / "resumed"),
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"),
    )
    assert main(["train", str(resumed)]) == 0
    again = {r["step"]: r["reward"] for r in _rows(tmp_path / "resumed") if "reward" in r}
    assert sorted(again) == [4, 5, 6]
    for step, reward in again.items():
        assert reward == pytest.approx(full[step], abs=1e-9)


def test_a_logged_row_is_the_mean_of_its_window(tmp_path, tiny_word_base, counting_prompts):
    """With logging_steps 3 each row averages its three steps (the same steps a logging_steps 1 run logs
    one by one), as TRL averages over its logging window; lr is the window's last."""
    every = _config(tmp_path / "every", tiny_word_base, counting_prompts, max_steps=6)
    assert main(["train", str(every)]) == 0
    steps = [r for r in _rows(tmp_path / "every" / "run") if "reward" in r]
    windowed = _config(tmp_path / "windowed", tiny_word_base, counting_prompts, max_steps=6, logging_steps=3)
    assert main(["train", str(windowed)]) == 0
    rows = [r for r in _rows(tmp_path / "windowed" / "run") if "reward" in r]
    assert [r["step"] for r in rows] == [3, 6]
    for row, window in zip(rows, (steps[:3], steps[3:])):
        for key in ("reward", "reward_std", "loss", "grad_norm", "completions/mean_length", "entropy"):
            given = [s[key] for s in window if key in s]  # a step with nothing to train has no entropy
            assert row[key] == pytest.approx(sum(given) / len(given), rel=1e-9, abs=1e-12), key
        assert row["lr"] == window[-1]["lr"]
    assert len({round(s["reward"], 6) for s in steps[:3]}) > 1  # the steps differ: a mean, not a pick


# The reward keys of Axolotl's GRPO quick start (docs/grpo.qmd)
QUICK_START_REWARDS = {
    "reward_funcs": ["rewards.accuracy_reward", "rewards.format_reward"],
    "reward_weights": [1.0, 0.5],
}


def _rewards_module_run(tmp_path, base, monkeypatch, source: str, rows: list[dict], dataset_type: str):
    """A two-step GRPO config with the quick start's reward keys, `source` as rewards.py in the working
    directory (imported afresh) and `rows` as its dataset of `dataset_type`."""
    (tmp_path / "rewards.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the working directory the import adds goes again after
    monkeypatch.delitem(sys.modules, "rewards", raising=False)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    datasets = [{"path": str(data), "type": dataset_type}]
    return _config(tmp_path, base, data, datasets=datasets, max_steps=2, trl=QUICK_START_REWARDS)


def test_axolotls_reward_module_by_dotted_path_trains_on_chat_prompts(tmp_path, tiny_word_base, monkeypatch):
    """Axolotl's GRPO quick start: `reward_funcs: [rewards.accuracy_reward, rewards.format_reward]` from a
    rewards.py in the working directory, with reward_weights, on chat prompts with an `answer` column."""
    rewards = (
        "def accuracy_reward(completions, answer, **kwargs):\n"
        "    return [1.0 if c[0]['content'].split()[-1:] == [a] else 0.0 for c, a in zip(completions, answer)]\n"
        "def format_reward(completions, **kwargs):\n"
        "    return [float('four' in c[0]['content']) for c in completions]\n"
    )
    rows = [
        {"messages": [{"role": "user", "content": w}], "answer": "four"} for w in ("one two", "five six") * 4
    ]
    config = _rewards_module_run(tmp_path, tiny_word_base, monkeypatch, rewards, rows, "chat_template")
    assert main(["train", str(config)]) == 0
    rows = [row for row in _rows(tmp_path / "run") if "reward" in row]
    assert rows and all(
        {"rewards/rewards.accuracy_reward/mean", "rewards/rewards.format_reward/mean"} <= set(row)
        for row in rows
    )
    for row in rows:  # the total is the weighted sum of the two, as in TRL
        want = row["rewards/rewards.accuracy_reward/mean"] + 0.5 * row["rewards/rewards.format_reward/mean"]
        assert row["reward"] == pytest.approx(want, abs=1e-6)
    sys.modules.pop("rewards", None)  # not through monkeypatch, which would put it back


DOCS_REWARDS = """
import re


def accuracy_reward(completions, answer, **kwargs) -> list[float]:
    rewards = []
    for completion, correct in zip(completions, answer):
        numbers = re.findall(r"-?\\d+(?:\\.\\d+)?", completion[0]["content"])
        rewards.append(1.0 if (numbers[-1] if numbers else "") == str(correct) else 0.0)
    return rewards


def format_reward(completions, **kwargs) -> list[float]:
    return [float("<answer>" in c[0]["content"]) for c in completions]


def prompt_transform(cfg, *args, **kwargs):
    def transform_fn(example, tokenizer=None):
        label = example["answer"].split("####")[-1].strip().replace(",", "")
        return {
            "prompt": [
                {"role": "system", "content": "Solve the math problem."},
                {"role": "user", "content": example["question"]},
            ],
            "answer": label,
        }
    return transform_fn, {"remove_columns": ["question"]}
"""


def test_axolotls_grpo_quick_start_transform_and_rewards_train(tmp_path, tiny_word_base, monkeypatch):
    """The reward module of Axolotl's GRPO quick start (its transform as written there, its rewards in the
    same shape): `type: rewards.prompt_transform` turns GSM8K rows into chat prompts with an `answer` label."""
    from hanzo_gym.config import load_config
    from hanzo_gym.data.prompts import load_prompts
    from hanzo_gym.model.hub import load_tokenizer

    rows = [{"question": f"one two {n}", "answer": f"Sum it.\n#### {n},000"} for n in range(6)]
    config = _rewards_module_run(
        tmp_path, tiny_word_base, monkeypatch, DOCS_REWARDS, rows, "rewards.prompt_transform"
    )
    cfg = load_config(config)
    prompts = load_prompts(cfg, load_tokenizer(cfg.base_model)).train
    first = next(p for p in prompts if p.messages[1]["content"] == "one two 3")
    assert first.messages == [
        {"role": "system", "content": "Solve the math problem."},
        {"role": "user", "content": "one two 3"},
    ]
    assert first.answer == "3000" and first.columns == {"answer": "3000"}  # `question` removed, as asked
    assert first.text.startswith("<|im_start|> system")  # rendered with the run's chat template
    assert main(["train", str(config)]) == 0
    assert {"rewards/rewards.accuracy_reward/mean", "rewards/rewards.format_reward/mean"} <= set(
        _rows(tmp_path / "run")[-1]
    )
    sys.modules.pop("rewards", None)  # not through monkeypatch, which would put it back


def test_a_misspelt_type_is_not_taken_for_a_transform(tmp_path, tiny_word_base, counting_prompts):
    from config_files import error_of

    text = (
        f"base_model: {tiny_word_base}\ndatasets:\n  - path: {counting_prompts}\n    type: chatml.intell\n"
        "adapter: lora\nlora_target_linear: true\noutput_dir: out\n"
    )
    assert "did you mean `chatml.intel`" in error_of(tmp_path, text)


def test_full_fine_tuning_grpo_samples_from_and_trains_every_weight(
    tmp_path, tiny_word_base, counting_prompts
):
    """No adapter: the sampler reads the live weights, every weight trains, and the run writes the model."""
    from safetensors.torch import load_file

    path = _config(tmp_path, tiny_word_base, counting_prompts, learning_rate=3e-3)
    written = yaml.safe_load(path.read_text())
    for key in ("adapter", "lora_r", "lora_alpha", "lora_target_linear"):
        written.pop(key)
    path.write_text(yaml.safe_dump(written))
    assert main(["train", str(path)]) == 0
    rows = [r for r in _rows(tmp_path / "run") if "reward" in r]
    early, late = (sum(r["reward"] for r in part) / 6 for part in (rows[:6], rows[-6:]))
    assert late > early + 0.3, (early, late)
    trained, base = (
        load_file(tmp_path / "run" / "model.safetensors"),
        load_file(tiny_word_base / "model.safetensors"),
    )
    assert all(not torch.equal(trained[name], base[name]) for name in base if name.endswith("proj.weight"))


def test_full_fine_tuning_grpo_refuses_vllm_rollouts():
    from config_files import parse_minimal

    grpo = {
        "rl": "grpo",
        "adapter": None,
        "lora_target_linear": None,
        "datasets": [{"path": "p", "type": "completion"}],
    }
    with pytest.raises(ConfigError, match="a fully trained model has none"):
        parse_minimal(**grpo, trl={"reward_funcs": ["exact_match"], "use_vllm": True})
    assert parse_minimal(**grpo, trl={"reward_funcs": ["exact_match"]}).full_fine_tuning


def test_gdpo_is_grpo_with_each_reward_normalized_before_the_sum(tmp_path, tiny_word_base, counting_prompts):
    """Axolotl's `rl: gdpo`: TRL's multi_objective_aggregation normalize_then_sum, whatever the rewards' scales."""
    from hanzo_gym.config import load_config

    path = _config(
        tmp_path,
        tiny_word_base,
        counting_prompts,
        rl="gdpo",
        trl={"reward_funcs": ["format:four", "length:2"], "reward_weights": [1.0, 0.5]},
    )
    cfg = load_config(path)
    assert (cfg.rl, cfg.trl.multi_objective_aggregation) == ("grpo", "normalize_then_sum")
    assert main(["train", str(path)]) == 0
    rows = [r for r in _rows(tmp_path / "run") if "reward" in r]
    early, late = (sum(r["rewards/format:four/mean"] for r in part) / 6 for part in (rows[:6], rows[-6:]))
    assert late > early + 0.3, (early, late)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"rl": "gdpo", "trl": {"multi_objective_aggregation": "sum_then_normalize"}},
            "is GRPO (Axolotl's rule)",
        ),
        (
            {"trl": {"multi_objective_aggregation": "normalize_then_sum", "scale_rewards": "batch"}},
            "remove scale_rewards",
        ),
        ({"save_safetensors": False}, "hanzo-gym writes safetensors only"),
    ],
)
def test_gdpo_and_checkpoint_format_mistakes_are_refused(keys, message):
    from config_files import parse_minimal

    grpo = {"rl": "grpo", "datasets": [{"path": "p", "type": "completion"}]}
    trl = {"reward_funcs": ["exact_match"], **keys.pop("trl", {})}
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_minimal(**{**grpo, **keys, "trl": trl})


def test_log_completions_writes_each_logged_rows_completions_as_trl_logs_them(
    tmp_path, tiny_word_base, counting_prompts, capsys
):
    path = _config(
        tmp_path,
        tiny_word_base,
        counting_prompts,
        max_steps=4,
        logging_steps=2,
        trl={
            "reward_funcs": ["format:four", "length:2"],
            "log_completions": True,
            "num_completions_to_print": 3,
        },
    )
    assert main(["train", str(path)]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if " completion: " in line]
    assert (
        len(printed) == 6
        and printed[0].startswith("step 2 completion: '")
        and printed[3].startswith("step 4")
    )
    records = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    # a row every 2 steps, each step 4 prompts × 8 completions: TRL's columns, the row's step
    assert [r["step"] for r in records] == [2] * 64 + [4] * 64
    assert list(records[0]) == ["step", "prompt", "completion", "format:four", "length:2", "advantage"]
    group = records[:8]  # one prompt's completions: advantages centred in the group (the default scaling)
    assert sum(r["advantage"] for r in group) == pytest.approx(0.0, abs=1e-6)
    assert {r["format:four"] for r in records} <= {0.0, 1.0} and {r["length:2"] for r in records} <= {
        0.0,
        -1.0,
    }
