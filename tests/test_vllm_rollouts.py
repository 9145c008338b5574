"""GRPO rollouts through a real vLLM on the real SmolLM2, in float32: vLLM colocated in this process (both ways
of handing it the policy) and a `vllm serve` started by `gym vllm-serve`. They run in their own environment,
which has vLLM (`make test-vllm`; vLLM pins another transformers than the project's).

The built-in sampler is the reference: greedy rollouts must equal its rollouts token for token, and vLLM's
sampled log-probabilities must equal the trainer's recomputed ones within 1e-3."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hanzo_gym.config import load_config
from hanzo_gym.engine.distributed import world_size
from hanzo_gym.loops.train import build_engine
from hanzo_gym.model.hub import load_tokenizer
from hanzo_gym.model.load_plan import LoadPlan
from hanzo_gym.records import Datum, SamplingParams
from hanzo_gym.rollout import rollout_sampler

pytestmark = pytest.mark.vllm

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
QUESTIONS = ["What is 2 + 3?", "Name a colour.", "Say hello in French.", "What is 7 + 1? Answer briefly."]


def _config(tmp_path: Path, gguf: Path, trl_extra: str, top: str = "", steps: int = 2) -> Path:
    text = f"""\
base_model: {gguf}
datasets:
  - path: {EXAMPLES / "addition-prompts.jsonl"}
    type: chat_template
val_set_size: 4
output_dir: {tmp_path / "out"}
sequence_len: 128
bf16: false
adapter: lora
lora_r: 16
lora_alpha: 32
lora_target_linear: true
micro_batch_size: 2
max_steps: {steps}
learning_rate: 3.0e-4
logging_steps: 1
eval_steps: {steps}
seed: 7
rl: grpo
trl:
  num_generations: 4
  max_completion_length: 12
  reward_funcs: [numeric_match, "length:9"]
  reward_weights: [1.0, 0.5]
  use_vllm: true
{trl_extra}{top}"""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def _prompts(tokenizer) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for q in QUESTIONS
    ]


def _perturb_adapter(engine, seed: int) -> None:
    """What an optimizer step does to the policy, in one move: every B matrix away from zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in engine.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


@pytest.fixture(scope="module", params=["merged", "adapter"])
def colocated(request, model_cache, tmp_path_factory):
    """(engine, vLLM sampler) on the real model; the adapter already moved away from the base."""
    tmp_path = tmp_path_factory.mktemp(f"colocate-{request.param}")
    extra = "  vllm_mode: colocate\n  vllm_gpu_memory_utilization: 0.25\n"
    if request.param == "adapter":
        extra += "  vllm_lora_sync: true\n"
    cfg = load_config(_config(tmp_path, model_cache.gguf, extra))
    tokenizer = load_tokenizer(cfg.base_model)
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32), tokenizer)
    _perturb_adapter(engine, seed=1)
    sampler = rollout_sampler(engine, cfg, tmp_path / "policy")
    yield engine, sampler
    sampler.close()


def test_greedy_rollouts_equal_the_built_in_samplers(colocated):
    engine, sampler = colocated
    prompts = _prompts(engine.tokenizer)
    params = SamplingParams(max_tokens=16, temperature=0.0, seed=0)
    ours = engine.sample(prompts, 1, params)
    theirs = sampler.sample(prompts, 1, params)
    assert [[s.tokens for s in g] for g in theirs] == [[s.tokens for s in g] for g in ours]
    assert [[s.stop_reason for s in g] for g in theirs] == [[s.stop_reason for s in g] for g in ours]


def test_the_next_rollout_after_an_optimizer_step_samples_the_new_policy(colocated):
    engine, sampler = colocated
    prompts = _prompts(engine.tokenizer)
    params = SamplingParams(max_tokens=16, temperature=0.0, seed=0)
    before = sampler.sample(prompts, 1, params)
    _perturb_adapter(engine, seed=2)
    sampler.policy_changed()
    after = sampler.sample(prompts, 1, params)
    ours = engine.sample(prompts, 1, params)
    assert [[s.tokens for s in g] for g in after] == [[s.tokens for s in g] for g in ours]
    assert [[s.tokens for s in g] for g in after] != [[s.tokens for s in g] for g in before]


def test_sampled_logprobs_equal_the_trainers_recomputed_ones(colocated):
    engine, sampler = colocated
    prompts = _prompts(engine.tokenizer)
    groups = sampler.sample(prompts, 4, SamplingParams(max_tokens=12, temperature=1.0, seed=5))
    datums, sampled = [], []
    for prompt, group in zip(prompts, groups):
        assert len({tuple(s.tokens) for s in group}) > 1  # n samples per prompt, not one repeated
        for s in group:
            tokens = prompt + s.tokens
            datums.append(Datum.from_tokens(tokens[:-1], target_tokens=tokens[1:]))
            sampled.append(torch.tensor(s.logprobs))
    recomputed = engine.forward(datums)
    worst = max((r[-len(s) :] - s).abs().max().item() for r, s in zip(recomputed, sampled, strict=True))
    assert worst < 1e-3, worst


def test_seeded_rollouts_repeat(colocated):
    engine, sampler = colocated
    prompts = _prompts(engine.tokenizer)[:2]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    first = sampler.sample(prompts, 3, params)
    again = sampler.sample(prompts, 3, params)
    assert [[s.tokens for s in g] for g in first] == [[s.tokens for s in g] for g in again]


def _train(config: Path, env: dict) -> tuple[str, list[dict]]:
    done = subprocess.run(
        [sys.executable, "-m", "hanzo_gym.cli", "train", str(config)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = load_config(config).output_dir
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return done.stdout, rows


def _check_run(stdout: str, rows: list[dict], what: str) -> None:
    assert f"rollouts: {what}" in stdout
    trained = [r for r in rows if "optim/kl_sample_train_v1" in r]
    assert trained, rows
    assert all(abs(r["optim/kl_sample_train_v1"]) < 1e-3 for r in trained)  # sampler and trainer agree
    assert any(r.get("eval/accuracy") is not None for r in rows)


def test_gym_train_grpo_with_colocated_vllm(model_cache, tmp_path):
    assert world_size() == 1
    config = _config(
        tmp_path, model_cache.gguf, "  vllm_mode: colocate\n  vllm_gpu_memory_utilization: 0.25\n"
    )
    stdout, rows = _train(config, {**os.environ, "HANZO_GYM_CACHE": str(model_cache.cache)})
    _check_run(stdout, rows, "vLLM")
    assert not (tmp_path / "out" / "vllm-policy").exists()  # the hand-over folders are gone


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_gym_train_qlora_grpo_with_colocated_vllm_samples_the_4bit_policy(model_cache, tmp_path, sync):
    """QLoRA: vLLM loads the base from disk in full precision, and is handed the NF4 values the trainer computes
    with (folded with the adapter, or once before the first adapter), so its sampled log-probabilities are the
    trainer's within 1e-3 as over a full-precision base."""
    extra = "  vllm_mode: colocate\n  vllm_gpu_memory_utilization: 0.25\n"
    if sync == "adapter":
        extra += "  vllm_lora_sync: true\n"
    config = _config(tmp_path, model_cache.gguf, extra)
    config.write_text(config.read_text().replace("adapter: lora\n", "adapter: qlora\nload_in_4bit: true\n"))
    stdout, rows = _train(config, {**os.environ, "HANZO_GYM_CACHE": str(model_cache.cache)})
    _check_run(stdout, rows, "vLLM")


def test_gym_train_grpo_with_colocated_vllm_under_torchrun(model_cache, tmp_path):
    """Two processes, each with an engine of its own (vLLM joins torchrun's processes, TRL's external
    launcher), sampling its own prompts: the run trains, and each engine samples the policy both train."""
    config = _config(
        tmp_path, model_cache.gguf, "  vllm_mode: colocate\n  vllm_gpu_memory_utilization: 0.2\n"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "hanzo_gym.cli"]
    env = {**os.environ, "HANZO_GYM_CACHE": str(model_cache.cache), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*command, "train", str(config)], check=False, capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    _check_run(done.stdout, rows, "vLLM")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gym_train_grpo_against_a_vllm_server_from_gym_vllm_serve(model_cache, tmp_path):
    port = _free_port()
    top = f"vllm:\n  host: 127.0.0.1\n  port: {port}\n  gpu_memory_utilization: 0.25\n  enforce_eager: true\n"
    config = _config(tmp_path, model_cache.gguf, "  vllm_server_timeout: 300\n", top)
    env = {**os.environ, "HANZO_GYM_CACHE": str(model_cache.cache)}
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - the server outlives this statement
    server = subprocess.Popen(
        [sys.executable, "-m", "hanzo_gym.cli", "vllm-serve", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        started = time.monotonic()
        stdout, rows = _train(config, env)
        _check_run(stdout, rows, f"vLLM server at http://127.0.0.1:{port}")
        print(f"server mode run: {time.monotonic() - started:.0f} s")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()
    assert "--enable-lora" in (tmp_path / "server.log").read_text().splitlines()[0]
