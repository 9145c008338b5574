"""Sampling requests from many threads, decoded together: requests that wait at the same time, for the same
adapter, sample count and parameters, become one batch for the sampler (one prefill per prompt, one decode
loop for all of them). Seeded requests run alone, so a seed reproduces its own result whatever else is queued.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hanzo_gym.engine.sampling import sample_groups
from hanzo_gym.errors import GymError
from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.records import SampledSequence, SamplingParams

MAX_PROMPTS_PER_BATCH = 64


@dataclass
class _Request:
    adapter: str | None
    prompt: list[int]
    num_samples: int
    params: SamplingParams
    future: concurrent.futures.Future
    # (sample index, token, raw log-probabilities over the vocabulary it was drawn from) as each token is drawn
    on_token: Callable[[int, int, torch.Tensor], None] | None
    owner: object = None  # kept alive while the request waits: a client's adapter lives as long as the client
    cancel: threading.Event | None = None  # set through SampleBatcher.cancel when nobody waits for the result

    def batch_key(self) -> tuple | None:
        if self.params.seed is not None or self.on_token is not None:
            return None
        p = self.params
        stop = tuple(p.stop) if isinstance(p.stop, (list, tuple)) else p.stop
        return (self.adapter, self.num_samples, p.max_tokens, stop, p.temperature, p.top_k, p.top_p)


class SampleBatcher:
    def __init__(self, host: ModelHost):
        self.host = host
        self._queue: collections.deque[_Request] = collections.deque()
        self._wakeup = threading.Condition()
        self._closing = False
        self._cancellations = threading.Event()  # some request was cancelled since the batch started
        self._thread = threading.Thread(target=self._serve, name="hanzo-gym-sampler", daemon=True)
        self._thread.start()

    def submit(
        self,
        adapter: str | None,
        prompt: Sequence[int],
        num_samples: int,
        params: SamplingParams,
        on_token: Callable[[int, int, torch.Tensor], None] | None = None,
        owner: object = None,
        cancel: threading.Event | None = None,
    ) -> concurrent.futures.Future[list[SampledSequence]]:
        """Checked here, on the caller's thread: a bad request fails its caller, never the sampler thread.
        `cancel`, passed later to `cancel()`, stops the request's decoding, even inside a batch."""
        if not isinstance(params, SamplingParams):
            raise GymError(f"sampling_params must be a SamplingParams, not {type(params).__name__}")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise GymError(f"num_samples must be a positive integer (got {num_samples!r})")
        tokens = list(prompt)
        self.host.check_token_ids(tokens, "the prompt")
        future: concurrent.futures.Future = concurrent.futures.Future()
        request = _Request(adapter, tokens, num_samples, params, future, on_token, owner, cancel)
        with self._wakeup:
            self._queue.append(request)
            self._wakeup.notify()
        return future

    def cancel(self, event: threading.Event) -> None:
        """Nobody waits for the request submitted with `event` any more: it fails with a GymError, and a batch
        it is decoding in stops decoding its rows at the next token."""
        event.set()
        self._cancellations.set()

    def close(self) -> None:
        """End the sampler thread once the queued requests are done; it holds the model while it runs."""
        with self._wakeup:
            self._closing = True
            self._wakeup.notify()
        self._thread.join()

    def _serve(self) -> None:
        while True:
            with self._wakeup:
                while not self._queue and not self._closing:
                    self._wakeup.wait()
                if not self._queue:
                    return
                batch = self._take_batch()
            try:
                self._run(batch)
            except BaseException as exc:  # noqa: BLE001 - the thread must outlive any one batch
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(exc)
            del batch  # the requests hold their clients alive: let them go while the thread waits

    def _take_batch(self) -> list[_Request]:
        first = self._queue.popleft()
        key = first.batch_key()
        batch = [first]
        if key is None:
            return batch
        kept: collections.deque[_Request] = collections.deque()
        while self._queue:
            request = self._queue.popleft()
            if request.batch_key() == key and len(batch) < MAX_PROMPTS_PER_BATCH:
                batch.append(request)
            else:
                kept.append(request)
        self._queue = kept
        return batch

    def _run(self, batch: list[_Request]) -> None:
        batch = [r for r in batch if r.future.set_running_or_notify_cancel()]
        self._cancellations.clear()  # before the check below: a cancel landing after it must stay seen
        for request in [r for r in batch if _cancelled(r)]:
            request.future.set_exception(GymError("the request was cancelled"))
        batch = [r for r in batch if not _cancelled(r)]
        if not batch:
            return

        def cancelled_prompts() -> list[int]:
            if not self._cancellations.is_set():  # the usual case costs one flag read per decoding step
                return []
            return [index for index, request in enumerate(batch) if _cancelled(request)]

        first = batch[0]
        on_step = None
        if first.on_token is not None:

            def on_step(rows: list[int], tokens: list[int], logprobs: torch.Tensor) -> None:
                for position, (row, token) in enumerate(zip(rows, tokens)):
                    first.on_token(row, token, logprobs[position])

        try:
            with self.host.using(first.adapter) as model:
                groups = sample_groups(
                    model,
                    self.host.tokenizer,
                    [r.prompt for r in batch],
                    first.num_samples,
                    first.params,
                    on_step=on_step,
                    cancelled_prompts=cancelled_prompts,
                )
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear about the failure
            for request in batch:
                request.future.set_exception(exc)
            return
        for request, group in zip(batch, groups):
            if _cancelled(request):
                request.future.set_exception(GymError("the request was cancelled"))
            else:
                request.future.set_result(group)


def _cancelled(request: _Request) -> bool:
    return request.cancel is not None and request.cancel.is_set()
