"""Sampling requests from many threads, decoded together as they come (continuous batching).

One thread drives the model. Requests share a lane: one `DecodeBatch` whose rows join between decode steps and
leave as they finish. The base model's requests and those of every plain LoRA adapter share lanes (SHARED): a
batch with rows of several adapters decodes each row through its own adapter (engine/adapter_tokens.py), so
several users' samples cost one pass over the base per step, not one each (bench/tinker_multi_tenant.py); a
batch of one adapter's rows decodes as that adapter alone (its LoRA folded into the weights on CPU). Adapters
that cannot share a step (DoRA, LoRA dropout or bias) get lanes of their own, and lanes of different keys take
turns of at least 16 steps. A request that arrives at a lane which has been decoding for a while and can still
cost much more than the request (rows × tokens left) starts a lane of its own instead, and lanes of one key take
steps in inverse proportion to what they can still cost, the cheapest first: a step's cost grows with its rows
(bench/serve_latency.py: on this CPU 9 rows cost 1.6× one), so a short request beside a long one finishes at
nearly its own pace, and the long one waits only for the short one's few steps (bench/serve_latency.py). A
seeded request gets a lane of its own, so a seed reproduces its own result whatever else is running. Whoever
else waits for the host (a training client's step, a prompt's scoring) gets it after the current decode step:
the host's lock is handed out in arrival order (host/fair_lock.py), and the sampler queues behind them
(bench/tinker_fairness.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hanzo_gym.engine.adapter_tokens import TokenAdapters, takes_token_adapters
from hanzo_gym.engine.decoding import decoding, lora_update_dtype
from hanzo_gym.engine.sampling import DecodeBatch, DecodeJob, Prompt
from hanzo_gym.errors import GymError
from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.records import SampledSequence, SamplingParams

MAX_ROWS_PER_LANE = 256  # a fuller lane makes another lane of the same adapter: the two take turns
JOINS_WHILE_STEPS = 8  # a lane this young takes any request of its adapter (a burst of requests is one batch)
JOINS_UP_TO_COST = 4  # later, it takes a request only if it can cost at most 4× what the request can
STEPS_PER_TURN = (
    16  # of one adapter's lanes while other adapters wait; also the most steps a lane gets per round
)


# The lane key of requests whose adapters share decode steps (engine/adapter_tokens.py): their rows decode in
# the same batch, each through its own adapter; the base model's rows too.
SHARED = "*shared*"


@dataclass(eq=False)
class _Request:
    adapter: str | None
    lane: str | None  # the key of the lanes it may join: SHARED, or its adapter's own
    prompt: list[int]
    num_samples: int
    params: SamplingParams
    future: concurrent.futures.Future
    # (sample index, token, raw log-probabilities over the vocabulary it was drawn from) as each token is drawn
    on_token: Callable[[int, int, torch.Tensor], None] | None
    owner: object = None  # kept alive while the request runs: a client's adapter lives as long as the client
    cancel: threading.Event | None = None  # set through SampleBatcher.cancel when nobody waits for the result

    def cost(self) -> int:
        """The most tokens it can draw (a request without max_tokens counts as a long one)."""
        return self.num_samples * (self.params.max_tokens or 4096)

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
    steps: int = 0  # decode steps since the lane began

    def rows(self) -> int:
        return sum(r.num_samples for r in self.waiting) + (self.batch.rows if self.batch else 0)

    def cost(self) -> int:
        """What the lane can still cost, in row-steps."""
        running = self.batch.live_rows * self.batch.most_tokens_left() if self.batch else 0
        return running + sum(r.cost() for r in self.waiting)

    def idle(self) -> bool:
        return not self.waiting and not self.running

    def takes(self, request: _Request) -> bool:
        return (
            self.seed is None
            and request.params.seed is None
            and request.lane == self.adapter
            and (self.batch is None or self.batch.can_add())
            and self.rows() + request.num_samples <= MAX_ROWS_PER_LANE
            and (self.steps < JOINS_WHILE_STEPS or self.cost() <= JOINS_UP_TO_COST * request.cost())
        )

    def fail(self, exc: BaseException) -> None:
        for request in [*self.waiting, *self.running.values()]:
            if not request.future.done():
                request.future.set_exception(exc)
        self.waiting.clear()
        self.running.clear()
        self.batch = None


def _requests(lane: _Lane) -> list[_Request]:
    return [*lane.waiting, *lane.running.values()]


def checked_prompt(
    host: ModelHost, prompt: Sequence[int], num_samples: int, params: SamplingParams
) -> list[int]:
    """The prompt's tokens, or a GymError for a request no sampler can run."""
    if not isinstance(params, SamplingParams):
        raise GymError(f"sampling_params must be a SamplingParams, not {type(params).__name__}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise GymError(f"num_samples must be a positive integer (got {num_samples!r})")
    tokens = list(prompt)
    host.check_token_ids(tokens, "the prompt")
    return tokens


class SampleBatcher:
    def __init__(self, host: ModelHost):
        self.host = host
        self._queue: collections.deque[_Request] = collections.deque()
        self._lanes: collections.deque[_Lane] = collections.deque()  # the next lane to run is lanes[0]
        self._wakeup = threading.Condition()
        self._closing = False
        self._cancellations = threading.Event()  # some request was cancelled since the last look
        self._shares: dict[str, bool] = {}  # adapter → whether its rows may share decode steps
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
        tokens = checked_prompt(self.host, prompt, num_samples, params)
        future: concurrent.futures.Future = concurrent.futures.Future()
        # a seeded request decodes alone, as its adapter's own (the same numbers whatever else runs)
        lane = SHARED if params.seed is None and self._shares_steps(adapter) else adapter
        request = _Request(adapter, lane, tokens, num_samples, params, future, on_token, owner, cancel)
        with self._wakeup:
            self._queue.append(request)
            self._wakeup.notify()
        return future

    def _shares_steps(self, adapter: str | None) -> bool:
        if adapter is None:
            return True
        if adapter not in self._shares:  # adapter names are never reused: what is known stays true
            with self.host.lock:  # the look walks the model's modules, which adding an adapter changes
                self._shares[adapter] = takes_token_adapters(self.host.model, adapter) is None
        return self._shares[adapter]

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
            adapter = self._lanes[0].adapter
            try:
                self._run_turn(adapter)
            except BaseException as exc:  # noqa: BLE001 - the thread must outlive any one adapter's failure
                for lane in self._lanes_of(adapter):
                    lane.fail(exc)
            # This adapter's lanes go to the back; those with nothing left go (their requests hold their clients
            # alive: let them go while the thread waits).
            self._lanes = collections.deque(
                [lane for lane in self._lanes if lane.adapter != adapter]
                + [lane for lane in self._lanes if lane.adapter == adapter and not lane.idle()]
            )

    def _lanes_of(self, adapter: str | None) -> list[_Lane]:
        return [lane for lane in self._lanes if lane.adapter == adapter]

    def _route_queued(self) -> None:
        """Move what was submitted into lanes. Called with `_wakeup` held."""
        while self._queue:
            request = self._queue.popleft()
            lane = next((lane for lane in self._lanes if lane.takes(request)), None)
            if lane is None:
                lane = _Lane(request.lane, request.params.seed)
                self._lanes.append(lane)
            lane.waiting.append(request)

    def _run_turn(self, key: str | None) -> None:
        """Decode the lanes of `key` (an adapter, or SHARED), each round giving every lane steps in inverse
        proportion to what it can still cost, until they are done or, with other lanes waiting, the turn has
        had its steps. Shared lanes whose rows are all of one adapter decode as that adapter's own (with its
        LoRA folded on CPU); rows of several decode through TokenAdapters."""
        adapters = {r.adapter for lane in self._lanes_of(key) for r in _requests(lane)}
        if key != SHARED or len(adapters) == 1:
            alone = key if key != SHARED else adapters.pop()
            with self.host.using(alone) as model, decoding(model):
                self._decode_lanes(key, model, None, alone)
            return
        # The model as it is (TokenAdapters turns every adapter's own branch off): `using(None)` would first
        # survey every layer's status, on every turn.
        with self.host.held() as model:
            self._fail_unloaded(self._lanes_of(key))
            with (
                decoding(model, fold=False),
                TokenAdapters(model, (), trains=False, dtype=lora_update_dtype(model)) as router,
            ):
                self._decode_lanes(key, model, router, None)

    def _fail_unloaded(self, lanes: list[_Lane]) -> None:
        """Requests whose adapter was unloaded meanwhile fail; the lanes' other rows go on."""
        loaded = set(self.host.adapters)
        for lane in lanes:
            gone = [r for r in lane.waiting if r.adapter is not None and r.adapter not in loaded]
            lane.waiting[:] = [r for r in lane.waiting if r not in gone]
            for job, request in list(lane.running.items()):
                if request.adapter is not None and request.adapter not in loaded:
                    lane.batch.drop(job)
                    del lane.running[job]
                    gone.append(request)
            for request in gone:
                if not request.future.done():
                    request.future.set_exception(GymError(f"adapter `{request.adapter}` was unloaded"))

    def _decode_lanes(
        self, key: str | None, model: torch.nn.Module, router: TokenAdapters | None, alone: str | None
    ) -> None:
        """`_run_turn`'s steps: with a `router`, rows of any adapter; else only requests of adapter `alone`
        are admitted, and one of another adapter ends the turn (the next decodes them together)."""
        steps = 0
        while True:
            lanes = self._lanes_of(key)
            for lane in lanes:
                if lane.batch is not None:
                    lane.batch.bind(model)
                    lane.batch.router = router
                self._admit(lane, model, router, alone)
            running = [lane for lane in lanes if lane.running]
            if not running:
                return
            if router is None and any(r.adapter != alone for lane in lanes for r in lane.waiting):
                return  # the next turn decodes them together
            if router is not None and len({r.adapter for lane in lanes for r in _requests(lane)}) == 1:
                return  # one adapter left: the next turn decodes it alone (folded on CPU)
            costs = {lane: max(1, lane.cost()) for lane in running}
            dearest = max(costs.values())
            for lane in running:
                for _ in range(min(STEPS_PER_TURN, max(1, round(dearest / costs[lane])))):
                    if not lane.running:
                        break
                    self._step(lane)
                    steps += 1
                    if self.host.lock.waiting():
                        return  # a training step (or any other use of the host) goes first
                    # what arrived meanwhile joins at the lane's next step
                    self._admit(lane, model, router, alone)
            if steps >= STEPS_PER_TURN and any(lane.adapter != key for lane in self._lanes):
                return

    def _step(self, lane: _Lane) -> None:
        try:
            finished = lane.batch.step()
        except BaseException as exc:  # noqa: BLE001 - this lane's requests fail, the others go on
            lane.fail(exc)
            return
        lane.steps += 1
        for job in finished:
            request = lane.running.pop(job)
            if not request.future.done():
                request.future.set_result(job.sequences)
        if self._queue:  # read without the lock: a request missed now is seen at the next step
            with self._wakeup:
                self._route_queued()
        if self._cancellations.is_set():
            self._drop_cancelled()

    def _admit(
        self, lane: _Lane, model: torch.nn.Module, router: TokenAdapters | None, alone: str | None
    ) -> None:
        """Prefill the lane's waiting requests into its batch (one pass); a request that cannot be decoded
        fails alone. Without a `router`, only those of adapter `alone` (the others wait for a turn with one)."""
        if not lane.waiting:
            return
        if lane.batch is None:
            lane.batch = DecodeBatch(model, self.host.tokenizer, seed=lane.seed)
            lane.batch.router = router
        admitted: list[tuple[_Request, Prompt]] = []
        later = [r for r in lane.waiting if router is None and r.adapter != alone]
        for request in lane.waiting:
            if request in later:
                continue
            if not request.future.set_running_or_notify_cancel():
                continue
            if request.cancelled:
                request.future.set_exception(GymError("the request was cancelled"))
                continue
            prompt = Prompt(
                request.prompt, request.num_samples, request.params, request.on_token, request.adapter
            )
            try:
                lane.batch.check(prompt)
            except GymError as exc:
                request.future.set_exception(exc)
                continue
            admitted.append((request, prompt))
        lane.waiting[:] = later
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
