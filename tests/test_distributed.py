"""Data-parallel training under torchrun on CPU (gloo, 2 processes), launched as Kubeflow launches it:
`torchrun --no-python gym …` with the PET_* variables the torch plugin injects.

A `sitecustomize` on the workers' PYTHONPATH installs an audit hook that records every write under the output
directory, per rank, so the tests can check that rank 0 alone writes."""

import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors.torch import load_file
from tiny_models import tiny_model

from hanzo_gym import distributed
from hanzo_gym.cli import main
from hanzo_gym.errors import GymError
from hanzo_gym.rundir import RunDir
from hanzo_gym.trainjob import VARIABLES

BIN = Path(sys.executable).parent

AUDIT = """
import atexit, json, os, sys
_out, _watch = os.environ.get("GYM_TEST_AUDIT_DIR"), os.environ.get("GYM_TEST_WATCH_DIR")
if _out and _watch and os.environ.get("RANK") is not None:
    _seen = []
    _WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    _EVENTS = ("os.rename", "os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree", "os.chmod", "os.truncate")

    def _hook(event, args):
        if event == "open":
            path, mode, flags = args
            if not (isinstance(mode, str) and set(mode) & set("wax+")) and not (flags or 0) & _WRITE:
                return
        elif event in _EVENTS:
            path = args[0]
        else:
            return
        if isinstance(path, (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(path))
            if path.startswith(_watch):
                _seen.append([event, path])

    sys.addaudithook(_hook)

    def _dump():
        with open(os.path.join(_out, "rank-%s.json" % os.environ["RANK"]), "w") as handle:
            json.dump(_seen, handle)

    atexit.register(_dump)
"""


@pytest.fixture(scope="module")
def word_base(tmp_path_factory, word_tokenizer):
    directory = tmp_path_factory.mktemp("tiny-word-llama")
    model = tiny_model(
        "llama",
        vocab_size=len(word_tokenizer),
        eos_token_id=word_tokenizer.eos_token_id,
        bos_token_id=None,
        initializer_range=0.2,
    )
    model.save_pretrained(directory)
    word_tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """22 chat rows in a jsonl and a parquet file: 11 micro-batches of 2, so with 2 processes the last window
    of each epoch gives rank 1 nothing to do."""
    directory = tmp_path_factory.mktemp("chat")
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "a"]
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"how are you {x}"},
                {"role": "assistant", "content": f"I am {y} {x} thanks"},
            ]
        }
        for x, y in itertools.islice(itertools.product(words, ["well", "fine"]), 22)
    ]
    with open(directory / "first.jsonl", "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows[:12])
    (directory / "more").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[12:]), directory / "more" / "second.parquet")
    return directory


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(tmp_path, command: list[str], env: dict[str, str], watch: Path) -> dict[int, list]:
    """Run `torchrun --no-python <command>` on 2 CPU processes the way Kubeflow's torch plugin configures it;
    return each rank's recorded writes under `watch`."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(AUDIT)
    audit = tmp_path / "audit"
    audit.mkdir()
    full_env = {
        **{k: v for k, v in os.environ.items() if k not in VARIABLES},
        **env,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "OMP_NUM_THREADS": "1",
        "PET_NNODES": "1",
        "PET_NPROC_PER_NODE": "2",
        "PET_NODE_RANK": "0",
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(_free_port()),
        "GYM_TEST_AUDIT_DIR": str(audit),
        "GYM_TEST_WATCH_DIR": str(watch),
    }
    done = subprocess.run(
        [str(BIN / "torchrun"), "--no-python", *command],
        env=full_env,
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("trainjob config:") <= 1  # rank 0 alone prints
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in audit.glob("rank-*.json")}


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_train_exactly_as_one_with_the_same_global_batch(
    tmp_path, word_base, chat_dir, monkeypatch
):
    common = {
        "MODEL_DIR": str(word_base),
        "DATASET_DIR": str(chat_dir),
        "TASK": "chat",
        "METHOD": "lora",
        "EPOCHS": "2",
        "BATCH_SIZE": "2",
        "LORA_RANK": "4",
        "LORA_ALPHA": "8",
        "LORA_DROPOUT": "0",
        "LEARNING_RATE": "0.01",
        "WARMUP_RATIO": "0.1",
        "MERGE": "false",
    }
    # one process: 2 micro-batches per step
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in {**common, "GRAD_ACCUM": "2", "OUTPUT_DIR": str(tmp_path / "one")}.items():
        monkeypatch.setenv(name, value)
    assert main(["trainjob"]) == 0
    # two processes: 1 micro-batch each per step
    two = tmp_path / "two"
    writes = _torchrun(
        tmp_path, ["gym", "trainjob"], {**common, "GRAD_ACCUM": "1", "OUTPUT_DIR": str(two)}, watch=two
    )

    # MERGE=false: the adapter and the run files, no merged model
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())
    assert sorted(p.name for p in two.iterdir()) == ["adapter", "run"]
    one_rows, two_rows = _rows(tmp_path / "one" / "run"), _rows(two / "run")
    # 11 micro-batches of 2 → 6 steps per epoch, 2 epochs; logging_steps 10 logs steps 10 and 12
    assert [r["step"] for r in two_rows] == [r["step"] for r in one_rows] == [10, 12]
    for a, b in zip(one_rows, two_rows):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)  # summed gradients, not averaged
        assert (b["tokens"], b["trained_tokens"]) == (a["tokens"], a["trained_tokens"])
    one_adapter = load_file(tmp_path / "one" / "adapter" / "adapter_model.safetensors")
    two_adapter = load_file(two / "adapter" / "adapter_model.safetensors")
    assert one_adapter.keys() == two_adapter.keys()
    moved = max(t.abs().max().item() for k, t in one_adapter.items() if "lora_B" in k)
    assert moved > 1e-3  # training moved the adapter, so equal adapters mean equal trajectories
    for key in one_adapter:
        torch.testing.assert_close(two_adapter[key], one_adapter[key], rtol=1e-4, atol=1e-6)

    assert sorted(writes) == [0, 1]
    assert writes[1] == []  # rank 1 wrote nothing under OUTPUT_DIR
    written = [path for _, path in writes[0]]
    assert any(p.endswith("/run/metrics.jsonl") for p in written) and any("adapter" in p for p in written)


def test_grpo_on_two_processes_shards_prompts_and_logs_the_global_step(tmp_path, word_base):
    prompts = tmp_path / "count.jsonl"
    starts = ["one two three", "two three four", "five six seven", "a b c", "d e f", "six seven eight"]
    prompts.write_text("".join(json.dumps({"text": t, "answer": "four"}) + "\n" for t in starts * 4))
    out = tmp_path / "grpo"
    cfg = {
        "base_model": str(word_base),
        "datasets": [{"path": str(prompts), "type": "completion"}],
        "val_set_size": 4,
        "output_dir": str(out),
        "sequence_len": 32,
        "adapter": "lora",
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_target_linear": True,
        "rl": "grpo",
        "trl": {"num_generations": 4, "max_completion_length": 3, "reward_funcs": ["format:four"]},
        "micro_batch_size": 2,  # per process: 4 prompts per step in all
        "num_epochs": 1,
        "max_steps": 3,
        "learning_rate": 3e-2,
        "lr_scheduler": "constant",
        "logging_steps": 1,
        "save_steps": 2,
        "seed": 3,
    }
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    writes = _torchrun(tmp_path, ["gym", "train", str(path)], {}, watch=out)

    rows = _rows(out)
    train_rows = [r for r in rows if "reward" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]  # one row per step: rank 0 alone logs
    # 20 training prompts, 4 per global step → 5 steps per epoch (a per-process count would give 10)
    assert [r["epoch"] for r in train_rows] == [0.2, 0.4, 0.6]
    for row in train_rows:
        assert 0.0 <= row["reward"] <= 1.0 and row["completions/mean_length"] > 0
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 3]  # held-out prompts scored across both processes
    assert (out / "checkpoint-2" / "adapter_model.safetensors").is_file()
    assert (out / "adapter_model.safetensors").is_file()
    assert writes[1] == [] and writes[0]


def test_one_process_helpers_are_no_ops(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.init_from_env() is False
    assert (distributed.rank(), distributed.world_size(), distributed.is_main()) == (0, 1, True)
    assert distributed.shard([1, 2, 3]) == [1, 2, 3]
    assert distributed.sum_across(1.5, 2) == [1.5, 2]
    assert distributed.gather_objects({"a": 1}) == [{"a": 1}]
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 2.0)
    distributed.sync_gradients([param])
    assert param.grad.tolist() == [2.0, 2.0, 2.0]


def test_a_half_configured_launch_is_named(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(
        GymError, match="WORLD_SIZE is 2 but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT unset"
    ):
        distributed.init_from_env()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(GymError, match="WORLD_SIZE=two: not an integer"):
        distributed.init_from_env()


def test_a_reading_run_dir_writes_nothing(tmp_path):
    run = RunDir(tmp_path / "run", writer=False)
    run.write_config({"a": 1})
    run.log({"step": 1})
    assert run.start_fresh() == []
    run.forget_after(0)
    final = run.save_checkpoint(1, 0.5, lambda d: (d / "x").write_text("x"))
    assert final == tmp_path / "run" / "checkpoint-1"
    assert not (tmp_path / "run").exists()
    assert run.metrics() == [] and run.latest_checkpoint() is None
