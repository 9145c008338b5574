"""tinker-cookbook 0.6.1's own recipes `sl_loop` and `rl_loop`, unmodified, against `gym serve --tinker` on the
real SmolLM2-135M-Instruct, each in a subprocess as a user runs them (TINKER_BASE_URL, a tml- key, offline).

The cookbook picks its renderer from a registry name and loads its tokenizer from a folder of that name when
one exists, so the model is served as `meta-llama/Llama-3.2-1B` (renderer role_colon) from a folder linked
under that name. The recipes' hub datasets (no_robots, gsm8k) are replaced by small local ones: the recipes
look `datasets.load_dataset` up when they run, so the driver swaps that one attribute before calling
`chz.nested_entrypoint(recipe.main, argv=…)`, as `python -m tinker_cookbook.recipes.…` does."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tinker_serve import start_gym_serve, stop

pytestmark = pytest.mark.real_model

# A cookbook registry name whose renderer, role_colon, fits any tokenizer.
SERVED_NAME = "meta-llama/Llama-3.2-1B"
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."  # rl_loop's question suffix
DRIVER = """
import importlib, json, os, sys
import chz, datasets
recipe, data, *argv = sys.argv[1:]
rows = datasets.Dataset.from_list([json.loads(line) for line in open(data)])
splits = os.environ.get("RECIPE_SPLITS", "train").split(",")
datasets.load_dataset = lambda *args, **kwargs: datasets.DatasetDict({split: rows for split in splits})
entry = getattr(importlib.import_module(f"tinker_cookbook.recipes.{recipe}"), os.environ.get("RECIPE_ENTRY", "main"))
chz.nested_entrypoint(entry, argv=argv)
"""
# sl_loop: 48 dialogues in batches of 8 = 6 steps, a state checkpoint at step 4 and the final one.
SL_ARGS = ["batch_size=8", "lora_rank=8", "learning_rate=1e-3", "save_every=4"]
# rl_loop: 2 batches of 3 questions × 6 samples; the hosted-only default loss replaced by importance_sampling.
RL_ARGS = ["batch_size=3", "group_size=6", "max_tokens=24", "max_steps=2", "save_every=0"]
RL_ARGS += ["learning_rate=1e-4", "loss_fn=importance_sampling"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def cookbook(converted_real_model, tmp_path_factory):
    """`gym serve --tinker --model meta-llama/Llama-3.2-1B`, run where that folder links to SmolLM2, and the
    recipes' datasets: one-sum addition dialogues in the shape of rl_loop's questions."""
    work = tmp_path_factory.mktemp("cookbook")
    # The cookbook's tokenizer loads from this folder and the server its model: both by the registry name.
    (work / "meta-llama").mkdir()
    (work / SERVED_NAME).symlink_to(converted_real_model.model_dir, target_is_directory=True)
    sums = [(a, b) for a in range(1, 9) for b in range(1, 7)]
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"What is {a} + {b}?{SUFFIX}"},
                {"role": "assistant", "content": f"{a} + {b} = {a + b}. \\boxed{{{a + b}}}"},
            ]
        }
        for a, b in sums
    ]
    questions = [
        {"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
        for a, b in random.Random(0).sample(sums, 12)
    ]
    # The DPO recipe's hh-rlhf rows: the same dialogue ending in the right sum (chosen) or a wrong one.
    pairs = [
        {
            "chosen": f"\n\nHuman: What is {a} + {b}?\n\nAssistant: {a} + {b} = {a + b}.",
            "rejected": f"\n\nHuman: What is {a} + {b}?\n\nAssistant: {a} + {b} = {a + b + 3}.",
        }
        for a, b in sums[:24]
    ]
    started = time.monotonic()
    process, url = start_gym_serve(SERVED_NAME, work / "runs", cwd=work)
    print(f"\ngym serve --tinker: up in {time.monotonic() - started:.0f} s")
    try:
        yield SimpleNamespace(
            work=work,
            url=url,
            chats=write_jsonl(work / "chats.jsonl", chats),
            questions=write_jsonl(work / "questions.jsonl", questions),
            pairs=write_jsonl(work / "pairs.jsonl", pairs),
        )
    finally:
        stop(process)


def run_recipe(
    cookbook,
    recipe: str,
    data: Path,
    log_path: Path,
    args: list[str],
    entry: str = "main",
    splits: str = "train",
) -> str:
    """The recipe's console output (`entry`: its function that `python -m` calls; `splits`: the dataset splits
    its load_dataset returns, each the local rows); a failed run fails the test with its tail."""
    env = {
        **os.environ,
        "RECIPE_ENTRY": entry,
        "RECIPE_SPLITS": splits,
        "TINKER_BASE_URL": cookbook.url,
        "TINKER_API_KEY": "tml-dummy",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    argv = [f"model_name={SERVED_NAME}", f"log_path={log_path}", *args]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, recipe, str(data), *argv],
        check=False,
        cwd=cookbook.work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = done.stdout + done.stderr
    print(f"\n{recipe} ({log_path.name}): {time.monotonic() - started:.0f} s")
    assert done.returncode == 0, output[-6000:]
    return output


@pytest.fixture(scope="module")
def sl_run(cookbook) -> Path:
    log_path = cookbook.work / "sl"
    run_recipe(cookbook, "sl_loop", cookbook.chats, log_path, SL_ARGS)
    return log_path


def test_sl_loop_trains_and_a_rerun_resumes_from_its_checkpoint(cookbook, sl_run):
    metrics = read_jsonl(sl_run / "metrics.jsonl")
    nll = [row["train_mean_nll"] for row in metrics]
    assert [row["step"] for row in metrics] == list(range(6))
    print(f"\nsl_loop train_mean_nll by step: {' '.join(f'{x:.3f}' for x in nll)}")
    assert all(math.isfinite(row["grad_norm"]) for row in metrics)
    assert nll[-1] < 0.5 * nll[0]
    checkpoints = read_jsonl(sl_run / "checkpoints.jsonl")
    assert [(row["name"], row["batch"]) for row in checkpoints] == [("000004", 4), ("final", 6)]
    assert checkpoints[-1]["sampler_path"].startswith("tinker://")

    # A run stopped after its step-4 checkpoint (its log cut there), then started again with the same
    # log_path: it loads that state with its optimizer and trains batches 4 and 5 as the whole run did.
    stopped = cookbook.work / "sl-stopped"
    stopped.mkdir()
    (stopped / "checkpoints.jsonl").write_text(json.dumps(checkpoints[0]) + "\n")
    (stopped / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in metrics[:4]))
    output = run_recipe(cookbook, "sl_loop", cookbook.chats, stopped, SL_ARGS)
    assert "Resuming from batch 4" in output
    resumed = read_jsonl(stopped / "metrics.jsonl")[4:]
    assert [row["step"] for row in resumed] == [4, 5]
    np.testing.assert_allclose([row["train_mean_nll"] for row in resumed], nll[4:], rtol=1e-4)
    assert read_jsonl(stopped / "checkpoints.jsonl")[-1]["name"] == "final"


def test_rl_loop_trains_from_the_sl_state(cookbook, sl_run):
    """Untrained, SmolLM2-135M seldom answers in \\boxed{}: most groups' rewards are all 0, and the recipe skips
    a batch whose groups all have equal rewards. The sl_loop state answers some, so rl_loop starts from it, the
    way it resumes: a checkpoints.jsonl row in its log_path."""
    final = read_jsonl(sl_run / "checkpoints.jsonl")[-1]
    log_path = cookbook.work / "rl"
    log_path.mkdir()
    row = {"name": "from-sl-loop", "batch": 0, "state_path": final["state_path"]}
    (log_path / "checkpoints.jsonl").write_text(json.dumps(row) + "\n")

    output = run_recipe(cookbook, "rl_loop", cookbook.questions, log_path, RL_ARGS)
    assert "Resuming from batch 0" in output
    metrics = read_jsonl(log_path / "metrics.jsonl")
    assert [row["step"] for row in metrics] == [0, 1]
    rewards = [row["reward/total"] for row in metrics]
    norms = [row.get("grad_norm") for row in metrics]
    print(f"\nrl_loop reward/total by batch: {' '.join(f'{r:.2f}' for r in rewards)}; grad_norm: {norms}")
    assert all(0.0 <= reward <= 1.0 for reward in rewards)
    # A batch whose groups all got equal rewards is skipped by the recipe (no grad_norm); the others trained.
    trained = [row for row in metrics if "grad_norm" in row]
    assert trained and all(math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0 for row in trained)
    assert read_jsonl(log_path / "checkpoints.jsonl")[-1]["name"] == "final"


def test_the_dpo_recipe_trains_through_forward_backward_custom(cookbook):
    """recipes.preference.dpo.train (its hh-rlhf dataset replaced by 24 local pairs): the reference is a
    sampling client of the starting weights, the loss a Python function over forward_backward_custom's
    logprobs. At the first step policy and reference are the same weights, so the loss is ln 2 exactly as far
    as the server's training forward and its compute_logprobs agree; then the chosen answers pull ahead."""
    log_path = cookbook.work / "dpo"
    args = ["dataset=hhh", "batch_size=8", "learning_rate=1e-3", "dpo_beta=0.5", "max_length=256"]
    run_recipe(cookbook, "preference.dpo.train", cookbook.pairs, log_path, args, "cli_main", "train,test")
    metrics = [row for row in read_jsonl(log_path / "metrics.jsonl") if "dpo_loss" in row]
    losses = [row["dpo_loss"] for row in metrics]
    print(f"\ndpo recipe dpo_loss by step: {' '.join(f'{x:.4f}' for x in losses)}")
    assert [row["step"] for row in metrics] == [0, 1, 2] and all(row["num_pairs"] == 8 for row in metrics)
    assert abs(losses[0] - math.log(2)) < 1e-4 and abs(metrics[0]["margin"]) < 1e-3
    assert losses[-1] < losses[0] - 0.05 and metrics[-1]["margin"] > 0 and metrics[-1]["accuracy"] > 0.5
    assert read_jsonl(log_path / "checkpoints.jsonl")[-1]["name"] == "final"
