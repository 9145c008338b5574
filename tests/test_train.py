"""End-to-end `gym train` / `gym merge` on a tiny random Qwen3 model that uses the real Qwen3 tokenizer."""

import json
import math

import pytest
import torch
import yaml
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM

from hanzo_gym.cli import main
from hanzo_gym.engine import Engine
from hanzo_gym.loops import checkpoint as checkpoint_module
from hanzo_gym.loops.run_dir import RunDir
from hanzo_gym.model.load_plan import LoadPlan
from hanzo_gym.records import Datum, ModelInput


def _config(tmp_path, tiny_base, chat_data, **overrides):
    cfg = {
        "base_model": str(tiny_base),
        "datasets": [{"path": str(chat_data), "type": "chat_template"}],
        "val_set_size": 0.1,
        "output_dir": str(tmp_path / "run"),
        "sequence_len": 64,
        "adapter": "lora",
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.1,
        "lora_target_linear": True,
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "num_epochs": 2,
        "learning_rate": 5e-3,
        "warmup_steps": 1,
        "logging_steps": 1,
        "save_steps": 3,
        "seed": 7,
    }
    cfg.update(overrides)
    path = tmp_path / f"run-{len(list(tmp_path.glob('*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def _train_losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def test_gym_train_writes_the_run_directory_and_learns(tmp_path, tiny_base, chat_data, capsys):
    path, _ = _config(tmp_path, tiny_base, chat_data)
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    printed = capsys.readouterr().out
    assert "step 1/" in printed and "eval/loss" in printed

    resolved = json.loads((run / "run_config.json").read_text())
    assert resolved["lora_r"] == 4 and resolved["lr_scheduler"] == "cosine"  # defaults filled in

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    # 40 rows → 36 train → 9 micro-batches of 4 → 5 windows of 2 per epoch, 2 epochs
    assert [r["step"] for r in train_rows] == list(range(1, 11))
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"):
        assert key in train_rows[0]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 5, 10]  # before training, then once per epoch
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]

    records = [json.loads(line) for line in (run / "checkpoints.jsonl").read_text().splitlines()]
    assert [(r["name"], r["step"]) for r in records] == [
        ("checkpoint-3", 3),
        ("checkpoint-6", 6),
        ("checkpoint-9", 9),
    ]
    for record in records:
        assert (run / record["name"] / "adapter_model.safetensors").is_file()
    assert (run / "adapter_config.json").is_file() and (run / "adapter_model.safetensors").is_file()
    assert not [p for p in run.iterdir() if p.name.startswith(".")]


def test_adapter_loads_in_peft_with_the_same_logits_and_merge_matches(tmp_path, tiny_base, chat_data):
    path, _ = _config(tmp_path, tiny_base, chat_data, max_steps=3, save_steps=None)
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    config = json.loads((run / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["bias"] == "none"
    assert set(config["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }

    tokens = torch.tensor([[9707, 11, 1879, 0, 42, 77, 5]])
    base = AutoModelForCausalLM.from_pretrained(tiny_base)
    with torch.no_grad():
        base_logits = base(tokens).logits
    adapted = PeftModel.from_pretrained(base, str(run)).eval()
    with torch.no_grad():
        adapted_logits = adapted(tokens).logits
    assert not torch.allclose(adapted_logits, base_logits, atol=1e-4)  # the adapter did something

    # peft's model scores exactly as our engine does with the adapter it trained
    ids = tokens[0].tolist()
    trainable = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_base), str(run), is_trainable=True
    )
    ours = Engine(trainable).forward([Datum(ModelInput.from_ints(ids[:-1]), {"target_tokens": ids[1:]})])[0]
    theirs = adapted_logits[0, :-1].log_softmax(-1).gather(1, tokens[0, 1:, None]).squeeze(1)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)

    assert main(["merge", str(path), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, adapted_logits, rtol=1e-4, atol=1e-5)
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()


def test_resume_gives_the_losses_of_an_uninterrupted_run(tmp_path, tiny_base, chat_data):
    path, _ = _config(tmp_path, tiny_base, chat_data)
    assert main(["train", str(path)]) == 0
    uninterrupted = _train_losses(tmp_path / "run")

    resumed_path, _ = _config(
        tmp_path,
        tiny_base,
        chat_data,
        output_dir=str(tmp_path / "resumed"),
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-6"),  # mid-epoch-2 window boundary
    )
    assert main(["train", str(resumed_path)]) == 0
    resumed = _train_losses(tmp_path / "resumed")
    assert sorted(resumed) == [7, 8, 9, 10]
    for step in resumed:
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-6, abs=1e-7), step


def test_crash_while_writing_a_checkpoint_leaves_only_trusted_ones(
    tmp_path, tiny_base, chat_data, monkeypatch
):
    path, _ = _config(tmp_path, tiny_base, chat_data, resume_from_checkpoint=True)
    real_write = checkpoint_module.write_checkpoint
    calls = []

    def write_then_die(directory, engine, position):
        calls.append(position.step)
        if len(calls) == 2:
            (directory / "adapter_model.safetensors").write_bytes(b"half")
            raise KeyboardInterrupt  # the process is killed mid-write
        real_write(directory, engine, position)

    monkeypatch.setattr("hanzo_gym.loops.tail.write_checkpoint", write_then_die)
    assert main(["train", str(path)]) == 130
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-3"]
    assert not [p for p in run.iterdir() if p.name.startswith(".")]

    monkeypatch.setattr("hanzo_gym.loops.tail.write_checkpoint", real_write)
    assert main(["train", str(path)]) == 0  # resume_from_checkpoint: true picks checkpoint-3
    assert sorted(_train_losses(run)) == list(range(1, 11))
    assert (run / "checkpoint-9").is_dir()


def test_gradient_checkpointing_and_packing_train(tmp_path, tiny_base, chat_data):
    plain, _ = _config(tmp_path, tiny_base, chat_data, max_steps=2, lora_dropout=0.0, save_steps=None)
    assert main(["train", str(plain)]) == 0
    checkpointed, _ = _config(
        tmp_path,
        tiny_base,
        chat_data,
        max_steps=2,
        lora_dropout=0.0,
        save_steps=None,
        gradient_checkpointing=True,
        output_dir=str(tmp_path / "gc"),
    )
    assert main(["train", str(checkpointed)]) == 0
    a, b = _train_losses(tmp_path / "run"), _train_losses(tmp_path / "gc")
    assert a == pytest.approx(b, rel=1e-5)

    packed, _ = _config(
        tmp_path,
        tiny_base,
        chat_data,
        max_steps=2,
        save_steps=None,
        sample_packing=True,
        micro_batch_size=1,
        output_dir=str(tmp_path / "packed"),
    )
    assert main(["train", str(packed)]) == 0
    rows = [json.loads(x) for x in (tmp_path / "packed" / "metrics.jsonl").read_text().splitlines()]
    first_step = next(row for row in rows if "tokens" in row)
    # a step is 2 packed rows of at most 64 tokens, each holding several ~20-token examples
    assert 64 < first_step["tokens"] <= 128


def test_cli_errors_are_one_line_without_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "base_model: x\noutput_dir: o\nadapter: lora\nlora_target_linear: true\nlearning_rat: 1\n"
        "datasets: [{path: d.jsonl, type: alpaca}]\n"
    )
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: ")
        and "bad.yaml:5" in err
        and "learning_rate" in err
        and "Traceback" not in err
    )


@pytest.mark.real_model
def test_real_smollm2_from_gguf_lowers_held_out_loss(tmp_path, real):
    path, _ = _config(
        tmp_path,
        real.gguf,
        "examples/addition.jsonl",
        val_set_size=8,
        sequence_len=128,
        lora_r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        micro_batch_size=4,
        gradient_accumulation_steps=1,
        max_steps=4,
        learning_rate=1e-3,
        save_steps=None,
    )
    assert main(["train", str(path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval/loss"] for row in rows if "eval/loss" in row]
    assert len(evals) == 2 and evals[1] < 0.7 * evals[0]
    assert json.loads((tmp_path / "run" / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ] == str(real.gguf)


def test_a_new_run_in_an_old_output_dir_starts_clean(tmp_path, tiny_base, chat_data, capsys):
    first, _ = _config(tmp_path, tiny_base, chat_data, max_steps=4, save_steps=2)
    assert main(["train", str(first)]) == 0
    second, _ = _config(tmp_path, tiny_base, chat_data, max_steps=3, save_steps=None)
    assert main(["train", str(second)]) == 0
    printed = capsys.readouterr().out
    assert "the previous run's run_config.json, metrics.jsonl, checkpoints.jsonl" in printed
    assert "this run replaced the previous run's" in printed
    run = tmp_path / "run"
    assert sorted(_train_losses(run)) == [1, 2, 3]
    assert not list(run.glob("checkpoint-*")) and not (run / "checkpoints.jsonl").exists()
    assert json.loads((run / "run_config.json").read_text())["max_steps"] == 3
    assert (run / "adapter_config.json").is_file() and not [p for p in run.iterdir() if p.name[0] == "."]


def test_resume_refuses_other_adapter_settings(tmp_path, tiny_base, chat_data, capsys):
    path, _ = _config(tmp_path, tiny_base, chat_data, max_steps=3, save_steps=3)
    assert main(["train", str(path)]) == 0
    other, _ = _config(
        tmp_path,
        tiny_base,
        chat_data,
        lora_r=8,
        output_dir=str(tmp_path / "other"),
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"),
    )
    assert main(["train", str(other)]) == 2
    err = capsys.readouterr().err
    assert "lora_r: 4 → 8" in err and "Traceback" not in err


def test_logged_rows_after_resume_match_with_logging_windows(tmp_path, tiny_base, chat_data):
    path, _ = _config(tmp_path, tiny_base, chat_data, logging_steps=2, save_steps=3, max_steps=6)
    assert main(["train", str(path)]) == 0
    resumed, _ = _config(
        tmp_path,
        tiny_base,
        chat_data,
        logging_steps=2,
        save_steps=3,
        max_steps=6,
        output_dir=str(tmp_path / "resumed"),
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"),
    )
    assert main(["train", str(resumed)]) == 0
    straight, again = _train_losses(tmp_path / "run"), _train_losses(tmp_path / "resumed")
    assert sorted(again) == [4, 6]  # step 4's row averages steps 3 and 4, as in the straight run
    for step in again:
        assert again[step] == pytest.approx(straight[step], rel=1e-6)


def test_holding_out_everything_is_named(tmp_path, tiny_base, chat_data, capsys):
    path, _ = _config(tmp_path, tiny_base, chat_data, val_set_size=1.0)
    assert main(["train", str(path)]) == 2
    assert "val_set_size 1.0 holds out all 40 examples" in capsys.readouterr().err


def test_gradient_checkpointing_is_really_on(tmp_path, tiny_base, chat_data):
    from hanzo_gym.config import load_config
    from hanzo_gym.loops.train import build_engine

    path, _ = _config(tmp_path, tiny_base, chat_data, gradient_checkpointing=True)
    cfg = load_config(path)
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32))
    assert engine.model.get_base_model().is_gradient_checkpointing


def test_rslora_scales_by_the_root_of_the_rank_and_serves_as_trained(tmp_path, tiny_base, chat_data, capsys):
    """`peft_use_rslora`: the LoRA path is scaled alpha / sqrt(r); adapter_config.json says so, so PEFT (and
    what reads PEFT's files) scores the adapter as our engine trained it; resuming without it is refused."""
    path, _ = _config(
        tmp_path,
        tiny_base,
        chat_data,
        max_steps=3,
        save_steps=3,
        lora_r=16,
        lora_alpha=8,
        peft_use_rslora=True,
    )
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    assert json.loads((run / "adapter_config.json").read_text())["use_rslora"] is True
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_base), str(run)).eval()
    scalings = {m.scaling["default"] for m in adapted.modules() if isinstance(m, LoraLayer)}
    assert scalings == {8 / 16**0.5}  # 2.0 (exactly: sqrt(16) is 4), where plain LoRA would scale by 0.5

    tokens = torch.tensor([[9707, 11, 1879, 0, 42, 77, 5]])
    with torch.no_grad():
        theirs = adapted(tokens).logits[0, :-1].log_softmax(-1).gather(1, tokens[0, 1:, None]).squeeze(1)
    trainable = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_base), str(run), is_trainable=True
    )
    ids = tokens[0].tolist()
    ours = Engine(trainable).forward([Datum(ModelInput.from_ints(ids[:-1]), {"target_tokens": ids[1:]})])[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)

    plain, _ = _config(
        tmp_path,
        tiny_base,
        chat_data,
        lora_r=16,
        lora_alpha=8,
        output_dir=str(tmp_path / "plain"),
        resume_from_checkpoint=str(run / "checkpoint-3"),
    )
    assert main(["train", str(plain)]) == 2
    assert "peft_use_rslora: True → False" in capsys.readouterr().err


def test_per_epoch_cadences_and_the_checkpoint_limit_follow_axolotl_and_hf(
    tmp_path, tiny_base, chat_data, capsys
):
    """evals_per_epoch / saves_per_epoch become HF's ceil(total / (count × epochs)) steps; save_total_limit
    keeps the newest checkpoints (folders and records) and the newest is the one a resume takes."""
    path, _ = _config(
        tmp_path,
        tiny_base,
        chat_data,
        evals_per_epoch=2,
        saves_per_epoch=2,
        save_steps=None,
        save_total_limit=2,
    )
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    total = max(row["step"] for row in rows)
    every = math.ceil(total / (2 * 2))
    assert every < total // 2  # a cadence inside each epoch, not just its end
    evals = {row["step"] for row in rows if "eval/loss" in row}
    assert evals == {0, *range(every, total + 1, every), total // 2, total}
    saved = list(range(every, total + 1, every))
    assert capsys.readouterr().out.count("saved ") == len(saved)
    newest = [f"checkpoint-{step}" for step in saved[-2:]]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == sorted(newest)
    records = [json.loads(line)["name"] for line in (run / "checkpoints.jsonl").read_text().splitlines()]
    assert records == newest
    assert RunDir(run).latest_checkpoint() == run / newest[-1]


def _ctrl_c_at_step(step: int, config, monkeypatch) -> None:
    """`gym train config` as when Ctrl-C comes during optimizer step `step`; optim_step is itself again after."""
    real_step = Engine.optim_step
    steps = []

    def step_then_ctrl_c(self, adam):
        steps.append(1)
        if len(steps) == step:
            raise KeyboardInterrupt
        return real_step(self, adam)

    monkeypatch.setattr(Engine, "optim_step", step_then_ctrl_c)
    try:
        assert main(["train", str(config)]) == 130
    finally:
        monkeypatch.setattr(Engine, "optim_step", real_step)


@pytest.mark.slow  # a whole `gym train` run or two: CI's slow tier
def test_ctrl_c_says_how_to_continue_and_the_re_run_that_asks_continues(
    tmp_path, tiny_base, chat_data, monkeypatch, capsys
):
    path, _ = _config(tmp_path, tiny_base, chat_data, max_steps=8)
    _ctrl_c_at_step(5, path, monkeypatch)
    out = capsys.readouterr().out
    checkpoint = tmp_path / "run" / "checkpoint-3"
    assert f"{checkpoint} holds the run up to its step: run the same command to continue from there" in out
    assert main(["train", str(path)]) == 0  # the same command, the same config: it continues
    out = capsys.readouterr().out
    assert f"{tmp_path / 'run'} holds this config's interrupted run: continuing it from checkpoint-3" in out
    assert f"resumed from {checkpoint} at step 3" in out
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged if "loss" in row] == [1, 2, 3, 4, 5, 6, 7, 8]
    uninterrupted, _ = _config(
        tmp_path, tiny_base, chat_data, max_steps=8, output_dir=str(tmp_path / "whole")
    )
    assert main(["train", str(uninterrupted)]) == 0
    assert _train_losses(tmp_path / "run") == pytest.approx(_train_losses(tmp_path / "whole"), rel=1e-6)


@pytest.mark.slow  # whole `gym train` runs: CI's slow tier
def test_a_re_run_with_another_config_or_asked_to_starts_over_and_says_so(
    tmp_path, tiny_base, chat_data, monkeypatch, capsys
):
    path, _ = _config(tmp_path, tiny_base, chat_data, max_steps=8)
    _ctrl_c_at_step(5, path, monkeypatch)
    capsys.readouterr()
    other, _ = _config(tmp_path, tiny_base, chat_data, max_steps=4, save_steps=None, learning_rate=2e-4)
    assert main(["train", str(other)]) == 0
    out = capsys.readouterr().out
    assert "holds an interrupted run with another config (learning_rate, max_steps, save_steps differ)" in out
    assert "its checkpoint-3 stays until this run has its first checkpoint" in out
    assert sorted(_train_losses(tmp_path / "run")) == [1, 2, 3, 4]
    # finished now: the same config again starts over, as any re-run of a finished run does
    assert main(["train", str(other)]) == 0
    assert "continuing" not in capsys.readouterr().out
    # asked to start over: resume_from_checkpoint: false
    _ctrl_c_at_step(5, path, monkeypatch)
    capsys.readouterr()
    fresh, _ = _config(tmp_path, tiny_base, chat_data, max_steps=8, resume_from_checkpoint=False)
    assert main(["train", str(fresh)]) == 0
    out = capsys.readouterr().out
    assert "continuing" not in out and "resumed from" not in out
    assert sorted(_train_losses(tmp_path / "run")) == list(range(1, 9))


def test_a_bad_row_fails_before_the_model_loads(tmp_path, tiny_base, chat_data, monkeypatch, capsys):
    rows = chat_data.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([*rows[:5], '{"messages": "oops"}', *rows[5:]]) + "\n")
    path, _ = _config(tmp_path, tiny_base, chat_data, datasets=[{"path": str(bad), "type": "chat_template"}])

    def no_model_load(plan):
        raise AssertionError("the model loaded before the data was checked")

    monkeypatch.setattr("hanzo_gym.loops.train.load_base", no_model_load)
    assert main(["train", str(path)]) == 2
    out, err = capsys.readouterr()
    assert err == f"error: {bad} row 6: row has no `messages` list (field_messages = `messages`)\n"
    assert "loading" not in out


@pytest.mark.slow  # whole `gym train` runs and a second process: CI's slow tier
def test_a_second_run_on_a_busy_output_dir_fails_at_once_naming_the_first(
    tmp_path, tiny_base, chat_data, capsys
):
    import signal
    import subprocess
    import sys
    import time

    path, cfg = _config(tmp_path, tiny_base, chat_data, max_steps=2, save_steps=None)
    holder = subprocess.Popen(  # what a first `gym train` on the same output_dir does while it runs
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from pathlib import Path; from hanzo_gym.files import held_exclusively\n"
                "with held_exclusively(Path(sys.argv[1]), 'gym train'):\n"
                "    print('held', flush=True); time.sleep(120)"
            ),
            cfg["output_dir"],
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        started = time.monotonic()
        assert main(["train", str(path)]) == 2
        assert time.monotonic() - started < 3  # before the model loads
        err = capsys.readouterr().err
        assert err == (
            f"error: {cfg['output_dir']} is in use by another gym train (process {holder.pid}): wait for it to "
            "finish, or give this run another output_dir\n"
        )
    finally:
        holder.send_signal(signal.SIGKILL)  # killed, not finished: the OS lets go of its lock all the same
        holder.wait()
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    assert (run / "adapter_config.json").is_file()
    assert not (run / ".gym-train.pid").exists()  # a finished run leaves nothing of its hold


def _small_disk(directory, size: int) -> bool:
    """A tmpfs of `size` bytes at `directory` (True), where this process may mount one (root, as in CI)."""
    import subprocess

    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
        check=False,
        capture_output=True,
    )
    return mounted.returncode == 0


@pytest.mark.slow  # whole `gym train` runs and a second process: CI's slow tier
def test_a_full_disk_is_one_line_and_the_last_checkpoint_still_resumes(
    tmp_path, tiny_base, chat_data, monkeypatch, capsys
):
    import errno
    import subprocess

    sized, _ = _config(
        tmp_path, tiny_base, chat_data, max_steps=2, save_steps=1, output_dir=str(tmp_path / "sized")
    )
    assert main(["train", str(sized)]) == 0
    checkpoint = sum(f.stat().st_size for f in (tmp_path / "sized" / "checkpoint-1").iterdir())
    disk = tmp_path / "disk"
    path, _ = _config(tmp_path, tiny_base, chat_data, max_steps=4, save_steps=1, output_dir=str(disk / "run"))
    real = _small_disk(
        disk, int(1.6 * checkpoint) + 64 * 1024
    )  # room for checkpoint-1, not checkpoint-2 beside it
    if not real:  # no tmpfs to be had: the second checkpoint's write finds the disk full all the same
        from hanzo_gym.loops import tail

        writes = []

        def write_until_full(directory, engine, position):
            writes.append(position.step)
            if len(writes) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            real_write(directory, engine, position)

        real_write = tail.write_checkpoint
        monkeypatch.setattr(tail, "write_checkpoint", write_until_full)
    capsys.readouterr()
    try:
        assert main(["train", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            f"error: no space left on the disk of {disk / 'run'} while writing checkpoint-2 (about "
        )
        assert err.endswith(
            "checkpoint-1 is intact: free some space and run the same command to continue from it\n"
        )
        assert err.count("\n") == 1  # one line, no traceback
        assert sorted(p.name for p in (disk / "run").iterdir() if p.name.startswith("checkpoint-")) == [
            "checkpoint-1"
        ]
        if real:
            subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)  # space freed
        else:
            monkeypatch.setattr(tail, "write_checkpoint", real_write)
        assert main(["train", str(path)]) == 0  # the same command continues from checkpoint-1
        assert "continuing it from checkpoint-1" in capsys.readouterr().out
        assert sorted(_train_losses(disk / "run")) == [1, 2, 3, 4]
    finally:
        if real:
            subprocess.run(["umount", str(disk)], check=True)
