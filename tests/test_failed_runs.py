"""A run that fails leaves the run before it as it was: a reward function that raises, a refused resume, a loss
that stops being finite. The new run is staged beside the old one and replaces it only at its first checkpoint
or its adapter; a run killed at any moment of that swap is finished (or removed) by the next one."""

import json
import os
import subprocess

import pytest
import yaml
from conftest import save_tiny_word_model

from hanzo_gym import files
from hanzo_gym.cli import main
from hanzo_gym.loops.run_dir import RunDir


@pytest.fixture(scope="module")
def tiny_word_base(tmp_path_factory, word_tokenizer):
    return save_tiny_word_model(tmp_path_factory.mktemp("tiny-word-llama"), word_tokenizer)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "count.jsonl"
    starts = ["one two three", "two three four", "five six seven", "a b c"]
    path.write_text("".join(json.dumps({"text": text, "answer": "four"}) + "\n" for text in starts * 2))
    return path


@pytest.fixture(scope="module")
def dialogues(tmp_path_factory):
    path = tmp_path_factory.mktemp("dialogues") / "chat.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"{a} {b}"}, {"role": "assistant", "content": f"{b} {a}"}]}
        for a in ("one", "two", "three", "four")
        for b in ("five", "six")
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _config(tmp_path, base, data, data_type, **settings):
    """A config file: a LoRA run of the tiny model on `data`, with `settings` on top."""
    cfg = {
        "base_model": str(base),
        "datasets": [{"path": str(data), "type": data_type}],
        "output_dir": str(tmp_path / "run"),
        "sequence_len": 32,
        "adapter": "lora",
        "lora_target_linear": True,
        "micro_batch_size": 2,
        "logging_steps": 1,
        "seed": 3,
        **settings,
    }
    return _written(tmp_path, cfg)


def _grpo(tmp_path, base, data, **overrides):
    trl = {"num_generations": 4, "max_completion_length": 3, "reward_funcs": ["format:four"]}
    settings = {"lora_r": 8, "lora_alpha": 16, "rl": "grpo", "trl": trl, "max_steps": 2, "save_steps": 1}
    return _config(tmp_path, base, data, "completion", **{**settings, "learning_rate": 3e-2, **overrides})


def _sft(tmp_path, base, data, **overrides):
    settings = {"lora_r": 4, "lora_alpha": 8, "max_steps": 3, "learning_rate": 1e-2}
    return _config(tmp_path, base, data, "chat_template", **{**settings, **overrides})


def _written(tmp_path, cfg):
    path = tmp_path / f"run-{len(list(tmp_path.glob('*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _snapshot(directory):
    """Every file under `directory` by relative path, with its bytes (the directory's own path as `<run>`)."""
    return {
        str(p.relative_to(directory)): p.read_bytes().replace(str(directory).encode(), b"<run>")
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _error_lines(err):
    return [line for line in err.splitlines() if line.startswith("error:")]


def _finished_run(tmp_path, base, data, capsys):
    assert main(["train", str(_grpo(tmp_path, base, data))]) == 0
    capsys.readouterr()
    before = _snapshot(tmp_path / "run")
    for name in ("run_config.json", "metrics.jsonl", "checkpoints.jsonl", "adapter_config.json"):
        assert name in before
    assert "checkpoint-2/trainer_state.json" in before
    return before


def test_a_reward_that_raises_at_step_1_leaves_the_finished_run_intact(
    tmp_path, tiny_word_base, prompts, capsys, monkeypatch
):
    before = _finished_run(tmp_path, tiny_word_base, prompts, capsys)
    (tmp_path / "reward_that_raises.py").write_text(
        "def score(completions):\n    raise ValueError('the grader is down')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    trl = {
        "num_generations": 4,
        "max_completion_length": 3,
        "reward_funcs": ["python:reward_that_raises:score"],
    }
    assert main(["train", str(_grpo(tmp_path, tiny_word_base, prompts, trl=trl))]) == 2
    out, err = capsys.readouterr()
    assert _error_lines(err) == [line for line in err.splitlines() if line.strip()]
    (line,) = _error_lines(err)
    assert line.startswith(
        "error: step 1: reward function python:reward_that_raises:score raised ValueError: the grader is down"
    )
    assert "reward_that_raises.py:2" in line and "fix the reward function" in line
    assert "stay until this run has its first checkpoint" in out and "holds the previous run" in out
    assert _snapshot(tmp_path / "run") == before  # metrics, checkpoints, run_config.json and adapter
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".")]


def test_a_refused_resume_leaves_run_config_json_as_it_was(tmp_path, tiny_word_base, prompts, capsys):
    before = _finished_run(tmp_path, tiny_word_base, prompts, capsys)
    other = _grpo(tmp_path, tiny_word_base, prompts, lora_r=4, resume_from_checkpoint=True)
    assert main(["train", str(other)]) == 2
    assert "lora_r: 8 → 4" in capsys.readouterr().err
    assert _snapshot(tmp_path / "run") == before


def _strict_rows(path):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("loop", ["sft", "grpo"])
def test_a_diverging_run_stops_at_the_step_and_writes_no_adapter(
    tmp_path, tiny_word_base, prompts, dialogues, loop, capsys
):
    """A huge but finite learning rate: the first update overflows the adapter and the next loss is not finite."""
    if loop == "sft":
        path = _sft(tmp_path, tiny_word_base, dialogues, learning_rate=1e30)
    else:
        path = _grpo(tmp_path, tiny_word_base, prompts, learning_rate=1e30, save_steps=None, max_steps=4)
    assert main(["train", str(path)]) == 2
    out, err = capsys.readouterr()
    (line,) = _error_lines(err)
    assert "training diverged" in line and "Lower learning_rate (now 1e+30)" in line, line
    step = int(line.removeprefix("error: step ").split(":")[0])
    assert 1 <= step <= 4 and "wrote adapter" not in out
    run = tmp_path / "run"
    rows = _strict_rows(run / "metrics.jsonl")  # every line is JSON: no NaN or Infinity reached the file
    assert all(row["step"] < step for row in rows)
    assert not (run / "adapter_config.json").exists() and not (run / "adapter_model.safetensors").exists()


def test_a_diverging_run_leaves_the_previous_run_intact(tmp_path, tiny_word_base, prompts, dialogues, capsys):
    before = _finished_run(tmp_path, tiny_word_base, prompts, capsys)
    assert main(["train", str(_sft(tmp_path, tiny_word_base, dialogues, learning_rate=1e30))]) == 2
    assert "training diverged" in capsys.readouterr().err
    assert _snapshot(tmp_path / "run") == before


def _old_run(directory):
    directory.mkdir()
    (directory / "run_config.json").write_text("old config")
    (directory / "metrics.jsonl").write_text('{"step": 1}\n')
    (directory / "checkpoints.jsonl").write_text('{"step": 5}\n')
    (directory / "adapter_config.json").write_text("old adapter")
    (directory / "adapter_model.safetensors").write_text("old weights")
    (directory / "checkpoint-5").mkdir()
    (directory / "checkpoint-5" / "trainer_state.json").write_text("{}")
    (directory / "notes.txt").write_text("the user's, not the run's")
    return _snapshot(directory)


def _new_run(directory, with_adapter):
    """What a new run writes: config, a metric row, a checkpoint, then (or not) its adapter."""
    run = RunDir(directory)
    assert run.start_fresh() == [
        "run_config.json",
        "metrics.jsonl",
        "checkpoints.jsonl",
        "adapter_config.json",
        "adapter_model.safetensors",
        "checkpoint-5",
    ]
    run.write_config({"new": True})
    run.log({"step": 1, "loss": 0.5})
    if not with_adapter:
        run.save_checkpoint(2, 1.0, lambda d: (d / "trainer_state.json").write_text('{"new": true}'))
        return run

    def adapter(d):
        for name in ("adapter_model.safetensors", "tokenizer.json", "adapter_config.json"):
            (d / name).write_text(f"new {name}")

    run.publish_final(adapter)
    return run


def test_a_new_run_is_staged_until_its_first_checkpoint(tmp_path, capsys):
    old = _old_run(tmp_path / "run")
    run = RunDir(tmp_path / "run")
    run.start_fresh()
    run.write_config({"new": True})
    run.log({"step": 1, "loss": 0.5})
    assert _snapshot(tmp_path / "run") == old | {
        f"{run.metrics_path.parent.name}/run_config.json": b'{\n  "new": true\n}\n',
        f"{run.metrics_path.parent.name}/metrics.jsonl": b'{"step": 1, "loss": 0.5}\n',
    }
    run.save_checkpoint(2, 1.0, lambda d: (d / "trainer_state.json").write_text("{}"))
    assert "this run replaced the previous run's run_config.json, metrics.jsonl" in capsys.readouterr().out
    after = _snapshot(tmp_path / "run")
    assert sorted(after) == [
        "checkpoint-2/trainer_state.json",
        "checkpoints.jsonl",
        "metrics.jsonl",
        "notes.txt",
        "run_config.json",
    ]
    record = json.loads(after["checkpoints.jsonl"])
    assert record["path"] == "<run>/checkpoint-2"  # where it ends up, not in the staging folder
    run.log({"step": 2, "loss": 0.4})  # after the swap the run writes in place
    assert len(run.metrics()) == 2 and (tmp_path / "run" / "metrics.jsonl") == run.metrics_path


def test_a_log_row_that_is_not_finite_never_reaches_the_file(tmp_path):
    run = RunDir(tmp_path / "run")
    with pytest.raises(ValueError):
        run.log({"step": 1, "loss": float("nan")})
    assert not run.metrics_path.exists() or run.metrics_path.read_text() == ""


class Killed(BaseException):
    """What kill -9 does to the process at that instant, as far as the files can tell."""


class KillSwitch:
    """Counts the file operations (renames, unlinks, tree removals) and kills the process before the one
    numbered `kill_at`, as another process id: the next run must treat what it left as a dead run's."""

    def __init__(self, monkeypatch, kill_at):
        self.kill_at, self.calls = kill_at, 0
        child = subprocess.Popen(["true"])
        child.wait()
        monkeypatch.setattr(os, "getpid", lambda: child.pid)
        for module, name in ((os, "replace"), (os, "unlink"), (files.shutil, "rmtree")):
            monkeypatch.setattr(module, name, self._counted(getattr(module, name)))

    def _counted(self, operation):
        def run(*args, **kwargs):
            self.calls += 1
            if self.calls > self.kill_at:
                raise Killed
            return operation(*args, **kwargs)

        return run


@pytest.mark.parametrize("with_adapter", [False, True], ids=["at-checkpoint", "at-adapter"])
def test_a_run_killed_at_any_moment_leaves_one_run_that_the_next_run_completes(
    tmp_path, monkeypatch, capsys, with_adapter
):
    clean = tmp_path / "clean"
    old = _old_run(clean)
    _new_run(clean, with_adapter)
    new = _snapshot(clean)

    outcomes = []
    for kill_at in range(1000):
        directory = tmp_path / f"killed-{kill_at}"
        _old_run(directory)
        with monkeypatch.context() as patch:
            KillSwitch(patch, kill_at)
            try:
                _new_run(directory, with_adapter)
                break  # it ran to the end: every moment before has been tried
            except Killed:
                pass
        adapter = [directory / "adapter_config.json", directory / "adapter_model.safetensors"]
        if adapter[0].exists():  # an adapter_config.json only ever vouches for weights of its own run
            assert {p.read_text().split()[0] for p in adapter} in ({"old"}, {"new"}), kill_at
        capsys.readouterr()
        RunDir(directory)  # the next run
        said = capsys.readouterr().out
        after = _snapshot(directory)
        assert after in (old, new), kill_at
        assert not [p for p in directory.iterdir() if p.name.startswith(".")], kill_at
        outcomes.append("old" if after == old else "new")
        assert ("finished moving in the run staged" if after == new else "removed .new-run-") in said, said
    # Killed before the swap began the old run stays; from then on the new one is completed.
    assert kill_at > 5 and outcomes == sorted(outcomes, reverse=True) and set(outcomes) == {"old", "new"}


def test_a_swap_that_fails_part_way_is_left_for_the_next_run_to_finish(tmp_path, monkeypatch, capsys):
    """Not removed as a failed staged run would be: by then the previous run is partly gone."""
    _old_run(tmp_path / "run")
    run = RunDir(tmp_path / "run")
    run.start_fresh()
    run.write_config({"new": True})

    def disk_gone(path):
        raise OSError("disk gone")

    with monkeypatch.context() as patch:
        patch.setattr(files, "remove_entry", disk_gone)
        with pytest.raises(OSError):
            run.save_checkpoint(2, 1.0, lambda d: (d / "trainer_state.json").write_text("{}"))
    assert run.discard() is False
    monkeypatch.setattr("hanzo_gym.loops.run_dir.process_alive", lambda pid: False)  # the next process
    RunDir(tmp_path / "run")
    assert "finished moving in the run staged in .new-run-" in capsys.readouterr().out
    assert sorted(_snapshot(tmp_path / "run")) == [
        "checkpoint-2/trainer_state.json",
        "checkpoints.jsonl",
        "notes.txt",
        "run_config.json",
    ]
