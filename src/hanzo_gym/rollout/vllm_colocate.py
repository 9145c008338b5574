"""vLLM in the training process (TRL's colocate mode): its own copy of the base weights on the same device,
handed the policy before each rollout that follows an optimizer step. Under torchrun each process has its own
engine, which samples that process's prompts.

Two ways to hand it over, chosen by `trl.vllm_lora_sync` as Axolotl means it: false (the default) folds the
adapter into the base weights and reloads them in place (vLLM then decodes a plain model, the fast path);
true writes the adapter to a folder and samples through a new LoRA id (vLLM's LoRA kernels, which cost decode
time; the previous id is dropped). Over a 4- or 8-bit base (QLoRA) vLLM is handed the dequantized base weights,
the values the trainer's quantized layers compute with, instead of the full-precision ones it loads from disk:
folded with the adapter each time, or once before the first adapter."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hanzo_gym.config import Config
from hanzo_gym.config.vllm_keys import VllmSettings, vllm_lora_rank
from hanzo_gym.engine import Engine
from hanzo_gym.engine.distributed import world_size
from hanzo_gym.errors import GymError
from hanzo_gym.model.hub import resolve_model
from hanzo_gym.records import SampledSequence
from hanzo_gym.rollout.policy_weights import merged_weights, write_policy_adapter
from hanzo_gym.rollout.vllm_import import import_vllm
from hanzo_gym.rollout.vllm_requests import VllmSampler, vllm_sequences

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ColocatedVllmSampler(VllmSampler):
    def __init__(self, engine: Engine, settings: VllmSettings, cfg: Config, workdir: Path):
        if world_size() > 1 and settings.tensor_parallel_size > 1:
            raise GymError(
                "colocated vLLM under torchrun runs one engine in each process; tensor_parallel_size "
                f"{settings.tensor_parallel_size} would split one engine over processes, which is not supported: "
                "set it to 1, or start one `vllm serve` and use `trl.vllm_mode: server`"
            )
        super().__init__(engine)
        # vLLM loads the base from disk in full precision; a 4- or 8-bit base computes with other values
        self._base_differs = cfg.load_in_4bit or cfg.load_in_8bit
        vllm = import_vllm()
        self._vllm = vllm
        self._lora_sync = settings.lora_sync
        self._workdir = workdir
        self._dtype = _base_dtype(engine) if settings.dtype == "auto" else getattr(torch, settings.dtype)
        self.name = f"vLLM {vllm.__version__} (colocated, {'adapter' if self._lora_sync else 'merged'} sync)"
        config = engine.model.get_base_model().config
        context = getattr(config, "max_position_embeddings", None) or cfg.sequence_len
        max_model_len = settings.max_model_len or min(
            context, cfg.sequence_len + cfg.trl.max_completion_length
        )
        options = {
            "model": str(resolve_model(cfg.base_model, cfg.trust_remote_code, cfg.revision_of_model)),
            "trust_remote_code": cfg.trust_remote_code,
            "dtype": DTYPE_NAMES[self._dtype],
            "seed": cfg.seed,
            "max_model_len": max_model_len,
            "enforce_eager": settings.enforce_eager,
            "gpu_memory_utilization": settings.memory_utilization,
            "tensor_parallel_size": settings.tensor_parallel_size,
        }
        if world_size() > 1:
            # torchrun started the processes: vLLM joins them instead of spawning its own (TRL's way), and with
            # tensor_parallel_size 1 each process holds an engine of its own, for the prompts it samples
            options["distributed_executor_backend"] = "external_launcher"
        if settings.enable_prefix_caching is not None:
            options["enable_prefix_caching"] = settings.enable_prefix_caching
        if self._lora_sync:
            try:
                rank = vllm_lora_rank(engine.adapter_config.r)
            except ValueError as exc:
                raise GymError(str(exc)) from None
            options.update(enable_lora=True, max_lora_rank=rank, max_loras=1)
        self._llm = vllm.LLM(**options)
        self._lora = None  # the LoRARequest of the policy (adapter sync)
        self._version = 0

    def _generate(
        self, prompts: Sequence[Sequence[int]], num_samples: int, fields: dict[str, Any]
    ) -> list[list[SampledSequence]]:
        from vllm.inputs import TokensPrompt

        outputs = self._llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
            self._vllm.SamplingParams(n=num_samples, **fields),
            lora_request=self._lora,
            use_tqdm=False,
        )
        return [vllm_sequences(output) for output in outputs]

    def _sync(self) -> None:
        model = self._engine.model
        self._version += 1
        if self._lora_sync:
            from vllm.lora.request import LoRARequest

            if self._base_differs:  # once: the dequantized base, which the adapter is added to
                base = merged_weights(model, self._dtype, fold_adapter=False)
                self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": base})
                self._base_differs = False
            folder = write_policy_adapter(model, self._workdir / f"policy-{self._version}")
            previous, self._lora = (
                self._lora,
                LoRARequest(f"policy-{self._version}", self._version, str(folder)),
            )
            if previous is not None:
                self._llm.llm_engine.remove_lora(previous.lora_int_id)
                shutil.rmtree(previous.lora_path, ignore_errors=True)
        else:
            weights = merged_weights(model, self._dtype)
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self._llm.reset_prefix_cache()  # cached prompt blocks hold the old weights' keys and values

    def close(self) -> None:
        if self._lora is not None:
            shutil.rmtree(self._lora.lora_path, ignore_errors=True)
        self._llm = None


def _base_dtype(engine: Engine) -> torch.dtype:
    """The frozen base weights' dtype: the run's precision (bf16 or fp32)."""
    frozen = [p.dtype for p in engine.model.parameters() if not p.requires_grad and p.is_floating_point()]
    return frozen[0] if frozen else torch.float32
