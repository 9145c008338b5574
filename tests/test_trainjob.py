"""`gym trainjob`'s environment contract: every variable, its default, trimming, empty = unset and every
rejection."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from hanzo_gym.cli import main
from hanzo_gym.cli.trainjob import VARIABLES, dataset_files, trainjob_from_env
from hanzo_gym.config import parse_config
from hanzo_gym.errors import ConfigError

CHAT_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}

# What the broker (hanzoai/ai trainerEnv) sends for a LoRA job with its recommended hyperparameters.
BROKER_ENV = {
    "BASE_MODEL": "Qwen/Qwen3-0.6B",
    "METHOD": "lora",
    "TASK": "chat",
    "OUTPUT_DIR": "/workspace/output",
    "EPOCHS": "3",
    "LEARNING_RATE": "0.0002",
    "BATCH_SIZE": "2",
    "GRAD_ACCUM": "8",
    "MAX_SEQ_LEN": "2048",
    "LORA_RANK": "16",
    "LORA_ALPHA": "32",
    "LORA_DROPOUT": "0.05",
    "QUANT_4BIT": "false",
    "GRADIENT_CHECKPOINTING": "true",
    "WARMUP_RATIO": "0.03",
    "WEIGHT_DECAY": "0.01",
    "HF_TOKEN": "hf_secret_do_not_print",
}


@pytest.fixture
def dirs(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "dataset"
    (data / "nested" / "deeper").mkdir(parents=True)
    (data / ".cache" / "huggingface").mkdir(parents=True)
    (data / "b.jsonl").write_text(json.dumps(CHAT_ROW) + "\n")
    (data / "a.json").write_text(json.dumps([CHAT_ROW]))
    pq.write_table(pa.Table.from_pylist([CHAT_ROW]), data / "nested" / "deeper" / "c.parquet")
    (data / ".cache" / "huggingface" / "hidden.jsonl").write_text("not json")
    (data / ".hidden.jsonl").write_text("not json")
    (data / "README.md").write_text("# card")
    return {"MODEL_DIR": str(model), "DATASET_DIR": str(data), "OUTPUT_DIR": str(tmp_path / "out")}


def _env(dirs, **values):
    return {**dirs, "TASK": "chat", **values}


def _error(env) -> str:
    with pytest.raises(ConfigError) as caught:
        trainjob_from_env(env)
    return str(caught.value)


def test_defaults_match_the_broker(dirs):
    job = trainjob_from_env(_env(dirs))
    cfg = job.config
    assert cfg.base_model == dirs["MODEL_DIR"]
    assert cfg.sequence_len == 2048
    assert (cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout) == (16, 32.0, 0.05)
    assert (cfg.micro_batch_size, cfg.gradient_accumulation_steps, cfg.num_epochs) == (2, 8, 3)
    assert (cfg.learning_rate, cfg.warmup_ratio, cfg.weight_decay) == (2e-4, 0.03, 0.01)
    assert cfg.adapter == "lora" and cfg.lora_target_linear and cfg.lora_target_modules == []
    assert cfg.bf16 == "auto" and cfg.gradient_checkpointing is False
    assert (cfg.lr_scheduler, cfg.seed, cfg.logging_steps, cfg.max_grad_norm) == ("cosine", 42, 10, 1.0)
    assert cfg.val_set_size == 0.0 and cfg.save_steps is None
    assert job.merge is True and job.base_model_name is None
    assert job.output_dir == Path(dirs["OUTPUT_DIR"])
    assert cfg.output_dir == str(Path(dirs["OUTPUT_DIR"]) / "run")
    assert job.adapter_dir == Path(dirs["OUTPUT_DIR"]) / "adapter"


def test_unset_paths_default_to_the_workspace_volume(tmp_path):
    env = {"TASK": "chat", "BASE_MODEL": "Qwen/Qwen3-0.6B"}
    message = _error(env)
    # /workspace/model is absent here, so BASE_MODEL is used; /workspace/dataset is absent too
    assert message.startswith("DATASET_DIR=/workspace/dataset: not a directory")
    assert "MODEL_DIR" not in message


def test_every_variable_is_read_trimmed(dirs):
    env = _env(
        dirs,
        TASK=" Instruct ",
        METHOD=" LoRA\n",
        EPOCHS=" 2.0 ",
        MAX_SEQ_LEN=" 512",
        LORA_RANK="8 ",
        LORA_ALPHA=" 16",
        LORA_DROPOUT="0.1",
        BATCH_SIZE="4",
        GRAD_ACCUM="3",
        LEARNING_RATE="1e-4",
        WARMUP_RATIO="0.1",
        WEIGHT_DECAY="0.0",
        QUANT_4BIT=" FALSE ",
        GRADIENT_CHECKPOINTING=" True",
        MERGE=" false ",
        BASE_MODEL=" org/name ",
        OUTPUT_DIR=f" {dirs['OUTPUT_DIR']}/x ",
        MODEL_DIR=f" {dirs['MODEL_DIR']} ",
    )
    job = trainjob_from_env(env)
    cfg = job.config
    assert {d.type for d in cfg.datasets} == {"alpaca"}
    assert cfg.num_epochs == 2 and isinstance(cfg.num_epochs, int)
    assert cfg.sequence_len == 512
    assert (cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout) == (8, 16.0, 0.1)
    assert (cfg.micro_batch_size, cfg.gradient_accumulation_steps) == (4, 3)
    assert (cfg.learning_rate, cfg.warmup_ratio, cfg.weight_decay) == (1e-4, 0.1, 0.0)
    assert cfg.gradient_checkpointing is True
    assert job.merge is False
    assert cfg.base_model == dirs["MODEL_DIR"]  # MODEL_DIR holds a model, so it wins over BASE_MODEL …
    assert job.base_model_name == "org/name"  # … which is what the adapter will name as its base
    assert job.output_dir == Path(dirs["OUTPUT_DIR"]) / "x"


def test_empty_values_count_as_unset(dirs):
    blank = {name: "  " for name in (*BROKER_ENV, "MERGE") if name != "TASK"}
    job = trainjob_from_env({**blank, **dirs, "TASK": "completion"})
    assert job.config.lora_r == 16 and job.config.num_epochs == 3 and job.merge is True
    assert {d.type for d in job.config.datasets} == {"completion"}
    blank_paths = {**blank, "TASK": "chat", "MODEL_DIR": "", "DATASET_DIR": "", "BASE_MODEL": ""}
    message = _error(blank_paths)
    assert "MODEL_DIR=/workspace/model is not a directory and BASE_MODEL is unset" in message
    assert "DATASET_DIR=/workspace/dataset: not a directory" in message


def test_what_the_broker_sends_is_accepted(dirs, capsys, monkeypatch):
    env = {**BROKER_ENV, **dirs, "METHOD": "LoRA"}
    job = trainjob_from_env(env)
    assert job.config.gradient_checkpointing is True
    assert job.base_model_name == "Qwen/Qwen3-0.6B"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["trainjob", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "hf_secret_do_not_print" not in printed and "HF_TOKEN" not in printed


@pytest.mark.parametrize(
    ("task", "strategy"), [("chat", "chat_template"), ("INSTRUCT", "alpaca"), ("Completion", "completion")]
)
def test_task_picks_the_strategy_for_every_file(dirs, task, strategy):
    cfg = trainjob_from_env(_env(dirs, TASK=task)).config
    assert [(Path(d.path).name, d.type) for d in cfg.datasets] == [
        ("a.json", strategy),
        ("b.jsonl", strategy),
        ("c.parquet", strategy),
    ]
    assert all(d.field_messages == "messages" for d in cfg.datasets)


def test_model_dir_then_base_model(dirs, tmp_path):
    assert trainjob_from_env(_env(dirs)).config.base_model == dirs["MODEL_DIR"]
    missing = str(tmp_path / "nowhere")
    job = trainjob_from_env(_env(dirs, MODEL_DIR=missing, BASE_MODEL="Qwen/Qwen3-0.6B"))
    assert job.config.base_model == "Qwen/Qwen3-0.6B" and job.base_model_name is None
    empty = tmp_path / "empty-model"
    empty.mkdir()  # a volume mounted but never filled
    job = trainjob_from_env(_env(dirs, MODEL_DIR=str(empty), BASE_MODEL="Qwen/Qwen3-0.6B"))
    assert job.config.base_model == "Qwen/Qwen3-0.6B"
    assert f"MODEL_DIR={missing} is not a directory and BASE_MODEL is unset" in _error(
        _env(dirs, MODEL_DIR=missing)
    )
    assert f"MODEL_DIR={empty} holds no config.json and BASE_MODEL is unset" in _error(
        _env(dirs, MODEL_DIR=str(empty))
    )


def test_dataset_dir_walk_skips_hidden_and_sorts(dirs):
    names = [p.relative_to(dirs["DATASET_DIR"]).as_posix() for p in dataset_files(dirs["DATASET_DIR"])]
    assert names == ["a.json", "b.jsonl", "nested/deeper/c.parquet"]


def test_dataset_dir_with_split_files_trains_on_the_train_split(tmp_path):
    data = tmp_path / "hub-snapshot" / "data"
    data.mkdir(parents=True)
    for name in (
        "train-00000-of-00002.parquet",
        "train-00001-of-00002.parquet",
        "test-00000-of-00001.parquet",
    ):
        pq.write_table(pa.Table.from_pylist([CHAT_ROW]), data / name)
    chosen = [p.name for p in dataset_files(str(tmp_path / "hub-snapshot"))]
    assert chosen == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]


def test_dataset_dir_split_words_are_whole_words_and_the_choice_is_printed(
    dirs, tmp_path, capsys, monkeypatch
):
    data = tmp_path / "mixed"
    (data / "sub").mkdir(parents=True)
    for name in ("A.JSONL", "constraints.jsonl", "latest.jsonl", "sub/test.jsonl"):
        (data / name).write_text(json.dumps(CHAT_ROW) + "\n")
    # no file names the train split (constraints/latest only contain split words): all but the test split
    names = [p.relative_to(data).as_posix() for p in dataset_files(str(data))]
    assert names == ["A.JSONL", "constraints.jsonl", "latest.jsonl"]
    (data / "train.jsonl").write_text(json.dumps(CHAT_ROW) + "\n")
    env = _env(dirs, DATASET_DIR=str(data))
    assert [Path(d.path).name for d in trainjob_from_env(env).config.datasets] == ["train.jsonl"]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["trainjob", "--dry-run"]) == 0
    assert (
        f"# DATASET_DIR={data}: split `train` reads 1 file(s): train.jsonl; skipped 4 not named for split "
        "`train`: A.JSONL, constraints.jsonl, latest.jsonl, sub/test.jsonl\n"
    ) in capsys.readouterr().out


def test_dataset_dir_missing_or_empty(dirs, tmp_path):
    empty = tmp_path / "empty"
    (empty / ".cache").mkdir(parents=True)
    (empty / ".cache" / "x.jsonl").write_text("{}")
    (empty / "notes.txt").write_text("no data here")
    assert f"DATASET_DIR={empty}: no .jsonl, .json or .parquet files" in _error(
        _env(dirs, DATASET_DIR=str(empty))
    )
    assert f"DATASET_DIR={tmp_path / 'none'}: not a directory" in _error(
        _env(dirs, DATASET_DIR=str(tmp_path / "none"))
    )


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"METHOD": "qlora", "QUANT_4BIT": "false"}, "QLoRA is a 4-bit base; send QUANT_4BIT=true"),
        ({"METHOD": "full", "QUANT_4BIT": "true"}, "which a 4-bit base cannot hold; send QUANT_4BIT=false"),
        (
            {"METHOD": "full", "LORA_RANK": "16"},
            "LORA_RANK=16 with METHOD=full: full fine-tuning trains every",
        ),
        ({"METHOD": "full", "MERGE": "false"}, "MERGE=false with METHOD=full"),
        ({"METHOD": "dpo"}, "METHOD=dpo: unknown method; send METHOD=lora, qlora or full"),
        ({"QUANT_4BIT": "maybe"}, "QUANT_4BIT=maybe: not a boolean; send true or false"),
        ({"GRADIENT_CHECKPOINTING": "sometimes"}, "GRADIENT_CHECKPOINTING=sometimes: not a boolean"),
        ({"MERGE": "perhaps"}, "MERGE=perhaps: not a boolean"),
        ({"TASK": "chatty"}, "TASK=chatty: must be chat, instruct or completion"),
        ({"TASK": ""}, "TASK is unset: send TASK=chat"),
        ({"EPOCHS": "1.5"}, "EPOCHS=1.5: hanzo-gym trains a whole number of epochs; send 1 or 2"),
        ({"EPOCHS": "0"}, "EPOCHS=0: must be at least 1"),
        ({"EPOCHS": "three"}, "EPOCHS=three: not a number"),
        ({"EPOCHS": "1e20"}, "EPOCHS=1e20: too large; send at most 10000"),
        ({"EPOCHS": "1e400"}, "EPOCHS=1e400: too large; send at most 10000"),
        ({"EPOCHS": "10001"}, "EPOCHS=10001: too large"),
        (
            {"BATCH_SIZE": "99999999999999999999999"},
            "BATCH_SIZE=99999999999999999999999: too large; send at most 65536",
        ),
        ({"BATCH_SIZE": "65537"}, "BATCH_SIZE=65537: too large"),
        ({"GRAD_ACCUM": "1000000"}, "GRAD_ACCUM=1000000: too large; send at most 65536"),
        ({"LORA_RANK": "16385"}, "LORA_RANK=16385: too large; send at most 16384"),
        ({"MAX_SEQ_LEN": "1048577"}, "MAX_SEQ_LEN=1048577: too large; send at most 1048576"),
        (
            {"MAX_SEQ_LEN": "9" * 5000},
            "MAX_SEQ_LEN=9999999999999999999999999999999999999999… (5000 characters): too large",
        ),
        (
            {"OUTPUT_DIR": "file://tmp/x"},
            "OUTPUT_DIR=file://tmp/x: names the host `tmp`, and only this machine's",
        ),
        (
            {"OUTPUT_DIR": "file://nfs.example/out"},
            "send file:///nfs.example/out if that was meant as a local path",
        ),
        ({"OUTPUT_DIR": "file:///tmp/x?y=1"}, "OUTPUT_DIR=file:///tmp/x?y=1: not a local file URL"),
        (
            {"OUTPUT_DIR": "s3://bucket/finetunes/x/"},
            "OUTPUT_DIR=s3://bucket/finetunes/x/: only a local path",
        ),
        ({"LORA_RANK": "x"}, "LORA_RANK=x: not a whole number; send an integer such as 16"),
        ({"LORA_RANK": "8.5"}, "LORA_RANK=8.5: not a whole number"),
        ({"LORA_RANK": "0"}, "LORA_RANK=0: input should be greater than 0 (it sets `lora_r`)"),
        ({"MAX_SEQ_LEN": "1"}, "MAX_SEQ_LEN=1: input should be greater than 1 (it sets `sequence_len`)"),
        ({"BATCH_SIZE": "0"}, "BATCH_SIZE=0: input should be greater than or equal to 1"),
        ({"GRAD_ACCUM": "-2"}, "GRAD_ACCUM=-2: not a whole number"),
        ({"LORA_ALPHA": "big"}, "LORA_ALPHA=big: not a finite number; send a decimal such as 32.0"),
        ({"LORA_DROPOUT": "1.5"}, "LORA_DROPOUT=1.5: input should be less than 1 (it sets `lora_dropout`)"),
        ({"LEARNING_RATE": "nan"}, "LEARNING_RATE=nan: not a finite number"),
        ({"LEARNING_RATE": "-1"}, "LEARNING_RATE=-1: input should be greater than or equal to 0"),
        ({"WARMUP_RATIO": "2"}, "WARMUP_RATIO=2: input should be less than or equal to 1"),
        ({"WEIGHT_DECAY": "-0.1"}, "WEIGHT_DECAY=-0.1: input should be greater than or equal to 0"),
    ],
)
def test_rejections_name_the_variable_and_what_to_send(dirs, values, expected):
    assert expected in _error(_env(dirs, **values))


@pytest.mark.parametrize(
    ("values", "qlora"),
    [
        ({"METHOD": "qlora"}, True),
        ({"METHOD": "QLoRA", "QUANT_4BIT": "true"}, True),
        ({"METHOD": "lora", "QUANT_4BIT": "TRUE"}, True),
        ({"METHOD": "lora", "QUANT_4BIT": "false"}, False),
        ({}, False),
    ],
)
def test_qlora_is_a_lora_adapter_on_a_4bit_base(dirs, values, qlora):
    config = trainjob_from_env(_env(dirs, **values)).config
    assert (config.adapter, config.load_in_4bit) == (("qlora", True) if qlora else ("lora", False))


def test_all_problems_are_reported_together(dirs):
    message = _error(_env(dirs, METHOD="sft", TASK="poetry", EPOCHS="0.5", LORA_RANK="r"))
    lines = message.splitlines()
    assert [line.split("=", 1)[0] for line in lines] == ["METHOD", "TASK", "EPOCHS", "LORA_RANK"]


@pytest.mark.parametrize("prefix", ["file://", "file://localhost", "FILE://LocalHost"])
def test_file_url_output_dir_is_a_local_path(dirs, tmp_path, prefix):
    job = trainjob_from_env(_env(dirs, OUTPUT_DIR=f"{prefix}{tmp_path}/my%20out"))
    assert job.output_dir == tmp_path / "my out"  # not the relative path localhost/…


@pytest.mark.parametrize(
    ("name", "largest"), [("EPOCHS", "10000"), ("BATCH_SIZE", "65536"), ("LORA_RANK", "+0016384")]
)
def test_whole_numbers_up_to_their_bound_are_accepted(dirs, name, largest):
    job = trainjob_from_env(_env(dirs, **{name: largest}))
    key = {"EPOCHS": "num_epochs", "BATCH_SIZE": "micro_batch_size", "LORA_RANK": "lora_r"}[name]
    assert getattr(job.config, key) == int(largest)


def test_output_dir_may_not_be_the_model(dirs):
    message = _error(_env(dirs, OUTPUT_DIR=dirs["MODEL_DIR"]))
    assert f"OUTPUT_DIR={dirs['MODEL_DIR']}: is the model folder itself" in message


def test_dry_run_prints_yaml_that_gym_train_accepts(dirs, capsys, monkeypatch):
    env = _env(dirs, LORA_RANK="4", EPOCHS="2")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["trainjob", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"# gym trainjob: OUTPUT_DIR={dirs['OUTPUT_DIR']}")
    assert not Path(dirs["OUTPUT_DIR"]).exists()  # a dry run writes nothing
    again = parse_config(yaml.safe_load(printed), "dry-run")
    assert again == trainjob_from_env(env).config
    assert again.lora_r == 4 and again.num_epochs == 2


def test_cli_reports_env_errors_without_traceback(dirs, capsys, monkeypatch):
    for name, value in _env(dirs, METHOD="dpo").items():
        monkeypatch.setenv(name, value)
    assert main(["trainjob", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: METHOD=dpo") and "Traceback" not in err


def test_method_full_is_full_fine_tuning_with_the_brokers_lora_zeros(dirs):
    """The hanzo-ft-full runtime sends METHOD=full and the broker's LoRA values as 0: no adapter, every weight."""
    job = trainjob_from_env(_env(dirs, METHOD="full", LORA_RANK="0", LORA_ALPHA="0", LORA_DROPOUT="0"))
    cfg = job.config
    assert cfg.full_fine_tuning and not cfg.load_in_4bit and cfg.adapter is None
    assert trainjob_from_env(_env(dirs, METHOD="FULL", QUANT_4BIT="false")).config.full_fine_tuning


def test_a_bad_data_row_leaves_the_previous_outputs_intact(tmp_path, tiny_base, capsys, monkeypatch):
    output = tmp_path / "output"
    earlier = {  # what an earlier job left: merged model, adapter, run directory
        "config.json": '{"model_type": "qwen3"}',
        "model.safetensors": "merged weights",
        "tokenizer.json": "{}",
        "adapter/adapter_config.json": '{"r": 16}',
        "adapter/adapter_model.safetensors": "adapter weights",
        "run/run_config.json": "{}",
        "run/metrics.jsonl": '{"step": 3}\n',
        "run/checkpoint-3/trainer_state.json": "{}",
    }
    for name, text in earlier.items():
        (output / name).parent.mkdir(parents=True, exist_ok=True)
        (output / name).write_text(text)
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "train.jsonl").write_text(json.dumps(CHAT_ROW) + "\n" + '{"messages": [\n')
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    env = {
        "MODEL_DIR": str(tiny_base),
        "DATASET_DIR": str(dataset),
        "OUTPUT_DIR": str(output),
        "TASK": "chat",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["trainjob"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "train.jsonl line 2" in err and "Traceback" not in err
    files = {str(p.relative_to(output)): p.read_text() for p in output.rglob("*") if p.is_file()}
    assert files == earlier
