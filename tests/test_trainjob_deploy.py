"""The deployment files (Dockerfile, Kubeflow Trainer v2 runtime and TrainJob) and an end-to-end
`gym trainjob` run with the manifests' environment on a tiny random model: what lands in OUTPUT_DIR and
who can load it."""

import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from hanzo_gym.cli import main
from hanzo_gym.cli.trainjob import VARIABLES, _publish_merged, trainjob_from_env

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
RUNTIME = DEPLOY / "kubeflow" / "clustertrainingruntime.yaml"
TRAINJOB = DEPLOY / "kubeflow" / "trainjob-example.yaml"
PET_RESERVED = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"
# replicatedJob name → (ancestor step, the container name the TrainingRuntime webhook requires)
REQUIRED_JOBS = {
    "dataset-initializer": ("dataset-initializer", "dataset-initializer"),
    "model-initializer": ("model-initializer", "model-initializer"),
    "node": ("trainer", "node"),
}


def _load(path):
    return yaml.safe_load(path.read_text())


def _node_container(runtime):
    jobs = {job["name"]: job for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
    return jobs["node"]["template"]["spec"]["template"]["spec"]["containers"][0]


def _manifest_env() -> dict[str, str]:
    """The node container's environment as Kubeflow builds it: the runtime's, with trainer.env upserted."""
    env = {item["name"]: item["value"] for item in _node_container(_load(RUNTIME)).get("env", [])}
    env.update({item["name"]: item["value"] for item in _load(TRAINJOB)["spec"]["trainer"]["env"]})
    return env


def test_cluster_training_runtime_has_the_v2_2_shape():
    runtime = _load(RUNTIME)
    assert runtime["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert runtime["kind"] == "ClusterTrainingRuntime"
    assert runtime["metadata"]["name"] == "hanzo-ft-lora"
    assert runtime["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "torch"
    policy = runtime["spec"]["mlPolicy"]
    assert policy["torch"] == {} and policy["numNodes"] == 1  # v2.2+: no numProcPerNode in the runtime
    template = runtime["spec"]["template"]["spec"]
    claims = [t["metadata"]["name"] for p in template["volumeClaimPolicies"] for t in p["templates"]]
    assert claims == ["initializer"]
    jobs = {job["name"]: job for job in template["replicatedJobs"]}
    assert set(jobs) == set(REQUIRED_JOBS)
    for name, (step, container_name) in REQUIRED_JOBS.items():
        job = jobs[name]
        assert job["template"]["metadata"]["labels"][ANCESTOR] == step  # on the Job template, not the Pod
        pod = job["template"]["spec"]["template"]
        assert ANCESTOR not in pod.get("metadata", {}).get("labels", {})
        containers = pod["spec"]["containers"]
        assert [c["name"] for c in containers] == [container_name]
        assert {"name": "initializer", "mountPath": "/workspace"} in containers[0]["volumeMounts"]
    assert jobs["node"]["dependsOn"] == [
        {"name": "dataset-initializer", "status": "Complete"},
        {"name": "model-initializer", "status": "Complete"},
    ]
    node = _node_container(runtime)
    assert node["command"] == ["torchrun", "--no-python", "gym", "trainjob"]
    names = [item["name"] for item in node["env"]]
    assert not PET_RESERVED & set(names) and set(names) <= set(VARIABLES)
    assert {item["name"]: item["value"] for item in node["env"]}["METHOD"] == "lora"


def test_trainjob_example_fits_the_crd_and_the_runtime():
    job = _load(TRAINJOB)
    runtime = _load(RUNTIME)
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and job["kind"] == "TrainJob"
    name = job["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63
    ref = job["spec"]["runtimeRef"]
    assert ref["name"] == runtime["metadata"]["name"]
    assert ref.get("kind", "ClusterTrainingRuntime") == runtime["kind"]
    assert ref.get("apiGroup", "trainer.kubeflow.org") == "trainer.kubeflow.org"
    for initializer in job["spec"]["initializer"].values():
        assert re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*://.+", initializer["storageUri"])
    trainer = job["spec"]["trainer"]
    assert isinstance(trainer["numProcPerNode"], int) and isinstance(trainer["numNodes"], int)
    assert trainer["command"] == _node_container(runtime)["command"]
    names = [item["name"] for item in trainer["env"]]
    assert not PET_RESERVED & set(names)
    assert set(names) <= set(VARIABLES), set(names) - set(VARIABLES)  # no typo'd variable is silently ignored
    assert len(names) == len(set(names)) <= 128


def test_dockerfile_runs_gym_trainjob_from_a_cuda_base():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    base = next(line for line in lines if line.startswith("ARG BASE_IMAGE="))
    assert "cuda" in base
    assert "FROM ${BASE_IMAGE}" in lines
    entrypoint = [line for line in lines if line.startswith("ENTRYPOINT")]
    cmd = [line for line in lines if line.startswith("CMD")]
    assert [json.loads(line.removeprefix("ENTRYPOINT")) for line in entrypoint] == [["gym"]]
    assert [json.loads(line.removeprefix("CMD")) for line in cmd] == [["trainjob"]]
    assert "pip install -c /tmp/constraints.txt '.[qlora]'" in text  # this package, with bitsandbytes
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert "*" in ignored and "!src/" in ignored and "!pyproject.toml" in ignored


def _workspace(tmp_path, tiny_base) -> Path:
    """What the initializers leave on the volume: the model and a dataset of mixed jsonl and parquet."""
    workspace = tmp_path / "workspace"
    (workspace / "dataset" / "more").mkdir(parents=True)
    (workspace / "model").symlink_to(tiny_base, target_is_directory=True)
    rows = [
        {"instruction": f"Add {a} and {b}.", "input": "", "output": f"{a} plus {b} is {a + b}."}
        for a in range(2)
        for b in range(3)
    ]
    (workspace / "dataset" / "part-a.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:3]))
    pq.write_table(pa.Table.from_pylist(rows[3:]), workspace / "dataset" / "more" / "part-b.parquet")
    return workspace


def _set_env(monkeypatch, workspace: Path, **extra):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    env = {
        name: value.replace("/workspace", str(workspace), 1) if value.startswith("/workspace") else value
        for name, value in {**_manifest_env(), **extra}.items()
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def test_trainjob_end_to_end_with_the_manifest_environment(tmp_path, tiny_base, monkeypatch, capsys):
    workspace = _workspace(tmp_path, tiny_base)
    env = _set_env(monkeypatch, workspace)
    assert env["GRADIENT_CHECKPOINTING"] == "true" and env["TASK"] == "instruct"
    output = workspace / "output"
    output.mkdir()
    (output / "model-00001-of-00002.safetensors").write_bytes(b"a stale shard of an earlier merge")
    (output / "notes.txt").write_text("kept")

    assert main(["trainjob"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("trainjob config:\n") and "removed the previous run's" in printed

    # the run directory: resolved config and metrics (6 rows, 2 × 8 per step → 1 step per epoch, 3 epochs)
    run = output / "run"
    resolved = json.loads((run / "run_config.json").read_text())
    assert resolved["gradient_checkpointing"] is True and resolved["lora_r"] == 16
    assert resolved["datasets"][0]["path"].endswith("dataset/more/part-b.parquet")
    assert resolved["datasets"][1]["path"].endswith("dataset/part-a.jsonl")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [3]  # logging_steps 10: the last step is always logged
    assert rows[0]["trained_tokens"] > 0

    # the adapter: plain PEFT, vLLM-safe, naming the hub model rather than the job's volume
    adapter = output / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "Qwen/Qwen3-0.6B"
    assert config["r"] == 16 and config["lora_alpha"] == 32 and config["bias"] == "none"
    assert not config.get("modules_to_save") and not config.get("use_dora")
    with safe_open(adapter / "adapter_model.safetensors", "pt") as tensors:
        keys = list(tensors.keys())
    assert keys and all(re.search(r"\.lora_[AB]\.weight$", key) for key in keys)

    # the merged model at the top: a plain transformers model and tokenizer, readable by other users
    assert not (output / "model-00001-of-00002.safetensors").exists()
    assert (output / "notes.txt").read_text() == "kept"
    assert json.loads((output / "config.json").read_text())["model_type"] == "qwen3"
    assert (output / "model.safetensors").stat().st_mode & 0o044 == 0o044
    assert not [p for p in output.rglob(".*")]
    tokens = torch.tensor([[9707, 11, 1879, 0, 42, 77, 5]])
    merged = AutoModelForCausalLM.from_pretrained(output)
    base = AutoModelForCausalLM.from_pretrained(tiny_base)
    with torch.no_grad():
        base_logits = base(tokens).logits
        adapted_logits = PeftModel.from_pretrained(base, str(adapter)).eval()(tokens).logits
        merged_logits = merged(tokens).logits
    assert not torch.allclose(adapted_logits, base_logits, atol=1e-6)  # training moved the adapter
    torch.testing.assert_close(merged_logits, adapted_logits, rtol=1e-4, atol=1e-5)
    assert AutoTokenizer.from_pretrained(output)("What is 2 plus 2?")["input_ids"]


def test_method_full_writes_the_trained_model_where_the_merged_one_goes(
    tmp_path, tiny_base, monkeypatch, capsys
):
    """METHOD=full (the hanzo-ft-full runtime, with the broker's LoRA values 0): every weight trained, the model
    at OUTPUT_DIR's top as deploy serves it, run/ inside, and no adapter/ (an earlier job's is removed)."""
    workspace = _workspace(tmp_path, tiny_base)
    _set_env(
        monkeypatch,
        workspace,
        METHOD="full",
        QUANT_4BIT="false",
        LORA_RANK="0",
        LORA_ALPHA="0",
        LORA_DROPOUT="0",
    )
    output = workspace / "output"
    (output / "adapter").mkdir(parents=True)
    (output / "adapter" / "adapter_config.json").write_text('{"r": 16}')
    assert main(["trainjob"]) == 0
    printed = capsys.readouterr().out
    assert "#   trained model:" in printed and "removed the previous run's adapter/" in printed
    assert not (output / "adapter").exists()
    resolved = json.loads((output / "run" / "run_config.json").read_text())
    assert resolved["adapter"] is None
    trained, base = (
        AutoModelForCausalLM.from_pretrained(output),
        AutoModelForCausalLM.from_pretrained(tiny_base),
    )
    assert (output / "model.safetensors").stat().st_mode & 0o044 == 0o044
    moved = [
        name
        for name, weight in base.state_dict().items()
        if not torch.equal(weight, trained.state_dict()[name])
    ]
    assert any("mlp" in name for name in moved) and any("embed_tokens" in name for name in moved)
    assert AutoTokenizer.from_pretrained(output)("What is 2 plus 2?")["input_ids"]
    assert not [p for p in output.rglob(".*")]


def test_a_crash_while_writing_the_merged_model_leaves_nothing_half_written(tmp_path, tiny_base, monkeypatch):
    workspace = _workspace(tmp_path, tiny_base)
    _set_env(monkeypatch, workspace)
    job = trainjob_from_env(os.environ)
    job.output_dir.mkdir()

    class Dies:
        def save_pretrained(self, directory):
            (Path(directory) / "config.json").write_text("{}")
            (Path(directory) / "model.safetensors").write_bytes(b"half")
            raise KeyboardInterrupt  # the pod is killed mid-write

    monkeypatch.setattr("hanzo_gym.cli.merge.merged_from", lambda cfg, adapter: (Dies(), Dies()))
    with pytest.raises(KeyboardInterrupt):
        _publish_merged(job)
    assert list(job.output_dir.iterdir()) == []
