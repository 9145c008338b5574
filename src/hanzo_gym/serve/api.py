"""The endpoints' work: a typed request → prompts → the shared batcher → an OpenAI response, or a stream of
chunks. Requests without streaming or top log-probabilities wait in the batcher with others like them and are
decoded together; streamed ones (and those asking for top alternatives) follow their tokens as they are drawn.
With `echo`, the prompts are scored first (`serve.echo`) and their text and logprobs go before the completion's.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hanzo_gym.engine.sampling import stop_lists
from hanzo_gym.errors import GymError
from hanzo_gym.records import SampledSequence, SamplingParams
from hanzo_gym.renderers import RendererError
from hanzo_gym.serve.echo import EchoedPrompt, echo_prompts
from hanzo_gym.serve.models import ServedModels
from hanzo_gym.serve.protocol import APIError, ChatRequest, CompletionRequest, Sampling
from hanzo_gym.serve.responses import (
    chat_choice,
    chat_chunk,
    chat_completion,
    chat_logprobs,
    completion_logprobs,
    new_id,
    now,
    text_choice,
    text_chunk,
    text_completion,
    usage_chunk,
)
from hanzo_gym.serve.text import TextTracker, decode, find_stop

_DONE = object()

CLIENT_CHECK_SECONDS = 0.25  # how often a non-streamed request checks that its client is still there


@dataclass
class _Sample:
    """One completion (prompt p, sample j) as it is built."""

    tracker: TextTracker
    logprobs: list[float] = field(default_factory=list)  # per drawn token, when followed token by token
    tops: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class _Job:
    prompt: list[int]
    samples: list[_Sample]
    future: concurrent.futures.Future | None = None


class Generation:
    """One request's prompts × n samples through the batcher."""

    def __init__(
        self,
        models: ServedModels,
        adapter: str | None,
        prompts: list[list[int]],
        sampling: Sampling,
        stop_ids: list[int],
        stop_strings: list[str],
        top_logprobs: int | None,  # None: no log-probabilities; 0: the sampled token's only
        follow: bool,  # stream: hear every token as it is drawn
        client_gone: Callable[[], bool] | None = None,  # while waiting: has the client hung up?
    ):
        self.models = models
        self.tokenizer = models.host.tokenizer
        self.top = top_logprobs or 0
        self.want_logprobs = top_logprobs is not None
        self.stop_strings = stop_strings
        tracker_stop_ids = set(stop_ids)
        if self.tokenizer.eos_token_id is not None:
            tracker_stop_ids.add(self.tokenizer.eos_token_id)  # the sampler always stops on it
        params = SamplingParams(
            max_tokens=sampling.max_tokens,
            seed=sampling.seed,
            stop=[*stop_ids, *stop_strings] or None,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
        )
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.jobs = [
            _Job(
                prompt,
                [
                    _Sample(TextTracker(self.tokenizer, tracker_stop_ids, stop_strings))
                    for _ in range(sampling.n)
                ],
            )
            for prompt in prompts
        ]
        self.follow = follow or self.top > 0
        self.client_gone = client_gone
        self.cancel_event = threading.Event()
        for index, job in enumerate(self.jobs):
            on_token = self._listener(index) if self.follow else None
            job.future = models.batcher.submit(
                adapter, job.prompt, sampling.n, params, on_token=on_token, cancel=self.cancel_event
            )
            job.future.add_done_callback(lambda _, index=index: self.events.put((_DONE, index)))

    def _listener(self, job: int):
        def on_token(row: int, token: int, logprobs: torch.Tensor) -> None:
            # Runs on the sampler's thread: keep it short; the request's thread does the text work.
            value = float(logprobs[token]) if self.want_logprobs else 0.0
            tops: list[tuple[int, float]] = []
            if self.top:
                values, ids = logprobs.topk(self.top)
                tops = list(zip(ids.tolist(), values.tolist()))
            self.events.put((job, row, token, value, tops))

        return on_token

    # -- results ---------------------------------------------------------------------------------------------
    def result(self, job: int) -> list[SampledSequence]:
        """Job `job`'s samples, or the APIError its failure means for the client."""
        try:
            return self.jobs[job].future.result()
        except GymError as exc:
            raise APIError(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - the client gets a 500; the server keeps serving
            raise APIError(f"sampling failed: {exc}", status=500, type="server_error") from None

    def results(self) -> list[list[SampledSequence]]:
        futures = [job.future for job in self.jobs]
        while self.client_gone is not None:
            _, pending = concurrent.futures.wait(futures, timeout=CLIENT_CHECK_SECONDS)
            if not pending:
                break
            if self.client_gone():
                # Nobody will read the answer: free the sampler for the requests still waiting.
                self.cancel()
                raise APIError("the client closed the connection", 499, code="client_closed_request")
        return [self.result(job) for job in range(len(self.jobs))]

    def finished(self) -> list[list[tuple[_Sample, SampledSequence]]]:
        """Every sample, its tokens run through its tracker (after a followed run, the tokens already were)."""
        results = self.results()
        if self.follow:
            self.drain()
        for job, sequences in zip(self.jobs, results):
            for sample, sequence in zip(job.samples, sequences):
                if not self.follow:
                    for token in sequence.tokens:
                        sample.tracker.add(token)
                    sample.logprobs = list(sequence.logprobs)
                sample.tracker.finish()
        return [list(zip(job.samples, sequences)) for job, sequences in zip(self.jobs, results)]

    def stream(self) -> Iterator[tuple[int, int, _Sample | None]]:
        """(job, row, sample) each time a sample gains a token; (job, -1, None) when a job has finished."""
        remaining = len(self.jobs)
        while remaining:
            event = self.events.get()
            if event[0] is _DONE:
                remaining -= 1
                yield event[1], -1, None
                continue
            job, row, token, value, tops = event
            sample = self.jobs[job].samples[row]
            sample.tracker.add(token)
            sample.logprobs.append(value)
            sample.tops.append(tops)
            yield job, row, sample

    def cancel(self) -> None:
        self.models.batcher.cancel(self.cancel_event)

    def drain(self) -> None:
        for _ in self.stream():
            pass

    # -- shaping ---------------------------------------------------------------------------------------------
    def piece(self, token: int) -> str:
        return decode(self.tokenizer, [token])

    def token_view(
        self, sample: _Sample, positions: range
    ) -> tuple[list[str], list[float], list[list[tuple[str, float]]] | None]:
        tokens = sample.tracker.tokens
        pieces = [self.piece(tokens[i]) for i in positions]
        values = [sample.logprobs[i] for i in positions]
        tops = None
        if self.top:
            tops = [[(self.piece(t), v) for t, v in sample.tops[i]] for i in positions]
        return pieces, values, tops

    def usage(self, results: list[list[tuple[_Sample, SampledSequence]]]) -> tuple[int, int]:
        prompt = sum(len(job.prompt) for job in self.jobs)
        completion = sum(len(seq.tokens) for group in results for _, seq in group)
        return prompt, completion


# -- /v1/chat/completions ----------------------------------------------------------------------------------
def chat(
    models: ServedModels, request: ChatRequest, client_gone: Callable[[], bool] | None = None
) -> dict[str, Any] | Iterator[dict[str, Any]]:
    adapter = models.adapter_slot(request.model)
    renderer = models.chat_renderer()
    try:
        prompt = renderer.build_generation_prompt(request.messages).to_ints()
    except RendererError as exc:
        raise APIError(
            f"cannot render these messages: {exc}", param="messages", code="invalid_value"
        ) from None
    request.sampling.max_tokens = models.default_max_tokens(request.sampling.max_tokens, len(prompt))
    models.check_prompt(prompt, request.sampling.max_tokens)
    models.check_budget(1, request.sampling.n, request.sampling.max_tokens)
    stop_ids, renderer_strings = stop_lists(renderer.get_stop_sequences())
    generation = Generation(
        models,
        adapter,
        [prompt],
        request.sampling,
        stop_ids,
        list(dict.fromkeys([*request.sampling.stop, *renderer_strings])),
        request.top_logprobs if request.logprobs else None,
        follow=request.stream,
        client_gone=client_gone,
    )
    model = request.model or models.name
    if request.stream:
        return _chat_stream(generation, model, request)
    results = generation.finished()
    choices = []
    for index, (sample, sequence) in enumerate(results[0]):
        logprobs = None
        if request.logprobs:
            logprobs = chat_logprobs(*generation.token_view(sample, range(sample.tracker.visible_tokens())))
        message = _chat_message(renderer, sample, sequence, generation.stop_strings)
        choices.append(chat_choice(index, message, sequence.stop_reason, logprobs))
    return chat_completion(new_id("chatcmpl"), model, choices, *generation.usage(results))


def _chat_message(renderer, sample: _Sample, sequence: SampledSequence, stops: list[str]) -> dict[str, Any]:
    """The renderer's reading of the response (it splits off reasoning), cut at the first stop string."""
    try:
        parsed, _ = renderer.parse_response(sequence.tokens)
    except RendererError:
        return {"role": "assistant", "content": sample.tracker.text}
    content = parsed.get("content")
    reasoning = ""
    if isinstance(content, list):
        reasoning = "".join(p.get("thinking", "") for p in content if p.get("type") == "thinking")
        content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
    text = content or ""
    cut = find_stop(text, stops)
    message: dict[str, Any] = {"role": "assistant", "content": text if cut is None else text[:cut]}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def _chat_stream(generation: Generation, model: str, request: ChatRequest) -> Iterator[dict[str, Any]]:
    try:
        yield from _chat_chunks(generation, model, request)
    finally:
        generation.cancel()  # a no-op once sampling is done; stops it when the client left early


def _chat_chunks(generation: Generation, model: str, request: ChatRequest) -> Iterator[dict[str, Any]]:
    id, created = new_id("chatcmpl"), now()
    n = request.sampling.n
    for index in range(n):
        yield chat_chunk(id, model, created, index, {"role": "assistant", "content": ""})

    def delta_chunk(row: int, sample: _Sample, finish_reason: str | None = None):
        text, positions = sample.tracker.take()
        if not text and not (positions and request.logprobs):
            return None
        logprobs = chat_logprobs(*generation.token_view(sample, positions)) if request.logprobs else None
        return chat_chunk(id, model, created, row, {"content": text}, finish_reason, logprobs)

    for _, row, sample in generation.stream():
        if sample is not None:
            chunk = delta_chunk(row, sample)
            if chunk is not None:
                yield chunk
    results = generation.results()
    for row, (sample, sequence) in enumerate(zip(generation.jobs[0].samples, results[0])):
        sample.tracker.finish()
        chunk = delta_chunk(row, sample)
        if chunk is not None:
            yield chunk
        yield chat_chunk(id, model, created, row, {}, sequence.stop_reason)
    if request.include_usage:
        prompt_tokens = len(generation.jobs[0].prompt)
        completion_tokens = sum(len(seq.tokens) for seq in results[0])
        yield usage_chunk(id, "chat.completion.chunk", model, created, prompt_tokens, completion_tokens)


# -- /v1/completions ---------------------------------------------------------------------------------------
def complete(
    models: ServedModels, request: CompletionRequest, client_gone: Callable[[], bool] | None = None
) -> dict[str, Any] | Iterator[dict[str, Any]]:
    adapter = models.adapter_slot(request.model)
    tokenizer = models.host.tokenizer
    prompts = []
    for prompt in request.prompts:
        tokens = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        models.check_prompt(tokens, request.sampling.max_tokens, param="prompt")
        prompts.append(tokens)
    models.check_budget(len(prompts), request.sampling.n, request.sampling.max_tokens)
    model = request.model or models.name
    echoes = None
    if request.echo:
        echoes = echo_prompts(models.host, adapter, request.prompts, prompts, request.logprobs)
        if request.sampling.max_tokens == 0:
            return _echoes_only(model, request, echoes, sum(len(tokens) for tokens in prompts))
    generation = Generation(
        models,
        adapter,
        prompts,
        request.sampling,
        [],
        request.sampling.stop,
        request.logprobs,
        request.stream,
        client_gone,
    )
    if request.stream:
        return _completion_stream(generation, model, request)
    results = generation.finished()
    choices = []
    for p, group in enumerate(results):
        for j, (sample, sequence) in enumerate(group):
            text, logprobs = sample.tracker.text, None
            if echoes is not None:
                text, logprobs = _echoed(
                    echoes[p], generation, sample, sequence, request.logprobs is not None
                )
            elif request.logprobs is not None:
                logprobs = _completion_logprobs(generation, sample, range(sample.tracker.visible_tokens()))
            index = p * request.sampling.n + j
            choices.append(text_choice(index, text, sequence.stop_reason, logprobs))
    return text_completion(new_id("cmpl"), model, choices, *generation.usage(results))


def _completion_logprobs(generation: Generation, sample: _Sample, positions: range) -> dict[str, Any]:
    offsets = [sample.tracker.starts[i] for i in positions]
    return completion_logprobs(*generation.token_view(sample, positions), offsets)


def _echoes_only(
    model: str, request: CompletionRequest, echoes: list[EchoedPrompt], prompt_tokens: int
) -> dict[str, Any]:
    """`max_tokens: 0` with `echo`: each prompt scored, nothing generated."""
    choices = []
    for p, echo in enumerate(echoes):
        logprobs = None
        if request.logprobs is not None:
            logprobs = completion_logprobs(echo.pieces, echo.logprobs, echo.tops, echo.offsets)
        for j in range(request.sampling.n):
            choices.append(text_choice(p * request.sampling.n + j, echo.text, "length", logprobs))
    return text_completion(new_id("cmpl"), model, choices, prompt_tokens, 0)


def _echoed(
    echo: EchoedPrompt,
    generation: Generation,
    sample: _Sample,
    sequence: SampledSequence,
    want_logprobs: bool,
) -> tuple[str, dict[str, Any] | None]:
    """The prompt's text and logprobs, then the completion's."""
    text = echo.text + sample.tracker.text
    if not want_logprobs:
        return text, None
    tracker = sample.tracker
    positions = range(tracker.visible_tokens())
    pieces, values, tops = generation.token_view(sample, positions)
    offsets = [len(echo.text) + tracker.starts[i] for i in positions]
    stop_token = len(tracker.tokens)  # its index in the sequence, when a stop token ended it
    if tracker.ended and not tracker.cut_by_stop and stop_token < len(sequence.tokens):
        # Unlike a plain completion's, echo's logprobs cover the stop token too (as vLLM's do): harnesses
        # ask for one token and drop the last position, which would otherwise be one of the prompt's.
        pieces.append(generation.piece(sequence.tokens[stop_token]))
        values.append(sample.logprobs[stop_token])
        if tops is not None:
            tops.append([(generation.piece(t), v) for t, v in sample.tops[stop_token]])
        offsets.append(len(text))
    all_tops = None if tops is None else [*(echo.tops or [[] for _ in echo.pieces]), *tops]
    logprobs = completion_logprobs(
        [*echo.pieces, *pieces], [*echo.logprobs, *values], all_tops, [*echo.offsets, *offsets]
    )
    return text, logprobs


def _completion_stream(
    generation: Generation, model: str, request: CompletionRequest
) -> Iterator[dict[str, Any]]:
    try:
        yield from _completion_chunks(generation, model, request)
    finally:
        generation.cancel()


def _completion_chunks(
    generation: Generation, model: str, request: CompletionRequest
) -> Iterator[dict[str, Any]]:
    id, created = new_id("cmpl"), now()
    n = request.sampling.n
    want_logprobs = request.logprobs is not None

    def delta_chunk(job: int, row: int, sample: _Sample):
        text, positions = sample.tracker.take()
        if not text and not (positions and want_logprobs):
            return None
        logprobs = _completion_logprobs(generation, sample, positions) if want_logprobs else None
        return text_chunk(id, model, created, job * n + row, text, None, logprobs)

    for job, row, sample in generation.stream():
        if sample is not None:
            chunk = delta_chunk(job, row, sample)
            if chunk is not None:
                yield chunk
            continue
        # Job `job` is done: its samples' last text and finish reasons.
        sequences = generation.result(job)
        for r, (done, sequence) in enumerate(zip(generation.jobs[job].samples, sequences)):
            done.tracker.finish()
            chunk = delta_chunk(job, r, done)
            if chunk is not None:
                yield chunk
            yield text_chunk(id, model, created, job * n + r, "", sequence.stop_reason)
    if request.include_usage:
        results = generation.results()
        prompt_tokens = sum(len(j.prompt) for j in generation.jobs)
        completion_tokens = sum(len(seq.tokens) for group in results for seq in group)
        yield usage_chunk(id, "text_completion", model, created, prompt_tokens, completion_tokens)
