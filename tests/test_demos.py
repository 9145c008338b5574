"""The README's demos, run as they are (only output_dir moved, and the base model where the test's cache has it
converted): each learns what the README says it learns, and `make demo` is these commands."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from hanzo_gym.cli import main

pytestmark = pytest.mark.real_model
REPO = Path(__file__).resolve().parents[1]


def _run_demo(name: str, tmp_path, real, monkeypatch) -> list[dict]:
    config = yaml.safe_load((REPO / "examples" / name).read_text())
    assert config["base_model"] == ".venv/models/SmolLM2-135M-Instruct.Q4_1.gguf"  # what make demo links
    config["base_model"] = str(real.gguf)
    config["output_dir"] = str(tmp_path / "run")
    (tmp_path / name).write_text(yaml.safe_dump(config))
    monkeypatch.chdir(REPO)  # the demos name their data relative to the repository, as make demo runs them
    assert main(["train", str(tmp_path / name)]) == 0
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def _series(rows: list[dict], name: str) -> list[float]:
    return [row[name] for row in rows if name in row]


def test_make_demo_trains_the_sft_demo_then_reports_it():
    dry = subprocess.run(["make", "-n", "demo"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    commands = [line for line in dry.splitlines() if re.match(r"\S*gym ", line)]
    assert commands == [
        ".venv/bin/gym train examples/smollm2-sft.yaml",
        ".venv/bin/gym report outputs/smollm2-sft",
    ]


def test_the_sft_demo_trains_and_its_eval_loss_falls(tmp_path, real, monkeypatch, capsys):
    rows = _run_demo("smollm2-sft.yaml", tmp_path, real, monkeypatch)
    evals = _series(rows, "eval/loss")
    assert len(evals) == 4 and evals[0] > 2.0 and min(evals[1:]) < 0.2  # the README: 2.76 → 0.035–0.12
    assert main(["report", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "report.png").is_file()
    assert "SFT (lora), finished · 27 steps" in capsys.readouterr().out


def test_the_grpo_demo_raises_the_reward(tmp_path, real, monkeypatch):
    rows = _run_demo("smollm2-grpo.yaml", tmp_path, real, monkeypatch)
    accuracy = _series(rows, "eval/accuracy")
    assert accuracy[0] <= 0.7 and max(accuracy[2:]) >= 0.85  # the README: 0.55 → 0.90–0.95 from step 15


def test_the_dpo_demo_prefers_the_right_answer(tmp_path, real, monkeypatch):
    rows = _run_demo("smollm2-dpo.yaml", tmp_path, real, monkeypatch)
    accuracies, losses = _series(rows, "eval/rewards/accuracies"), _series(rows, "eval/loss")
    assert losses[0] == pytest.approx(0.693, abs=0.01)  # the adapter starts at zero: policy = reference
    assert accuracies[-1] >= 0.95 and losses[-1] < 0.45  # the README: all 20 pairs, 0.693 → 0.244


def test_the_qlora_demo_trains(tmp_path, real, monkeypatch):
    rows = _run_demo("smollm2-qlora.yaml", tmp_path, real, monkeypatch)
    evals = _series(rows, "eval/loss")
    assert evals[0] > 2.0 and min(evals[1:]) < 0.2  # the README: 2.46 (the NF4 base) → 0.034
