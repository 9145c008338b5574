"""`gym report`: the summary says where each metric went, the picture has a chart per metric with every run on it,
and a folder that is not a run gets one line."""

from __future__ import annotations

import json

import pytest
from matplotlib import image
from PIL import Image
from test_train import _config

from hanzo_gym.cli import main
from hanzo_gym.cli.report import RunRecord, chart_names, report, summary
from hanzo_gym.errors import GymError


def _run(directory, rows, config=None, finished=True, checkpoints=()):
    directory.mkdir(parents=True)
    lines = [json.dumps(row) for row in rows]
    (directory / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (directory / "run_config.json").write_text(json.dumps(config or {"adapter": "lora", "rl": None}))
    if checkpoints:
        records = [json.dumps({"name": name, "step": int(name.split("-")[1])}) for name in checkpoints]
        (directory / "checkpoints.jsonl").write_text("\n".join(records) + "\n")
    if finished:
        (directory / "adapter_config.json").write_text("{}")
    return directory


def _sft_rows(losses, evals):
    rows = [
        {
            "step": step,
            "loss": loss,
            "lr": 2e-4 * step / len(losses),
            "grad_norm": 1.0 / step,
            "tokens_per_s": 300 + step,
            "elapsed_s": 10.0 * step,
        }
        for step, loss in enumerate(losses, start=1)
    ]
    rows += [{"step": step, "eval/loss": value, "elapsed_s": 10.0 * step} for step, value in evals]
    return sorted(rows, key=lambda row: row["step"])


def test_the_summary_says_where_each_metric_went_and_how_the_run_ended(tmp_path):
    rows = _sft_rows([2.5, 2.0, 1.5, 1.25], [(0, 2.6), (2, 1.9), (4, 1.95)])
    run = RunRecord.read(_run(tmp_path / "sft", rows, checkpoints=["checkpoint-2", "checkpoint-4"]))
    assert summary(run) == [
        f"{tmp_path / 'sft'}: SFT (lora), finished · 4 steps · 40 s",
        "  loss 2.5 → 1.25 (step 1 → 4)",
        "  eval/loss 2.6 → 1.95 (step 0 → 4), best 1.9 at step 2",
        "  lr peak 2.00e-04, last 2.00e-04 · grad_norm last 0.25 · tokens/s median 302",
        "  checkpoints: checkpoint-2, checkpoint-4",
    ]
    stopped = RunRecord.read(_run(tmp_path / "cut", rows[:3], finished=False, checkpoints=["checkpoint-2"]))
    assert summary(stopped)[0].endswith("SFT (lora), stopped; checkpoint-2 continues it · 2 steps · 20 s")
    grpo = RunRecord.read(
        _run(
            tmp_path / "grpo",
            [{"step": s, "reward": r, "elapsed_s": 70.0 * s} for s, r in ((1, 0.25), (2, 0.75))],
            config={"rl": "grpo", "adapter": None},
        )
    )
    assert summary(grpo) == [
        f"{tmp_path / 'grpo'}: GRPO (full fine-tuning), finished · 2 steps · 2 min 20 s",
        "  reward 0.25 → 0.75 (step 1 → 2)",
    ]


def test_each_logged_metric_gets_a_chart_and_every_run_shares_it(tmp_path):
    sft = RunRecord.read(_run(tmp_path / "a", _sft_rows([2.0, 1.0], [(2, 1.5)])))
    bench = _sft_rows([2.0, 1.5, 1.0], [])
    bench.append({"step": 3, "eval/bench_total_accuracy": 0.5, "eval/loss": 1.2})
    other = RunRecord.read(_run(tmp_path / "b", bench))
    assert [title for title, _ in chart_names([sft, other])] == [
        "loss",
        "learning rate",
        "grad_norm",
        "tokens/s",
        "eval/bench_total_accuracy",
    ]
    out = report([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "pictures" / "both.png"))
    assert out == tmp_path / "pictures" / "both.png" and not list(out.parent.glob(".*"))
    with Image.open(out) as picture:
        assert picture.format == "PNG" and picture.size == (1500, 640)  # 3 charts a row, 2 rows, at 100 dpi
    # the charts are drawn: the picture is not one colour (an empty figure would be white)
    pixels = image.imread(out)
    assert pixels.std() > 0.05


def test_one_run_draws_into_its_own_folder(tmp_path, capsys):
    run = _run(tmp_path / "sft", _sft_rows([2.0, 1.0], []))
    assert report([str(run)]) == run / "report.png"
    assert (run / "report.png").is_file()
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {run / 'report.png'}"


def test_a_torn_last_line_from_a_crash_is_left_out(tmp_path):
    run = _run(tmp_path / "sft", _sft_rows([2.0, 1.0], []), finished=False)
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 3, "loss": 0.')
    assert RunRecord.read(run).series("loss") == ([1, 2], [2.0, 1.0])


def test_a_folder_that_is_not_a_run_is_one_line(tmp_path, capsys):
    with pytest.raises(GymError, match=r"does not exist: give the output_dir of a `gym train` run"):
        RunRecord.read(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(GymError, match="has no metrics.jsonl"):
        RunRecord.read(tmp_path / "empty")
    _run(tmp_path / "new", [{"step": 0, "note": "starting"}])
    with pytest.raises(GymError, match="holds no numbers to draw yet"):
        report([str(tmp_path / "new")])


def test_gym_report_on_a_trained_run(tmp_path, tiny_base, chat_data, capsys):
    path, _ = _config(tmp_path, tiny_base, chat_data, max_steps=4, eval_steps=2, save_steps=None)
    assert main(["train", str(path)]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert out[0].startswith(f"{tmp_path / 'run'}: SFT (lora), finished · 4 steps")
    assert out[1] == f"  loss {losses[0]:.4g} → {losses[-1]:.4g} (step 1 → 4)"
    assert out[2].startswith("  eval/loss ") and out[-1] == f"wrote {tmp_path / 'run' / 'report.png'}"
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert (
        capsys.readouterr().err
        == f"error: {tmp_path / 'missing'} does not exist: give the output_dir of a `gym train` run\n"
    )
