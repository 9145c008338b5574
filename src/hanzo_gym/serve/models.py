"""The models a server offers: one base model and named LoRA adapters on one `ModelHost`, every request
sampled through one `SampleBatcher`. A request's `model` picks the adapter; the base model's name picks none.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.host.sample_batcher import SampleBatcher
from hanzo_gym.renderers import Renderer, RendererError, get_renderer
from hanzo_gym.serve.protocol import APIError

# What one request may cost, so that no request can hold the sampler for long: a request without `max_tokens`
# gets at most DEFAULT_MAX_TOKENS, and prompts × n × max_tokens may not pass MAX_REQUEST_TOKENS. Both are
# stated in /v1/models and set by `gym serve --default-max-tokens / --max-request-tokens`.
DEFAULT_MAX_TOKENS = 1024
MAX_REQUEST_TOKENS = 32768


@dataclass
class ServedAdapter:
    name: str  # what requests call it
    slot: str  # its name on the host (fresh per load, so a name can be unloaded and loaded again)
    path: str
    created: int


def default_renderer_name(host: ModelHost) -> str:
    """Tinker's renderer for the model, else the tokenizer's own chat template (what `model_info` picks)."""
    from hanzo_gym.cookbook.model_info import get_recommended_renderer_name

    return get_recommended_renderer_name(host.base_model, host.tokenizer)


class ServedModels:
    def __init__(
        self,
        host: ModelHost,
        adapters: dict[str, str] | None = None,
        renderer: str | None = None,
        name: str | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        max_request_tokens: int = MAX_REQUEST_TOKENS,
    ):
        self.host = host
        self.max_tokens_default = default_max_tokens
        self.max_request_tokens = max_request_tokens
        self.batcher = SampleBatcher(host)
        self.name = name or host.base_model
        self.created = int(time.time())
        self.renderer: Renderer | None = None
        self.renderer_problem = ""
        try:
            self.renderer = get_renderer(renderer or default_renderer_name(host), host.tokenizer)
        except RendererError as exc:
            if renderer is not None:  # asked for by name: a mistake to report now
                raise
            self.renderer_problem = f"{exc}; start the server with --renderer NAME for chat"
        self._adapters: dict[str, ServedAdapter] = {}
        self._lock = threading.Lock()  # the adapter table; loading itself holds the host's lock
        config = host.model.config
        self.context_length: int | None = getattr(config, "max_position_embeddings", None)
        for adapter_name, path in (adapters or {}).items():
            self.load(adapter_name, path)

    # -- adapters --------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        with self._lock:
            return [self.name, *self._adapters]

    def adapters(self) -> list[ServedAdapter]:
        with self._lock:
            return list(self._adapters.values())

    def adapter_slot(self, model: str | None) -> str | None:
        """The host adapter that serves `model`; None: the base model (also when a request names no model)."""
        if model is None or model == self.name:
            return None
        with self._lock:
            adapter = self._adapters.get(model)
        if adapter is None:
            raise APIError(
                f"The model `{model}` does not exist (served: {', '.join(self.names())})",
                status=404,
                param="model",
                code="model_not_found",
            )
        return adapter.slot

    def load(self, name: str, path: str) -> ServedAdapter:
        """Load the PEFT adapter at `path` (a folder or a gym:// sampler path) as model `name`."""
        from hanzo_gym.tinker.paths import default_root, resolve

        if name == self.name:
            raise APIError(f"`{name}` is the base model's name", param="lora_name", code="invalid_value")
        with self._lock:
            if name in self._adapters:
                raise APIError(
                    f"an adapter named `{name}` is already loaded; unload it first",
                    param="lora_name",
                    code="invalid_value",
                )
            # Claimed before the (slow) load so that a second load of the same name fails at once.
            adapter = ServedAdapter(name, self.host.new_name("served"), path, int(time.time()))
            self._adapters[name] = adapter
        try:
            self.host.load_adapter(adapter.slot, resolve(path, default_root()))
        except Exception as exc:  # noqa: BLE001 - whatever the folder holds, the answer is a 400
            with self._lock:
                del self._adapters[name]
            self.host.retire(adapter.slot)
            raise APIError(
                f"cannot load adapter `{name}` from {path}: {exc}", param="lora_path", code="invalid_value"
            ) from None
        return adapter

    def unload(self, name: str) -> None:
        with self._lock:
            adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise APIError(
                f"no adapter named `{name}` is loaded", status=404, param="lora_name", code="model_not_found"
            )
        self.host.retire(adapter.slot)

    # -- requests --------------------------------------------------------------------------------------------
    def chat_renderer(self) -> Renderer:
        if self.renderer is None:
            raise APIError(
                f"this server cannot render chats: {self.renderer_problem}", code="no_chat_template"
            )
        return self.renderer

    def default_max_tokens(self, max_tokens: int | None, prompt_tokens: int) -> int:
        """What a request without `max_tokens` gets: the rest of the context, at most `max_tokens_default`."""
        if max_tokens is not None:
            return max_tokens
        room = self.max_tokens_default if self.context_length is None else self.context_length - prompt_tokens
        return max(1, min(self.max_tokens_default, room))

    def check_budget(self, prompts: int, n: int, max_tokens: int) -> None:
        """A 400 for a request that could generate more than `max_request_tokens` tokens."""
        could_generate = prompts * n * max_tokens
        if could_generate > self.max_request_tokens:
            count = f"{prompts} prompts × " if prompts > 1 else ""
            raise APIError(
                f"this request could generate {could_generate} tokens ({count}n={n} × max_tokens={max_tokens}); "
                f"this server allows at most {self.max_request_tokens} per request: lower n or max_tokens",
                param="n" if n > 1 else "max_tokens",
                code="request_too_large",
            )

    def check_prompt(self, tokens: list[int], max_tokens: int | None, param: str = "messages") -> None:
        if not tokens:
            raise APIError(
                "the prompt is empty: it needs at least one token", param=param, code="invalid_value"
            )
        if any(t >= self.host.vocab_size for t in tokens):
            raise APIError(
                f"token ids must be below the vocabulary size {self.host.vocab_size}",
                param=param,
                code="invalid_value",
            )
        if self.context_length is None:
            return
        wanted = len(tokens) + (1 if max_tokens is None else max_tokens)
        if wanted > self.context_length:
            raise APIError(
                f"This model's maximum context length is {self.context_length} tokens. However, you requested "
                f"{wanted} tokens ({len(tokens)} in the prompt, {wanted - len(tokens)} for the completion). Please "
                "reduce the prompt or the completion length.",
                param="max_tokens" if max_tokens and len(tokens) < self.context_length else param,
                code="context_length_exceeded",
            )
