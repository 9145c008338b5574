"""Training clients' `forward` and `forward_backward` calls on one host, run in shared passes.

Each training client runs its calls in order on a thread of its own, and each call waits for the host. Whoever
gets it takes every call of the same kind (scoring, or scoring with a backward) that waits by then, up to
MAX_CALLS_PER_RUN, and runs them in one set of passes over the base (engine/shared_pass.py): four clients
stepping at once share one set of passes instead of taking four turns (bench/tinker_multi_tenant.py measures
what that saves). A call whose turn comes when another has already run it takes its result and gives the host
back. Clients in step send their calls a reply apart, so a call that finds the host free but the other
recently active clients absent waits a moment for them (GATHER_SECONDS). An adapter that cannot share a pass
(engine/shared_pass.py's why_not_shared) runs alone.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from hanzo_gym.engine import Engine, ForwardBackwardOutput, check_datums, check_loss_inputs
from hanzo_gym.engine.losses import LOSS_FNS
from hanzo_gym.engine.shared_pass import AdapterJob, score_together, why_not_shared
from hanzo_gym.errors import GymError

MAX_CALLS_PER_RUN = 16  # a longer queue is served in runs of this many: each still waits for one run only
# A call whose turn comes while clients that called within ACTIVE_SECONDS have no call waiting gives the host
# back and waits up to this long for theirs (clients in step send theirs a reply apart); a lone client never
# waits, and a client that did not come is not waited for again until it calls again.
GATHER_SECONDS = 0.1
ACTIVE_SECONDS = 10.0


@dataclass(eq=False)
class _Call:
    job: AdapterJob
    backward: bool
    result: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class SharedPasses:
    def __init__(self, using: Callable[[str | None], AbstractContextManager]):
        """`using(adapter)`: hold the model with that adapter active (ModelHost.using)."""
        self._using = using
        self._waiting: list[_Call] = []
        self._arrivals = threading.Condition()  # guards _waiting and _last_call
        self._last_call: dict[str, float] = {}  # adapter → when it last called
        self._sharing: dict[
            str | None, bool
        ] = {}  # adapter → whether it can share passes (names never recur)

    def run(self, job: AdapterJob, backward: bool) -> ForwardBackwardOutput:
        """`job.engine.forward_backward` (or with `backward=False` its `forward_loss`) of the job's datums,
        in a pass shared with whichever other clients' calls wait for the host meanwhile."""
        if job.loss_fn not in LOSS_FNS:
            raise GymError(f"unknown loss_fn `{job.loss_fn}`; choose one of {', '.join(LOSS_FNS)}")
        check_datums(job.datums)  # a bad call fails alone, before it joins others
        check_loss_inputs(job.datums, job.loss_fn)
        call = _Call(job, backward)
        shares = self._shares(job.engine)
        if shares:
            with self._arrivals:
                self._waiting.append(call)
                self._last_call[job.engine.adapter_name] = time.monotonic()
                self._arrivals.notify_all()
        gathered = not shares
        try:
            while not call.result.done():
                with self._using(job.engine.adapter_name):
                    if call.result.done():
                        break
                    if gathered or self._all_active_wait(call):
                        self._run(self._take(call) if shares else [call])
                        break
                # The host is free and the others are not here yet: they are a reply away (their
                # optim_step's), so give them a moment, the host free meanwhile for what they wait on.
                gathered = True
                with self._arrivals:
                    if not self._arrivals.wait_for(
                        lambda: self._all_active_wait(call), timeout=GATHER_SECONDS
                    ):
                        self._forget_absent(call)
        finally:
            with self._arrivals:  # a call that failed before its turn must not run later in someone's run
                if call in self._waiting:
                    self._waiting.remove(call)
        return call.result.result()

    def _shares(self, engine: Engine) -> bool:
        """Whether the engine's adapter can share passes; looked at once per adapter, holding the model (the
        look walks its modules, which adding or deleting an adapter changes)."""
        name = engine.adapter_name
        if name not in self._sharing:
            with self._using(name):
                self._sharing[name] = why_not_shared(engine) is None
        return self._sharing[name]

    def _all_active_wait(self, call: _Call) -> bool:
        """Whether every adapter that called lately has a call of this kind waiting (or this one has run)."""
        with self._arrivals:
            now = time.monotonic()
            waiting = {c.job.engine.adapter_name for c in self._waiting if c.backward == call.backward}
            lately = {a for a, at in self._last_call.items() if now - at < ACTIVE_SECONDS}
            return call.result.done() or lately <= waiting

    def _forget_absent(self, call: _Call) -> None:
        """Nobody waits again for the clients that did not come, until they call again."""
        with self._arrivals:
            waiting = {c.job.engine.adapter_name for c in self._waiting if c.backward == call.backward}
            self._last_call = {a: at for a, at in self._last_call.items() if a in waiting}

    def _take(self, call: _Call) -> list[_Call]:
        with self._arrivals:
            alike = [c for c in self._waiting if c.backward == call.backward and c is not call]
            taken = [call, *alike[: MAX_CALLS_PER_RUN - 1]]
            self._waiting = [c for c in self._waiting if c not in taken]
        return taken

    def _run(self, calls: list[_Call]) -> None:
        try:
            if len(calls) == 1:
                job = calls[0].job
                score = job.engine.forward_backward if calls[0].backward else job.engine.forward_loss
                outputs = [score(job.datums, job.loss_fn, job.loss_fn_config)]
            else:
                try:
                    outputs = score_together([c.job for c in calls], calls[0].backward)
                except Exception:  # noqa: BLE001 - nothing happened: each call alone, so only a bad one fails
                    for c in calls:
                        self._run([c])
                    return
            for c, output in zip(calls, outputs, strict=True):
                c.result.set_result(output)
        except BaseException as exc:
            for c in calls:
                if not c.result.done():
                    c.result.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            with self._arrivals:  # a call taken while it gathered stops waiting
                self._arrivals.notify_all()
