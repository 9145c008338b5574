"""Experiment tracking (W&B, TensorBoard, MLflow) as Axolotl's keys ask for it, in offline modes: the values that
reach each tracker, read back from its own files, are the rows of metrics.jsonl under the same names."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import yaml

from hanzo_gym.cli import main
from hanzo_gym.config import parse_config
from hanzo_gym.config import tracking as tracking_module
from hanzo_gym.config.feature import feature_notes
from hanzo_gym.errors import ConfigError
from hanzo_gym.loops.trackers import Tracker, Trackers, tensorboard_dir

BASE = {
    "base_model": "some/model",
    "datasets": [{"path": "train.jsonl", "type": "chat_template"}],
    "output_dir": "out",
    "adapter": "lora",
    "lora_target_linear": True,
}


def _cfg(**keys):
    return parse_config({**BASE, **keys})


def _refusal(**keys) -> str:
    with pytest.raises(ConfigError) as caught:
        _cfg(**keys)
    return str(caught.value)


def test_which_trackers_a_config_turns_on_follows_axolotl():
    assert _cfg().trackers == []
    # Axolotl's example configs write every wandb key empty: nothing is logged
    empty = dict.fromkeys(("wandb_project", "wandb_entity", "wandb_watch", "wandb_name", "wandb_log_model"))
    assert _cfg(**empty).trackers == []
    assert _cfg(wandb_project="p").trackers == ["wandb"]
    assert _cfg(use_wandb=True).trackers == ["wandb"]
    assert _cfg(wandb_project="p", wandb_mode="disabled").trackers == []  # disabled: W&B off
    assert _cfg(use_tensorboard=True).trackers == ["tensorboard"]
    assert _cfg(mlflow_experiment_name="e").trackers == ["mlflow"]
    assert _cfg(use_mlflow=True, mlflow_tracking_uri="file:///tmp/x").trackers == ["mlflow"]
    every = _cfg(wandb_project="p", use_tensorboard=True, use_mlflow=True, wandb_watch=False)
    assert every.trackers == ["wandb", "tensorboard", "mlflow"]


def test_keys_of_a_tracker_that_is_off_are_refused_not_ignored():
    assert "`wandb_entity` set without `wandb_project`" in _refusal(wandb_entity="team")
    assert "`wandb_name`, `wandb_mode` set without `wandb_project`" in _refusal(
        wandb_name="n", wandb_mode="offline"
    )
    assert "would do nothing" in _refusal(wandb_project="p", wandb_mode="disabled", wandb_watch="all")
    assert "`mlflow_tracking_uri` set without" in _refusal(mlflow_tracking_uri="http://localhost:5000")
    assert "`mlflow_run_name` set without" in _refusal(mlflow_run_name="r")
    assert "allowed: 'online', 'offline' or 'disabled'" in _refusal(wandb_project="p", wandb_mode="dryrun")
    # any other text is what transformers' W&B callback reads as false, where Axolotl hands it
    from transformers.integrations.integration_utils import WandbLogModel

    unread = _cfg(wandb_project="p", wandb_log_model="my-model-name")
    assert unread.wandb_log_model == WandbLogModel("my-model-name").value == "false"
    assert feature_notes(unread) == [
        (
            "wandb_log_model: 'my-model-name' is none of checkpoint, end, false: transformers' W&B callback reads it "
            "as false (no model is uploaded to W&B), and so does this run"
        )
    ]
    # `false` in either spelling asks for nothing
    assert _cfg(wandb_entity=None, wandb_watch="false", wandb_log_model=False).trackers == []


def test_a_tracker_that_is_not_installed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what an import of a missing package finds
    message = _refusal(wandb_project="p", mlflow_experiment_name="e")
    assert (
        "MLflow logging is asked for but `mlflow` is not installed: pip install 'hanzo-gym[mlflow]'"
        in message
    )
    assert "wandb" not in message
    assert not tracking_module.installed("surely_no_such_module_here") and tracking_module.installed("yaml")


def test_rows_reach_every_tracker_with_the_names_of_metrics_jsonl():
    class Recorder(Tracker):
        def __init__(self):
            self.rows = []

        def log(self, row, step):
            self.rows.append((step, row))

    one, two = Recorder(), Recorder()
    trackers = Trackers([one, two])
    trackers.log({"step": 3, "epoch": 0.5, "loss": 1.25, "tokens": 40, "eval/loss": 2.0})
    expected = [(3, {"epoch": 0.5, "loss": 1.25, "tokens": 40.0, "eval/loss": 2.0})]
    assert one.rows == expected and two.rows == expected
    trackers.finish()
    assert not trackers


def test_tensorboard_logs_where_hf_puts_them(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    directory = tensorboard_dir(_cfg(output_dir=str(tmp_path / "out"), use_tensorboard=True))
    assert directory.parent == tmp_path / "out" / "runs"  # output_dir/runs/<Mon DD_HH-MM-SS>_<host>
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    assert tensorboard_dir(_cfg(use_tensorboard=True)) == tmp_path / "tb"


# ---- reading each tracker's own files back --------------------------------------------------------------------


def _wandb_records(path: Path):
    """The records of an offline W&B run file (`run-<id>.wandb`): a LevelDB-style log of protobuf records,
    32 KiB blocks, each chunk behind a 7-byte header (crc, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    position, pending = 7, b""
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if (length, kind) == (0, 0):
            position += left
            continue
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _wandb_history(wandb_dir: Path) -> tuple[list[dict], list]:
    import wandb

    # wandb's service process writes the run file behind the run's finish(); on a loaded machine the last
    # records (the end-of-run artifact) may not be there yet. Stopping the service flushes them.
    wandb.teardown()
    (run_file,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    rows, artifacts = [], []
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
        elif kind == "artifact":
            artifacts.append(record.artifact)
    return rows, artifacts


def _tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = directory.glob("runs/*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B files under tmp_path; wandb's process-wide settings (which keep the first run's WANDB_DIR) reset
    after the test."""
    import wandb

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield tmp_path
    wandb.teardown()


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    with open(path, "w") as handle:
        for a in range(6):
            for b in range(4):
                messages = [
                    {"role": "user", "content": f"{a} and {b}?"},
                    {"role": "assistant", "content": f"{a} and {b} make {a + b}."},
                ]
                handle.write(json.dumps({"messages": messages}) + "\n")
    return path


def _train_config(tmp_path, tiny_base, chat_data, **overrides) -> Path:
    cfg = {
        "base_model": str(tiny_base),
        "datasets": [{"path": str(chat_data), "type": "chat_template"}],
        "val_set_size": 0.25,
        "output_dir": str(tmp_path / "run"),
        "sequence_len": 64,
        "adapter": "lora",
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_target_linear": True,
        "micro_batch_size": 3,
        "gradient_accumulation_steps": 2,
        "num_epochs": 1,
        "learning_rate": 5e-3,
        "logging_steps": 1,
        "save_steps": 2,
        "seed": 3,
        **overrides,
    }
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"run-{len(list(tmp_path.glob('*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_gym_train_sends_every_metrics_row_to_wandb_tensorboard_and_mlflow(
    tmp_path, tiny_base, chat_data, monkeypatch, capsys, offline_wandb
):
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store without it
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    store = f"file://{tmp_path / 'mlruns'}"
    path = _train_config(
        tmp_path,
        tiny_base,
        chat_data,
        wandb_project="hanzo-test",
        wandb_name="tiny",
        wandb_mode="offline",
        wandb_watch="gradients",
        wandb_log_model="checkpoint",
        use_tensorboard=True,
        mlflow_tracking_uri=store,
        mlflow_experiment_name="hanzo-test",
        mlflow_run_name="tiny",
    )
    assert main(["train", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "W&B: run tiny in project hanzo-test (offline)" in printed and "TensorBoard: logging to" in printed
    run = tmp_path / "run"
    rows = _rows(run)
    assert any("eval/loss" in row for row in rows) and any("loss" in row for row in rows)
    expected = [(row["step"], key, value) for row in rows for key, value in row.items() if key != "step"]

    # W&B: one history row per metrics row, same names, `step` as the x axis
    history, artifacts = _wandb_history(tmp_path)
    logged = [
        {k: v for k, v in h.items() if not k.startswith("_") and not k.startswith("gradients/")}
        for h in history
    ]
    assert [row for row in logged if row] == rows
    assert {artifact.type for artifact in artifacts} == {"model"}
    checkpoints = [json.loads(line)["step"] for line in (run / "checkpoints.jsonl").read_text().splitlines()]
    # `checkpoint`: each checkpoint folder, then (as HF's `is_enabled` does for both values) the final adapter
    assert [set(a.aliases) - {"latest"} for a in artifacts] == [
        *({f"epoch_{round(step / 3, 2)}", f"checkpoint_global_step_{step}"} for step in checkpoints),
        {"final_model"},
    ]
    assert checkpoints == [2] and all(a.name == "model-tiny" for a in artifacts)
    assert "trainer_state.json" in {entry.path for entry in artifacts[0].manifest.contents}

    # TensorBoard: event files under output_dir/runs/<date>_<host>
    scalars = _tensorboard_scalars(run)
    got = sorted((step, tag, value) for tag, events in scalars.items() for step, value in events)
    assert [(step, tag) for step, tag, _ in got] == [(step, tag) for step, tag, _ in sorted(expected)]
    assert [value for *_, value in got] == pytest.approx(
        [v for *_, v in sorted(expected)], rel=1e-6
    )  # float32

    # MLflow: the local file store, read back through its client
    client = mlflow.MlflowClient(store)
    (found,) = client.search_runs([client.get_experiment_by_name("hanzo-test").experiment_id])
    assert found.info.run_name == "tiny" and found.info.status == "FINISHED"
    assert found.data.params["lora_r"] == "4"
    history = sorted(
        (m.step, key, m.value)
        for key in {k for _, k, _ in expected}
        for m in client.get_metric_history(found.info.run_id, key)
    )
    assert history == sorted(expected)


def test_trackers_change_no_number_of_the_run_and_end_artifact(tmp_path, tiny_base, chat_data, offline_wandb):
    plain = _train_config(
        tmp_path / "plain", tiny_base, chat_data, output_dir=str(tmp_path / "plain" / "run")
    )
    tracked = _train_config(
        tmp_path / "tracked",
        tiny_base,
        chat_data,
        output_dir=str(tmp_path / "tracked" / "run"),
        wandb_project="hanzo-test",
        wandb_mode="offline",
        wandb_log_model="end",
        use_tensorboard=True,
    )
    assert main(["train", str(plain)]) == 0 and main(["train", str(tracked)]) == 0
    drop = {"elapsed_s", "tokens_per_s"}
    strip = lambda rows: [{k: v for k, v in row.items() if k not in drop} for row in rows]
    assert strip(_rows(tmp_path / "plain" / "run")) == strip(_rows(tmp_path / "tracked" / "run"))
    _, artifacts = _wandb_history(tmp_path)
    (final,) = artifacts  # `end`: only the final adapter, no checkpoint
    assert final.type == "model" and "final_model" in final.aliases
    files = {entry.path for entry in final.manifest.contents}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files


def test_only_the_main_process_logs(monkeypatch, tmp_path):
    from hanzo_gym.loops import trackers as trackers_module

    monkeypatch.setattr(trackers_module, "is_main", lambda: False)
    cfg = _cfg(output_dir=str(tmp_path), use_tensorboard=True, wandb_project="p", wandb_mode="offline")
    assert not trackers_module.open_trackers(cfg, model=None)
    assert not (tmp_path / "runs").exists()


def test_mlflow_run_of_a_failed_training_is_marked_failed(tmp_path, monkeypatch):
    import mlflow

    from hanzo_gym.loops.trackers import open_trackers

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = f"file://{tmp_path / 'mlruns'}"
    cfg = _cfg(mlflow_tracking_uri=store, mlflow_experiment_name="failing")
    trackers = open_trackers(cfg, model=None)
    trackers.log({"step": 1, "epoch": 0.1, "loss": 3.5})
    trackers.finish(failed=True)
    client = mlflow.MlflowClient(store)
    (found,) = client.search_runs([client.get_experiment_by_name("failing").experiment_id])
    assert found.info.status == "FAILED" and found.data.metrics == {"epoch": 0.1, "loss": 3.5}


def test_an_mlflow_store_that_refuses_is_one_clear_error(tmp_path, monkeypatch):
    from hanzo_gym.errors import GymError
    from hanzo_gym.loops.trackers import open_trackers

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # MLflow 3 refuses a new file store then
    store = f"file://{tmp_path / 'mlruns'}"
    with pytest.raises(GymError, match=f"MLflow could not start a run at {store}: .*MLFLOW_ALLOW_FILE_STORE"):
        open_trackers(_cfg(mlflow_tracking_uri=store, mlflow_experiment_name="e"), model=None)


def test_wandb_watch_logs_gradient_histograms_every_hundred_passes(tmp_path, offline_wandb):
    import torch

    from hanzo_gym.loops.trackers import open_trackers

    model = torch.nn.Linear(3, 2)
    cfg = _cfg(wandb_project="p", wandb_mode="offline", wandb_watch="gradients", logging_steps=1)
    trackers = open_trackers(cfg, model)
    for step in range(1, 201):
        loss = model(torch.randn(4, 3)).pow(2).sum()
        loss.backward()
        trackers.log({"step": step, "loss": loss.item()})
    trackers.finish()
    history, _ = _wandb_history(tmp_path)
    # a histogram arrives as nested keys (gradients/weight/_type, …/bins, …/values); wandb names a process's
    # later watched models gradients/graph_<n>weight
    with_gradients = [
        row["step"] for row in history if any(k.startswith("gradients/") and "weight/" in k for k in row)
    ]
    assert with_gradients == [100, 200]  # log_freq max(100, logging_steps), as HF's callback
    assert [row["step"] for row in history if "loss" in row] == list(range(1, 201))


def test_eval_predictions_reach_each_tracker_as_a_table(tmp_path, monkeypatch, offline_wandb):
    """eval_table_size: an evaluation's completions as a W&B table, an MLflow table artifact and TensorBoard text,
    read back from each tracker's own files."""
    import mlflow
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hanzo_gym.loops.trackers import WANDB_TABLES, open_trackers

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    store = f"file://{tmp_path / 'mlruns'}"
    cfg = _cfg(
        output_dir=str(tmp_path / "run"),
        wandb_project="p",
        wandb_mode="offline",
        use_tensorboard=True,
        mlflow_tracking_uri=store,
        mlflow_experiment_name="tables",
    )
    records = [
        {"step": 4, "id": 0, "prompt": "2+2?", "reference": "4", "prediction": "4 | four"},
        {"step": 4, "id": 1, "prompt": "3+3?\nquick", "reference": "6", "prediction": "5"},
    ]
    trackers = open_trackers(cfg, model=None)
    trackers.table("eval_predictions", records, 4)
    trackers.finish()

    history, _ = _wandb_history(tmp_path)
    name = WANDB_TABLES["eval_predictions"]
    (logged,) = [row for row in history if name in row or f"{name}/_type" in row]
    assert logged["step"] == 4
    table_files = list(tmp_path.glob("wandb/offline-run-*/files/media/table/*.table.json"))
    (table,) = [json.loads(path.read_text()) for path in table_files]
    assert table["columns"] == ["step", "id", "prompt", "reference", "prediction"]
    assert table["data"] == [[4, 0, "2+2?", "4", "4 | four"], [4, 1, "3+3?\nquick", "6", "5"]]

    client = mlflow.MlflowClient(store)
    (found,) = client.search_runs([client.get_experiment_by_name("tables").experiment_id])
    local = Path(client.download_artifacts(found.info.run_id, "eval_predictions/step_4.json", str(tmp_path)))
    saved = json.loads(local.read_text())
    assert saved["columns"] == ["step", "id", "prompt", "reference", "prediction"] and len(saved["data"]) == 2

    (events,) = (tmp_path / "run").glob("runs/*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    (text,) = accumulator.Tensors("eval_predictions/text_summary")
    assert text.step == 4
    markdown = text.tensor_proto.string_val[0].decode()
    assert "| 4 | 0 | 2+2? | 4 | 4 \\| four |" in markdown and "3+3?<br>quick" in markdown
