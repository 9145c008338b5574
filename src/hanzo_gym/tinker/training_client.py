"""TrainingClient: one LoRA adapter on a shared base model, trained through Tinker's primitives.

Every call returns a future at once and runs on the client's own worker in submission order, so
`forward_backward` then `optim_step` submitted back to back behave like the same calls awaited one by one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from hanzo_gym.engine import Engine, check_datums, check_finite_inputs
from hanzo_gym.engine.losses import CONFIG_KEYS, LOSS_FNS
from hanzo_gym.engine.shared_pass import AdapterJob
from hanzo_gym.engine.state_files import load_engine_state, save_engine_state
from hanzo_gym.errors import GymError
from hanzo_gym.files import publish_directory
from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.host.sample_batcher import SampleBatcher
from hanzo_gym.model.lora import read_adapter_config
from hanzo_gym.records import AdamParams
from hanzo_gym.tinker.futures import APIFuture, OrderedWorker
from hanzo_gym.tinker.paths import checkpoint_path, resolve
from hanzo_gym.tinker.sampling_client import SamplingClient
from hanzo_gym.tinker.types import (
    Datum,
    ForwardBackwardOutput,
    GetInfoResponse,
    LoadWeightsResponse,
    ModelData,
    OptimStepResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    logprobs_output,
)

CustomLossFn = Callable[[list[Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


RUN_RECORD = "gym_checkpoint.json"  # in every checkpoint folder: its run, base model and RUN_RECORD_KEYS
RUN_RECORD_KEYS = ("train_mlp", "train_attn", "train_unembed", "user_metadata")


def read_run_record(directory: Path) -> dict[str, Any]:
    """A checkpoint's RUN_RECORD ({} for a folder saved elsewhere, a PEFT adapter from gym train say)."""
    try:
        record = json.loads((directory / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


class TrainingClient:
    def __init__(
        self,
        host: ModelHost,
        batcher: SampleBatcher,
        adapter: str,
        run_id: str,
        root: Path,
        open_sampler: Callable[[str], SamplingClient],
        record: dict[str, Any] | None = None,
    ):
        """Made by ServiceClient: `root` is where gym:// paths live, `open_sampler(model_path)` is the
        service's create_sampling_client, `record` what each checkpoint notes about the run (RUN_RECORD_KEYS:
        which layers it trains, the user's metadata)."""
        self._host = host
        self._batcher = batcher
        self._root = root
        self._open_sampler = open_sampler
        self._adapter = adapter
        self.run_id = run_id
        self.record = dict(record or {})
        with host.using(adapter) as model:
            self._engine = Engine(model, host.tokenizer)
        self._worker = OrderedWorker(f"hanzo-gym-{run_id}")

    # -- training ---------------------------------------------------------------------------------------
    def forward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """The loss and per-token logprobs of `forward_backward`, without touching the gradients."""
        # Not under the host's lock: the host's shared passes take it, with other clients' calls that wait.
        return self._worker.submit(self._scored, list(data), loss_fn, loss_fn_config, False)

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """Add the gradient of the summed loss to what earlier calls accumulated, until `optim_step`."""
        return self._worker.submit(self._scored, list(data), loss_fn, loss_fn_config, True)

    def forward_backward_custom(
        self, data: Sequence[Datum], loss_fn: CustomLossFn, *, loss_type_input: str = "logprobs"
    ) -> APIFuture[ForwardBackwardOutput]:
        """Any differentiable function of the per-token logprobs: its gradient is carried back through a
        weighted cross-entropy pass (weights = -dLoss/dlogprobs), as Tinker does it."""
        if loss_type_input != "logprobs":
            raise GymError(f"loss_type_input {loss_type_input!r}: only 'logprobs' is supported")
        # Not under the host's lock as a whole: the user's function may call other clients on the same model.
        return self._worker.submit(self._forward_backward_custom, list(data), loss_fn)

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        if not isinstance(adam_params, AdamParams):
            raise GymError(f"optim_step takes types.AdamParams, not {type(adam_params).__name__}")
        if adam_params.learning_rate < 0:
            raise GymError(f"learning_rate must be >= 0 (got {adam_params.learning_rate})")
        return self._submit(self._optim_step, adam_params)

    def _optim_step(self, adam_params: AdamParams) -> OptimStepResponse:
        metrics = self._engine.optim_step(adam_params)
        if not math.isfinite(metrics["grad_norm"]):
            raise GymError(
                f"optim_step refused: the gradients since the last step are not finite (grad_norm "
                f"{metrics['grad_norm']}); they were dropped, and the weights and optimizer state are as they were"
            )
        return OptimStepResponse(metrics=metrics)

    # -- checkpoints --------------------------------------------------------------------------------------
    def save_state(
        self, name: str, ttl_seconds: int | None = None, overwrite: bool = False
    ) -> APIFuture[SaveWeightsResponse]:
        """Adapter + AdamW moments under gym://<run>/weights/<name>: `load_state_with_optimizer` resumes
        exactly. `ttl_seconds` is accepted and ignored: local checkpoints never expire."""
        path = checkpoint_path(self.run_id, "weights", name)
        return self._submit(self._save, path, True, overwrite, SaveWeightsResponse)

    def save_weights_for_sampler(
        self, name: str, ttl_seconds: int | None = None
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """The adapter as a PEFT directory under gym://<run>/sampler_weights/<name> (peft and vLLM load it)."""
        path = checkpoint_path(self.run_id, "sampler_weights", name)
        return self._submit(self._save, path, False, True, SaveWeightsForSamplerResponse)

    def load_state(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """The weights of a checkpoint; the optimizer starts fresh (use load_state_with_optimizer to resume)."""
        return self._submit(self._load, path, False)

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadWeightsResponse]:
        return self._submit(self._load, path, True)

    def save_weights_and_get_sampling_client(
        self, name: str | None = None, retry_config: Any = None
    ) -> SamplingClient:
        """A sampling client over a snapshot of the current weights (after every call submitted before)."""
        return self.sampling_snapshot().result()

    def sampling_snapshot(self) -> APIFuture[SamplingClient]:
        """What save_weights_and_get_sampling_client waits for: a future of the sampling client, taken in
        submission order (after every call submitted before, before every call submitted after)."""
        return self._submit(self._snapshot)

    def create_sampling_client(self, model_path: str, retry_config: Any = None) -> SamplingClient:
        return self._open_sampler(model_path)

    # -- information ---------------------------------------------------------------------------------------
    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self._host.tokenizer

    def get_info(self) -> GetInfoResponse:
        config = self._host.config(self._adapter)
        arch = getattr(self._host.model.config, "model_type", "unknown")
        name = self._host.base_model
        return GetInfoResponse(
            model_data=ModelData(arch=arch, model_name=name, tokenizer_id=name),
            model_id=self.run_id,
            is_lora=True,
            lora_rank=int(config.r),
            model_name=name,
        )

    # -- async twins: each returns the future once submitted (Tinker's "double await") ---------------------
    async def forward_async(self, *args: Any, **kwargs: Any) -> APIFuture[ForwardBackwardOutput]:
        return self.forward(*args, **kwargs)

    async def forward_backward_async(self, *args: Any, **kwargs: Any) -> APIFuture[ForwardBackwardOutput]:
        return self.forward_backward(*args, **kwargs)

    async def forward_backward_custom_async(
        self, *args: Any, **kwargs: Any
    ) -> APIFuture[ForwardBackwardOutput]:
        return self.forward_backward_custom(*args, **kwargs)

    async def optim_step_async(self, *args: Any, **kwargs: Any) -> APIFuture[OptimStepResponse]:
        return self.optim_step(*args, **kwargs)

    async def save_state_async(self, *args: Any, **kwargs: Any) -> APIFuture[SaveWeightsResponse]:
        return self.save_state(*args, **kwargs)

    async def load_state_async(self, *args: Any, **kwargs: Any) -> APIFuture[LoadWeightsResponse]:
        return self.load_state(*args, **kwargs)

    async def load_state_with_optimizer_async(
        self, *args: Any, **kwargs: Any
    ) -> APIFuture[LoadWeightsResponse]:
        return self.load_state_with_optimizer(*args, **kwargs)

    async def save_weights_for_sampler_async(
        self, *args: Any, **kwargs: Any
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        return self.save_weights_for_sampler(*args, **kwargs)

    async def save_weights_and_get_sampling_client_async(self, *args: Any, **kwargs: Any) -> SamplingClient:
        return await self.sampling_snapshot()

    async def get_info_async(self) -> GetInfoResponse:
        return self.get_info()

    # -- work, on the worker thread with this client's adapter active ------------------------------------
    def _submit(self, fn: Callable[..., Any], *args: Any) -> APIFuture:
        def run() -> Any:
            with self._host.using(self._adapter):
                return fn(*args)

        return self._worker.submit(run)

    def _checked(self, data: list[Datum], loss_fn: str, config: dict | None = None) -> list[Datum]:
        if loss_fn not in LOSS_FNS:
            raise GymError(f"unknown loss_fn `{loss_fn}`; choose one of {', '.join(LOSS_FNS)}")
        unknown = sorted(set(config or {}) - set(CONFIG_KEYS[loss_fn]))
        if unknown:
            allowed = ", ".join(CONFIG_KEYS[loss_fn]) or "none"
            raise GymError(f"loss_fn_config for `{loss_fn}` has unknown keys {unknown}; it takes: {allowed}")
        check_datums(data)
        check_finite_inputs(data)
        for index, datum in enumerate(data):
            targets = datum.loss_fn_inputs["target_tokens"].data
            for what, ids in (("model_input", datum.model_input.to_ints()), ("target_tokens", targets)):
                self._host.check_token_ids(list(ids), f"datum {index}: {what}")
        return data

    def _scored(
        self, data: list[Datum], loss_fn: str, config: dict | None, backward: bool
    ) -> ForwardBackwardOutput:
        datums = self._checked(data, loss_fn, config)
        if not datums:  # Tinker sends no request for an empty batch: nothing to accumulate
            return _empty_output(loss_fn)
        out = self._host.passes.run(AdapterJob(self._engine, datums, loss_fn, config), backward)
        return ForwardBackwardOutput(loss_fn, logprobs_output(out.logprobs), {"loss:sum": out.loss_sum})

    def _forward_backward_custom(self, data: list[Datum], loss_fn: CustomLossFn) -> ForwardBackwardOutput:
        for index, datum in enumerate(data):
            extra = set(datum.loss_fn_inputs) - {"target_tokens", "weights"}
            if "target_tokens" not in datum.loss_fn_inputs or extra:
                raise GymError(
                    f"datum {index}: forward_backward_custom takes loss_fn_inputs target_tokens (and optionally "
                    f"weights) only; got {sorted(datum.loss_fn_inputs)}"
                )
        datums = self._checked(data, "cross_entropy")
        if not datums:
            return _empty_output("cross_entropy")
        with self._host.using(self._adapter):
            leaves = [lp.clone().requires_grad_() for lp in self._engine.forward(datums)]
        loss, metrics = loss_fn(data, leaves)
        loss.backward()
        weighted = [
            Datum(
                d.model_input,
                {
                    "target_tokens": d.loss_fn_inputs["target_tokens"],
                    "weights": -leaf.grad if leaf.grad is not None else torch.zeros(len(d)),
                },
            )
            for d, leaf in zip(datums, leaves)
        ]
        with self._host.using(self._adapter):
            out = self._engine.forward_backward(weighted, "cross_entropy")
        # As the SDK reports it: `loss:sum` is the custom loss, the weighted cross-entropy is its surrogate.
        return ForwardBackwardOutput(
            "cross_entropy",
            logprobs_output(out.logprobs),
            {
                **{k: float(v) for k, v in metrics.items()},
                "loss:sum": float(loss.detach().sum()),
                "surrogate_loss:sum": out.loss_sum,
            },
        )

    def _save(self, path: str, with_optimizer: bool, overwrite: bool, response: type) -> Any:
        destination = resolve(path, self._root)
        if destination.exists() and not overwrite:
            raise GymError(f"{path} already exists; pick another name or pass overwrite=True")
        destination.parent.mkdir(parents=True, exist_ok=True)

        def build(staging: Path) -> None:
            save_engine_state(self._engine, staging, with_optimizer)
            self._host.tokenizer.save_pretrained(str(staging))
            record = {"base_model": self._host.base_model, "run_id": self.run_id, "path": path, **self.record}
            (staging / RUN_RECORD).write_text(json.dumps(record) + "\n")

        # Written whole into a temporary sibling and renamed: a crash never leaves half a checkpoint.
        publish_directory(build, destination)
        return response(path=path)

    def _load(self, path: str, with_optimizer: bool) -> LoadWeightsResponse:
        directory = resolve(path, self._root)
        config = read_adapter_config(directory)
        mine = self._host.config(self._adapter)
        shape = _adapter_shape(config)
        if shape != _adapter_shape(mine):
            raise GymError(
                f"{path}: an adapter with {shape} does not fit this client's {_adapter_shape(mine)}; use "
                "ServiceClient.create_training_client_from_state to start from it"
            )
        load_engine_state(self._engine, directory, with_optimizer)
        return LoadWeightsResponse(path=path)

    def _snapshot(self) -> SamplingClient:
        name = self._host.new_name("snapshot")
        self._host.add_adapter(name, self._host.config(self._adapter))
        self._host.set_weights(name, self._host.weights(self._adapter))
        return SamplingClient(self._host, self._batcher, name, owns_adapter=True)


def _empty_output(loss_fn: str) -> ForwardBackwardOutput:
    return ForwardBackwardOutput(loss_fn, [], {"loss:sum": 0.0})


def _adapter_shape(config: Any) -> dict:
    """What a saved adapter must share with a client's to load into it."""
    return {
        "rank": int(config.r),
        "lora_alpha": float(config.lora_alpha),
        "target_modules": sorted(config.target_modules or []),
        "use_rslora": bool(getattr(config, "use_rslora", False)),
        "use_dora": bool(getattr(config, "use_dora", False)),
    }
