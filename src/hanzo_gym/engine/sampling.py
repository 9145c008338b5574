"""Batched sampling with a KV cache: every prompt is prefilled once, its cache is repeated for the prompt's
samples, and all samples of all prompts decode together, one forward pass per token.

The per-step bookkeeping is tensor work over the live rows; only rows whose new token could complete a stop
string are decoded to text. Rows that finish are dropped from the batch (and the cache) in bulk.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from hanzo_gym.errors import GymError
from hanzo_gym.records import SampledSequence, SamplingParams


def stop_lists(stop: SamplingParams.stop) -> tuple[list[int], list[str]]:
    if stop is None:
        return [], []
    if isinstance(stop, str):
        return [], [stop]
    items = list(stop)
    ids = [s for s in items if isinstance(s, int) and not isinstance(s, bool)]
    strings = [s for s in items if isinstance(s, str)]
    if len(ids) + len(strings) != len(items):
        raise GymError("SamplingParams.stop takes strings and token ids")
    # A mix is what a chat server needs: the renderer's end-of-turn token ids plus the request's stop strings.
    return ids, strings


def _filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k and top-p masks, on fp32 logits [rows, vocab]."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens ranked above it already cover top_p (the top token always stays)
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@functools.lru_cache(maxsize=16)
def _tokens_containing(tokenizer: PreTrainedTokenizerBase, characters: str) -> list[bool]:
    """For every token id: does its text contain any of `characters`? (one batched decode per tokenizer)"""
    texts = tokenizer.batch_decode([[token_id] for token_id in range(len(tokenizer))])
    return [any(c in text for c in characters) for text in texts]


def _draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row by inverse-CDF: one uniform draw per row (torch.multinomial draws one per vocab entry)."""
    cdf = probs.cumsum(-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).squeeze(1).clamp_(max=probs.shape[-1] - 1)


@contextlib.contextmanager
def _lora_folded(model: PreTrainedModel) -> Iterator[None]:
    """Decode with each LoRA layer's ΔW folded into a temporary copy of its weight and the adapter branch off.

    On CPU, decoding a few rows is bound by the number of matmul calls, and LoRA triples them. The base
    weights are swapped for the copies and back, never changed in place, so the frozen base stays bit-exact.
    """
    from peft.tuners.lora import LoraLayer

    if not hasattr(model, "disable_adapter"):
        yield
        return
    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and not m.disable_adapters]
    if any(not m.get_base_layer().weight.is_floating_point() for m in layers):
        yield  # a quantized (QLoRA) base has no weight to fold into: decode with the adapter branch on
        return
    swapped = []
    with torch.no_grad():
        for module in layers:
            adapters = [a for a in module.active_adapters if a in module.lora_A]
            if not adapters:
                continue
            base = module.get_base_layer()
            delta = sum(module.get_delta_weight(a) for a in adapters)
            swapped.append((base, base.weight))
            base.weight = torch.nn.Parameter(base.weight + delta.to(base.weight.dtype), requires_grad=False)
    try:
        with model.disable_adapter():
            yield
    finally:
        for base, weight in swapped:
            base.weight = weight


class _NextTokenLogits:
    """Each row's logits at its last position. With a plain output projection the decoder runs alone and the
    logits are computed as (W · hᵀ)ᵀ: for a few rows against a vocabulary-sized W, that order streams W once and
    runs about twice as fast on CPU as h · Wᵀ (bench/output_projection.py, SmolLM2's 49k×576 head at 8 rows:
    7.6 vs 15.7 ms on 2 cores)."""

    def __init__(self, model: PreTrainedModel):
        causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        head = causal_lm.get_output_embeddings()
        scaled = any(
            getattr(causal_lm.config, key, None)
            for key in ("final_logit_softcapping", "logit_scale", "logits_scaling")
        )
        plain = isinstance(head, torch.nn.Linear) and head.bias is None and not scaled
        self._model = model
        self._decoder = causal_lm.get_decoder() if plain else None
        self._weight = head.weight

    def __call__(self, **inputs: torch.Tensor | DynamicCache | bool) -> torch.Tensor:
        if self._decoder is None:
            return self._model(**inputs, logits_to_keep=1).logits[:, -1].float()
        hidden = self._decoder(**inputs).last_hidden_state[:, -1]
        return (self._weight @ hidden.T).T.float()


class _StopStrings:
    """Finds rows whose text now ends a stop string, decoding only rows whose newest token could finish one."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, stops: list[str], vocab_size: int, device: torch.device
    ):
        self.tokenizer = tokenizer
        self.stops = stops
        self.candidates = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if stops:
            last_chars = "".join(sorted({s[-1] for s in stops if s}))
            self.candidates[: len(tokenizer)] = torch.tensor(_tokens_containing(tokenizer, last_chars)).to(
                device
            )
        self.window = max((len(s) for s in stops), default=0) + 8  # tokens of tail worth decoding

    def hits(
        self, new_tokens: torch.Tensor, rows: torch.Tensor, history: torch.Tensor, step: int
    ) -> torch.Tensor:
        hit = torch.zeros_like(new_tokens, dtype=torch.bool)
        if not self.stops:
            return hit
        for position in self.candidates[new_tokens].nonzero().flatten().tolist():
            tail = history[rows[position], max(0, step + 1 - self.window) : step + 1].tolist()
            text = self.tokenizer.decode(tail)
            hit[position] = any(s in text for s in self.stops)
        return hit


@torch.no_grad()
def sample_groups(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    num_samples: int,
    params: SamplingParams,
    on_step: Callable[[list[int], list[int], torch.Tensor], None] | None = None,
    cancelled_prompts: Callable[[], list[int]] | None = None,
) -> list[list[SampledSequence]]:
    """`num_samples` completions for each prompt; result[i][j] is sample j of prompt i. `on_step(rows, tokens,
    logprobs)` hears each step's new tokens (row = prompt index × num_samples + sample index) and the raw
    log-probability distributions they were drawn from ([len(rows), vocab]), for streaming. `cancelled_prompts()`,
    asked before every step, names the prompts nobody waits for any more: their rows stop decoding there."""
    if not prompts or num_samples < 1:
        return [[] for _ in prompts]
    if any(len(p) == 0 for p in prompts):
        raise GymError("every prompt needs at least one token")
    if params.temperature < 0:
        raise GymError(f"temperature must be >= 0 (got {params.temperature})")
    device = next(model.parameters()).device
    longest = max(len(p) for p in prompts)
    room = getattr(model.config, "max_position_embeddings", longest + (params.max_tokens or 0)) - longest
    if params.max_tokens is not None and params.max_tokens < 1:
        raise GymError(f"max_tokens must be at least 1 (got {params.max_tokens})")
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    if max_tokens < 1:
        raise GymError(f"no room to sample: prompts of {longest} tokens fill the model's context")
    stop_ids, stop_strings = stop_lists(params.stop)
    if tokenizer.eos_token_id is not None:
        stop_ids = [*stop_ids, tokenizer.eos_token_id]
    stop_ids_t = torch.tensor(stop_ids, dtype=torch.long, device=device)
    vocab = model.get_output_embeddings().weight.shape[0]
    stop_strings_finder = _StopStrings(tokenizer, stop_strings, vocab, device)
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    was_training = model.training
    model.eval()
    stack = contextlib.ExitStack()
    if device.type == "cpu":
        stack.enter_context(_lora_folded(model))
    try:
        # Prefill each distinct prompt once (left-padded), then repeat its cache rows for its samples.
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(prompts), longest), pad, dtype=torch.long, device=device)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt) :] = torch.tensor(list(prompt), device=device)
            mask[row, longest - len(prompt) :] = 1
        cache = DynamicCache()
        next_logits = _NextTokenLogits(model)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = next_logits(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
        )
        cache.batch_repeat_interleave(num_samples)
        logits = logits.repeat_interleave(num_samples, dim=0)
        mask = mask.repeat_interleave(num_samples, dim=0)
        next_position = positions[:, -1:].repeat_interleave(num_samples, dim=0) + 1

        total = len(prompts) * num_samples
        tokens = torch.zeros((total, max_tokens), dtype=torch.long, device=device)
        logprobs = torch.zeros((total, max_tokens), dtype=torch.float32, device=device)
        lengths = torch.full((total,), max_tokens, dtype=torch.long, device=device)
        stopped = torch.zeros(total, dtype=torch.bool, device=device)
        rows = torch.arange(total, device=device)  # batch row → output row
        live = torch.ones(total, dtype=torch.bool, device=device)  # finished rows ride along until pruned

        for step in range(max_tokens):
            gone = cancelled_prompts() if cancelled_prompts is not None else []
            if gone:
                gone_rows = torch.tensor(
                    [p * num_samples + j for p in gone for j in range(num_samples)], device=device
                )
                hit = live & torch.isin(rows, gone_rows)
                lengths[rows[hit]] = step
                live &= ~hit
                if not live.any():
                    break
            if params.temperature == 0:
                chosen = logits.argmax(-1)
            else:
                probs = _filtered_logits(logits, params).softmax(-1)
                chosen = _draw(probs, generator)
            live_rows, live_chosen = rows[live], chosen[live]
            tokens[live_rows, step] = live_chosen
            step_logprobs = logits[live].log_softmax(-1)
            logprobs[live_rows, step] = step_logprobs.gather(1, live_chosen[:, None]).squeeze(1)
            done = torch.isin(live_chosen, stop_ids_t) | stop_strings_finder.hits(
                live_chosen, live_rows, tokens, step
            )
            if on_step is not None:
                on_step(live_rows.tolist(), live_chosen.tolist(), step_logprobs)
            lengths[live_rows[done]] = step + 1
            stopped[live_rows[done]] = True
            live[live.nonzero().flatten()[done]] = False
            if not live.any() or step == max_tokens - 1:
                break
            if (~live).sum() * 4 >= len(rows):
                # Shrinking the cache copies it: worth it once a quarter of the batch has finished.
                index = live.nonzero().flatten()
                cache.batch_select_indices(index)
                rows, chosen, mask, next_position = (
                    rows[index],
                    chosen[index],
                    mask[index],
                    next_position[index],
                )
                live = live[index]
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=device)], dim=1)
            logits = next_logits(
                input_ids=chosen[:, None],
                attention_mask=mask,
                position_ids=next_position,
                cache=cache,
                use_cache=True,
            )
            next_position = next_position + 1
    finally:
        stack.close()
        model.train(was_training)

    lengths_list, stopped_list = lengths.tolist(), stopped.tolist()
    tokens_list, logprobs_list = tokens.tolist(), logprobs.tolist()
    sequences = [
        SampledSequence(
            tokens=tokens_list[i][: lengths_list[i]],
            logprobs=logprobs_list[i][: lengths_list[i]],
            stop_reason="stop" if stopped_list[i] else "length",
        )
        for i in range(total)
    ]
    return [sequences[p * num_samples : (p + 1) * num_samples] for p in range(len(prompts))]
