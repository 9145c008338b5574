"""Who may use the server: its API keys, each a user. A request carries its key as the `openai` client sends it
(`Authorization: Bearer KEY`) or as the official `tinker` SDK does (`X-API-Key: KEY`); both are taken on both
APIs. Keys are compared in constant time and never printed; a user is known by a digest of its key, which is what
the server records as the owner of a run."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from hanzo_gym.errors import GymError

KEY_ENV = "VLLM_API_KEY"  # the variable vLLM's OpenAI server reads its key from: the same deployments work here
LOCAL_USER = "local"  # the one user of a server without keys


class ApiKeys:
    def __init__(self, keys: Iterable[str]):
        self._keys = [key.encode() for key in keys]
        if any(not key.strip() for key in self._keys):
            raise GymError("an API key may not be empty")

    @classmethod
    def from_sources(cls, given: list[str] | None, key_file: str | None, env: Mapping[str, str] = os.environ):
        """--api-key (repeatable), --api-key-file (one key a line, `#` comments), and $VLLM_API_KEY."""
        keys = list(given or [])
        if key_file is not None:
            try:
                lines = Path(key_file).read_text(encoding="utf-8").splitlines()
            except OSError as exc:
                raise GymError(f"--api-key-file {key_file}: {exc.strerror}") from None
            found = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
            if not found:
                raise GymError(f"--api-key-file {key_file} holds no key (one a line)")
            keys += found
        if env.get(KEY_ENV):
            keys.append(env[KEY_ENV])
        return cls(keys)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def user_of(self, headers: Mapping[str, str]) -> str | None:
        """The user a request's key names (LOCAL_USER where the server has no keys); None for a missing or
        wrong key."""
        if not self._keys:
            return LOCAL_USER
        sent = _sent_key(headers)
        if sent is None:
            return None
        # every key compared, in constant time each: neither the answer's time nor its path tells which matched
        matched = [hmac.compare_digest(sent, key) for key in self._keys]
        return "user-" + hashlib.sha256(sent).hexdigest()[:16] if any(matched) else None


def _sent_key(headers: Mapping[str, str]) -> bytes | None:
    authorization = headers.get("Authorization") or ""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip().encode()
    key = headers.get("X-API-Key")
    return key.strip().encode() if key and key.strip() else None


def is_loopback(bind: str) -> bool:
    """Whether `bind` is reachable from this machine only (a host name other than localhost counts as not)."""
    if bind == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return False
