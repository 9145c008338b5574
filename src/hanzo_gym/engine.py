"""The engine: one model with its LoRA adapter and optimizer, driven through a few Tinker-named primitives.

Everything that trains goes through `forward`, `forward_backward` and `optim_step`. Datums in one call are
packed into a single row without padding: position ids restart at every datum, which transformers turns into
attention that never crosses a datum's boundary.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hanzo_gym.distributed import sync_gradients
from hanzo_gym.errors import GymError
from hanzo_gym.losses import LOSS_FNS, OPTIONAL_INPUTS, REQUIRED_INPUTS
from hanzo_gym.prefix_sharing import shared_layout
from hanzo_gym.sampling import SampledSequence, SamplingParams, sample_groups
from hanzo_gym.token_logprobs import token_logprobs


@dataclass
class Datum:
    """`model_input[t]` predicts `loss_fn_inputs["target_tokens"][t]`; every loss input has the input's length."""

    model_input: list[int]
    loss_fn_inputs: dict[str, torch.Tensor | list]

    def __len__(self) -> int:
        return len(self.model_input)


@dataclass
class AdamParams:
    """Tinker's defaults. `grad_clip_norm` 0 disables clipping; weight decay is decoupled (AdamW)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


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
        logprob_chunk: int = 1024,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_tokens_per_pass = max_tokens_per_pass or default_tokens_per_pass(self.device)
        self.logprob_chunk = logprob_chunk
        # Captured now: a model host may later add adapters whose parameters belong to other engines.
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=0.0) if self.trainable else None
        causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = causal_lm.config
        scaled = [
            k
            for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")
            if getattr(config, k, None)
        ]
        if scaled:
            raise GymError(f"{config.model_type}: output logits with `{scaled[0]}` are not supported yet")
        self._decoder = causal_lm.get_decoder()
        self._output_weight = causal_lm.get_output_embeddings().weight
        self.packs_datums = False  # the check below scores on the plain path
        self.packs_datums = self._packing_is_exact()
        if not self.packs_datums:
            warnings.warn(
                f"{config.model_type} does not keep packed sequences apart: one datum per pass (slower)",
                stacklevel=2,
            )

    @property
    def trainable_parameter_count(self) -> int:
        return sum(p.numel() for p in self.trainable)

    def forward(self, datums: list[Datum], reference: bool = False) -> list[torch.Tensor]:
        """Per-token log-probabilities of each datum's targets; no gradients, dropout off. `reference=True`
        scores with the adapter disabled: the frozen base model, the reference of a KL penalty."""
        was_training = self.model.training
        self.model.eval()
        logprobs: list[torch.Tensor] = []
        try:
            with torch.no_grad(), self._adapter_disabled() if reference else contextlib.nullcontext():
                for group in self._passes(datums):
                    logprobs_N, _ = self._packed_logprobs(group)
                    logprobs.extend(logprobs_N.cpu().split([len(d) for d in group]))
        finally:
            self.model.train(was_training)
        return logprobs

    def forward_backward(
        self, datums: list[Datum], loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None
    ) -> ForwardBackwardOutput:
        """Accumulate the gradient of the summed loss into the adapter; return the loss sum, logprobs and the
        policy's per-token entropies."""
        if not self.trainable:
            raise GymError("the model has no trainable parameters: is the LoRA adapter attached?")
        if loss_fn not in LOSS_FNS:
            raise GymError(f"unknown loss_fn `{loss_fn}`; choose one of {', '.join(LOSS_FNS)}")
        check_loss_inputs(datums, loss_fn)
        self.model.train()
        loss_sum = 0.0
        logprobs: list[torch.Tensor] = []
        entropies: list[torch.Tensor] = []
        # Losses are token-level sums, so pass-by-pass backwards accumulate exactly the whole batch's gradient.
        for group in self._passes(datums):
            keys = [*REQUIRED_INPUTS[loss_fn], *(k for k in OPTIONAL_INPUTS if k in group[0].loss_fn_inputs)]
            inputs = {key: self._concat(group, key, torch.float32) for key in keys}
            logprobs_N, entropy_N = self._packed_logprobs(group)
            loss = LOSS_FNS[loss_fn](logprobs_N, inputs, loss_fn_config or {})
            loss.backward()
            loss_sum += loss.item()
            lengths = [len(d) for d in group]
            logprobs.extend(logprobs_N.detach().cpu().split(lengths))
            entropies.extend(entropy_N.cpu().split(lengths))
        return ForwardBackwardOutput(
            loss_sum=loss_sum, logprobs=logprobs, metrics={"loss:sum": loss_sum}, entropies=entropies
        )

    def sample(
        self, prompts: Sequence[Sequence[int]], num_samples: int, params: SamplingParams
    ) -> list[list[SampledSequence]]:
        """`num_samples` completions per prompt from the current policy (adapter on, dropout off)."""
        if self.tokenizer is None:
            raise GymError("sampling needs the engine's tokenizer (for EOS and stop strings)")
        return sample_groups(self.model, self.tokenizer, prompts, num_samples, params)

    def _adapter_disabled(self) -> contextlib.AbstractContextManager:
        if not hasattr(self.model, "disable_adapter"):
            raise GymError(
                "reference log-probabilities need a LoRA model (the adapter is what gets disabled)"
            )
        return self.model.disable_adapter()

    def _packing_is_exact(self) -> bool:
        """Whether two datums packed in one row score as they do alone. Architectures that ignore restarting
        position ids (OPT, for one) would let packed datums attend to each other."""
        generator = torch.Generator().manual_seed(0)
        vocab = self._output_weight.shape[0]
        datums = [
            Datum(tokens, {"target_tokens": tokens})
            for tokens in (torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (6, 4))
        ]
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                packed = self._packed_logprobs(datums)[0].split([6, 4])
                alone = [self._packed_logprobs([datum])[0] for datum in datums]
        finally:
            self.model.train(was_training)
        quantized = any(not p.is_floating_point() for p in self.model.parameters())  # a 4-bit (QLoRA) base
        tolerance = 1e-3 if self._output_weight.dtype == torch.float32 and not quantized else 5e-2
        return all(torch.allclose(a, b, atol=tolerance, rtol=tolerance) for a, b in zip(packed, alone))

    def _passes(self, datums: list[Datum]) -> list[list[Datum]]:
        """Consecutive groups of at most `max_tokens_per_pass` tokens (a longer datum goes alone), so that
        activation memory follows the pass size, not the batch size."""
        groups: list[list[Datum]] = []
        used = self.max_tokens_per_pass
        for datum in datums:
            if len(datum) < 1:
                raise GymError("every datum needs at least one input token")
            if used + len(datum) > self.max_tokens_per_pass or not self.packs_datums:
                groups.append([])
                used = 0
            groups[-1].append(datum)
            used += len(datum)
        return groups

    def _concat(self, datums: list[Datum], key: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([_as_tensor(d.loss_fn_inputs[key], dtype, len(d)) for d in datums]).to(self.device)

    def _packed_logprobs(self, datums: list[Datum]) -> tuple[torch.Tensor, torch.Tensor]:
        """All datums as one row: position ids restart per datum, which transformers turns into attention
        blocks that never cross datums (it infers them only when no cache is passed)."""
        targets = self._concat(datums, "target_tokens", torch.long)
        shared = shared_layout([d.model_input for d in datums], self.device) if self.packs_datums else None
        if shared is not None:
            output = self._decoder(
                input_ids=shared.tokens[None],
                position_ids=shared.positions[None],
                attention_mask=shared.mask[None, None],
                use_cache=False,
            )
            hidden = output.last_hidden_state[0].index_select(0, shared.index)
            return token_logprobs(hidden, self._output_weight, targets, self.logprob_chunk)
        tokens = torch.tensor([t for d in datums for t in d.model_input], device=self.device)
        positions = torch.cat([torch.arange(len(d), device=self.device) for d in datums])[None]
        # A lone datum takes the model's own default positions (some, like OPT, offset them internally).
        output = self._decoder(
            input_ids=tokens[None], position_ids=positions if len(datums) > 1 else None, use_cache=False
        )
        return token_logprobs(output.last_hidden_state[0], self._output_weight, targets, self.logprob_chunk)

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """Clip (when asked), take one AdamW step with these parameters, and clear the gradients.
        Under torchrun the gradients are first summed over all processes (see `distributed`)."""
        sync_gradients(self.trainable)
        grads = [p.grad for p in self.trainable if p.grad is not None]
        if not grads:  # nothing was accumulated: AdamW would still decay weights and advance its step count
            return {"grad_norm": 0.0, "lr": adam.learning_rate}
        grad_norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
        ).item()
        if adam.grad_clip_norm > 0 and grad_norm > adam.grad_clip_norm:
            scale = adam.grad_clip_norm / (grad_norm + 1e-6)
            for g in grads:
                g.mul_(scale)
        for group in self.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "lr": adam.learning_rate}


def default_tokens_per_pass(device: torch.device) -> int:
    """On CPU activation memory (a few MB per token even for a 135M model) runs out before larger passes
    pay off; on a GPU bigger passes keep the device busy."""
    return 16384 if device.type == "cuda" else 512


def _as_tensor(value: torch.Tensor | list, dtype: torch.dtype, length: int) -> torch.Tensor:
    tensor = value.to(dtype) if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=dtype)
    if tensor.shape != (length,):
        raise GymError(f"a loss input has shape {tuple(tensor.shape)}; expected ({length},) like model_input")
    return tensor


def check_loss_inputs(datums: list[Datum], loss_fn: str) -> None:
    # the optional inputs come as a set: all of them on every datum, or none anywhere
    wanted = any(k in d.loss_fn_inputs for d in datums for k in OPTIONAL_INPUTS)
    optional = OPTIONAL_INPUTS if wanted else ()
    for key in ("target_tokens", *REQUIRED_INPUTS[loss_fn], *optional):
        missing = [i for i, d in enumerate(datums) if key not in d.loss_fn_inputs]
        if missing:
            raise GymError(f"loss_fn `{loss_fn}` needs loss_fn_inputs[`{key}`]; datum {missing[0]} has none")
