"""The Tinker clients' sampling through a colocated vLLM: what `SampleBatcher` does (requests from many threads,
batched as they come, each for one of the host's adapters), with vLLM decoding. A sampling client's adapter is
a fixed snapshot, so each is written to a folder once, on its first request, and served under a LoRA id of its
own; adapters the host has retired leave vLLM at the next batch. Log-probabilities of prompts
(`compute_logprobs`) still come from the host's own forward pass, the trainer's numbers."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from hanzo_gym.errors import GymError
from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.host.sample_batcher import checked_prompt
from hanzo_gym.model.hub import resolve_model
from hanzo_gym.model.lora import write_adapter
from hanzo_gym.records import SampledSequence, SamplingParams
from hanzo_gym.rollout.vllm_colocate import DTYPE_NAMES
from hanzo_gym.rollout.vllm_import import import_vllm
from hanzo_gym.rollout.vllm_requests import vllm_sampling_fields, vllm_sequences

MAX_LORA_RANK = 64  # the largest adapter rank a client may sample (Tinker's ranks go up to 32 by default)
MAX_MODEL_LEN = 8192  # vLLM's context here: the model's own, at most this (its KV cache is sized by it)


class VllmBatcher:
    def __init__(self, host: ModelHost, memory_utilization: float = 0.3):
        self.host = host
        self._vllm = vllm = import_vllm()
        context = getattr(host.model.config, "max_position_embeddings", None) or MAX_MODEL_LEN
        self._max_model_len = min(context, MAX_MODEL_LEN)
        self._llm = vllm.LLM(
            model=str(resolve_model(host.base_model)),
            dtype=DTYPE_NAMES[next(host.model.parameters()).dtype],
            max_model_len=self._max_model_len,
            enforce_eager=True,
            gpu_memory_utilization=memory_utilization,
            enable_lora=True,
            max_lora_rank=MAX_LORA_RANK,
            max_loras=4,
        )
        self._folders = Path(tempfile.mkdtemp(prefix="hanzo-gym-vllm-"))
        self._loras: dict[str, object] = {}  # adapter name → its LoRARequest
        self._ids = itertools.count(1)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="hanzo-gym-vllm-sampler", daemon=True)
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
        if on_token is not None:
            raise GymError("streaming token by token is not supported with vLLM sampling")
        tokens = checked_prompt(self.host, prompt, num_samples, params)
        room = self._max_model_len - len(tokens)
        if room < 1:
            raise GymError(
                f"no room to sample: a prompt of {len(tokens)} tokens fills vLLM's {self._max_model_len}"
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        fields = vllm_sampling_fields(dataclasses.replace(params, max_tokens=max_tokens), self.host.tokenizer)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((adapter, tokens, num_samples, fields, future, owner))
        return future

    def cancel(self, event: threading.Event) -> None:
        """vLLM finishes a request it has begun; nobody reads the result."""
        event.set()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        shutil.rmtree(self._folders, ignore_errors=True)

    def _serve(self) -> None:
        from vllm.inputs import TokensPrompt

        while True:
            batch = [self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            closing = None in batch
            batch = [request for request in batch if request is not None]
            if batch:
                try:
                    self._forget_retired()
                    loras = [self._lora(adapter) for adapter, *_ in batch]
                    outputs = self._llm.generate(
                        [TokensPrompt(prompt_token_ids=tokens) for _, tokens, *_ in batch],
                        [self._vllm.SamplingParams(n=n, **fields) for _, _, n, fields, *_ in batch],
                        lora_request=loras,
                        use_tqdm=False,
                    )
                    for (*_, future, _owner), output in zip(batch, outputs, strict=True):
                        future.set_result(vllm_sequences(output))
                except BaseException as exc:  # noqa: BLE001 - each caller's future carries it
                    for *_, future, _owner in batch:
                        if not future.done():
                            future.set_exception(exc)
            if closing:
                return

    def _lora(self, adapter: str | None):
        if adapter is None:
            return None
        if adapter not in self._loras:
            from vllm.lora.request import LoRARequest

            config = self.host.config(adapter)
            if config.r > MAX_LORA_RANK:
                raise GymError(
                    f"vLLM sampling here takes adapters up to rank {MAX_LORA_RANK}; this one has {config.r}"
                )
            folder = self._folders / adapter
            write_adapter(folder, config, self.host.weights(adapter))
            self._loras[adapter] = LoRARequest(adapter, next(self._ids), str(folder))
        return self._loras[adapter]

    def _forget_retired(self) -> None:
        live = set(self.host.adapters)
        for name in [n for n in self._loras if n not in live]:
            request = self._loras.pop(name)
            self._llm.llm_engine.remove_lora(request.lora_int_id)
            shutil.rmtree(request.lora_path, ignore_errors=True)
