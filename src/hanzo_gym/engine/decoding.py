"""The token-level pieces of decoding: next-token logits, per-row filters and draws, stop-string candidates, and
the CPU trick of folding LoRA into the weights while decoding. `sampling.DecodeBatch` puts them together."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator

import torch
from torch.nn.utils import parametrize
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from hanzo_gym.engine.token_logprobs import plain_output_head


def filtered_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Per row: temperature, then the top-k and top-p masks, on fp32 logits [rows, vocab]. A row's top_k ≤ 0 or
    ≥ vocab and top_p ≥ 1 switch its mask off; temperature must be > 0 here (greedy rows take the argmax)."""
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    limited = (top_k > 0) & (top_k < vocab)
    if limited.any():
        largest = int(top_k[limited].max())
        kth = torch.topk(logits, largest, dim=-1).values.gather(1, (top_k.clamp(1, largest) - 1)[:, None])
        logits = logits.masked_fill((logits < kth) & limited[:, None], float("-inf"))
    nucleus = top_p < 1.0
    if nucleus.any():
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already cover top_p (the top token always stays)
        drop_sorted = ((sorted_probs.cumsum(-1) - sorted_probs) >= top_p[:, None]) & nucleus[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row by inverse-CDF: one uniform draw per row (torch.multinomial draws one per vocab entry)."""
    cdf = probs.cumsum(-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).squeeze(1).clamp_(max=probs.shape[-1] - 1)


@functools.lru_cache(maxsize=16)
def _tokens_containing(tokenizer: PreTrainedTokenizerBase, characters: str) -> tuple[bool, ...]:
    """For every token id: does its text contain any of `characters`? (one batched decode per tokenizer)"""
    texts = tokenizer.batch_decode([[token_id] for token_id in range(len(tokenizer))])
    return tuple(any(c in text for c in characters) for text in texts)


@functools.lru_cache(maxsize=16)
def stop_string_candidates(
    tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[vocab] bool: could this token, drawn last, complete one of `stops`? Only such rows are decoded to text.
    Cached (read only): a batch asks again whenever its rows change."""
    candidates = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    last_chars = "".join(sorted({s[-1] for s in stops if s}))
    if last_chars:
        candidates[: len(tokenizer)] = torch.tensor(_tokens_containing(tokenizer, last_chars)).to(device)
    return candidates


@contextlib.contextmanager
def _lora_folded(model: PreTrainedModel) -> Iterator[None]:
    """Decode with each LoRA layer's ΔW folded into a temporary copy of its weight (an expert stack's, for LoRA
    on expert parameters) and the adapter branch off.

    On CPU, decoding a few rows is bound by the number of matmul calls, and LoRA triples them. The base
    weights are swapped for the copies and back, never changed in place, so the frozen base stays bit-exact.
    Only an fp32 base is folded: rounding W + ΔW to bf16 (8 significant bits) drops every update smaller than
    half a unit of W's last place, so early in training the sampler would decode the base model, not the policy
    (measured on SmolLM2 with a small adapter: sampler/trainer kl_sample_train_v1 0.0048 folded, 0.0015 not).
    """
    from peft.tuners.lora import LoraLayer

    if not hasattr(model, "disable_adapter"):
        yield
        return
    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and not m.disable_adapters]
    targets = [(m, m.get_base_layer(), getattr(m, "parameter_name", "weight")) for m in layers]
    if any(parametrize.is_parametrized(base, name) for _, base, name in targets):
        yield  # quantized experts (quantize_moe_experts): no plain tensor to fold into
        return
    if any(not getattr(base, name).is_floating_point() for _, base, name in targets):
        yield  # a quantized (QLoRA) base has no weight to fold into: decode with the adapter branch on
        return
    if any(getattr(base, name).dtype != torch.float32 for _, base, name in targets):
        # A bf16 / fp16 base would round the adapter's update away: the adapter branch stays, computed in the
        # base's dtype as the trainer's autocast computes it, so that sampled log-probs stay close to the ones
        # the trainer recomputes (bench/bf16_sampler_branch.py on SmolLM2, 24 samples: mean gap +0.0055 →
        # +0.0019, mean |gap| 0.053 → 0.046). No faster than PEFT's fp32 branch on CPU (0.93x a round there).
        with _lora_branch_in(getattr(targets[0][1], targets[0][2]).dtype, [m for m, _, _ in targets]):
            yield
        return
    swapped = []
    with torch.no_grad():
        for module, base, name in targets:
            adapters = [a for a in module.active_adapters if a in module.lora_A]
            if not adapters:
                continue
            weight = getattr(base, name)
            delta = sum(module.get_delta_weight(a) for a in adapters)
            swapped.append((base, name, weight))
            setattr(base, name, torch.nn.Parameter(weight + delta.to(weight.dtype), requires_grad=False))
    try:
        with model.disable_adapter():
            yield
    finally:
        for base, name, weight in swapped:
            setattr(base, name, weight)


@contextlib.contextmanager
def _lora_branch_in(dtype: torch.dtype, layers: list[torch.nn.Module]) -> Iterator[None]:
    """Each linear LoRA layer's A and B swapped for copies in `dtype` (the adapter is not trained while it
    decodes), and back."""
    from peft.tuners.lora import Linear as LoraLinear

    swapped = []
    with torch.no_grad():
        for layer in layers:
            if not isinstance(layer, LoraLinear):
                continue
            for adapter in (a for a in layer.active_adapters if a in layer.lora_A):
                for factor in (layer.lora_A[adapter], layer.lora_B[adapter]):
                    if factor.weight.dtype != dtype:
                        swapped.append((factor, factor.weight))
                        factor.weight = torch.nn.Parameter(factor.weight.to(dtype), requires_grad=False)
    try:
        yield
    finally:
        for factor, weight in swapped:
            factor.weight = weight


@contextlib.contextmanager
def decoding(model: PreTrainedModel, fold: bool = True) -> Iterator[None]:
    """The model in eval mode, without gradients, with LoRA folded on CPU (unless not `fold`: rows of several
    adapters, engine/adapter_tokens.py); as it was afterwards. Everything it changes is undone on exit, so
    whoever holds the model next (a training step) sees it untouched."""
    was_training = model.training
    model.eval()
    try:
        with (
            torch.no_grad(),
            _lora_folded(model)
            if fold and next(model.parameters()).device.type == "cpu"
            else contextlib.nullcontext(),
        ):
            yield
    finally:
        model.train(was_training)


def lora_update_dtype(model: PreTrainedModel) -> torch.dtype | None:
    """The dtype the sampler computes a LoRA update in when it does not fold it: a bf16 / fp16 base's on CPU
    (see _lora_folded), else None (PEFT's rule: the adapter's own)."""
    weight = model.get_input_embeddings().weight
    if weight.device.type == "cpu" and weight.is_floating_point() and weight.dtype != torch.float32:
        return weight.dtype
    return None


class NextTokenLogits:
    """Each row's fp32 logits at its last position. With a plain output projection the decoder runs alone and
    the logits are computed as (W · hᵀ)ᵀ: for a few rows against a vocabulary-sized W, that order streams W once
    and runs about twice as fast on CPU as h · Wᵀ (bench/output_projection.py, SmolLM2's 49k×576 head at 8 rows:
    7.6 vs 15.7 ms on 2 cores)."""

    def __init__(self, model: PreTrainedModel):
        plain = plain_output_head(model)
        self._model = model
        self._decoder, head = plain if plain is not None else (None, None)
        self._weight = head.weight if head is not None else None
        causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._cache_argument = cache_argument(self._decoder or causal_lm)

    def __call__(self, **inputs: torch.Tensor | DynamicCache | bool) -> torch.Tensor:
        inputs[self._cache_argument] = inputs.pop("cache")
        if self._decoder is None:
            return self._model(**inputs, logits_to_keep=1).logits[:, -1].float()
        hidden = self._decoder(**inputs).last_hidden_state[:, -1]
        return (self._weight @ hidden.T).T.float()


def cache_argument(module: torch.nn.Module) -> str:
    """The name a model's forward takes its KV cache under: `cache` since transformers 5.2x, `past_key_values`
    before (vLLM's CPU build pins a transformers of that time). A model ignores a name it does not know, and
    then decodes every step without the tokens before it."""
    return "cache" if "cache" in inspect.signature(type(module).forward).parameters else "past_key_values"


class GrowingLayer(DynamicLayer):
    """A full-length cache layer that appends in place into room kept at its end. DynamicLayer appends with
    `torch.cat`, which copies the whole cache at every decode step: with a few hundred tokens cached that copy,
    not the weights, bounds a CPU decode step (SmolLM2-135M, 9 rows, 400 tokens: 166 MB a step). Here a step
    writes only its own token; the room grows by half when it runs out.

    `keys` / `values` read as the filled part; assigning them (as `batch_select_indices` and merges do) takes
    the new tensors as they are, the room comes back at the next append."""

    _keys: torch.Tensor | None = None
    _values: torch.Tensor | None = None
    _keys_length = _values_length = 0  # apart: assigning keys must not change what `values` reads

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[..., : self._keys_length, :]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._keys, self._keys_length = value, _filled(value)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[..., : self._values_length, :]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._values, self._values_length = value, _filled(value)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._keys_length == 0:
            self.keys, self.values = key_states, value_states
            return self.keys, self.values
        start, end = self._keys_length, self._keys_length + key_states.shape[-2]
        if end > self._keys.shape[-2]:
            room = max(end, self._keys.shape[-2] * 3 // 2 + 16)
            self._keys, self._values = _with_room(self.keys, room), _with_room(self.values, room)
        self._keys[..., start:end, :] = key_states
        self._values[..., start:end, :] = value_states
        self._keys_length = self._values_length = end
        return self.keys, self.values


def _filled(states: torch.Tensor | None) -> int:
    return 0 if states is None or states.dim() < 2 else states.shape[-2]


def _with_room(filled: torch.Tensor, room: int) -> torch.Tensor:
    grown = filled.new_empty((*filled.shape[:-2], room, filled.shape[-1]))
    grown[..., : filled.shape[-2], :] = filled
    return grown


def growing_cache() -> DynamicCache:
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache
