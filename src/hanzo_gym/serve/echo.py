"""`echo` on /v1/completions: the prompt comes back in front of the completion, and with `logprobs` every
prompt token's log-probability and top alternatives, as vLLM and OpenAI's legacy API give them. This is how
evaluation harnesses (lm-evaluation-harness's `local-completions`) score multiple-choice answers: they send
context + answer as the prompt and add up the answer tokens' log-probabilities.

The first prompt token has no context: its logprob and its alternatives are `null`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hanzo_gym.engine.token_logprobs import prompt_logprobs
from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.serve.protocol import APIError
from hanzo_gym.serve.text import decode, decode_with_starts


@dataclass
class EchoedPrompt:
    text: str  # the prompt as sent (a string), or its tokens decoded (token ids)
    pieces: list[str]  # each prompt token's own text
    offsets: list[int]  # where each token's text begins in `text`
    logprobs: list[float | None]  # None for the first token
    tops: list[list[tuple[str, float]]] | None  # per token, its alternatives (text, logprob), best first


def echo_text(tokenizer, prompt: str | list[int], tokens: list[int]) -> tuple[str, list[int]]:
    """The echoed text and each token's offset in it. A string prompt comes back as sent: when the tokenizer
    put special tokens in front of it (a BOS), those tokens sit at offset 0."""
    decoded, starts = decode_with_starts(tokenizer, tokens)
    if isinstance(prompt, str) and decoded.endswith(prompt):
        added = len(decoded) - len(prompt)
        return prompt, [max(0, start - added) for start in starts]
    return decoded, starts


def echo_prompts(
    host: ModelHost,
    adapter: str | None,
    prompts: Sequence[str | list[int]],
    token_lists: Sequence[list[int]],
    top_logprobs: int | None,  # None: text only; k: each token's logprob and its top k alternatives
) -> list[EchoedPrompt]:
    tokenizer = host.tokenizer
    echoes = []
    for prompt, tokens in zip(prompts, token_lists):
        text, offsets = echo_text(tokenizer, prompt, tokens)
        echoes.append(EchoedPrompt(text, [decode(tokenizer, [t]) for t in tokens], offsets, [], None))
    if top_logprobs is None:
        return echoes
    try:
        # Under the host's lock no other request switches the adapter or swaps in folded weights mid-pass.
        with host.using(adapter) as model:
            scores = [prompt_logprobs(model, tokens, top_logprobs) for tokens in token_lists]
    except Exception as exc:  # noqa: BLE001 - the client gets a 500; the server keeps serving
        raise APIError(f"scoring the prompt failed: {exc}", status=500, type="server_error") from None
    for echo, score in zip(echoes, scores):
        echo.logprobs = [None, *score.logprobs_N.tolist()]
        if top_logprobs:
            pieces = {t: decode(tokenizer, [t]) for t in set(score.top_ids_NK.flatten().tolist())}
            echo.tops = [[]] + [
                [(pieces[t], v) for t, v in zip(ids, values)]
                for ids, values in zip(score.top_ids_NK.tolist(), score.top_logprobs_NK.tolist())
            ]
    return echoes
