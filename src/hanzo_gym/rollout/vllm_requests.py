"""What the colocated engine and the server client share: handing vLLM the policy before the first rollout
after it changed, our sampling parameters in vLLM's terms and vLLM's outputs as our sampled sequences, so both
stop, filter and report as the built-in sampler does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from hanzo_gym.engine import Engine
from hanzo_gym.engine.sampling import stop_conditions
from hanzo_gym.errors import GymError
from hanzo_gym.records import SampledSequence, SamplingParams


def vllm_sampling_fields(params: SamplingParams, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """vLLM SamplingParams fields (also the extra fields of its OpenAI completions request). Completions stop
    where the built-in sampler stops: the tokenizer's EOS and the request's stop ids and strings, never the
    generation config's other EOS ids; log-probabilities of the sampled tokens are the raw model's (vLLM's
    default `raw_logprobs`), as ours are."""
    stop_ids, stop_strings = stop_conditions(params.stop, tokenizer.eos_token_id)
    if params.max_tokens is None:
        raise GymError("vLLM rollouts need max_tokens")
    return {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": max(0, params.top_k),  # vLLM: 0 switches top-k off
        "seed": params.seed,
        "stop_token_ids": stop_ids,
        "stop": stop_strings,
        "ignore_eos": True,  # the stop ids above already hold the tokenizer's EOS
        "logprobs": 0,  # the sampled token's own log-probability, nothing more
        "skip_special_tokens": False,
    }


def sampled_sequence(
    token_ids: list[int], logprobs: list[float], finish_reason: str | None
) -> SampledSequence:
    if finish_reason not in ("stop", "length"):
        raise GymError(f"vLLM ended a completion with `{finish_reason}` (expected stop or length)")
    if len(logprobs) != len(token_ids):
        raise GymError(f"vLLM returned {len(logprobs)} log-probabilities for {len(token_ids)} tokens")
    return SampledSequence(tokens=list(token_ids), logprobs=list(logprobs), stop_reason=finish_reason)


def vllm_sequences(output: Any) -> list[SampledSequence]:
    """A vLLM RequestOutput's completions (requested with `logprobs=0`) as our sampled sequences."""
    return [
        sampled_sequence(
            list(o.token_ids),
            [step[token].logprob for step, token in zip(o.logprobs, o.token_ids)],
            o.finish_reason,
        )
        for o in output.outputs
    ]


class VllmSampler:
    """A rollout sampler over vLLM: `_sync` hands it the engine's current policy, `_generate` draws from it."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self._stale = True  # vLLM holds the base model, not the policy (which may be a resumed adapter)

    def policy_changed(self) -> None:
        self._stale = True

    def sample(
        self, prompts: Sequence[Sequence[int]], num_samples: int, params: SamplingParams
    ) -> list[list[SampledSequence]]:
        if not prompts:
            return []
        if self._stale:
            self._sync()
            self._stale = False
        return self._generate(prompts, num_samples, vllm_sampling_fields(params, self._engine.tokenizer))

    def _sync(self) -> None:
        raise NotImplementedError

    def _generate(
        self, prompts: Sequence[Sequence[int]], num_samples: int, fields: dict[str, Any]
    ) -> list[list[SampledSequence]]:
        raise NotImplementedError
