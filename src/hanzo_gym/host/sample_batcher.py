"""Sampling requests from many threads, decoded together as they come (continuous batching).

One thread drives the model. Requests for the same adapter share a lane: one `DecodeBatch` whose rows join
between decode steps and leave as they finish, so a short request sent while a long one decodes is prefilled at
the next step and then decodes alongside it instead of waiting for it. Lanes of different adapters take turns
of a few steps each (the host serves one adapter at a time). A seeded request gets a lane of its own, so a seed
reproduces its own result whatever else is running.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hanzo_gym.engine.decoding import decoding
from hanzo_gym.engine.sampling import DecodeBatch, DecodeJob, Prompt
from hanzo_gym.errors import GymError
from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.records import SampledSequence, SamplingParams

MAX_ROWS_PER_LANE = 256  # a fuller lane makes another lane of the same adapter: the two take turns
STEPS_PER_TURN = 16  # while other lanes wait; on CPU each turn refolds its adapter's LoRA into the weights


@dataclass(eq=False)
class _Request:
    adapter: str | None
    prompt: list[int]
    num_samples: int
    params: SamplingParams
    future: concurrent.futures.Future
    # (sample index, token, raw log-probabilities over the vocabulary it was drawn from) as each token is drawn
    on_token: Callable[[int, int, torch.Tensor], None] | None
    owner: object = None  # kept alive while the request runs: a client's adapter lives as long as the client
    cancel: threading.Event | None = None  # set through SampleBatcher.cancel when nobody waits for the result

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()


@dataclass(eq=False)
class _Lane:
    adapter: str | None
    seed: int | None  # a seeded lane holds one request
    waiting: list[_Request] = field(default_factory=list)
    running: dict[DecodeJob, _Request] = field(default_factory=dict)
    batch: DecodeBatch | None = None

    def rows(self) -> int:
        return sum(r.num_samples for r in self.waiting) + (self.batch.rows if self.batch else 0)

    def idle(self) -> bool:
        return not self.waiting and not self.running

    def takes(self, request: _Request) -> bool:
        return (
            self.seed is None
            and request.params.seed is None
            and request.adapter == self.adapter
            and (self.batch is None or self.batch.can_add())
            and self.rows() + request.num_samples <= MAX_ROWS_PER_LANE
        )


class SampleBatcher:
    def __init__(self, host: ModelHost):
        self.host = host
        self._queue: collections.deque[_Request] = collections.deque()
        self._lanes: collections.deque[_Lane] = collections.deque()  # the next lane to run is lanes[0]
        self._wakeup = threading.Condition()
        self._closing = False
        self._cancellations = threading.Event()  # some request was cancelled since the last look
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
        `cancel`, passed later to `cancel()`, stops the request's decoding at the next step."""
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
        """Nobody waits for the request submitted with `event` any more: it fails with a GymError, and its rows
        stop decoding at the next step."""
        event.set()
        self._cancellations.set()

    def close(self) -> None:
        """End the sampler thread once the requests it has are done; it holds the model while it runs."""
        with self._wakeup:
            self._closing = True
            self._wakeup.notify()
        self._thread.join()

    # -- the sampler thread ------------------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            with self._wakeup:
                while not self._queue and not self._lanes and not self._closing:
                    self._wakeup.wait()
                self._route_queued()
                if not self._lanes:
                    return  # closing, and nothing left to do
            lane = self._lanes[0]
            self._lanes.rotate(-1)
            try:
                self._run_turn(lane)
            except BaseException as exc:  # noqa: BLE001 - the thread must outlive any one lane
                for request in [*lane.waiting, *lane.running.values()]:
                    if not request.future.done():
                        request.future.set_exception(exc)
                lane.waiting.clear()
                lane.running.clear()
                lane.batch = None
            if lane.idle():
                self._lanes.remove(lane)
            del lane  # its requests hold their clients alive: let them go while the thread waits

    def _route_queued(self) -> None:
        """Move what was submitted into lanes. Called with `_wakeup` held."""
        while self._queue:
            request = self._queue.popleft()
            lane = next((lane for lane in self._lanes if lane.takes(request)), None)
            if lane is None:
                lane = _Lane(request.adapter, request.params.seed)
                self._lanes.append(lane)
            lane.waiting.append(request)

    def _run_turn(self, lane: _Lane) -> None:
        with self.host.using(lane.adapter) as model, decoding(model):
            if lane.batch is None:
                lane.batch = DecodeBatch(model, self.host.tokenizer, seed=lane.seed)
            lane.batch.bind(model)
            steps = 0
            while True:
                if self._cancellations.is_set():
                    self._drop_cancelled()
                self._admit(lane)
                if not lane.running:
                    return
                for job in lane.batch.step():
                    request = lane.running.pop(job)
                    if not request.future.done():
                        request.future.set_result(job.sequences)
                steps += 1
                if self._queue:  # read without the lock: a request missed now is seen at the next step
                    with self._wakeup:
                        self._route_queued()
                others_wait = any(other is not lane for other in self._lanes)
                if others_wait and steps >= STEPS_PER_TURN:
                    return

    def _admit(self, lane: _Lane) -> None:
        """Prefill the lane's waiting requests into its batch (one pass); a request that cannot be decoded
        fails alone."""
        admitted: list[tuple[_Request, Prompt]] = []
        for request in lane.waiting:
            if not request.future.set_running_or_notify_cancel():
                continue
            if request.cancelled:
                request.future.set_exception(GymError("the request was cancelled"))
                continue
            prompt = Prompt(request.prompt, request.num_samples, request.params, request.on_token)
            try:
                lane.batch.check(prompt)
            except GymError as exc:
                request.future.set_exception(exc)
                continue
            admitted.append((request, prompt))
        lane.waiting.clear()
        if not admitted:
            return
        try:
            jobs = lane.batch.add([prompt for _, prompt in admitted])
        except BaseException as exc:  # noqa: BLE001 - these requests fail; the rows already running go on
            for request, _ in admitted:
                request.future.set_exception(exc)
            return
        for job, (request, _) in zip(jobs, admitted):
            lane.running[job] = request

    def _drop_cancelled(self) -> None:
        self._cancellations.clear()  # before looking: a cancel landing meanwhile stays seen
        for lane in self._lanes:
            for job, request in list(lane.running.items()):
                if request.cancelled:
                    lane.batch.drop(job)
                    del lane.running[job]
                    request.future.set_exception(GymError("the request was cancelled"))
