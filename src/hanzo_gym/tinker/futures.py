"""Tinker's futures: every call returns at once; `result()` waits. Calls on one client run in the order they
were submitted, one at a time, on that client's own worker thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class APIFuture(Generic[T]):
    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> T:
        # Shielded: a caller that stops waiting (a timeout, a cancelled task) must not cancel the request
        # itself, or the calls submitted after it would run without it.
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._future)), timeout)

    def done(self) -> bool:
        return self._future.done()

    def future(self) -> concurrent.futures.Future:
        """The underlying concurrent future (what the HTTP server waits on)."""
        return self._future

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()


class OrderedWorker:
    """One thread per client: submission order is execution order (Tinker's per-client guarantee)."""

    def __init__(self, name: str):
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> APIFuture[T]:
        return APIFuture(self._executor.submit(fn, *args, **kwargs))
