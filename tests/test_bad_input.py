"""Bad input gives one `error:` line and exit 2, never a hang or a traceback.

Inputs that used to hang or allocate without bound run the CLI in a subprocess under a timeout and an
address-space limit, so a regression fails the test instead of stalling or swapping the machine."""

from __future__ import annotations

import itertools
import json
import pathlib
import resource
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml
from tiny_models import tiny_model

from hanzo_gym.cli import main
from hanzo_gym.engine.state_files import LEGACY_TRAINER_FILE, OPTIMIZER_FILE, read_optimizer_state
from hanzo_gym.errors import GymError, ModelError
from hanzo_gym.loops.checkpoint import RNG_FILE
from hanzo_gym.model.lora import attach_lora
from hanzo_gym.tinker.paths import checkpoint_path, resolve

SUBPROCESS_SECONDS = 60
SUBPROCESS_MEMORY = 6 * 2**30  # torch maps ~2 GiB of address space at import; a bomb needs far more


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (SUBPROCESS_MEMORY, SUBPROCESS_MEMORY))


def _cli_in_subprocess(*args: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "hanzo_gym.cli", *args],
        capture_output=True,
        check=False,
        text=True,
        timeout=SUBPROCESS_SECONDS,
        preexec_fn=_limit_memory,
    )
    return done.returncode, done.stderr


def _cli(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


def _assert_one_error_line(code: int, err: str, *needles: str) -> str:
    """Exit 2 and exactly one `error:` line, the last thing on stderr, holding every needle."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and lines[-1] == errors[0], err
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


# ---------------------------------------------------------------- the config file


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"{a}?"}, {"role": "assistant", "content": f"{a}!"}]}
        for a in range(8)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _settings(tiny_base, chat_data, output_dir, **overrides) -> dict:
    settings = {
        "base_model": str(tiny_base),
        "datasets": [{"path": str(chat_data), "type": "chat_template"}],
        "output_dir": str(output_dir),
        "sequence_len": 64,
        "adapter": "lora",
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_target_linear": True,
        "micro_batch_size": 4,
        "max_steps": 1,
        "save_steps": 1,
        "logging_steps": 1,
    }
    settings.update(overrides)
    return settings


def _write_config(tmp_path, settings: dict, name: str = "run.yaml") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    return path


ALIAS_BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]\n" for previous, name in zip("abcdefgh", "bcdefghi")
)


def test_a_yaml_alias_bomb_is_refused_by_gym_train_without_expanding_it(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(ALIAS_BOMB + "base_model: m\n")
    code, err = _cli_in_subprocess("train", str(path))
    _assert_one_error_line(code, err, f"{path}:5:", "aliases repeat more than")


def test_a_yaml_alias_bomb_is_refused_by_gym_synth(tmp_path):
    path = tmp_path / "design.yaml"
    path.write_text(ALIAS_BOMB + "columns: [{name: n, sampler: uuid}]\n")
    code, err = _cli_in_subprocess("synth", str(path), "--preview", "1")
    _assert_one_error_line(code, err, f"{path}:5:", "aliases repeat more than")


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path, capsys):
    path = tmp_path / "loop.yaml"
    path.write_text("base_model: m\nchat_template: &loop [a, *loop]\n")
    _assert_one_error_line(*_cli(capsys, "train", str(path)), f"{path}:2:", "*loop", "inside")


def test_a_config_with_a_byte_that_is_not_utf8_names_its_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"base_model: m\noutput_dir: caf\xe9\n")
    _assert_one_error_line(*_cli(capsys, "train", str(path)), f"{path}:2:", "UTF-8")


def test_a_config_with_a_control_character_names_its_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("base_model: m\n\noutput_dir: a\x07b\n")
    _assert_one_error_line(*_cli(capsys, "train", str(path)), f"{path}:3:", "character")


@pytest.mark.parametrize("opening, closing", [("[", "]"), ("{a: ", "}")])
def test_a_config_nested_twenty_thousand_deep_is_refused(tmp_path, capsys, opening, closing):
    path = tmp_path / "run.yaml"
    path.write_text("base_model: m\nchat_template: " + opening * 20_000 + "x" + closing * 20_000 + "\n")
    _assert_one_error_line(*_cli(capsys, "train", str(path)), f"{path}:2:", "nested", "deep")


@pytest.mark.parametrize(
    "key, value",
    [
        ("val_set_size", ".inf"),
        ("learning_rate", ".inf"),
        ("lora_alpha", ".inf"),
        ("weight_decay", ".nan"),
        ("warmup_ratio", ".nan"),
        ("max_grad_norm", ".inf"),
        ("lora_dropout", ".nan"),
    ],
)
def test_a_non_finite_hyperparameter_names_its_key_and_line(tmp_path, capsys, key, value):
    path = tmp_path / "run.yaml"
    path.write_text(
        "base_model: m\noutput_dir: o\nadapter: lora\nlora_target_linear: true\n"
        f"datasets: [{{path: d.jsonl, type: alpaca}}]\n{key}: {value}\n"
    )
    _assert_one_error_line(*_cli(capsys, "train", str(path)), f"{path}:6:", f"`{key}`", "finite")


def test_a_non_finite_grpo_setting_names_its_key_and_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(
        "base_model: m\noutput_dir: o\nadapter: lora\nlora_target_linear: true\nrl: grpo\n"
        "datasets: [{path: d.jsonl, type: alpaca}]\ntrl:\n  reward_funcs: [numeric_match]\n"
        "  temperature: .inf\n"
    )
    _assert_one_error_line(*_cli(capsys, "train", str(path)), f"{path}:9:", "`trl.temperature`", "finite")


def test_a_seed_too_large_for_the_generators_is_refused_at_load(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(
        "base_model: m\noutput_dir: o\nadapter: lora\nlora_target_linear: true\n"
        "datasets: [{path: d.jsonl, type: alpaca}]\nseed: 99999999999999999999999\n"
    )
    _assert_one_error_line(*_cli(capsys, "train", str(path)), f"{path}:6:", "`seed`")


def test_a_lora_rank_above_the_layer_sizes_is_one_error_line(tmp_path, capsys, tiny_base, chat_data):
    path = _write_config(tmp_path, _settings(tiny_base, chat_data, tmp_path / "run", lora_r=17))
    _assert_one_error_line(*_cli(capsys, "train", str(path)), "lora_r", "17", "at most 16")


def test_a_huge_lora_rank_is_refused_before_anything_is_allocated():
    """lora_r: 100000000 would allocate 25 GB; on the meta device nothing is allocated even if that regressed."""
    with torch.device("meta"):
        model = tiny_model("qwen3")
        with pytest.raises(ModelError, match="lora_r .* 100000000 .* at most 16"):
            attach_lora(
                model,
                r=100_000_000,
                alpha=16.0,
                dropout=0.0,
                target_modules="all-linear",
                base_model_name="tiny",
            )
        assert (
            attach_lora(
                model, r=16, alpha=16.0, dropout=0.0, target_modules="all-linear", base_model_name="tiny"
            )
            is not None
        )


def test_a_data_row_nested_two_hundred_thousand_deep_names_the_file_and_line(
    tmp_path, capsys, tiny_base, chat_data
):
    data = tmp_path / "deep.jsonl"
    data.write_text(chat_data.read_text() + "[" * 200_000 + "]" * 200_000 + "\n")
    settings = _settings(tiny_base, chat_data, tmp_path / "run")
    settings["datasets"][0]["path"] = str(data)
    path = _write_config(tmp_path, settings)
    _assert_one_error_line(*_cli(capsys, "train", str(path)), f"{data} line 9", "nested")


def test_a_non_finite_synth_setting_names_its_key_and_line(tmp_path, capsys):
    path = tmp_path / "design.yaml"
    path.write_text("model:\n  name: m\n  timeout: .inf\ncolumns: [{name: n, sampler: uuid}]\n")
    _assert_one_error_line(*_cli(capsys, "synth", str(path)), f"{path}:3:", "`model.timeout`", "finite")


# ---------------------------------------------------------------- the base model


@pytest.fixture
def damaged_base(tmp_path, tiny_base) -> pathlib.Path:
    copy = tmp_path / "base"
    shutil.copytree(tiny_base, copy)
    return copy


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_base_model_weights_name_the_file(tmp_path, capsys, damaged_base, chat_data, damage):
    weights = damaged_base / "model.safetensors"
    weights.write_bytes(
        weights.read_bytes()[: weights.stat().st_size // 2] if damage == "truncated" else b"junk"
    )
    path = _write_config(tmp_path, _settings(damaged_base, chat_data, tmp_path / "run"))
    _assert_one_error_line(*_cli(capsys, "train", str(path)), str(weights))


def test_a_base_model_config_that_is_not_json_names_the_file(tmp_path, capsys, damaged_base, chat_data):
    (damaged_base / "config.json").write_text("{model_type: llama")
    path = _write_config(tmp_path, _settings(damaged_base, chat_data, tmp_path / "run"))
    _assert_one_error_line(*_cli(capsys, "train", str(path)), str(damaged_base / "config.json"), "JSON")


# ---------------------------------------------------------------- resuming from a checkpoint


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory, tiny_base, chat_data) -> pathlib.Path:
    """checkpoint-1 of a one-step run."""
    directory = tmp_path_factory.mktemp("trained")
    path = _write_config(directory, _settings(tiny_base, chat_data, directory / "run"))
    assert main(["train", str(path)]) == 0
    return directory / "run" / "checkpoint-1"


@pytest.fixture
def checkpoint(tmp_path, trained_checkpoint) -> pathlib.Path:
    copy = tmp_path / "checkpoint-1"
    shutil.copytree(trained_checkpoint, copy)
    return copy


def _as_legacy_checkpoint(checkpoint: pathlib.Path, state: object | None = None) -> pathlib.Path:
    """The checkpoint in the format before optimizer.safetensors: optimizer and RNG in training_state.pt
    (by default its own state, so that it resumes)."""
    if state is None:
        state = {
            "optimizer": read_optimizer_state(checkpoint),
            "cpu_rng": torch.get_rng_state(),
            "cuda_rng": None,
        }
    (checkpoint / OPTIMIZER_FILE).unlink()
    (checkpoint / RNG_FILE).unlink()
    legacy = checkpoint / LEGACY_TRAINER_FILE
    torch.save(state, legacy)
    return legacy


def _resume(tmp_path, capsys, tiny_base, chat_data, checkpoint) -> tuple[int, str]:
    settings = _settings(
        tiny_base, chat_data, tmp_path / "resumed", max_steps=2, resume_from_checkpoint=str(checkpoint)
    )
    return _cli(capsys, "train", str(_write_config(tmp_path, settings, "resume.yaml")))


class _RunsCode:
    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_a_training_state_that_would_run_code_is_refused_on_resume(
    tmp_path, capsys, tiny_base, chat_data, checkpoint
):
    marker = tmp_path / "code-ran"
    legacy = _as_legacy_checkpoint(checkpoint, {"optimizer": _RunsCode(marker), "cpu_rng": _RunsCode(marker)})
    code, err = _resume(tmp_path, capsys, tiny_base, chat_data, checkpoint)
    _assert_one_error_line(code, err, str(legacy), "refused")
    assert not marker.exists()


def test_an_intact_legacy_checkpoint_resumes(tmp_path, capsys, tiny_base, chat_data, checkpoint):
    """The damaged copies here start from checkpoints that resume."""
    _as_legacy_checkpoint(checkpoint)
    code, err = _resume(tmp_path, capsys, tiny_base, chat_data, checkpoint)
    assert code == 0, err


def _truncate(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_garbage_trainer_state_names_the_file(tmp_path, capsys, tiny_base, chat_data, checkpoint):
    (checkpoint / "trainer_state.json").write_text('{"step": 1, "epoch"')
    code, err = _resume(tmp_path, capsys, tiny_base, chat_data, checkpoint)
    _assert_one_error_line(code, err, str(checkpoint / "trainer_state.json"), "damaged")


def test_a_trainer_state_of_the_wrong_shape_names_the_file(
    tmp_path, capsys, tiny_base, chat_data, checkpoint
):
    (checkpoint / "trainer_state.json").write_text('{"step": "one", "colour": 3}')
    code, err = _resume(tmp_path, capsys, tiny_base, chat_data, checkpoint)
    _assert_one_error_line(code, err, str(checkpoint / "trainer_state.json"), "damaged")


@pytest.mark.parametrize(
    "name", ["adapter_model.safetensors", OPTIMIZER_FILE, RNG_FILE, "adapter_config.json"]
)
def test_a_truncated_checkpoint_file_names_the_file(tmp_path, capsys, tiny_base, chat_data, checkpoint, name):
    _truncate(checkpoint / name)
    code, err = _resume(tmp_path, capsys, tiny_base, chat_data, checkpoint)
    _assert_one_error_line(code, err, str(checkpoint / name), "damaged")


def test_a_truncated_legacy_training_state_names_the_file(tmp_path, capsys, tiny_base, chat_data, checkpoint):
    legacy = _as_legacy_checkpoint(checkpoint)
    _truncate(legacy)
    code, err = _resume(tmp_path, capsys, tiny_base, chat_data, checkpoint)
    message = _assert_one_error_line(code, err, str(legacy), "damaged")
    assert "run code" not in message  # a cut-off file is damaged, not dangerous


# ---------------------------------------------------------------- gym synth expressions


def _design(tmp_path, expression: str) -> pathlib.Path:
    path = tmp_path / "design.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            rows: 1
            columns:
              - name: n
                sampler: uniform
                low: 7
                high: 7.5
                convert_to: int
              - name: total
                expression: {json.dumps(expression)}
            """
        )
    )
    return path


@pytest.mark.parametrize(
    "expression",
    [
        "{{ 7 ** 7777777777 }}",  # folded as a constant when the template compiles
        "{{ n ** 7777777777 }}",  # evaluated when the row renders
        "{{ range(10**9) | list }}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{{ 'a' * 10**11 }}",
        "{{ [0] * 10**11 }}",
        "{{ 'a' | center(10**11) }}",
        "{{ 'a'.ljust(99999999999) }}",
        "{{ '%99999999999d' % 1 }}",
        "{{ '{:>99999999999}'.format(1) }}",
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
            "{{ ns.s | length }}"
        ),
        (
            "{% macro twice(k) %}{% if k %}{{ twice(k - 1) }}{{ twice(k - 1) }}{% endif %}{% endmacro %}"
            "{{ twice(64) }}"
        ),
        "{% macro forever() %}{{ forever() }}{% endmacro %}{{ forever() }}",
    ],
)
def test_a_costly_synth_expression_is_one_error_line(tmp_path, expression):
    code, err = _cli_in_subprocess("synth", str(_design(tmp_path, expression)), "--preview", "1")
    _assert_one_error_line(code, err, "column `total`", "too costly")


@pytest.mark.parametrize(
    "expression, value",
    [
        ("{{ 2 ** 64 }}", 2**64),
        ("{{ 'ab' * 3 }}", "ababab"),
        ("{{ range(5) | sum }}", 10),
        ("{{ '%05d' % 42 }}", "00042"),
        ("{{ 'x' | center(5) }}", "  x  "),
        ("{{ [1, 2] + [3] }}", [1, 2, 3]),
    ],
)
def test_ordinary_expressions_still_evaluate(expression, value):
    from hanzo_gym.synth.expressions import Template

    assert Template(expression).evaluate({}) == value


# ---------------------------------------------------------------- gym:// paths


@pytest.mark.parametrize(
    "path",
    [
        "gym://../../etc/x",
        "gym://a/../../b/weights/c",
        "gym://../weights/c",
        "gym://./weights/c",
        "gym://run/weights/..",
        "gym://run/weights/.",
        "gym:///weights/c",
        "gym://run\\..\\..\\x/weights/c",
        "gym://run/weights/c/",
        "gym:///etc/weights/x",
        "gym://",
    ],
)
def test_a_gym_path_never_resolves_outside_the_root(tmp_path, path):
    with pytest.raises(GymError, match="gym://<run>/weights/<name>|run id|name"):
        resolve(path, tmp_path / "root")


@pytest.mark.parametrize("run_id", ["", "..", ".", "a/b", "/abs", "a\\b"])
def test_a_checkpoint_path_refuses_a_run_id_that_leaves_the_root(run_id):
    with pytest.raises(GymError, match="run id"):
        checkpoint_path(run_id, "weights", "c")


def test_an_ordinary_gym_path_resolves_under_the_root(tmp_path):
    assert (
        resolve("gym://run-1/sampler_weights/final", tmp_path)
        == tmp_path / "run-1" / "sampler_weights" / "final"
    )


def test_no_gym_path_built_from_dots_and_slashes_leaves_the_root(tmp_path):
    root = tmp_path / "root"
    pieces = ["..", ".", "", "run", "weights", "/", "\\..", "a/..", "../x"]
    for run, name in itertools.product(pieces, repeat=2):
        path = f"gym://{run}/weights/{name}"
        try:
            resolved = resolve(path, root)
        except GymError:
            continue
        assert resolved.resolve().parent.parent.parent == root.resolve(), path  # <root>/<run>/weights/<name>
