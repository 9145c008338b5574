"""ServiceClient: the entry point. It loads each base model once and hands out training and sampling clients
that share it (each with its own adapter)."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any, Literal, Self

import torch
from peft import LoraConfig

from hanzo_gym.errors import GymError
from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.host.sample_batcher import SampleBatcher
from hanzo_gym.model.hub import model_key
from hanzo_gym.model.lora import read_adapter, read_adapter_config
from hanzo_gym.tinker.paths import default_root, resolve
from hanzo_gym.tinker.sampling_client import SamplingClient
from hanzo_gym.tinker.training_client import RUN_RECORD_KEYS, TrainingClient, read_run_record
from hanzo_gym.tinker.types import GetServerCapabilitiesResponse, SupportedModel

LORA_ALPHA = 32  # Tinker's adapters are exported with lora_alpha 32
_ATTENTION_PARENTS = ("attn", "attention")


class ServiceClient:
    """`root` is where checkpoints go (default `$HANZO_GYM_RUNS`, else the cache's `runs/`). `device` and
    `dtype` default to what `bf16: auto` picks: CUDA when there is a GPU, else the CPU; bf16 where the device
    multiplies it natively (a CPU with avx512_bf16 or AMX), else fp32. `sampler="vllm"` samples through a
    colocated vLLM (hanzo_gym.rollout.vllm_batcher) instead of the built-in sampler. Tinker's connection
    settings (`api_key`, `base_url`, …) are accepted and mean nothing locally."""

    def __init__(
        self,
        user_metadata: dict[str, str] | None = None,
        project_id: str | None = None,
        *,
        root: str | Path | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        sampler: Literal["builtin", "vllm"] = "builtin",
        **connection_settings: Any,
    ):
        if sampler not in ("builtin", "vllm"):
            raise GymError(f"sampler must be `builtin` or `vllm` (got {sampler!r})")
        self._sampler = sampler
        self.root = Path(root).expanduser() if root is not None else default_root()
        self._device = torch.device(device) if device is not None else None
        self._dtype = dtype
        self._hosts: dict[str, tuple[ModelHost, SampleBatcher]] = {}
        self._lock = threading.Lock()

    def get_server_capabilities(self) -> GetServerCapabilitiesResponse:
        """The base models already loaded in this process; any causal LM transformers can load works."""
        with self._lock:
            return GetServerCapabilitiesResponse([SupportedModel(name) for name in self._hosts])

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
    ) -> TrainingClient:
        """A fresh adapter of `rank` on `base_model` (hub id, local folder or .gguf file). `seed` makes the
        initial adapter reproducible. The output layer is never adapted (`train_unembed` is accepted for
        compatibility): adapters stay loadable by vLLM and the engine's fused log-prob path."""
        if rank < 1:
            raise GymError(f"rank must be a positive integer (got {rank})")
        host, _ = self._host(base_model)
        targets = sorted(
            {
                short
                for path, short in host.linear_layers.items()
                if (_in_attention(path) and train_attn) or (not _in_attention(path) and train_mlp)
            }
        )
        if not targets:
            raise GymError("train_mlp and train_attn are both False: the adapter would have nothing to train")
        record = {
            "train_mlp": train_mlp,
            "train_attn": train_attn,
            "train_unembed": train_unembed,
            "user_metadata": _user_metadata(user_metadata),
        }
        config = LoraConfig(
            r=rank,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
        )
        name = host.new_name("train")
        with host.lock, torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            host.add_adapter(name, config)
        return self._training_client(host, name, record)

    def create_training_client_from_state(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        **_: Any,
    ) -> TrainingClient:
        """A new training client starting from a checkpoint's weights, with a fresh optimizer. It keeps the
        checkpoint's user_metadata unless given its own."""
        return self._from_state(path, base_model, user_metadata, with_optimizer=False)

    def create_training_client_from_state_with_optimizer(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        **_: Any,
    ) -> TrainingClient:
        """A new training client starting from a checkpoint's weights and AdamW moments."""
        return self._from_state(path, base_model, user_metadata, with_optimizer=True)

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None, retry_config: Any = None
    ) -> SamplingClient:
        """Sample from a sampler checkpoint (`model_path`: gym:// path or PEFT folder) or from `base_model`."""
        if model_path is None and base_model is None:
            raise GymError("create_sampling_client needs model_path or base_model")
        if model_path is None:
            host, _ = self._host(base_model)
            return self._sampling_client(host, None, owns_adapter=False)
        directory = resolve(model_path, self.root)
        config, weights = read_adapter(directory)
        host, _ = self._host(base_model or _base_of(config, model_path))
        name = host.new_name("sampler")
        with host.lock:
            host.add_adapter(name, config)
            host.set_weights(name, weights)
        return self._sampling_client(host, name, owns_adapter=True)

    def serve_host(self, host: ModelHost, batcher: SampleBatcher) -> None:
        """Train and sample on a base model already loaded (gym serve shares one between its OpenAI and
        Tinker endpoints): clients asking for `host.base_model` get adapters on `host`, sampled by `batcher`."""
        with self._lock:
            self._hosts[model_key(host.base_model)] = (host, batcher)

    # -- async twins ---------------------------------------------------------------------------------------
    async def get_server_capabilities_async(self) -> GetServerCapabilitiesResponse:
        return self.get_server_capabilities()

    async def create_lora_training_client_async(self, *args: Any, **kwargs: Any) -> TrainingClient:
        return self.create_lora_training_client(*args, **kwargs)

    async def create_training_client_from_state_async(self, *args: Any, **kwargs: Any) -> TrainingClient:
        return self.create_training_client_from_state(*args, **kwargs)

    async def create_training_client_from_state_with_optimizer_async(
        self, *args: Any, **kwargs: Any
    ) -> TrainingClient:
        return self.create_training_client_from_state_with_optimizer(*args, **kwargs)

    async def create_sampling_client_async(self, *args: Any, **kwargs: Any) -> SamplingClient:
        return self.create_sampling_client(*args, **kwargs)

    # -- internals -----------------------------------------------------------------------------------------
    def _host(self, base_model: str) -> tuple[ModelHost, SampleBatcher]:
        key = model_key(base_model)
        with self._lock:
            if key not in self._hosts:
                host = ModelHost(base_model, self._device, self._dtype)
                self._hosts[key] = (host, self._new_batcher(host))
            return self._hosts[key]

    def _new_batcher(self, host: ModelHost) -> SampleBatcher:
        if self._sampler == "vllm":
            from hanzo_gym.rollout.vllm_batcher import VllmBatcher

            return VllmBatcher(host)  # the same interface
        return SampleBatcher(host)

    def _batcher_of(self, host: ModelHost) -> SampleBatcher:
        with self._lock:
            return next(b for h, b in self._hosts.values() if h is host)

    def _sampling_client(self, host: ModelHost, adapter: str | None, owns_adapter: bool) -> SamplingClient:
        return SamplingClient(host, self._batcher_of(host), adapter, owns_adapter)

    def _training_client(self, host: ModelHost, adapter: str, record: dict[str, Any]) -> TrainingClient:
        return TrainingClient(
            host, self._batcher_of(host), adapter, _new_run_id(), self.root, self._open_sampler, record
        )

    def _open_sampler(self, model_path: str) -> SamplingClient:
        return self.create_sampling_client(model_path=model_path)

    def close(self) -> None:
        """Stop the sampler threads; the base models are freed once no client refers to them."""
        with self._lock:
            hosts, self._hosts = list(self._hosts.values()), {}
        for _, batcher in hosts:
            batcher.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _from_state(
        self, path: str, base_model: str | None, user_metadata: dict[str, str] | None, with_optimizer: bool
    ) -> TrainingClient:
        directory = resolve(path, self.root)
        config = read_adapter_config(directory)
        host, _ = self._host(base_model or _base_of(config, path))
        name = host.new_name("train")
        host.add_adapter(name, LoraConfig(**{**config.to_dict(), "inference_mode": False}))
        record = {key: value for key, value in read_run_record(directory).items() if key in RUN_RECORD_KEYS}
        if user_metadata is not None:
            record["user_metadata"] = _user_metadata(user_metadata)
        client = self._training_client(host, name, record)
        load = client.load_state_with_optimizer if with_optimizer else client.load_state
        load(path).result()
        return client


def _in_attention(path: str) -> bool:
    parent = path.rsplit(".", 2)[-2] if path.count(".") >= 1 else ""
    return any(marker in parent for marker in _ATTENTION_PARENTS)


def _base_of(config: LoraConfig, path: str) -> str:
    if not config.base_model_name_or_path:
        raise GymError(f"{path}: adapter_config.json names no base_model_name_or_path; pass base_model=")
    return config.base_model_name_or_path


def _user_metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise GymError("user_metadata must map strings to strings")
    return dict(value)


def _new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
