"""The engine: one model with its LoRA adapter and optimizer, driven through a few Tinker-named primitives.

Everything that trains goes through `forward`, `forward_backward` and `optim_step`. Datums in one call are
packed into a single row without padding: position ids restart at every datum, which transformers turns into
attention that never crosses a datum's boundary.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from peft import LoraConfig, PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hanzo_gym.engine.adapter_tokens import TokenAdapters
from hanzo_gym.engine.distributed import sync_gradients
from hanzo_gym.engine.losses import LOSS_FNS, OPTIONAL_INPUTS, REQUIRED_INPUTS
from hanzo_gym.engine.offload import HostOffload
from hanzo_gym.engine.optimizers import OptimizerFactory, plain_adamw, state_as_tensors, state_for_optimizer
from hanzo_gym.engine.prefix_sharing import shared_layout
from hanzo_gym.engine.row_buckets import bucket_length, pads_rows
from hanzo_gym.engine.sampling import sample_groups
from hanzo_gym.engine.token_logprobs import choice_logprobs, token_logprobs, token_logprobs_with_log_sum_sq
from hanzo_gym.errors import GymError
from hanzo_gym.model.decoder import decoder_of
from hanzo_gym.model.lora import adapter_weights, set_adapter_weights
from hanzo_gym.records import AdamParams, Datum, SampledSequence, SamplingParams, TensorData

# per-datum token log-probabilities → (scalar loss, metrics); see Engine.forward_backward_custom
SequenceLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
# per-position values the scoring pass can return beside the log-probabilities (TRL's fused LM head names)
POSITION_OUTPUTS = ("entropy", "log_sum_sq_probs")


@dataclass
class ForwardBackwardOutput:
    loss_sum: float
    logprobs: list[torch.Tensor]  # per datum, fp32 on CPU
    metrics: dict[str, float] = field(default_factory=dict)
    entropies: list[torch.Tensor] = field(default_factory=list)  # per datum: entropy of each position


class Engine:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        max_tokens_per_pass: int | None = None,
        logprob_chunk: int | None = None,
        optimizer_factory: OptimizerFactory = plain_adamw,
        activation_offloading: bool = False,
        autocast_dtype: torch.dtype | None = None,
        loss_scaling: bool = False,
    ):
        """`activation_offloading`: keep the decoder's saved activations in host memory until the backward pass
        (engine/offload.py), trading transfer time for device memory. `autocast_dtype`: run the decoder under
        torch.autocast in that dtype (mixed precision over fp32 weights); the output layer and the losses stay
        fp32. By default an fp32 adapter over a bf16 (or fp16) base runs so (`mixed_precision_dtype`).
        `logprob_chunk`: positions per chunk of the output layer, by default sized to the vocabulary
        (token_logprobs.chunk_rows). `loss_scaling`: fp16's dynamic loss scaling, as HF's Trainer does it with
        torch's GradScaler (its defaults): the loss is multiplied before each backward so that small fp16
        gradients do not underflow, the gradients divided back before the step, and a step whose gradients
        overflowed is skipped and the scale halved."""
        self.model = model
        self.activation_offloading = activation_offloading
        self.autocast_dtype = autocast_dtype or mixed_precision_dtype(model)
        if self.autocast_dtype is not None:
            _let_autocast_cast_lora_inputs(model)
        self._optimizer_factory = optimizer_factory
        self._loss_scaling = loss_scaling
        self.loss_scaler: torch.amp.GradScaler | None = None
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        # full fine-tuning's reference weights, when kept (keep_reference)
        self._reference_weights: list[torch.Tensor] | None = None
        self.max_tokens_per_pass = max_tokens_per_pass or default_tokens_per_pass(self.device)
        self.logprob_chunk = logprob_chunk
        # Captured now: a model host may later add adapters whose parameters belong to other engines.
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        # The adapter this engine trains (a host's model carries several; the active one is this engine's).
        # None with trainable parameters: full fine-tuning, every weight of a plain model trains.
        self.adapter_name: str | None = (
            model.active_adapter if isinstance(model, PeftModel) and self.trainable else None
        )
        self.optimizer: torch.optim.Optimizer | None = None
        self.reset_optimizer()
        causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = causal_lm.config
        scaled = [
            k
            for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")
            if getattr(config, k, None)
        ]
        if scaled:
            raise GymError(f"{config.model_type}: output logits with `{scaled[0]}` are not supported yet")
        self._decoder = decoder_of(causal_lm)
        self._causal_lm = causal_lm
        self._router_loss = router_balance_loss_of(causal_lm)
        self.packs_datums = self._pads_rows = False  # the check below scores on the plain path
        self.packs_datums = self._packing_is_exact()
        self._pads_rows = self.packs_datums and pads_rows(self._decoder, self.device, self.autocast_dtype)
        if not self.packs_datums:
            warnings.warn(
                f"{config.model_type} does not keep packed sequences apart: one datum per pass (slower)",
                stacklevel=2,
            )

    @property
    def routes_experts(self) -> bool:
        """Whether training adds a mixture of experts' router load-balancing loss (`output_router_logits`)."""
        return self._router_loss is not None

    @property
    def trainable_parameter_count(self) -> int:
        return sum(p.numel() for p in self.trainable)

    def forward(
        self, datums: list[Datum], reference: bool = False, scored_from: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """Per-token log-probabilities of each datum's targets; no gradients, dropout off. `reference=True`
        scores with the adapter disabled: the frozen base model, the reference of a KL penalty.
        `scored_from` gives per datum the first position to score: those before it (a prompt's, which a
        preference or RL loss never reads) come back as 0, and the output layer computes no logits for them
        (a quarter of a short pair's work)."""
        return self.forward_with(datums, (), reference, scored_from)[0]

    def forward_with(
        self,
        datums: list[Datum],
        outputs: Sequence[str],
        reference: bool = False,
        scored_from: Sequence[int] | None = None,
    ) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
        """`forward`, and per datum the `outputs` named (of POSITION_OUTPUTS: `entropy`, `log_sum_sq_probs`
        = log Σ_v π(v)²), one value per position, all on the CPU."""
        check_datums(datums)
        logprobs: list[torch.Tensor] = []
        extras: dict[str, list[torch.Tensor]] = {name: [] for name in _checked_outputs(outputs)}
        with self._scoring(), self._adapter_disabled() if reference else contextlib.nullcontext():
            for group, firsts in self._passes_with(datums, scored_from):
                lengths = [len(d) for d in group]
                logprobs_N, values = self._packed_logprobs(group, "log_sum_sq_probs" in extras, firsts)
                logprobs.extend(logprobs_N.cpu().split(lengths))
                for name, per_datum in extras.items():
                    per_datum.extend(values[name].cpu().split(lengths))
        return logprobs, extras

    def forward_choices(
        self, datums: list[Datum], choices: Sequence[int], at: Sequence[int]
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """`forward` scored from `at` (per datum, a position), and `[D, C]`: the log-probability of each token
        of `choices` as the next token after datum d's position `at[d]` (a multiple-choice answer, ranked over
        the whole vocabulary's softmax), from the same pass."""
        check_datums(datums)
        if any(not 0 <= a < len(d) for d, a in zip(datums, at, strict=True)):
            raise GymError("forward_choices: each `at` must be a position of its datum")
        choices_C = torch.tensor(list(choices), dtype=torch.long, device=self.device)
        logprobs: list[torch.Tensor] = []
        picked: list[torch.Tensor] = []
        with self._scoring():
            for group, firsts in self._passes_with(datums, at):
                lengths = [len(d) for d in group]
                logprobs_N, values = self._packed_logprobs(group, scored_from=firsts, choices=choices_C)
                logprobs.extend(logprobs_N.cpu().split(lengths))
                # the scored rows of each datum run from its `at` to its end: the first is the one asked
                starts = torch.tensor([0, *(n - a for n, a in zip(lengths, firsts))]).cumsum(0)[:-1]
                picked.append(values["choices"].cpu()[starts])
        return logprobs, torch.cat(picked) if picked else torch.empty(0, len(choices_C))

    def forward_loss(
        self, datums: list[Datum], loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None
    ) -> ForwardBackwardOutput:
        """What `forward_backward` returns, with no gradient and dropout off (Tinker's `forward`)."""
        with self._scoring():
            return self._scored_passes(datums, loss_fn, loss_fn_config, backward=False)

    def forward_backward(
        self,
        datums: list[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict | None = None,
        scored_from: Sequence[int] | None = None,
    ) -> ForwardBackwardOutput:
        """Accumulate the gradient of the summed loss into the adapter; return the loss sum, logprobs and the
        policy's per-token entropies. `scored_from` as in `forward`, for positions before it whose weights,
        advantages and kl_weights are all 0: every loss is 0 there, so skipping them changes neither the loss
        nor the gradient."""
        if not self.trainable:
            raise GymError("the model has no trainable parameters: is the LoRA adapter attached?")
        self.model.train()
        return self._scored_passes(datums, loss_fn, loss_fn_config, backward=True, scored_from=scored_from)

    def forward_backward_custom(
        self,
        datums: list[Datum],
        loss_fn: SequenceLossFn,
        outputs: Sequence[str] = (),
        scored_from: Sequence[int] | None = None,
    ) -> tuple[float, dict[str, float]]:
        """Accumulate the gradient of `loss_fn` over these datums' per-token log-probabilities, with one forward
        and one backward: for a loss that couples datums (a DPO pair: chosen against rejected), the graph of
        every pass is kept until the loss is known, so memory follows the batch, as in a padded batch.
        `loss_fn(logprobs)` takes one `[len(datum)]` tensor per datum and returns (scalar loss, metrics); each
        name in `outputs` (see `forward_with`) comes as a keyword argument, one `[len(datum)]` tensor per datum
        without gradient; `scored_from` as in `forward`. Returns the loss's value and the metrics."""
        if not self.trainable:
            raise GymError("the model has no trainable parameters: is the LoRA adapter attached?")
        check_datums(datums)
        self.model.train()
        logprobs: list[torch.Tensor] = []
        extras: dict[str, list[torch.Tensor]] = {name: [] for name in _checked_outputs(outputs)}
        router_aux: list[torch.Tensor] = []
        for group, firsts in self._passes_with(datums, scored_from):
            lengths = [len(d) for d in group]
            logprobs_N, values = self._packed_logprobs(group, "log_sum_sq_probs" in extras, firsts)
            logprobs.extend(logprobs_N.split(lengths))
            for name, per_datum in extras.items():
                per_datum.extend(values[name].split(lengths))
            if "router_aux_loss" in values:
                router_aux.append(values["router_aux_loss"])
        loss, metrics = loss_fn(logprobs, **extras)
        if router_aux:
            metrics = {**metrics, "router_aux_loss": float(sum(aux.item() for aux in router_aux))}
        self._backward(loss + sum(router_aux))
        return loss.item(), metrics

    def _scored_passes(
        self,
        datums: list[Datum],
        loss_fn: str,
        loss_fn_config: dict | None,
        backward: bool,
        scored_from: Sequence[int] | None = None,
    ) -> ForwardBackwardOutput:
        if loss_fn not in LOSS_FNS:
            raise GymError(f"unknown loss_fn `{loss_fn}`; choose one of {', '.join(LOSS_FNS)}")
        check_datums(datums)
        check_loss_inputs(datums, loss_fn)
        loss_sum = router_sum = 0.0
        logprobs: list[torch.Tensor] = []
        entropies: list[torch.Tensor] = []
        # Losses are token-level sums, so pass-by-pass backwards accumulate exactly the whole batch's gradient.
        for group, firsts in self._passes_with(datums, scored_from):
            keys = [*REQUIRED_INPUTS[loss_fn], *(k for k in OPTIONAL_INPUTS if k in group[0].loss_fn_inputs)]
            inputs = {key: self._concat(group, key, torch.float32) for key in keys}
            logprobs_N, values = self._packed_logprobs(group, scored_from=firsts)
            entropy_N = values["entropy"]
            loss = LOSS_FNS[loss_fn](logprobs_N, inputs, loss_fn_config or {})
            if "router_aux_loss" in values:
                router_sum += values["router_aux_loss"].item()
            if backward:
                self._backward(loss + values.get("router_aux_loss", 0.0))
            loss_sum += loss.item()
            lengths = [len(d) for d in group]
            logprobs.extend(logprobs_N.detach().cpu().split(lengths))
            entropies.extend(entropy_N.cpu().split(lengths))
        metrics = {"loss:sum": loss_sum}
        if self._router_loss is not None and backward:
            metrics["router_aux_loss:sum"] = router_sum
        return ForwardBackwardOutput(
            loss_sum=loss_sum, logprobs=logprobs, metrics=metrics, entropies=entropies
        )

    def _backward(self, loss: torch.Tensor) -> None:
        (loss if self.loss_scaler is None else self.loss_scaler.scale(loss)).backward()

    # -- state: what a checkpoint holds -------------------------------------------------------------------
    @property
    def adapter_config(self) -> LoraConfig:
        return self.model.peft_config[self._require_adapter()]

    @property
    def full_fine_tuning(self) -> bool:
        """Every weight of a plain model trains (no adapter)."""
        return self.adapter_name is None and bool(self.trainable)

    def state_dict(self) -> dict[str, Any]:
        """What training continues from: `adapter` (CPU copies of the weights, keyed as in
        adapter_model.safetensors; in full fine-tuning the model's trained weights by parameter name) and
        `optimizer` (a copy of torch's AdamW state dict: training on does not change it, and loading it
        elsewhere shares no moment tensors with this engine)."""
        return {"adapter": self.weights(), "optimizer": self.optimizer_state()}

    def weights(self) -> dict[str, torch.Tensor]:
        """CPU copies of what trains: the adapter's weights, or in full fine-tuning the model's by name."""
        if self.full_fine_tuning:
            return {
                n: p.detach().to("cpu", copy=True)
                for n, p in self.model.named_parameters()
                if p.requires_grad
            }
        return adapter_weights(self.model, self._require_adapter())

    def optimizer_state(self) -> dict[str, Any]:
        """A copy of torch's AdamW state dict, its moments as tensors; with loss scaling, the scaler's state
        under `loss_scale`."""
        state = state_as_tensors(copy.deepcopy(self.optimizer.state_dict()))
        if self.loss_scaler is not None:
            state["loss_scale"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state["adapter"]` and, when present, `state["optimizer"]`; without it the optimizer starts
        fresh. Accumulated gradients are dropped either way."""
        if self.full_fine_tuning:
            self._set_model_weights(state["adapter"])
        else:
            set_adapter_weights(self.model, state["adapter"], adapter_name=self._require_adapter())
        if state.get("optimizer") is None:
            self.reset_optimizer()
            return
        self.optimizer.zero_grad(set_to_none=True)
        optimizer = dict(state["optimizer"])
        loss_scale = optimizer.pop("loss_scale", None)
        saved = state_for_optimizer(optimizer, self.optimizer)
        try:
            self.optimizer.load_state_dict(saved)
        except (ValueError, KeyError) as exc:
            raise GymError(f"the saved optimizer state does not fit this adapter ({exc})") from None
        if self.loss_scaler is not None and loss_scale is not None:
            self.loss_scaler.load_state_dict(loss_scale)

    def _set_model_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Full fine-tuning's weights by parameter name; a tied weight may come under either of its names."""
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        unknown = sorted(set(weights) - set(parameters))
        if unknown:
            raise GymError(f"the saved weights do not fit this model (unexpected {unknown[:3]})")
        loaded = {id(parameters[name]) for name in weights}
        missing = sorted(n for n, p in parameters.items() if p.requires_grad and id(p) not in loaded)
        if missing:
            raise GymError(f"the saved weights do not fit this model (missing {missing[:3]})")
        with torch.no_grad():
            for name, value in weights.items():
                parameters[name].copy_(value)

    def reset_optimizer(self) -> None:
        """A fresh optimizer (no moments, step 0) over the adapter, and a fresh loss scale; gradients are
        dropped."""
        for param in self.trainable:
            param.grad = None
        self.optimizer = self._optimizer_factory(self.trainable) if self.trainable else None
        if self._loss_scaling:
            self.loss_scaler = torch.amp.GradScaler(self.device.type)

    def _require_adapter(self) -> str:
        if self.adapter_name is None:
            raise GymError("this engine trains no adapter: there is no state to save or load")
        return self.adapter_name

    @contextlib.contextmanager
    def _scoring(self) -> Iterator[None]:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was_training)

    def sample(
        self, prompts: Sequence[Sequence[int]], num_samples: int, params: SamplingParams
    ) -> list[list[SampledSequence]]:
        """`num_samples` completions per prompt from the current policy (adapter on, dropout off)."""
        if self.tokenizer is None:
            raise GymError("sampling needs the engine's tokenizer (for EOS and stop strings)")
        return sample_groups(self.model, self.tokenizer, prompts, num_samples, params)

    def keep_reference(self) -> None:
        """Full fine-tuning: keep a copy of the trained weights as they are now, the reference that
        `forward(reference=True)` scores with (as TRL keeps a second model; it costs their size in memory)."""
        self._reference_weights = [parameter.detach().clone() for parameter in self.trainable]

    def _adapter_disabled(self) -> contextlib.AbstractContextManager:
        if self._reference_weights is not None:
            return self._reference_swapped_in()
        if not hasattr(self.model, "disable_adapter"):
            raise GymError(
                "reference log-probabilities need a LoRA model (the adapter is what gets disabled), or in full "
                "fine-tuning a kept copy of the starting weights (Engine.keep_reference)"
            )
        return self.model.disable_adapter()

    @contextlib.contextmanager
    def _reference_swapped_in(self) -> Iterator[None]:
        """The kept weights in the trained ones' place (their storage swapped, nothing copied), then back."""
        trained = [parameter.data for parameter in self.trainable]
        try:
            for parameter, kept in zip(self.trainable, self._reference_weights, strict=True):
                parameter.data = kept
            yield
        finally:
            for parameter, weights in zip(self.trainable, trained, strict=True):
                parameter.data = weights

    @property
    def _output_weight(self) -> torch.Tensor:
        # Read at every use: with a trained copy of the output layer (modules_to_save), disabling the adapter
        # (a reference pass) switches back to the base's.
        return self._causal_lm.get_output_embeddings().weight

    def _packing_is_exact(self) -> bool:
        """Whether two datums packed in one row score as they do alone. Architectures that ignore restarting
        position ids (OPT, for one) would let packed datums attend to each other."""
        generator = torch.Generator().manual_seed(0)
        vocab = self._output_weight.shape[0]
        datums = [
            Datum.from_tokens(tokens, target_tokens=tokens)
            for tokens in (torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (6, 4))
        ]
        with self._scoring():
            packed = self._packed_logprobs(datums)[0].split([6, 4])
            alone = [self._packed_logprobs([datum])[0] for datum in datums]
        quantized = any(not p.is_floating_point() for p in self.model.parameters())  # a 4-bit (QLoRA) base
        layers = next((p.dtype for p in self._decoder.parameters() if p.is_floating_point()), torch.float32)
        tolerance = 1e-3 if layers == torch.float32 and not quantized else 5e-2
        return all(torch.allclose(a, b, atol=tolerance, rtol=tolerance) for a, b in zip(packed, alone))

    def _passes(self, datums: list[Datum]) -> list[list[Datum]]:
        """Consecutive groups of at most `max_tokens_per_pass` tokens (a longer datum goes alone), so that
        activation memory follows the pass size, not the batch size."""
        groups: list[list[Datum]] = []
        used = self.max_tokens_per_pass
        for datum in datums:
            if used + len(datum) > self.max_tokens_per_pass or not self.packs_datums:
                groups.append([])
                used = 0
            groups[-1].append(datum)
            used += len(datum)
        return groups

    def _passes_with(
        self, datums: list[Datum], per_datum: Sequence | None
    ) -> list[tuple[list[Datum], Sequence | None]]:
        """`_passes`, each group with its datums' share of `per_datum` (None stays None)."""
        if per_datum is not None and len(per_datum) != len(datums):
            raise GymError(f"scored_from has {len(per_datum)} entries for {len(datums)} datums")
        groups, start = [], 0
        for group in self._passes(datums):
            groups.append((group, None if per_datum is None else per_datum[start : start + len(group)]))
            start += len(group)
        return groups

    def _concat(self, datums: list[Datum], key: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([_as_tensor(d.loss_fn_inputs[key], dtype, len(d)) for d in datums]).to(self.device)

    def _packed_logprobs(
        self,
        datums: list[Datum],
        log_sum_sq_probs: bool = False,
        scored_from: Sequence[int] | None = None,
        choices: torch.Tensor | None = None,
        adapters: tuple[TokenAdapters, Sequence[str]] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """All datums as one row: position ids restart per datum, which transformers turns into attention
        blocks that never cross datums (it infers them only when no cache is passed). The log-probabilities
        `[N]` and, by name, the per-position `entropy` (and `log_sum_sq_probs` when asked); with
        `scored_from`, 0 before each datum's first scored position, where no logits are computed. With
        `choices`, also `choices`: `[M, C]` log-probabilities of those tokens at the M scored positions only.
        With `adapters` (entered TokenAdapters of this model, and an adapter name per datum), each datum goes
        through its own LoRA adapter (engine/adapter_tokens.py)."""
        offloading = self.activation_offloading and torch.is_grad_enabled()
        offload = (
            HostOffload(pin_memory=self.device.type == "cuda") if offloading else contextlib.nullcontext()
        )
        mixed = self.autocast_dtype is not None
        autocast = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype) if mixed else contextlib.nullcontext()
        )
        scored = _scored_positions(datums, scored_from, self.device) if scored_from is not None else None
        with offload, autocast:
            hidden, router_aux = self._packed_hidden(datums, scored, adapters)
        targets = self._concat(datums, "target_tokens", torch.long)
        if scored is not None:
            targets = targets[scored]
        weight = self._output_weight
        hidden = hidden.to(weight.dtype)  # a trained fp32 copy of the output layer over a bf16 base
        if log_sum_sq_probs:
            logprobs, entropy, log_sum_sq = token_logprobs_with_log_sum_sq(
                hidden, weight, targets, self.logprob_chunk
            )
            values = {"entropy": entropy, "log_sum_sq_probs": log_sum_sq}
        else:
            logprobs, entropy = token_logprobs(hidden, weight, targets, self.logprob_chunk)
            values = {"entropy": entropy}
        at_choices = {} if router_aux is None else {"router_aux_loss": router_aux}
        if choices is not None:
            at_choices["choices"] = choice_logprobs(hidden, weight, choices, self.logprob_chunk)
        if scored is None:
            return logprobs, {**values, **at_choices}
        return _at_positions(logprobs, scored), {
            **{k: _at_positions(v, scored) for k, v in values.items()},
            **at_choices,
        }

    def _packed_hidden(
        self,
        datums: list[Datum],
        scored: torch.Tensor | None = None,
        adapters: tuple[TokenAdapters, Sequence[str]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder's last hidden states `[N, H]` of all datums' positions, one packed row (padded to a
        bucket length on a CPU in bf16 or fp16, engine/row_buckets.py); only the `scored` ones `[N]` (bool)
        when given. When training a mixture of experts whose config has `output_router_logits`, also the
        router's load-balancing loss over the datums' tokens, times `router_aux_loss_coef` (else None).
        `adapters` as in `_packed_logprobs`."""
        router = self._router_loss if torch.is_grad_enabled() else None
        routed = {"output_router_logits": True} if router is not None else {}
        inputs = [d.model_input.to_ints() for d in datums]
        owners = adapters[1] if adapters is not None else None
        shared = shared_layout(inputs, self.device, owners) if self.packs_datums else None
        row = len(shared.tokens) if shared is not None else sum(len(tokens) for tokens in inputs)
        padding = bucket_length(row) - row if self._pads_rows else 0
        pad_positions = torch.arange(padding, device=self.device)
        if adapters is not None:
            at = shared.index if shared is not None else torch.arange(row, device=self.device)
            adapters[0].route(_runs_of(owners, [len(t) for t in inputs], at, row + padding))
        if shared is not None:
            causal = torch.ones(padding, padding, dtype=torch.bool, device=self.device).tril()
            output = self._decoder(
                input_ids=torch.nn.functional.pad(shared.tokens, (0, padding))[None],
                position_ids=torch.cat([shared.positions, pad_positions])[None],
                attention_mask=torch.block_diag(shared.mask, causal)[None, None],
                use_cache=False,
                **routed,
            )
            index = shared.index if scored is None else shared.index[scored]
            # a shared prefix's token stands for every datum that holds it, as in a padded batch
            counts = torch.bincount(shared.index, minlength=len(shared.tokens) + padding).float()
            aux = router(output.router_logits, counts[None]) if router is not None else None
            return output.last_hidden_state[0].index_select(0, index), aux
        tokens = torch.tensor([t for tokens in inputs for t in tokens] + [0] * padding, device=self.device)
        # Packed datums restart their positions, and the pad tokens with them: a datum of their own. A lone
        # unpadded datum takes the model's own default positions (some, like OPT, offset them internally).
        positions = torch.cat([*(torch.arange(len(t), device=self.device) for t in inputs), pad_positions])
        restarts = len(inputs) > 1 or padding > 0
        output = self._decoder(
            input_ids=tokens[None],
            position_ids=positions[None] if restarts else None,
            use_cache=False,
            **routed,
        )
        hidden = output.last_hidden_state[0, :row]
        aux = None
        if router is not None:
            real = torch.cat([torch.ones(row, device=self.device), torch.zeros(padding, device=self.device)])
            aux = router(output.router_logits, real[None])
        return (hidden if scored is None else hidden[scored]), aux

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """Clip (when asked), take one AdamW step with these parameters, and clear the gradients.
        Under torchrun the gradients are first summed over all processes (see `distributed`). With loss
        scaling the gradients are unscaled first; a step whose gradients overflowed is skipped (its grad_norm
        reported as 0, the norm of the update applied) and `loss_scale` is the scale the next step uses.
        Without it, non-finite gradients are dropped unapplied, the weights and AdamW state as they were, and
        the non-finite grad_norm is reported."""
        sync_gradients(self.trainable)
        grads = [p.grad for p in self.trainable if p.grad is not None]
        if not grads:  # nothing was accumulated: AdamW would still decay weights and advance its step count
            return {"grad_norm": 0.0, "lr": adam.learning_rate}
        scaler = self.loss_scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        grad_norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
        ).item()
        overflowed = scaler is not None and not math.isfinite(grad_norm)
        if scaler is None and not math.isfinite(grad_norm):
            # Not applied: one NaN would reach every weight and AdamW moment. The caller says what happened.
            self.optimizer.zero_grad(set_to_none=True)
            return {"grad_norm": grad_norm, "lr": adam.learning_rate}
        if adam.grad_clip_norm > 0 and grad_norm > adam.grad_clip_norm and not overflowed:
            scale = adam.grad_clip_norm / (grad_norm + 1e-6)
            for g in grads:
                g.mul_(scale)
        for group in self.optimizer.param_groups:  # a group may scale the rate or keep no decay (LoRA+)
            group.update(
                lr=adam.learning_rate * group.get("lr_scale", 1.0),
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay if group.get("decays", True) else 0.0,
            )
        if scaler is None:
            self.optimizer.step()
        else:
            scaler.step(self.optimizer)  # skipped when unscale_ found an inf or nan
            scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        stats = {"grad_norm": 0.0 if overflowed else grad_norm, "lr": adam.learning_rate}
        if scaler is not None:
            stats["loss_scale"] = scaler.get_scale()
        return stats


def _let_autocast_cast_lora_inputs(model: torch.nn.Module) -> None:
    """Under autocast each LoRA matmul takes the activations as they come and autocast casts the small fp32
    adapter matrices, instead of PEFT casting every activation up to fp32; outside it (the sampler) PEFT casts
    as usual. Decided per call, so a checkpointed layer's recomputation, which torch runs under the forward's
    autocast state, computes in the same dtypes as the forward did."""
    for module in model.modules():
        if isinstance(module, BaseTunerLayer) and not getattr(module, "_gym_autocast_hook", False):
            module._gym_autocast_hook = True
            module.register_forward_pre_hook(_cast_lora_input_unless_autocast)


def _cast_lora_input_unless_autocast(module: torch.nn.Module, inputs: tuple) -> None:
    device = inputs[0].device.type if inputs and isinstance(inputs[0], torch.Tensor) else "cpu"
    module.cast_input_dtype_enabled = not torch.is_autocast_enabled(device)


def mixed_precision_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype to autocast a LoRA model's decoder to: its base layers' when they are bf16 or fp16 and the
    adapter trains in fp32, so that each LoRA matmul runs in that dtype on the activations as they come (autocast
    casts the small adapter matrices), where PEFT would cast every activation up to fp32 (measured on SmolLM2,
    8 x 128 tokens on 2 cores: 1.16x a bf16 step, bench/bf16_lora_cast.py). None for a quantized base (its own
    kernels pick their dtype) and for an fp32 one."""
    if not isinstance(model, PeftModel) or getattr(model.get_base_model(), "is_quantized", False):
        return None
    decoder = decoder_of(model.get_base_model())
    base = next(
        (p.dtype for p in decoder.parameters() if p.is_floating_point() and not p.requires_grad), None
    )
    adapter = any(p.requires_grad and p.dtype == torch.float32 for p in model.parameters())
    return base if base in (torch.bfloat16, torch.float16) and adapter else None


def router_balance_loss_of(causal_lm: torch.nn.Module) -> Callable | None:
    """For a mixture of experts whose config has `output_router_logits`: `(router_logits, token_weights) →`
    `router_aux_loss_coef` × the load-balancing loss, computed by the model's own module's
    `load_balancing_loss_func` (what its forward adds to the loss); None otherwise. GymError for a model whose
    module has no such function, where the key would do nothing."""
    if not getattr(causal_lm.config, "output_router_logits", False):
        return None
    module = sys.modules[type(causal_lm).__module__]
    balance = getattr(module, "load_balancing_loss_func", None)
    experts, top_k = getattr(causal_lm, "num_experts", None), getattr(causal_lm, "num_experts_per_tok", None)
    if balance is None or experts is None or top_k is None:
        raise GymError(
            f"model_config.output_router_logits: {causal_lm.config.model_type} has no router load-balancing loss "
            "here (it is for mixture-of-experts models such as Mixtral and Qwen3-MoE); remove it"
        )
    coef = float(getattr(causal_lm, "router_aux_loss_coef", causal_lm.config.router_aux_loss_coef))
    return lambda router_logits, weights: coef * balance(router_logits, experts, top_k, weights)


def _runs_of(
    adapters: Sequence[str], lengths: Sequence[int], at: torch.Tensor, size: int
) -> list[tuple[str | None, int]]:
    """The row's runs of positions of one adapter, in order (TokenAdapters.route): `adapters` and `lengths`
    per datum, `at` the row position of every datum token (datums concatenated; a prefix shared by datums of
    one adapter is one run), `size` the row's length with its padding (no adapter's)."""
    names = list(dict.fromkeys(adapters))
    owner = torch.full((size,), -1, dtype=torch.long)
    per_token = torch.repeat_interleave(
        torch.tensor([names.index(a) for a in adapters]), torch.tensor(lengths)
    )
    owner[at.cpu()] = per_token
    values, counts = torch.unique_consecutive(owner, return_counts=True)
    return [(names[v] if v >= 0 else None, c) for v, c in zip(values.tolist(), counts.tolist())]


def _scored_positions(datums: list[Datum], scored_from: Sequence[int], device: torch.device) -> torch.Tensor:
    """`[N]` bool over the datums' concatenated positions: True from each datum's `scored_from` on."""
    return torch.cat(
        [torch.arange(len(d), device=device) >= first for d, first in zip(datums, scored_from, strict=True)]
    )


def _at_positions(values_M: torch.Tensor, scored_N: torch.Tensor) -> torch.Tensor:
    """`[N]`: the values of the scored positions in their places, 0 elsewhere (differentiable)."""
    return values_M.new_zeros(scored_N.shape).masked_scatter(scored_N, values_M)


def _checked_outputs(outputs: Sequence[str]) -> tuple[str, ...]:
    unknown = [name for name in outputs if name not in POSITION_OUTPUTS]
    if unknown:
        raise GymError(f"unknown output `{unknown[0]}`; choose from {', '.join(POSITION_OUTPUTS)}")
    return tuple(dict.fromkeys(outputs))


def default_tokens_per_pass(device: torch.device) -> int:
    """On CPU activation memory (a few MB per token even for a 135M model) runs out before larger passes
    pay off; on a GPU bigger passes keep the device busy."""
    return 16384 if device.type == "cuda" else 512


def _as_tensor(value: TensorData, dtype: torch.dtype, length: int) -> torch.Tensor:
    tensor = torch.tensor(value.data, dtype=dtype)
    if tensor.shape != (length,):  # check_datums has named the datum already; this guards direct callers
        raise GymError(f"a loss input has shape {tuple(tensor.shape)}; expected ({length},) like model_input")
    return tensor


def check_datums(datums: list[Datum]) -> None:
    """GymError naming the datum and the input unless every datum has tokens and target_tokens, and every
    loss input has the model input's length."""
    for index, datum in enumerate(datums):
        if not isinstance(datum, Datum):
            raise GymError(f"datum {index} is a {type(datum).__name__}; build it with types.Datum(...)")
        length = len(datum)
        if length < 1:
            raise GymError(f"datum {index}: every datum needs at least one input token")
        if "target_tokens" not in datum.loss_fn_inputs:
            raise GymError(f"datum {index} has no loss_fn_inputs[`target_tokens`]")
        for key, value in datum.loss_fn_inputs.items():
            shape = tuple(value.shape) if value.shape is not None else (len(value.data),)
            if shape != (length,):
                raise GymError(
                    f"datum {index}: loss_fn_inputs[`{key}`] has shape {shape}, but model_input has {length} "
                    "tokens; every input is aligned with model_input (target t = token t+1)"
                )


def check_finite_inputs(datums: list[Datum]) -> None:
    """GymError naming the datum and the input where a client's float loss input holds NaN or an infinity: a
    NaN weight or advantage would reach every weight at the next step. (The loops' own datums need no such
    pass: their weights are 0 and 1.)"""
    for index, datum in enumerate(datums):
        for key, value in datum.loss_fn_inputs.items():
            if value.dtype == "float32" and not all(map(math.isfinite, value.data)):
                raise GymError(
                    f"datum {index}: loss_fn_inputs[`{key}`] holds NaN or infinite values; send finite numbers"
                )


def check_loss_inputs(datums: list[Datum], loss_fn: str) -> None:
    # the optional inputs come as a set: all of them on every datum, or none anywhere
    wanted = any(k in d.loss_fn_inputs for d in datums for k in OPTIONAL_INPUTS)
    optional = OPTIONAL_INPUTS if wanted else ()
    for key in ("target_tokens", *REQUIRED_INPUTS[loss_fn], *optional):
        missing = [i for i, d in enumerate(datums) if key not in d.loss_fn_inputs]
        if missing:
            raise GymError(f"loss_fn `{loss_fn}` needs loss_fn_inputs[`{key}`]; datum {missing[0]} has none")
