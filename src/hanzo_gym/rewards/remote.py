"""`http:<url>`: a reward server scores each completion.

Request: POST JSON `{"prompt": …, "completion": …, "answer": … | null}`; response: JSON with a numeric
`reward` (other fields ignored). Requests for a batch go out concurrently (at most MAX_CONCURRENT_REQUESTS).
Connection errors, timeouts, 429 and 5xx are retried with jittered exponential back-off (honouring
`Retry-After`, capped); other 4xx and a bad body fail at once, since repeating them cannot help. Standard
library only (urllib): proxies come from the usual environment variables.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import math
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from datetime import UTC, datetime

from hanzo_gym.errors import ConfigError, GymError
from hanzo_gym.rewards.base import Completion, RewardFunction, checked_scores

REQUEST_TIMEOUT_S = 30.0
MAX_TRIES = 5
BACKOFF_BASE_S = 0.5  # doubles after each failed try
BACKOFF_MAX_S = 8.0
RETRY_AFTER_MAX_S = 30.0
MAX_CONCURRENT_REQUESTS = 16
_ERROR_BODY_CHARS = 200

_sleep = time.sleep  # tests swap this to observe the waits without spending them


class _Retryable(Exception):
    """A failure worth another try; `wait_s` is the server's Retry-After, when it gave one."""

    def __init__(self, description: str, wait_s: float | None = None):
        super().__init__(description)
        self.wait_s = wait_s


def _retry_after_s(value: str | None) -> float | None:
    """Retry-After as seconds: either a number of seconds or an HTTP date."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:  # HTTP dates are GMT; "-0000" parses as naive
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), RETRY_AFTER_MAX_S)


def _backoff_s(failed_tries: int) -> float:
    delay = min(BACKOFF_BASE_S * 2 ** (failed_tries - 1), BACKOFF_MAX_S)
    return delay * random.uniform(0.5, 1.0)  # jitter, so a batch of failed requests does not retry in step


class HttpReward(RewardFunction):
    does_io = True

    def __init__(self, spec: str, url: str):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in {"http", "https"} or not parts.hostname:
            raise ConfigError(f'reward function "{spec}": {url!r} is not an http:// or https:// URL')
        try:
            parts.port  # noqa: B018 - raises ValueError for a malformed port
        except ValueError:
            raise ConfigError(f'reward function "{spec}": {url!r} has a malformed port') from None
        self.name = spec
        self.url = url
        self._opener = urllib.request.build_opener()

    def __call__(self, completions: list[Completion]) -> list[float]:
        if not completions:
            return []
        with ThreadPoolExecutor(min(MAX_CONCURRENT_REQUESTS, len(completions))) as pool:
            futures = [pool.submit(self._score_with_retries, c) for c in completions]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for future in done:
                if future.exception() is not None:
                    # Queued requests are pointless now; the ones in flight finish (bounded by the timeout).
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise future.exception()
            return checked_scores(self.name, [f.result() for f in futures], len(completions))

    def _score_with_retries(self, completion: Completion) -> float:
        for tries in range(1, MAX_TRIES + 1):
            try:
                return self._score_once(completion)
            except _Retryable as failure:
                if tries == MAX_TRIES:
                    raise GymError(
                        f"reward {self.url}: failed after {tries} tries; last error: {failure}"
                    ) from None
                _sleep(failure.wait_s if failure.wait_s is not None else _backoff_s(tries))
        raise AssertionError("unreachable")

    def _score_once(self, completion: Completion) -> float:
        body = {"prompt": completion.prompt, "completion": completion.text, "answer": completion.answer}
        request = urllib.request.Request(
            self.url,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Accept": "application/json"},
            method="POST",
        )
        try:
            with self._opener.open(request, timeout=REQUEST_TIMEOUT_S) as response:
                payload = response.read()
        except urllib.error.HTTPError as e:
            detail = f"http {e.code}: {e.read()[:_ERROR_BODY_CHARS].decode(errors='replace')}"
            if e.code == 429 or e.code >= 500:
                raise _Retryable(detail, _retry_after_s(e.headers.get("Retry-After"))) from None
            raise GymError(f"reward {self.url}: {detail}") from None
        except TimeoutError:
            raise _Retryable(f"timed out after {REQUEST_TIMEOUT_S:g} s") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise _Retryable(f"timed out after {REQUEST_TIMEOUT_S:g} s") from None
            raise _Retryable(f"connection error: {e.reason}") from None
        except (OSError, http.client.HTTPException) as e:  # the connection dropped or the reply was cut short
            raise _Retryable(f"connection error: {e}") from None
        return self._reward_from(payload)

    def _reward_from(self, payload: bytes) -> float:
        try:
            reward = json.loads(payload)["reward"]
        except (ValueError, TypeError, KeyError):
            reward = None
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            shown = payload[:_ERROR_BODY_CHARS].decode(errors="replace")
            raise GymError(f'reward {self.url}: expected {{"reward": number}}, got {shown!r}')
        return float(reward)
