"""Where GRPO's rollouts are sampled: the training engine's own sampler (the default, and the reference for
correctness), or vLLM, colocated in this process or as a server. Each is a `RolloutSampler`: `sample` draws
groups of completions from the current policy; `policy_changed` says an optimizer step moved it, so the next
`sample` first hands vLLM the new weights."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from hanzo_gym.config import Config
from hanzo_gym.engine import Engine
from hanzo_gym.records import SampledSequence, SamplingParams


class RolloutSampler(Protocol):
    name: str  # for the run's log line: which engine samples

    def sample(
        self, prompts: Sequence[Sequence[int]], num_samples: int, params: SamplingParams
    ) -> list[list[SampledSequence]]: ...

    def policy_changed(self) -> None: ...

    def close(self) -> None: ...


class EngineSampler:
    """The training engine's KV-cache sampler: it reads the live adapter, so there is nothing to sync."""

    name = "the training engine"

    def __init__(self, engine: Engine):
        self._engine = engine

    def sample(
        self, prompts: Sequence[Sequence[int]], num_samples: int, params: SamplingParams
    ) -> list[list[SampledSequence]]:
        return self._engine.sample(prompts, num_samples, params)

    def policy_changed(self) -> None:
        pass

    def close(self) -> None:
        pass


def rollout_sampler(engine: Engine, cfg: Config, workdir: Path) -> RolloutSampler:
    """The sampler `cfg.trl` asks for; vLLM's adapters (one per sync) are written under `workdir`."""
    if not cfg.trl.use_vllm:
        return EngineSampler(engine)
    from hanzo_gym.config.vllm_keys import vllm_settings

    settings = vllm_settings(cfg.trl, cfg.vllm)
    if settings.mode == "server":
        from hanzo_gym.rollout.vllm_server import VllmServerSampler

        return VllmServerSampler(engine, settings, workdir)
    from hanzo_gym.rollout.vllm_colocate import ColocatedVllmSampler

    return ColocatedVllmSampler(engine, settings, cfg, workdir)
