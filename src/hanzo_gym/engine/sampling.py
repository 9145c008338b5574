"""Batched sampling with a KV cache, rows joining and leaving between decode steps (continuous batching).

A row is one sample of one prompt. Prompts that join together are prefilled in one left-padded pass, once each,
and their cache rows repeated for their samples; the new rows are then merged into the running batch by
left-padding the shorter of the two KV caches. The padding is masked, and positions are explicit, so it changes
no row's numbers. Every row has its own length limit, stops and sampling parameters. Finished rows ride along
until a quarter of the batch has finished: dropping rows copies the cache, so it is done in bulk, and with it the
padding columns no live row needs any more. Only rows whose new token could complete a stop string are decoded
to text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from hanzo_gym.engine.adapter_tokens import TokenAdapters
from hanzo_gym.engine.decoding import (
    GrowingLayer,
    NextTokenLogits,
    decoding,
    draw,
    filtered_logits,
    growing_cache,
    stop_string_candidates,
)
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


def stop_conditions(stop: SamplingParams.stop, eos_token_id: int | None) -> tuple[list[int], list[str]]:
    """The token ids and strings that end a sample: the request's, plus the tokenizer's EOS unless the request
    gave an empty list (Tinker's rule: `stop=None` keeps the implicit EOS, `stop=[]` samples to max_tokens)."""
    ids, strings = stop_lists(stop)
    disables_eos = stop is not None and not isinstance(stop, str) and len(stop) == 0
    if eos_token_id is not None and not disables_eos:
        ids = [*ids, eos_token_id]
    return ids, strings


@dataclass
class Prompt:
    """One prompt to decode `num_samples` times. `on_token(sample, token, logprobs)` hears each new token and the
    raw log-probability distribution over the vocabulary it was drawn from, for streaming."""

    tokens: list[int]
    num_samples: int
    params: SamplingParams
    on_token: Callable[[int, int, torch.Tensor], None] | None = None
    adapter: str | None = None  # the LoRA adapter its rows decode through, in a batch with a `router`


class DecodeJob:
    """A prompt admitted to a batch; `sequences[j]` is sample j once `done`."""

    def __init__(self, prompt: Prompt, max_tokens: int, stop_ids: list[int], stop_strings: list[str]):
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.stop_ids = frozenset(stop_ids)
        self.stop_strings = stop_strings
        self._window = max((len(s) for s in stop_strings), default=0) + 8  # tokens of tail worth decoding
        self.sequences: list[SampledSequence | None] = [None] * prompt.num_samples
        self.unfinished = prompt.num_samples

    @property
    def done(self) -> bool:
        return self.unfinished == 0

    def ends_a_stop_string(self, tokenizer: PreTrainedTokenizerBase, tokens: list[int]) -> bool:
        text = tokenizer.decode(tokens[-self._window :])
        return any(s in text for s in self.stop_strings)


class DecodeBatch:
    """Rows decoding together on one model. Call `add` and `step` inside `decoding(model)`; nothing here locks:
    one thread drives a batch."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, seed: int | None = None):
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self._vocab = model.get_output_embeddings().weight.shape[0]
        self._context: int | None = getattr(model.config, "max_position_embeddings", None)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed if seed is not None else torch.seed())
        self.model: PreTrainedModel | None = None
        # Set (entered, not training): each row decodes through its prompt's adapter; else the model as it is.
        self.router: TokenAdapters | None = None
        self.bind(model)
        self._clear()

    def bind(self, model: PreTrainedModel) -> None:
        """Decode through `model` from now on: the same weights, maybe wrapped anew (PEFT wraps the base model
        when its first adapter is added)."""
        if model is not self.model:
            self.model = model
            self._next_logits = NextTokenLogits(model)

    def _clear(self) -> None:
        self._cache: DynamicCache | None = None
        self._mask = self._position = self._logits = None
        self._job_of: list[DecodeJob] = []  # per row
        self._sample_of: list[int] = []
        self._tokens: list[list[int]] = []
        self._logprobs: list[list[float]] = []
        self._live: list[bool] = []
        self.live_rows = 0
        self._temperature = self._top_k = self._top_p = None
        self._stop_ids = torch.zeros(0, dtype=torch.long, device=self.device)
        self._stop_candidates: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        """Rows in the batch, finished ones still riding along included: what a forward pass costs."""
        return len(self._live)

    def most_tokens_left(self) -> int:
        """The most tokens a live row may still draw: with `live_rows`, what the batch can still cost."""
        return max(
            (self._job_of[r].max_tokens - len(self._tokens[r]) for r, live in enumerate(self._live) if live),
            default=0,
        )

    def can_add(self) -> bool:
        """Rows join a running batch by concatenating caches: only plain (full-length) cache layers allow it."""
        return self._cache is None or all(isinstance(layer, GrowingLayer) for layer in self._cache.layers)

    # -- admission -------------------------------------------------------------------------------------------
    def check(self, prompt: Prompt) -> DecodeJob:
        """The job `prompt` becomes, or a GymError saying why it cannot be decoded."""
        params = prompt.params
        if not prompt.tokens:
            raise GymError("every prompt needs at least one token")
        if isinstance(prompt.num_samples, bool) or prompt.num_samples < 1:
            raise GymError(f"num_samples must be a positive integer (got {prompt.num_samples!r})")
        if params.temperature < 0:
            raise GymError(f"temperature must be >= 0 (got {params.temperature})")
        if params.max_tokens is not None and params.max_tokens < 1:
            raise GymError(f"max_tokens must be at least 1 (got {params.max_tokens})")
        if self._context is None:
            if params.max_tokens is None:
                raise GymError("max_tokens is needed: this model states no context length")
            max_tokens = params.max_tokens
        else:
            room = self._context - len(prompt.tokens)
            max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
            if max_tokens < 1:
                raise GymError(
                    f"no room to sample: a prompt of {len(prompt.tokens)} tokens fills the model's context "
                    f"of {self._context}"
                )
        stop_ids, stop_strings = stop_conditions(params.stop, self.tokenizer.eos_token_id)
        return DecodeJob(prompt, max_tokens, stop_ids, stop_strings)

    def add(self, prompts: Sequence[Prompt]) -> list[DecodeJob]:
        """Prefill `prompts` (one pass for all of them) and merge their rows into the batch; they draw their
        first token at the next `step`. Every prompt is checked before anything changes."""
        jobs = [self.check(p) for p in prompts]
        if not jobs:
            return []
        if not self.can_add():
            raise GymError("this batch cannot take new rows (its cache is not a plain one); start another")
        device = self.device
        longest = max(len(p.tokens) for p in prompts)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(prompts), longest), pad, dtype=torch.long, device=device)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt.tokens) :] = torch.tensor(prompt.tokens, device=device)
            mask[row, longest - len(prompt.tokens) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = growing_cache()
        if self.router is not None:
            self.router.route([(p.adapter, longest) for p in prompts])
        logits = self._next_logits(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
        )
        counts = torch.tensor([p.num_samples for p in prompts], device=device)
        repeat = torch.repeat_interleave(torch.arange(len(prompts), device=device), counts)
        cache.batch_select_indices(repeat)
        new = (cache, mask[repeat], positions[repeat, -1:] + 1, logits[repeat])

        if self._cache is None:
            self._cache, self._mask, self._position, self._logits = new
        else:
            if self.live_rows < len(self._live):
                self._keep(self._live_index())  # finished rows would be carried into the bigger batch
            self._merge(*new)
        for job in jobs:
            for sample in range(job.prompt.num_samples):
                self._job_of.append(job)
                self._sample_of.append(sample)
                self._tokens.append([])
                self._logprobs.append([])
                self._live.append(True)
        self.live_rows += int(counts.sum())
        self._refresh_row_settings()
        return jobs

    def _merge(
        self, cache: DynamicCache, mask: torch.Tensor, position: torch.Tensor, logits: torch.Tensor
    ) -> None:
        width = max(self._mask.shape[1], mask.shape[1])

        def left_pad(t: torch.Tensor, dim_from_end: int) -> torch.Tensor:
            missing = width - t.shape[-dim_from_end]
            return t if missing == 0 else F.pad(t, (0, 0) * (dim_from_end - 1) + (missing, 0))

        for old, joining in zip(self._cache.layers, cache.layers):
            old.keys = torch.cat([left_pad(old.keys, 2), left_pad(joining.keys, 2)])
            old.values = torch.cat([left_pad(old.values, 2), left_pad(joining.values, 2)])
        self._mask = torch.cat([left_pad(self._mask, 1), left_pad(mask, 1)])
        self._position = torch.cat([self._position, position])
        self._logits = torch.cat([self._logits, logits])

    def _refresh_row_settings(self) -> None:
        jobs = dict.fromkeys(self._job_of)  # distinct, in order
        params = [job.prompt.params for job in self._job_of]
        self._temperature = torch.tensor([p.temperature for p in params], device=self.device)
        self._top_k = torch.tensor([p.top_k for p in params], device=self.device)
        self._top_p = torch.tensor([p.top_p for p in params], device=self.device)
        self._streaming = any(job.prompt.on_token is not None for job in jobs)
        self._greedy = self._temperature == 0
        self._all_greedy = bool(self._greedy.all())
        stop_ids = sorted({i for job in jobs for i in job.stop_ids})
        self._stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=self.device)
        strings = sorted({s for job in jobs for s in job.stop_strings})
        self._stop_candidates = (
            stop_string_candidates(self.tokenizer, tuple(strings), self._vocab, self.device)
            if strings
            else None
        )

    # -- leaving ---------------------------------------------------------------------------------------------
    def drop(self, job: DecodeJob) -> None:
        """Stop decoding `job`'s rows (nobody waits for them); it never becomes done."""
        for row, owner in enumerate(self._job_of):
            if owner is job and self._live[row]:
                self._live[row] = False
                self.live_rows -= 1
        if self.live_rows == 0:
            self._clear()

    def _live_index(self) -> torch.Tensor:
        return torch.tensor([r for r, live in enumerate(self._live) if live], device=self.device)

    def _keep(self, index: torch.Tensor) -> None:
        """Keep only the rows in `index`, and only the cache columns some kept row attends to."""
        self._cache.batch_select_indices(index)
        self._mask, self._position, self._logits = (
            self._mask[index],
            self._position[index],
            self._logits[index],
        )
        kept = index.tolist()
        for name in ("_job_of", "_sample_of", "_tokens", "_logprobs", "_live"):
            values = getattr(self, name)
            setattr(self, name, [values[r] for r in kept])
        first_column = int(self._mask.any(0).int().argmax())
        if first_column > 0 and self.can_add():
            for layer in self._cache.layers:
                layer.keys = layer.keys[..., first_column:, :]
                layer.values = layer.values[..., first_column:, :]
            self._mask = self._mask[:, first_column:]
        self._refresh_row_settings()

    # -- decoding --------------------------------------------------------------------------------------------
    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        if self._all_greedy:
            return logits.argmax(-1)
        temperature = torch.where(self._greedy, 1.0, self._temperature)
        probs = filtered_logits(logits, temperature, self._top_k, self._top_p).softmax(-1)
        drawn = draw(probs, self._generator)
        return torch.where(self._greedy, logits.argmax(-1), drawn) if self._greedy.any() else drawn

    def step(self) -> list[DecodeJob]:
        """Every live row draws one token; returns the jobs whose last row finished with it."""
        if self.live_rows == 0:
            return []
        chosen = self._choose(self._logits)
        # The whole [rows, vocab] log-softmax only for a streaming row's listener; the chosen tokens' logprobs
        # need just one log-sum-exp per row.
        step_logprobs = self._logits.log_softmax(-1) if self._streaming else None
        chosen_logprobs = (
            self._logits.gather(1, chosen[:, None]).squeeze(1) - self._logits.logsumexp(-1)
        ).tolist()
        stop_token = torch.isin(chosen, self._stop_ids).tolist()
        could_end_string = (
            self._stop_candidates[chosen].tolist() if self._stop_candidates is not None else None
        )
        finished = []
        for row, token in enumerate(chosen.tolist()):
            if not self._live[row]:
                continue
            job, sample, tokens = self._job_of[row], self._sample_of[row], self._tokens[row]
            tokens.append(token)
            self._logprobs[row].append(chosen_logprobs[row])
            if job.prompt.on_token is not None:
                job.prompt.on_token(sample, token, step_logprobs[row])
            if (stop_token[row] and token in job.stop_ids) or (
                could_end_string is not None
                and could_end_string[row]
                and job.ends_a_stop_string(self.tokenizer, tokens)
            ):
                reason = "stop"
            elif len(tokens) >= job.max_tokens:
                reason = "length"
            else:
                continue
            self._live[row] = False
            self.live_rows -= 1
            job.sequences[sample] = SampledSequence(
                tokens=tokens, logprobs=self._logprobs[row], stop_reason=reason
            )
            job.unfinished -= 1
            if job.done:
                finished.append(job)
        if self.live_rows == 0:
            self._clear()
            return finished
        if (len(self._live) - self.live_rows) * 4 >= len(self._live):
            index = self._live_index()
            chosen = chosen[index]
            self._keep(index)
        self._mask = torch.cat(
            [self._mask, torch.ones((len(self._live), 1), dtype=self._mask.dtype, device=self.device)], dim=1
        )
        if self.router is not None:
            self.router.route([(job.prompt.adapter, 1) for job in self._job_of])
        self._logits = self._next_logits(
            input_ids=chosen[:, None],
            attention_mask=self._mask,
            position_ids=self._position,
            cache=self._cache,
            use_cache=True,
        )
        self._position = self._position + 1
        return finished


def sample_groups(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    num_samples: int,
    params: SamplingParams,
) -> list[list[SampledSequence]]:
    """`num_samples` completions for each prompt, all decoded together; result[i][j] is sample j of prompt i."""
    if not prompts or num_samples < 1:
        return [[] for _ in prompts]
    with decoding(model):
        batch = DecodeBatch(model, tokenizer, seed=params.seed)
        jobs = batch.add([Prompt(list(p), num_samples, params) for p in prompts])
        while batch.live_rows:
            batch.step()
    return [job.sequences for job in jobs]
