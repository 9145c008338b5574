"""do_bench_eval: the engine's multiple-choice scores against plain transformers, the questions against Axolotl's own
tokenizing and filtering code, the metrics against Axolotl's callback loop written out over plain transformers,
and a `gym train` run that logs them and picks its best checkpoint by one."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest
import torch
from test_eval_keys import _config, _rows
from tiny_models import tiny_model

from hanzo_gym.cli import main
from hanzo_gym.config import parse_config
from hanzo_gym.config.feature import feature_notes
from hanzo_gym.data.bench import BENCH_LETTERS, bench_questions, bench_rows, group_name, letter_tokens
from hanzo_gym.engine import Engine
from hanzo_gym.errors import DataError
from hanzo_gym.loops.bench_eval import bench_scores
from hanzo_gym.records import IGNORE_INDEX, Datum, ModelInput

BENCH_ROWS = [
    {
        "input": "Which number is even?\nA. 3\nB. 4\nC. 5\nAnswer:",
        "output": "B",
        "subject": "Dharma: arithmetic",
    },
    {"input": "2 + 2 =\nA. 4\nB. 5\nAnswer:", "output": "A", "subject": "dharma:arithmetic"},
    {"input": "The sky is\nA. green\nB. red\nC. blue\nD. pink\nAnswer:", "output": "C", "subject": "open-qa"},
    {
        "input": "Pick the last letter\nE. e\nF. f\nG. g\nAnswer:",
        "output": "G",
        "subject": "Open-QA: letters",
    },
    {"input": "Not a choice", "output": "maybe", "subject": "dharma: misc"},  # left out: no letter answer
]


def _axolotl_bench_functions(tokenizer) -> dict:
    """Axolotl's own `transform_bench_subject` and `tokenize_evals`, lifted out of its callback factory."""
    from axolotl.utils import callbacks

    factory = ast.parse(inspect.getsource(callbacks.bench_eval_callback_factory)).body[0]
    wanted = [
        n
        for n in factory.body
        if isinstance(n, ast.FunctionDef) and n.name in ("transform_bench_subject", "tokenize_evals")
    ]
    namespace = {"tokenizer": tokenizer, "IGNORE_INDEX": IGNORE_INDEX}
    exec(compile(ast.Module(wanted, []), "axolotl_bench", "exec"), namespace)  # noqa: S102 - Axolotl's code
    return namespace


class _EmptyBos:
    """A tokenizer whose missing BOS token is the empty text: how the questions are read here where Axolotl
    writes `None` (its f-string of a missing token)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.bos_token, self.eos_token = (
            tokenizer,
            tokenizer.bos_token or "",
            tokenizer.eos_token,
        )

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)


@pytest.mark.parametrize(
    "tokenizer_name", ["llama32_tokenizer", "qwen3_tokenizer"]
)  # with a BOS token, without
def test_questions_are_tokenized_and_filtered_as_axolotls_callback_does(tokenizer_name, request):
    tokenizer = request.getfixturevalue(tokenizer_name)
    axolotl = _axolotl_bench_functions(_EmptyBos(tokenizer))
    abcd_idx = [tokenizer(letter, add_special_tokens=False).input_ids[0] for letter in BENCH_LETTERS]
    assert letter_tokens(tokenizer) == abcd_idx
    expected = []
    for row in BENCH_ROWS:
        named = {**row, **axolotl["transform_bench_subject"](row)}
        encoded = axolotl["tokenize_evals"](named)
        if encoded["labels"][-2] in abcd_idx:  # Axolotl's filter
            first = next(i for i, label in enumerate(encoded["labels"]) if label != IGNORE_INDEX)
            expected.append((named["name"], encoded["input_ids"], first))
    ours = bench_questions(BENCH_ROWS, tokenizer)
    assert [(q.name, q.tokens, q.answer_at) for q in ours] == expected
    assert [q.name for q in ours] == ["dharma", "dharma", "open_qa", "open_qa"]
    assert [BENCH_LETTERS[q.reference] for q in ours] == ["B", "A", "C", "G"]


def test_group_names_follow_axolotls_rule():
    assert [group_name(s) for s in ("Dharma-1: x", " MMLU ", "a-b:c:d")] == ["dharma_1", "mmlu", "a_b"]


def _engine(qwen3_tokenizer) -> Engine:
    torch.manual_seed(0)
    model = tiny_model("qwen3", vocab_size=len(qwen3_tokenizer), initializer_range=0.2)
    return Engine(model, tokenizer=qwen3_tokenizer)


def test_forward_choices_equal_plain_transformers_log_softmax(qwen3_tokenizer):
    engine = _engine(qwen3_tokenizer)
    sequences = [[11, 12, 13, 14, 15, 16], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37, 38]]
    at = [3, 0, 5]
    choices = [5, 17, 900, 12]
    datums = [
        Datum(ModelInput.from_ints(s[:-1]), {"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)})
        for s in sequences
    ]
    logprobs, choices_DC = engine.forward_choices(datums, choices, at)
    assert choices_DC.shape == (3, 4)
    for tokens, a, lps, row in zip(sequences, at, logprobs, choices_DC):
        with torch.no_grad():
            full = engine.model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float().log_softmax(-1)
        torch.testing.assert_close(row, full[a, choices], atol=1e-5, rtol=1e-5)
        reference = full.gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)
        torch.testing.assert_close(lps[a:], reference[a:], atol=1e-5, rtol=1e-5)
        assert not lps[:a].any()  # before `at`, nothing is scored
    # the same numbers as `forward` scored from there
    alone = engine.forward(datums, scored_from=at)
    assert all(torch.equal(a, b) for a, b in zip(alone, logprobs))


def _axolotl_loop_over_plain_transformers(model, questions, tokenizer, batch_size) -> dict[str, float]:
    """Axolotl's BenchEvalCallback.on_evaluate with HF's prediction_step written out: per batch the model's mean
    loss over its label tokens, the letter argmax at the position before the first label."""
    abcd_idx = letter_tokens(tokenizer)
    preds, refs, names, losses = [], [], [], []
    for start in range(0, len(questions), batch_size):
        batch = questions[start : start + batch_size]
        nll, count = 0.0, 0
        for q in batch:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([q.tokens])).logits[0].float()
            labels = torch.tensor([IGNORE_INDEX] * q.answer_at + q.tokens[q.answer_at :])
            nll += torch.nn.functional.cross_entropy(
                logits[:-1], labels[1:], ignore_index=IGNORE_INDEX, reduction="sum"
            ).item()
            count += int((labels[1:] != IGNORE_INDEX).sum())
            first = int((labels != IGNORE_INDEX).nonzero()[0][0])
            preds.append(int(torch.argmax(logits[first - 1][abcd_idx])))
            label = q.tokens[q.answer_at]
            refs.append(abcd_idx.index(label) if label in abcd_idx else -1)
            names.append(q.name)
        losses.append(nll / count)
    by_name: dict[str, list[bool]] = {}
    for name, p, r in zip(names, preds, refs):
        by_name.setdefault(name, []).append(p == r)
    results = {f"eval/bench_accuracy_{n}": sum(h) / len(h) for n, h in by_name.items()}
    return {
        "eval/bench_loss": sum(losses) / len(losses),
        **results,
        "eval/bench_average_accuracy": sum(results.values()) / len(results),
        "eval/bench_total_accuracy": sum(p == r for p, r in zip(preds, refs)) / len(preds),
    }


def test_bench_scores_equal_axolotls_loop(qwen3_tokenizer):
    engine = _engine(qwen3_tokenizer)
    rows = [
        {
            "input": f"Question {i}: which?\nA. x\nB. y\nC. z\nAnswer:",
            "output": "ABC"[i % 3],
            "subject": f"g{i % 2}: s",
        }
        for i in range(7)
    ]
    questions = bench_questions(rows, qwen3_tokenizer)
    ours = bench_scores(engine, questions, batch_size=3)
    reference = _axolotl_loop_over_plain_transformers(engine.model, questions, qwen3_tokenizer, 3)
    assert ours.keys() == reference.keys()
    assert ours == pytest.approx(reference, abs=1e-5)


def test_bench_rows_read_a_local_file_and_say_what_a_row_lacks(tmp_path):
    good = tmp_path / "bench.json"
    good.write_text(
        "".join(json.dumps(row) + "\n" for row in BENCH_ROWS)
    )  # one object per line, as on the hub
    assert bench_rows(str(good)) == BENCH_ROWS
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input": "q", "output": "A"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl row 1: row has no `subject` string"):
        bench_rows(str(bad))
    with pytest.raises(DataError, match="no question has an answer that is one of the letters"):
        bench_questions([{"input": "q", "output": "yes", "subject": "s"}], _FakeTokenizerOfWords())


class _FakeTokenizerOfWords:
    bos_token, eos_token = None, "</s>"

    def __call__(self, text, **_):
        class Encoded:
            input_ids = [hash(word) % 1000 for word in text.split()] or [0]

        return Encoded()


def _parse(tmp_path, **keys):
    data = {
        "base_model": "m",
        "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
        "output_dir": str(tmp_path / "run"),
        "val_set_size": 0.1,
        "do_bench_eval": True,
        **keys,
    }
    return parse_config(data, "run.yaml")


def test_bench_keys_are_checked_at_load(tmp_path):
    from hanzo_gym.errors import ConfigError

    assert _parse(tmp_path).bench_source == "pharaouk/dharma-1/dharma_1_mini.json"
    assert _parse(tmp_path, bench_dataset="mmlu-zs").bench_source == "mmlu-zs"
    refusals = {
        "needs a held-out set": {"val_set_size": 0},
        "rl: dpo is not supported": {"rl": "dpo", "datasets": [{"path": "d", "type": "chatml.intel"}]},
        "is neither a local .json/.jsonl file": {"bench_dataset": "no-such-file.json"},
        "bench_dataset is what do_bench_eval: true scores": {
            "do_bench_eval": False,
            "bench_dataset": "mmlu-zs",
        },
    }
    for message, keys in refusals.items():
        with pytest.raises(ConfigError, match=message):
            _parse(tmp_path, **keys)
    quiet = _parse(tmp_path, eval_strategy="no", bench_dataset="mmlu-zs")
    assert not quiet.do_bench_eval
    assert any("do_bench_eval, bench_dataset: changes nothing here" in note for note in feature_notes(quiet))


@pytest.mark.slow  # a whole `gym train` run or two: CI's slow tier
def test_gym_train_logs_bench_metrics_and_keeps_the_checkpoint_of_the_best_accuracy(
    tmp_path, tiny_base, chat_data, capsys
):
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps(row) + "\n" for row in BENCH_ROWS))
    keys = {
        "max_steps": 4,
        "eval_steps": 2,
        "save_steps": 2,
        "do_bench_eval": True,
        "bench_dataset": str(bench),
        "load_best_model_at_end": True,
        "metric_for_best_model": "eval_bench_total_accuracy",
    }
    assert main(["train", str(_config(tmp_path, tiny_base, chat_data, **keys))]) == 0
    evals = [row for row in _rows(tmp_path / "run") if "eval/loss" in row]
    assert [row["step"] for row in evals] == [0, 2, 4]
    for row in evals:
        assert {"eval/bench_loss", "eval/bench_accuracy_dharma", "eval/bench_accuracy_open_qa"} <= row.keys()
        assert row["eval/bench_total_accuracy"] in (0.0, 0.25, 0.5, 0.75, 1.0)  # four questions
        assert row["eval/bench_average_accuracy"] == pytest.approx(
            (row["eval/bench_accuracy_dharma"] + row["eval/bench_accuracy_open_qa"]) / 2
        )
    state = json.loads((tmp_path / "run" / "checkpoint-4" / "trainer_state.json").read_text())
    best = max(evals[1:], key=lambda row: row["eval/bench_total_accuracy"])  # the first of equals, HF's rule
    assert state["best"]["step"] == best["step"]
    assert state["best"]["metric"] == best["eval/bench_total_accuracy"]


def test_a_missing_bench_file_on_the_hub_is_said_before_the_model_loads(
    tmp_path, tiny_base, chat_data, monkeypatch, capsys
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    keys = {"max_steps": 1, "do_bench_eval": True, "bench_dataset": "nobody/no-such-bench/bench.json"}
    assert main(["train", str(_config(tmp_path, tiny_base, chat_data, **keys))]) == 2
    assert "nobody/no-such-bench" in capsys.readouterr().err
    assert not (Path(tmp_path) / "run" / "metrics.jsonl").exists()
