"""Rollouts from an OpenAI-compatible vLLM server (TRL's server mode): the policy reaches it as a PEFT
folder through `/v1/load_lora_adapter`, under a new name after each optimizer step (vLLM keys its prefix cache
on the adapter's name, so an adapter reloaded in place under its old name could reuse the old policy's cached
prompt blocks; the previous name is unloaded), and
completions come from `/v1/completions` with token ids in and out. The server must read the folder, so it
runs on this machine or shares the output directory's filesystem, and it needs runtime LoRA loading
(`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, `--enable-lora`; `gym vllm-serve run.yaml` starts it so)."""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hanzo_gym.config.vllm_keys import VllmSettings
from hanzo_gym.engine import Engine
from hanzo_gym.errors import GymError
from hanzo_gym.records import SampledSequence
from hanzo_gym.rollout.policy_weights import write_policy_adapter
from hanzo_gym.rollout.vllm_requests import VllmSampler, sampled_sequence

POLICY_NAME = "hanzo-gym-policy"  # + "-v<N>", one name per hand-over


class VllmServerSampler(VllmSampler):
    def __init__(self, engine: Engine, settings: VllmSettings, workdir: Path):
        super().__init__(engine)
        self._url = settings.base_url
        self._workdir = workdir
        self._timeout_s = settings.timeout_s
        self.name = f"vLLM server at {self._url} (adapter sync)"
        self._wait_until_up()
        self._version = 0  # 0: no adapter of ours on the server yet

    def _generate(
        self, prompts: Sequence[Sequence[int]], num_samples: int, fields: dict[str, Any]
    ) -> list[list[SampledSequence]]:
        # One request per prompt, all in flight at once: the server batches them continuously.
        with ThreadPoolExecutor(max_workers=min(len(prompts), 64)) as pool:
            return list(pool.map(lambda p: self._complete(list(p), num_samples, fields), prompts))

    def _complete(self, prompt: list[int], n: int, fields: dict[str, Any]) -> list[SampledSequence]:
        body = {"model": self._policy_name, "prompt": prompt, "n": n, "return_token_ids": True, **fields}
        choices = sorted(self._post("/v1/completions", body)["choices"], key=lambda c: c["index"])
        return [
            sampled_sequence(c["token_ids"], c["logprobs"]["token_logprobs"], c["finish_reason"])
            for c in choices
        ]

    @property
    def _policy_name(self) -> str:
        return f"{POLICY_NAME}-v{self._version}"

    def _sync(self) -> None:
        previous = self._policy_name if self._version else None
        self._version += 1
        folder = write_policy_adapter(self._engine.model, self._workdir / f"policy-{self._version}")
        body = {"lora_name": self._policy_name, "lora_path": str(folder.resolve())}
        self._post("/v1/load_lora_adapter", body, expect_json=False)
        if previous is not None:
            self._unload(previous)
            shutil.rmtree(self._workdir / f"policy-{self._version - 1}", ignore_errors=True)

    def _unload(self, name: str) -> None:
        self._post("/v1/unload_lora_adapter", {"lora_name": name}, expect_json=False)

    def close(self) -> None:
        if self._version:
            try:
                self._unload(self._policy_name)
            except GymError:
                pass  # the server may be gone already; nothing of ours is left on it then
        shutil.rmtree(self._workdir, ignore_errors=True)

    def _wait_until_up(self) -> None:
        """Wait up to `trl.vllm_server_timeout` for the server to answer, as TRL does."""
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self._url}/v1/models", timeout=10) as response:
                    json.load(response)
                return
            except (urllib.error.URLError, OSError, ValueError) as exc:
                if time.monotonic() > deadline:
                    raise GymError(
                        f"no vLLM server answered at {self._url} within {self._timeout_s:.0f} s ({exc}); start "
                        "one with `gym vllm-serve <run.yaml>` or set `trl.vllm_server_host` / `_port`"
                    ) from None
                time.sleep(1.0)

    def _post(self, path: str, body: dict, expect_json: bool = True) -> Any:
        request = urllib.request.Request(
            f"{self._url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            hint = (
                " (start the server with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora)"
                if "lora" in path
                else ""
            )
            raise GymError(f"the vLLM server answered {path} with {exc.code}: {detail}{hint}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise GymError(f"the vLLM server at {self._url} did not answer {path}: {exc}") from None
        return json.loads(payload) if expect_json else payload
