"""The host's lock: handed out in arrival order, reentrant, and it says who waits."""

from __future__ import annotations

import threading
import time

import pytest

from hanzo_gym.host.fair_lock import FairLock


def test_waiters_get_the_lock_in_the_order_they_asked_even_against_a_thread_that_asks_again_at_once():
    lock, order = FairLock(), []
    lock.acquire()
    threads = []
    for name in "abc":
        thread = threading.Thread(target=lambda n=name: [lock.acquire(), order.append(n), lock.release()])
        thread.start()
        threads.append(thread)
        while lock.waiting() < len(threads):
            time.sleep(0.001)
    lock.release()
    lock.acquire()  # asking again at once: behind the three that waited
    order.append("holder again")
    lock.release()
    for thread in threads:
        thread.join(5)
    assert order == ["a", "b", "c", "holder again"]
    assert lock.waiting() == 0


def test_the_holder_may_take_it_again_and_another_thread_may_not_release_it():
    lock = FairLock()
    with lock, lock:
        assert lock.waiting() == 0
        outcome = []
        thread = threading.Thread(target=lambda: outcome.append(pytest.raises(RuntimeError, lock.release)))
        thread.start()
        thread.join(5)
        assert outcome
    done = threading.Event()
    threading.Thread(target=lambda: [lock.acquire(), done.set(), lock.release()]).start()
    assert done.wait(5)  # both levels were released
