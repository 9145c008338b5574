"""Axolotl's evaluation keys: eval_batch_size, early stopping and the best checkpoint (checked against HF's own
EarlyStoppingCallback, best-metric rule and checkpoint rotation), generation metrics on held-out prompts
(do_causal_lm_eval), the predictions table (eval_table_size) and the debug print."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import sacrebleu
import torch
from config_files import refusal_of, write_tiny_run
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, EarlyStoppingCallback, Trainer, TrainerControl, TrainerState
from transformers.trainer_utils import rotate_checkpoints

from hanzo_gym.cli import main
from hanzo_gym.data.example import Example
from hanzo_gym.loops import sft
from hanzo_gym.loops.generation_eval import corpus_scores, held_out_split
from hanzo_gym.loops.run_dir import RunDir
from hanzo_gym.loops.tail import BestCheckpoint
from hanzo_gym.records import IGNORE_INDEX

# -- config rules ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"early_stopping_patience": 3},
            "early_stopping_patience compares eval losses: it needs a held-out set",
        ),
        ({"load_best_model_at_end": True, "val_set_size": 0.1}, "it needs `eval_steps` (or evals_per_epoch)"),
        ({"do_causal_lm_eval": True}, "do_causal_lm_eval completes held-out prompts"),
        ({"do_causal_lm_eval": True, "val_set_size": 0.1}, "`comet` is in Axolotl's default list"),
        (
            {"do_causal_lm_eval": True, "val_set_size": 0.1, "eval_causal_lm_metrics": ["bleurt"]},
            "`bleurt` is not one of sacrebleu, ter, chrf, perplexity",
        ),
        ({"eval_causal_lm_metrics": ["ter"]}, "are computed with do_causal_lm_eval: true"),
        (
            {"rl": "grpo", "trl": {"reward_funcs": ["exact_match"]}, "early_stopping_patience": 2},
            "rl: grpo evaluates rewards of greedy completions",
        ),
        (
            {
                "rl": "dpo",
                "datasets": [{"path": "d", "type": "chatml.intel"}],
                "eval_table_size": 2,
                "val_set_size": 2,
            },
            "rl: dpo (pairs) is not supported yet",
        ),
        (
            {
                "rl": "kto",
                "datasets": [{"path": "d", "type": "chatml.argilla"}],
                "micro_batch_size": 2,
                "eval_batch_size": 1,
            },
            "rl: kto needs eval_batch_size ≥ 2",
        ),
    ],
)
def test_eval_key_mistakes_are_refused_with_a_sentence(keys, message):
    assert message in refusal_of(**keys)


# -- early stopping and the best checkpoint: HF's rules ------------------------------------------------------


def hf_stop_step(values: list[float], patience: int, greater: bool) -> tuple[int | None, int | None]:
    """(the evaluation after which HF's Trainer stops, the step of its best metric) for a run evaluated at steps
    1, 2, …: HF's EarlyStoppingCallback (on_evaluate) followed by Trainer._determine_best_metric, in HF's order."""
    callback = EarlyStoppingCallback(early_stopping_patience=patience)
    name = "bench_total_accuracy" if greater else "loss"
    args = SimpleNamespace(
        metric_for_best_model=name,
        greater_is_better=greater,
        load_best_model_at_end=True,
        save_strategy="steps",
    )
    state, control = TrainerState(), TrainerControl()
    trainer = SimpleNamespace(args=args, state=state)
    for step, value in enumerate(values, start=1):
        state.global_step = step
        callback.on_evaluate(args, state, control, metrics={f"eval_{name}": value})
        Trainer._determine_best_metric(trainer, {f"eval_{name}": value}, None)
        if control.should_training_stop:
            return step, state.best_global_step
    return None, state.best_global_step


def our_stop_step(values: list[float], patience: int, greater: bool) -> tuple[int | None, int | None]:
    best = BestCheckpoint()
    for step, value in enumerate(values, start=1):
        best.evaluated(step, value, greater)
        if best.patience_count >= patience:
            return step, best.step
    return None, best.step


@pytest.mark.parametrize("greater", [False, True], ids=["eval_loss", "an accuracy"])
def test_early_stopping_stops_where_hfs_callback_does(greater):
    generator = random.Random(0)
    for _ in range(300):
        values = [round(generator.uniform(0.5, 1.5), 1) for _ in range(generator.randint(1, 12))]  # ties too
        patience = generator.randint(1, 4)
        assert our_stop_step(values, patience, greater) == hf_stop_step(values, patience, greater), (values, patience)


def test_a_best_record_saved_when_only_the_loss_was_compared_restores():
    saved = {"loss": 1.4, "step": 3, "checkpoint_step": 2, "checkpoint_loss": 1.5, "patience_count": 1}
    assert BestCheckpoint.restore(saved) == BestCheckpoint(1.4, 3, 2, 1.5, 1)


def test_checkpoint_rotation_keeps_the_best_as_hf_does(tmp_path):
    for limit in (1, 2, 3):
        for best_step in (2, 4, 8, 10):
            ours, theirs = tmp_path / f"ours-{limit}-{best_step}", tmp_path / f"hf-{limit}-{best_step}"
            run = RunDir(ours, writer=True)
            for step in range(2, 12, 2):
                run.save_checkpoint(step, 0.0, lambda d: (d / "x").write_text("x"), limit, spare=best_step)
                (theirs / f"checkpoint-{step}").mkdir(parents=True)
                rotate_checkpoints(
                    str(theirs),
                    limit,
                    best_model_checkpoint=str(theirs / f"checkpoint-{best_step}")
                    if step >= best_step
                    else None,
                )
            assert sorted(p.name for p in ours.glob("checkpoint-*")) == sorted(
                p.name for p in theirs.glob("checkpoint-*")
            ), (limit, best_step)


def _config(tmp_path, tiny_base, chat_data, **overrides) -> Path:
    keys = {"val_set_size": 4, "micro_batch_size": 2, "gradient_accumulation_steps": 1, **overrides}
    return write_tiny_run(tmp_path, tiny_base, chat_data, **keys)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _scripted_eval_losses(monkeypatch, losses: list[float]) -> None:
    """The SFT eval loss of each evaluation in turn, so the test decides when the run has stopped improving."""
    script = iter(losses)
    monkeypatch.setattr(sft, "evaluate", lambda *args, **kwargs: next(script))


def _adapter(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "adapter_model.safetensors")


def test_gym_train_stops_early_and_ends_with_the_best_saved_checkpoint(
    tmp_path, tiny_base, chat_data, monkeypatch, capsys
):
    # evaluations at step 0 (the base model), 1, 2, …: the best is step 3's, but step 2's is the best saved
    _scripted_eval_losses(monkeypatch, [3.0, 2.0, 1.5, 1.4, 1.6, 1.7, 1.45])
    path = _config(
        tmp_path,
        tiny_base,
        chat_data,
        max_steps=10,
        eval_steps=1,
        save_steps=2,
        save_total_limit=1,
        early_stopping_patience=3,
    )
    assert main(["train", str(path)]) == 0
    printed = capsys.readouterr().out
    assert (
        "step 6: eval/loss 1.4500 not below the best 1.4000 (step 3) for 3 evaluations: stopping" in printed
    )
    assert "loaded checkpoint-2 (eval/loss 1.5000, the best at a save) as the final weights" in printed
    run = tmp_path / "run"
    assert [row["step"] for row in _rows(run) if "loss" in row] == [1, 2, 3, 4, 5, 6]
    # save_total_limit 1 keeps the newest and the best, as HF's rotation does
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-6"]
    final, best, last = _adapter(run), _adapter(run / "checkpoint-2"), _adapter(run / "checkpoint-6")
    assert all(torch.equal(final[k], best[k]) for k in final)
    assert not all(torch.equal(final[k], last[k]) for k in final)
    state = json.loads((run / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["best"] == {
        "metric": 1.4,
        "step": 3,
        "checkpoint_step": 2,
        "checkpoint_metric": 1.5,
        "patience_count": 3,
    }


def test_the_steps_since_the_last_row_are_logged_when_early_stopping_ends_the_run(
    tmp_path, tiny_base, chat_data, monkeypatch
):
    _scripted_eval_losses(monkeypatch, [3.0, 2.0, 2.5, 2.6])
    keys = {"max_steps": 10, "eval_steps": 1, "logging_steps": 2, "early_stopping_patience": 2}
    assert main(["train", str(_config(tmp_path, tiny_base, chat_data, **keys))]) == 0
    rows = [row for row in _rows(tmp_path / "run") if "loss" in row]
    assert [row["step"] for row in rows] == [2, 3]  # step 3's row covers step 3 alone


def test_early_stopping_resumes_with_its_count(tmp_path, tiny_base, chat_data, monkeypatch, capsys):
    def killed_at_step_5():
        yield from [3.0, 2.0, 1.5, 1.4, 1.6]  # steps 0 to 4; checkpoint-4 holds the count 1
        raise RuntimeError("killed")

    script = killed_at_step_5()
    monkeypatch.setattr(sft, "evaluate", lambda *args, **kwargs: next(script))
    keys = {"max_steps": 10, "eval_steps": 1, "save_steps": 4, "early_stopping_patience": 3}
    with pytest.raises(RuntimeError, match="killed"):
        main(["train", str(_config(tmp_path, tiny_base, chat_data, **keys))])
    _scripted_eval_losses(monkeypatch, [1.7, 1.45])  # two more without a lower loss: the third in a row
    checkpoint = tmp_path / "run" / "checkpoint-4"
    assert (
        main(
            [
                "train",
                str(_config(tmp_path, tiny_base, chat_data, resume_from_checkpoint=str(checkpoint), **keys)),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "step 6: eval/loss 1.4500 not below the best 1.4000 (step 3) for 3 evaluations" in printed
    assert [row["step"] for row in _rows(tmp_path / "run") if "loss" in row] == [1, 2, 3, 4, 5, 6]


# -- generation metrics and the predictions table --------------------------------------------------------


def test_the_held_out_prompt_is_what_precedes_the_first_trained_token():
    example = Example([1, 2, 3, 4, 5, 6, 7], [IGNORE_INDEX, IGNORE_INDEX, 3, 4, IGNORE_INDEX, 6, 7])
    split = held_out_split(example)
    assert (split.prompt, split.reference) == ([1, 2], [3, 4])
    assert held_out_split(Example([1, 2], [1, 2])) is None  # no prompt to complete
    assert held_out_split(Example([1, 2], [IGNORE_INDEX] * 2)) is None


def test_corpus_scores_are_sacrebleus():
    hypotheses, references = ["the cat sat on the mat", "a dog"], ["the cat sat on a mat", "a dog barked"]
    scores = corpus_scores(["sacrebleu", "ter", "chrf"], hypotheses, references)
    assert scores["eval/sacrebleu"] == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [references]).score)
    assert scores["eval/ter"] == pytest.approx(sacrebleu.corpus_ter(hypotheses, [references]).score)
    assert scores["eval/chrf"] == pytest.approx(sacrebleu.corpus_chrf(hypotheses, [references]).score)
    same = corpus_scores(["sacrebleu", "ter", "chrf"], references, references)
    assert same == {
        "eval/sacrebleu": pytest.approx(100.0),
        "eval/ter": 0.0,
        "eval/chrf": pytest.approx(100.0),
    }


@pytest.fixture(scope="module")
def alpaca_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("alpaca") / "rows.jsonl"
    rows = [{"instruction": f"What is {a} plus 2?", "output": f"{a + 2}."} for a in range(12)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_gym_train_scores_and_writes_greedy_completions_of_held_out_prompts(
    tmp_path, tiny_base, alpaca_data, monkeypatch, capsys
):
    path = _config(
        tmp_path,
        tiny_base,
        alpaca_data,
        datasets=[{"path": str(alpaca_data), "type": "alpaca:phi"}],
        max_steps=2,
        eval_steps=2,
        do_causal_lm_eval=True,
        eval_max_new_tokens=6,
        eval_causal_lm_metrics=["sacrebleu", "chrf", "ter", "perplexity"],
        eval_table_size=2,
        debug=True,
    )
    assert main(["train", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "debug: the first training example:\n" in printed and "Count of labels:" in printed
    assert "(-100, " in printed  # the prompt's tokens, not trained
    run = tmp_path / "run"
    evals = [row for row in _rows(run) if "eval/loss" in row]
    assert [row["step"] for row in evals] == [0, 2]
    for row in evals:
        assert {"eval/sacrebleu", "eval/chrf", "eval/ter", "eval/perplexity"} <= row.keys()
        assert 0 <= row["eval/sacrebleu"] <= 100 and row["eval/perplexity"] > 1
    predictions = [json.loads(line) for line in (run / "eval_predictions.jsonl").read_text().splitlines()]
    assert [(p["step"], p["id"]) for p in predictions] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    for prediction in predictions:
        assert prediction["prompt"].startswith("<|system|>\nBelow is an instruction")  # alpaca:phi, decoded
        assert prediction["prompt"].endswith("<|end|>\n<|assistant|>\n")
        assert prediction["reference"].endswith(".")
        assert isinstance(prediction["prediction"], str)


def test_perplexity_is_exp_of_the_models_own_loss_on_each_reference(tmp_path, tiny_base, qwen3_tokenizer):
    """eval/perplexity against transformers: exp of the mean of the model's own next-token loss over the
    references' first eval_max_new_tokens tokens (token-weighted across references)."""
    from hanzo_gym.loops.generation_eval import reference_perplexity

    model = AutoModelForCausalLM.from_pretrained(tiny_base, dtype=torch.float32).eval()
    references = ["Seven plus two is nine.", "The answer: 4", "x"]
    window = 5
    nll, count = 0.0, 0
    for text in references:
        ids = qwen3_tokenizer.encode(text, add_special_tokens=True)[:window]
        if len(ids) < 2:
            continue
        with torch.no_grad():
            loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
        nll, count = nll + loss * (len(ids) - 1), count + len(ids) - 1
    cfg = SimpleNamespace(eval_max_new_tokens=window)
    engine = SimpleNamespace(tokenizer=qwen3_tokenizer)

    def mean_nll(examples):  # what SFT's evaluate computes, here with the plain model
        total, tokens = 0.0, 0
        for example in examples:
            ids = torch.tensor([example.input_ids])
            with torch.no_grad():
                loss = model(input_ids=ids, labels=ids).loss.item()
            total, tokens = total + loss * (len(example) - 1), tokens + len(example) - 1
        return total / tokens

    assert reference_perplexity(references, cfg, engine, mean_nll) == pytest.approx(
        math.exp(nll / count), rel=1e-6
    )


def test_sft_eval_loss_skips_the_prompts_logits_and_equals_transformers_masked_loss(
    tiny_base, qwen3_tokenizer
):
    """SFT scores from each example's first trained position (engine `scored_from`), computing no logits over
    the prompt; its mean NLL is still transformers' loss with the prompt's labels at -100."""
    from hanzo_gym.engine import Engine
    from hanzo_gym.model.lora import attach_lora

    model = AutoModelForCausalLM.from_pretrained(tiny_base, dtype=torch.float32)
    engine = Engine(
        attach_lora(model, r=4, alpha=8, dropout=0.0, target_modules="all-linear", base_model_name="tiny"),
        tokenizer=qwen3_tokenizer,
    )
    texts = [
        ("What is seven plus two?", " Nine."),
        ("Name a colour.", " Blue, or perhaps green."),
        ("Hi", " Hello"),
    ]
    examples = []
    for prompt, answer in texts:
        p, a = qwen3_tokenizer.encode(prompt), qwen3_tokenizer.encode(answer)
        examples.append(Example(input_ids=p + a, labels=[IGNORE_INDEX] * len(p) + a))
    datums = sft.batch_datums(examples, 1.0, None, False, None)
    assert sft.first_trained(datums) == [len(qwen3_tokenizer.encode(p)) - 1 for p, _ in texts]
    total, count = 0.0, 0
    base = engine.model.get_base_model().eval()
    for example in examples:
        with torch.no_grad(), engine.model.disable_adapter():
            loss = base(
                input_ids=torch.tensor([example.input_ids]), labels=torch.tensor([example.labels])
            ).loss
        total, count = total + loss.item() * example.trained_tokens, count + example.trained_tokens
    assert sft.evaluate(engine, examples, micro_batch_size=2) == pytest.approx(total / count, rel=1e-5)
