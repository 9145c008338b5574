"""SamplingClient: completions and prompt log-probabilities from a fixed set of weights (a sampler checkpoint, a
snapshot of a training client, or the base model)."""

from __future__ import annotations

import concurrent.futures
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from transformers import PreTrainedTokenizerBase

from hanzo_gym.errors import GymError
from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.host.sample_batcher import SampleBatcher
from hanzo_gym.records import Datum, ModelInput, SamplingParams
from hanzo_gym.tinker.futures import APIFuture, OrderedWorker
from hanzo_gym.tinker.types import SampleResponse

T = TypeVar("T")


class SamplingClient:
    def __init__(self, host: ModelHost, batcher: SampleBatcher, adapter: str | None, owns_adapter: bool):
        self._host = host
        self._batcher = batcher
        self._adapter = adapter  # None: the base model
        self._scoring = OrderedWorker("hanzo-gym-scoring")
        if owns_adapter and adapter is not None:
            # The adapter slot lives as long as this client; many are created in a loop, one per step.
            weakref.finalize(self, host.retire, adapter)

    @property
    def context_length(self) -> int | None:
        """The most tokens a prompt and its completion may hold together (None where the model states none)."""
        return getattr(self._host.model.config, "max_position_embeddings", None)

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int,
        sampling_params: SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        *,
        cancel: threading.Event | None = None,
    ) -> APIFuture[SampleResponse]:
        """`cancel`, passed later to `cancel()`, stops the sampling at its next decode step (the future then
        fails)."""
        tokens = _prompt_tokens(prompt, self._host)
        if num_samples < 1:
            raise GymError(f"num_samples must be at least 1 (got {num_samples})")
        sequences = self._batcher.submit(
            self._adapter, tokens, num_samples, sampling_params, owner=self, cancel=cancel
        )
        if not include_prompt_logprobs and topk_prompt_logprobs <= 0:
            return APIFuture(_joined([sequences], lambda seqs: SampleResponse(sequences=seqs)))
        if topk_prompt_logprobs > self._host.vocab_size:
            raise GymError(f"topk_prompt_logprobs {topk_prompt_logprobs} exceeds the vocabulary")
        scores = self._scoring.submit(
            self._prompt_scores, tokens, include_prompt_logprobs, topk_prompt_logprobs
        )

        def combine(seqs: list, scored: tuple) -> SampleResponse:
            prompt_logprobs, topk = scored
            return SampleResponse(sequences=seqs, prompt_logprobs=prompt_logprobs, topk_prompt_logprobs=topk)

        return APIFuture(_joined([sequences, scores._future], combine))

    async def sample_async(self, *args: Any, **kwargs: Any) -> SampleResponse:
        return await self.sample(*args, **kwargs)

    def cancel(self, event: threading.Event) -> None:
        """Stop the sample submitted with `cancel=event`: nobody waits for it any more."""
        self._batcher.cancel(event)

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        """log p(token_i | tokens before i) for every prompt token; element 0 is None (nothing precedes it)."""
        tokens = _prompt_tokens(prompt, self._host)
        return self._scoring.submit(lambda: self._prompt_scores(tokens, True, 0)[0])

    async def compute_logprobs_async(self, prompt: ModelInput) -> list[float | None]:
        return await self.compute_logprobs(prompt)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self._host.tokenizer

    def get_base_model(self) -> str:
        return self._host.base_model

    async def get_base_model_async(self) -> str:
        return self.get_base_model()

    def _prompt_scores(
        self, tokens: list[int], logprobs: bool, topk: int
    ) -> tuple[list[float | None] | None, list[list[tuple[int, float]] | None] | None]:
        if len(tokens) < 2:
            return ([None] if logprobs else None), ([None] if topk > 0 else None)
        prompt_logprobs = None
        with self._host.using(self._adapter) as model:
            if logprobs:
                datum = Datum.from_tokens(tokens[:-1], target_tokens=tokens[1:])
                scored = self._host.scorer.forward([datum])[0].tolist()
                prompt_logprobs = [None, *scored]
            topk_lists = None
            if topk > 0:
                was_training = model.training
                model.eval()
                try:
                    with torch.no_grad():
                        ids = torch.tensor([tokens[:-1]], device=self._host.device)
                        logits = model(input_ids=ids, use_cache=False).logits[0].float()
                finally:
                    model.train(was_training)
                values, indices = logits.log_softmax(-1).topk(topk, dim=-1)
                topk_lists = [None] + [
                    list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)
                ]
        return prompt_logprobs, topk_lists


def _prompt_tokens(prompt: ModelInput, host: ModelHost) -> list[int]:
    if not isinstance(prompt, ModelInput):
        raise GymError(
            f"prompt must be a ModelInput (ModelInput.from_ints(tokens)), not {type(prompt).__name__}"
        )
    tokens = prompt.to_ints()
    if not tokens:
        raise GymError("the prompt is empty: sampling needs at least one token")
    host.check_token_ids(tokens, "the prompt")
    return tokens


def _joined(futures: list[concurrent.futures.Future], fn: Callable[..., T]) -> concurrent.futures.Future[T]:
    """A future of fn(*results), set by whichever input finishes last; nothing waits on a worker thread."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def finish(_: concurrent.futures.Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        try:
            out.set_result(fn(*(f.result() for f in futures)))
        except BaseException as exc:  # noqa: BLE001 - the caller's future carries it
            out.set_exception(exc)

    for future in futures:
        future.add_done_callback(finish)
    return out
