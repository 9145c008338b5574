"""A reentrant lock handed out in the order it was asked for, which tells its holder whether anyone waits.

threading.RLock lets a thread that releases and re-acquires at once win again and again: a sampler that
releases the model between decode steps would keep it from a training step for as long as it decodes. Here the
next holder is always the longest waiter, and the sampler asks `waiting()` to know when to step aside.
"""

from __future__ import annotations

import collections
import threading
from types import TracebackType
from typing import Self


class FairLock:
    def __init__(self) -> None:
        self._condition = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._queue: collections.deque[int] = collections.deque()  # waiting threads, in arrival order

    def acquire(self) -> bool:
        me = threading.get_ident()
        with self._condition:
            if self._owner == me:
                self._depth += 1
                return True
            self._queue.append(me)
            while self._owner is not None or self._queue[0] != me:
                self._condition.wait()
            self._queue.popleft()
            self._owner, self._depth = me, 1
            return True

    def release(self) -> None:
        with self._condition:
            if self._owner != threading.get_ident():
                raise RuntimeError("FairLock released by a thread that does not hold it")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._condition.notify_all()

    def waiting(self) -> int:
        """How many other threads wait for the lock (read without it: a waiter missed now is seen next time)."""
        return len(self._queue)

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()
