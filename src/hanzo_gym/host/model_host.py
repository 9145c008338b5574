"""One base model in memory with any number of named LoRA adapters, used one operation at a time.

The Tinker-style clients and `gym serve` keep a host per base model: a training client owns one adapter, every
sampling client another (a snapshot of some weights), and a served model name is an adapter too. Switching is
a `set_adapter` call, so a new sampling client per training step costs a copy of the adapter, never a second
copy of the base model.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from hanzo_gym.engine import Engine
from hanzo_gym.errors import GymError, ModelError
from hanzo_gym.host.fair_lock import FairLock
from hanzo_gym.host.shared_passes import SharedPasses
from hanzo_gym.model.hub import Precision, choose_precision, load_causal_lm, load_tokenizer, model_key
from hanzo_gym.model.load_plan import BaseModelPlan
from hanzo_gym.model.lora import adapter_weights, linear_layer_paths, read_adapter, set_adapter_weights


class ModelHost:
    def __init__(self, base_model: str, device: torch.device | None = None, dtype: torch.dtype | None = None):
        """The base model on `device` in `dtype`; each defaults to what `bf16: auto` picks (CUDA, else the CPU;
        bf16 where the device multiplies it natively, else fp32), and `precision` says which and why. On bf16
        the adapters stay fp32 (PEFT's autocast of adapter weights), the mixed recipe `gym train` uses."""
        auto = choose_precision("auto")
        if device is not None and device.type != auto.device.type:  # auto's choice was for another device
            auto = Precision(device, torch.float32, f"on {device.type}")
        self.precision = Precision(
            device or auto.device,
            dtype or auto.dtype,
            auto.reason if dtype is None or dtype == auto.dtype else "as asked",
        )
        self.base_model = base_model
        plan = BaseModelPlan.of(base_model, self.precision.dtype, self.precision.device)
        self.tokenizer = load_tokenizer(base_model, model_dir=plan.source.directory)
        self.model = load_causal_lm(plan)
        self.model.requires_grad_(False)
        self.linear_layers = linear_layer_paths(self.model)
        self.lock = FairLock()  # a sampler steps aside between decode steps for whoever waits
        self.passes = SharedPasses(self.using)  # training clients' calls that wait together run together
        self._names = itertools.count()
        self._retired: list[str] = []
        # Scores for whichever adapter is active (or none); it trains nothing.
        self.scorer = Engine(self.model, self.tokenizer)

    @property
    def device(self) -> torch.device:
        return self.scorer.device

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[0]

    def check_token_ids(self, tokens: list, what: str) -> None:
        """GymError naming `what` unless every token is an id of this model's vocabulary (an id out of range
        would crash the embedding lookup, on CUDA for the whole process)."""
        vocab = self.vocab_size
        bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise GymError(f"{what} holds {bad[0]!r}, not a token id of this model (0 ≤ id < {vocab})")

    @property
    def adapters(self) -> list[str]:
        return list(self.model.peft_config) if isinstance(self.model, PeftModel) else []

    def new_name(self, prefix: str) -> str:
        return f"{prefix}-{next(self._names)}"

    def add_adapter(self, name: str, config: LoraConfig) -> None:
        """A fresh adapter (A random from torch's generator, B zero), made the active one."""
        with self.lock, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            self._drop_retired()
            if name in self.adapters:
                raise ModelError(f"an adapter named `{name}` is already loaded")
            if config.modules_to_save:
                # The sampler folds LoRA deltas into the weights; a whole trained module would be left out.
                raise ModelError(
                    f"adapter `{name}` trains whole modules too (modules_to_save {list(config.modules_to_save)}), "
                    "which this server does not sample from yet (nor does vLLM): fold it into the base with "
                    "`gym merge` and serve the merged model"
                )
            if config.init_lora_weights == "loftq":
                # Its base is rounded through NF4 / int8 (model/loftq.py); this host's base is shared unrounded.
                raise ModelError(
                    f"adapter `{name}` is a LoftQ adapter, trained over a base rounded to "
                    f"{(config.loftq_config or {}).get('loftq_bits', 4)} bits, not over the full-precision base "
                    "this server shares between adapters: fold it into the rounded base with `gym merge` and serve "
                    "the merged model"
                )
            try:
                if isinstance(self.model, PeftModel):
                    self.model.add_adapter(name, config)
                else:
                    self.model = get_peft_model(self.model, config, adapter_name=name)
            except ValueError as exc:
                raise ModelError(f"cannot attach LoRA to {self.base_model}: {exc}") from None
            # A local base is recorded by its absolute path: the adapter then loads from any working directory.
            self.model.peft_config[name].base_model_name_or_path = model_key(self.base_model)
            self.scorer.model = self.model
            self.activate(name)

    def load_adapter(self, name: str, directory: str | Path) -> None:
        """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) as adapter `name`."""
        config, weights = read_adapter(directory)
        with self.lock:
            self.add_adapter(name, config)
            self.set_weights(name, weights)

    def set_weights(self, name: str, weights: dict[str, torch.Tensor]) -> None:
        with self.lock:
            set_adapter_weights(self.model, weights, adapter_name=name)

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        """A CPU copy of adapter `name`'s weights, keyed as in adapter_model.safetensors."""
        with self.lock:
            return adapter_weights(self.model, name)

    def config(self, name: str) -> LoraConfig:
        return self.model.peft_config[name]

    def retire(self, name: str) -> None:
        """Forget adapter `name` at the next operation. Safe from any thread, a finalizer included."""
        self._retired.append(name)

    def activate(self, name: str | None) -> None:
        if name is None:
            return
        if name not in self.adapters:
            raise ModelError(f"no adapter named `{name}` is loaded (loaded: {', '.join(self.adapters)})")
        self.model.set_adapter(name)

    @contextlib.contextmanager
    def using(self, name: str | None) -> Iterator[torch.nn.Module]:
        """Hold the host with adapter `name` active; `None` is the base model with every adapter off."""
        with self.lock:
            self._drop_retired()
            if name is None and isinstance(self.model, PeftModel):
                with self.model.disable_adapter():
                    yield self.model
            else:
                self.activate(name)
                yield self.model

    @contextlib.contextmanager
    def held(self) -> Iterator[torch.nn.Module]:
        """Hold the host as it is (whichever adapter is active), retired adapters gone: for passes that pick
        each row's adapter themselves (engine/adapter_tokens.py)."""
        with self.lock:
            self._drop_retired()
            yield self.model

    def _drop_retired(self) -> None:
        kept = []
        while self._retired:  # pop, not iterate: retire() may append from another thread meanwhile
            name = self._retired.pop()
            if name in self.adapters and len(self.adapters) > 1:
                with warnings.catch_warnings():
                    # "adapter … was active which is now deleted": every operation activates its own adapter.
                    warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
                    self.model.delete_adapter(name)
            elif name in self.adapters:
                kept.append(name)  # peft cannot delete the last adapter: it goes once another one exists
        self._retired.extend(kept)
