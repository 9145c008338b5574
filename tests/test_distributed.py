"""Data-parallel training under torchrun on CPU (gloo, 2 processes), launched as Kubeflow launches it:
`torchrun --no-python gym …` with the PET_* variables the torch plugin injects.

A `sitecustomize` on the workers' PYTHONPATH installs an audit hook that records every write under the output
directory, per rank, so the tests can check that rank 0 alone writes. It can also kill a worker at a chosen
write (an interrupted run) and make GRPO sample each prompt with a seed of its own (so that runs on 1 and 2
processes draw the same completions and can be compared)."""

import itertools
import json
import os
import runpy
import socket
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from config_files import write_tiny_run
from conftest import save_tiny_word_model
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hanzo_gym.cli import main
from hanzo_gym.cli.trainjob import VARIABLES
from hanzo_gym.engine import Engine, distributed
from hanzo_gym.errors import GymError
from hanzo_gym.loops import checkpoint
from hanzo_gym.loops.run_dir import TRAINER_STATE, RunDir

BIN = Path(sys.executable).parent

# GRPO samples a step's prompts in one batch from one generator seeded per rank, so what a prompt draws
# depends on which other prompts share its process. This patch samples each prompt alone, seeded by the
# step's seed (the rank's share taken out) and the prompt: the same draws on any number of processes.
PER_PROMPT_SEEDS = """
import dataclasses, zlib
from hanzo_gym import engine as _engine
from hanzo_gym.engine.distributed import rank as _rank
from hanzo_gym.loops.grpo import RANK_SEED_STRIDE as _STRIDE

_original = _engine.Engine.sample

def _per_prompt(self, prompts, num_samples, params):
    if params.temperature == 0:
        return _original(self, prompts, num_samples, params)
    step_seed = params.seed - _rank() * _STRIDE
    seeds = [step_seed + zlib.crc32(str(list(p)).encode()) for p in prompts]
    return [
        _original(self, [p], num_samples, dataclasses.replace(params, seed=seed))[0]
        for p, seed in zip(prompts, seeds)
    ]

_engine.Engine.sample = _per_prompt
"""

AUDIT = """
import atexit, json, os, sys
_out, _watch = os.environ.get("GYM_TEST_AUDIT_DIR"), os.environ.get("GYM_TEST_WATCH_DIR")
_crash_at = os.environ.get("GYM_TEST_CRASH_AT")
if os.environ.get("GYM_TEST_PER_PROMPT_SEEDS") and os.environ.get("RANK") is not None:
    exec(PER_PROMPT_SEEDS)
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
                if _crash_at and _crash_at in path:
                    os._exit(3)  # killed mid-run: no cleanup, no atexit

    sys.addaudithook(_hook)

    def _dump():
        with open(os.path.join(_out, "rank-%s.json" % os.environ["RANK"]), "w") as handle:
            json.dump(_seen, handle)

    atexit.register(_dump)
"""


@pytest.fixture(scope="module")
def word_base(tmp_path_factory, word_tokenizer):
    return save_tiny_word_model(tmp_path_factory.mktemp("tiny-word-llama"), word_tokenizer)


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


@dataclass
class Launch:
    writes: dict[int, list]  # each rank's recorded writes under the watched folder
    stdout: str


def _torchrun(tmp_path, command: list[str], env: dict[str, str], watch: Path, check: bool = True) -> Launch:
    """Run `torchrun --no-python <command>` on 2 CPU processes the way Kubeflow's torch plugin configures it;
    return each rank's recorded writes under `watch` and what the processes printed."""
    site = Path(tempfile.mkdtemp(prefix="site-", dir=tmp_path))
    (site / "sitecustomize.py").write_text(f"PER_PROMPT_SEEDS = {PER_PROMPT_SEEDS!r}\n{AUDIT}")
    audit = Path(tempfile.mkdtemp(prefix="audit-", dir=tmp_path))
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
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    else:
        assert done.returncode != 0, done.stdout[-3000:]
    assert done.stdout.count("trainjob config:") <= 1  # rank 0 alone prints
    writes = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in audit.glob("rank-*.json")}
    return Launch(writes, done.stdout)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_train_exactly_as_one_with_the_same_global_batch_and_rank_0_merges(
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
    # two processes: 1 micro-batch each per step, and the merged model too
    two = tmp_path / "two"
    env = {**common, "GRAD_ACCUM": "1", "OUTPUT_DIR": str(two), "MERGE": "true"}
    launch = _torchrun(tmp_path, ["gym", "trainjob"], env, watch=two)
    writes = launch.writes

    # MERGE=false: the adapter and the run files, no merged model
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["adapter", "run"]
    # MERGE=true: the merged model beside them, written once (by rank 0), no staging folder left over
    assert {"adapter", "run", "config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in two.iterdir()
    }
    assert not [p.name for p in two.iterdir() if p.name.startswith(".")]
    assert launch.stdout.count("wrote merged model to") == 1
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

    assert sorted(writes) == [0, 1]  # both exited cleanly (the audit is written at exit)
    assert writes[1] == []  # rank 1 wrote nothing under OUTPUT_DIR: no run files, adapter or merged model
    written = [path for _, path in writes[0]]
    assert any(p.endswith("/run/metrics.jsonl") for p in written) and any("adapter" in p for p in written)
    assert any(p.endswith(".safetensors") and "/adapter" not in p for p in written)

    # the merged model loads as a plain model and computes what the base with the adapter computes
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    merged = AutoModelForCausalLM.from_pretrained(two).eval()
    base = AutoModelForCausalLM.from_pretrained(word_base)
    with_adapter = PeftModel.from_pretrained(base, tmp_path / "one" / "adapter").eval()
    with torch.no_grad():
        expected, got = with_adapter(ids).logits, merged(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(word_base).eval()(ids).logits
    assert (expected - plain).abs().max() > 1e-3  # the adapter changes the output, so equality means merged
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def _grpo_config(tmp_path, word_base, name: str, micro_batch_size: int) -> tuple[Path, Path]:
    prompts = tmp_path / "count.jsonl"
    starts = ["one two three", "two three four", "five six seven", "a b c", "d e f", "six seven eight"]
    prompts.write_text("".join(json.dumps({"text": t, "answer": "four"}) + "\n" for t in starts * 4))
    out = tmp_path / name
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
        "micro_batch_size": micro_batch_size,  # per process
        "num_epochs": 1,
        "max_steps": 3,
        "learning_rate": 3e-2,
        "lr_scheduler": "constant",
        "logging_steps": 1,
        "save_steps": 2,
        "seed": 3,
        # fp32: one process and two sum the same gradients in another order, which bf16 rounds apart
        "bf16": False,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, out


@pytest.mark.slow
def test_grpo_on_two_processes_matches_one_process_at_the_same_global_batch(tmp_path, word_base, monkeypatch):
    # one process, 4 prompts per step, each prompt sampled with its own seed (see PER_PROMPT_SEEDS)
    one_yaml, one = _grpo_config(tmp_path, word_base, "one", micro_batch_size=4)
    monkeypatch.setattr(Engine, "sample", Engine.sample)  # restored after the test
    (tmp_path / "per_prompt_seeds.py").write_text(PER_PROMPT_SEEDS)
    runpy.run_path(str(tmp_path / "per_prompt_seeds.py"))
    assert main(["train", str(one_yaml)]) == 0
    # two processes, 2 prompts each per step: the same 4 prompts, the same draws
    two_yaml, two = _grpo_config(tmp_path, word_base, "two", micro_batch_size=2)
    launch = _torchrun(
        tmp_path, ["gym", "train", str(two_yaml)], {"GYM_TEST_PER_PROMPT_SEEDS": "1"}, watch=two
    )

    one_rows, two_rows = _rows(one), _rows(two)
    train_rows = [r for r in two_rows if "reward" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]  # one row per step: rank 0 alone logs
    # 20 training prompts, 4 per global step → 5 steps per epoch (a per-process count would give 10)
    assert [r["epoch"] for r in train_rows] == [0.2, 0.4, 0.6]
    assert [r["step"] for r in two_rows] == [r["step"] for r in one_rows] == [0, 1, 2, 3, 3]
    for a, b in zip(one_rows, two_rows):
        # rewards and lengths gathered from both processes are those of the one-process step
        for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "eval/reward"):
            assert (key in a) == (key in b)
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-9, abs=1e-12), key
        if "loss" in a:  # the loss and the gradient of the global batch, summed over processes
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-7)
    assert any(r.get("grad_norm", 0) > 0 for r in one_rows)  # some steps trained
    assert 0 < statistics.mean(r["reward"] for r in train_rows) < 1  # rewards vary: advantages are not all 0
    one_adapter, two_adapter = (load_file(d / "adapter_model.safetensors") for d in (one, two))
    assert max(t.abs().max().item() for k, t in one_adapter.items() if "lora_B" in k) > 1e-3
    for key in one_adapter:
        torch.testing.assert_close(two_adapter[key], one_adapter[key], rtol=1e-4, atol=1e-6)
    assert (two / "checkpoint-2" / "adapter_model.safetensors").is_file()
    assert launch.writes[1] == [] and launch.writes[0]


def _sft_config(tmp_path, word_base, chat_dir, name: str, grad_accum: int, **extra) -> tuple[Path, Path]:
    settings = {"micro_batch_size": 2, "gradient_accumulation_steps": grad_accum, "num_epochs": 2}
    settings.update(learning_rate=0.01, save_steps=2, bf16="auto", seed=42, **extra)
    return write_tiny_run(tmp_path, word_base, chat_dir / "first.jsonl", name, **settings), tmp_path / name


@pytest.mark.slow
def test_a_run_interrupted_under_torchrun_resumes_to_the_uninterrupted_adapter(tmp_path, word_base, chat_dir):
    # uninterrupted: one process, 2 micro-batches of 2 per step (12 rows → 3 steps per epoch, 6 in all)
    whole_yaml, whole = _sft_config(tmp_path, word_base, chat_dir, "whole", grad_accum=2)
    assert main(["train", str(whole_yaml)]) == 0
    # two processes, killed as rank 0 starts writing checkpoint-4 (steps 3 and 4 are lost)
    cut_yaml, cut = _sft_config(
        tmp_path, word_base, chat_dir, "cut", grad_accum=1, resume_from_checkpoint=True
    )
    _torchrun(
        tmp_path,
        ["gym", "train", str(cut_yaml)],
        {"GYM_TEST_CRASH_AT": ".checkpoint-4.tmp-"},
        cut,
        check=False,
    )
    assert sorted(p.name for p in cut.glob("checkpoint-*")) == ["checkpoint-2"]
    assert not (cut / "adapter_model.safetensors").exists()
    # the same command again resumes from checkpoint-2 and finishes
    launch = _torchrun(tmp_path, ["gym", "train", str(cut_yaml)], {}, cut)
    assert launch.stdout.count(f"resumed from {cut / 'checkpoint-2'} at step 2") == 1  # rank 0 alone says so
    assert launch.writes[1] == []

    whole_rows, cut_rows = _rows(whole), _rows(cut)
    assert [r["step"] for r in cut_rows] == [r["step"] for r in whole_rows] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(whole_rows, cut_rows):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    whole_adapter, cut_adapter = (load_file(d / "adapter_model.safetensors") for d in (whole, cut))
    for key in whole_adapter:
        torch.testing.assert_close(cut_adapter[key], whole_adapter[key], rtol=1e-4, atol=1e-6)


def test_resume_fails_on_every_rank_when_one_cannot_see_the_checkpoint(tmp_path, monkeypatch):
    """What a second node with its own output_dir disk would see: rank 0's checkpoint is not there."""
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / TRAINER_STATE).write_text("{}")
    monkeypatch.setattr(checkpoint, "gather_objects", lambda seen: [seen, False, True, False])
    with pytest.raises(GymError, match=r"rank\(s\) 1, 3 cannot see it .* storage that every node mounts"):
        checkpoint.starting_position(None, RunDir(tmp_path, writer=False), {}, tmp_path / "checkpoint-2")
    monkeypatch.setattr(checkpoint, "gather_objects", lambda seen: [False, seen])
    with pytest.raises(GymError, match="is not a complete checkpoint"):  # rank 0 cannot see it either
        checkpoint.starting_position(None, RunDir(tmp_path, writer=False), {}, tmp_path / "checkpoint-2")


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
