"""Log-probabilities of chosen tokens without keeping `[tokens, vocab]` logits alive.

The output projection is applied in chunks of positions. The forward pass keeps only the hidden states and one
log-sum-exp per position; the backward pass recomputes each chunk's logits and touches only positions whose
incoming gradient is non-zero (in SFT that skips every prompt token). The same chunks give, on request, each
position's log Σ_v π(v)² (WPO's weights). `prompt_logprobs` scores a whole sequence with the same chunking, for
`echo` on /v1/completions (a prompt's own log-probabilities and top alternatives).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hanzo_gym.model.decoder import decoder_of

CHUNK_BYTES = 16 << 20  # one fp32 `[positions, vocab]` buffer; a chunk holds two at a time
MIN_CHUNK, MAX_CHUNK = 64, 1024


def chunk_rows(vocab: int) -> int:
    """Positions per chunk for this vocabulary: as many as fit CHUNK_BYTES (85 for SmolLM2's 49152 tokens),
    at least MIN_CHUNK, since each chunk reads the whole output weight again. On SmolLM2 a 176-position DPO
    row's output layer peaked at 175 MB above the decoder in one 1024-position chunk, with a separate buffer
    per operation, and steps ran no faster for it."""
    return min(MAX_CHUNK, max(MIN_CHUNK, CHUNK_BYTES // (4 * vocab)))


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, chunk, with_log_sum_sq):
        n = hidden_NH.shape[0]
        logprobs_N = torch.empty(n, dtype=torch.float32, device=hidden_NH.device)
        logsumexp_N = torch.empty(n, dtype=torch.float32, device=hidden_NH.device)
        entropy_N = torch.empty(n, dtype=torch.float32, device=hidden_NH.device)
        log_sum_sq_N = torch.empty(n if with_log_sum_sq else 0, dtype=torch.float32, device=hidden_NH.device)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            logits = (hidden_NH[start:end] @ weight_VH.T).float()
            picked = logits.gather(1, targets_N[start:end, None]).squeeze(1)
            # One `[chunk, vocab]` buffer besides the logits, reused in place: this is the step's largest
            # working set on a small model (SmolLM2's vocabulary is 49152 wide: 35 MB per 176 positions).
            highest = logits.amax(-1, keepdim=True)
            shifted = torch.sub(logits, highest).exp_()  # e^{s}, s = logits − max
            total = shifted.sum(-1)
            lse = total.log().add_(highest.squeeze(1))
            logsumexp_N[start:end] = lse
            logprobs_N[start:end] = picked - lse
            if with_log_sum_sq:
                # log Σ e^{2s} − 2 log Σ e^{s}, as TRL's kernel computes it: exp(logits − lse) would carry lse's
                # rounding (an ulp of the logits' size) into every term
                log_sum_sq_N[start:end] = shifted.square().sum(-1).log() - 2 * total.log()
            # H = lse − Σ p·logits, p = e^{s} / Σ e^{s}
            entropy_N[start:end] = lse - shifted.mul_(logits).sum(-1).div_(total)
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, logsumexp_N)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(entropy_N, log_sum_sq_N)
        return logprobs_N, entropy_N, log_sum_sq_N

    @staticmethod
    def backward(ctx, grad_N, _grad_entropy, _grad_log_sum_sq):
        hidden_NH, weight_VH, targets_N, logsumexp_N = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden_NH) if need_hidden else None
        grad_weight = (
            torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device)
            if need_weight
            else None
        )
        active = grad_N.nonzero().squeeze(1)
        for start in range(0, active.numel(), ctx.chunk):
            rows = active[start : start + ctx.chunk]
            h = hidden_NH[rows]
            logits = (h @ weight_VH.T).float()
            # d logprob / d logits = onehot(target) - softmax
            grad_logits = logits.sub_(logsumexp_N[rows, None]).exp_().mul_(-grad_N[rows, None])
            grad_logits[torch.arange(rows.numel(), device=rows.device), targets_N[rows]] += grad_N[rows]
            grad_logits = grad_logits.to(hidden_NH.dtype)
            if need_hidden:
                grad_hidden[rows] = grad_logits @ weight_VH
            if need_weight:
                grad_weight += (grad_logits.T @ h).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight_VH.dtype)
        return grad_hidden, grad_weight, None, None, None


def token_logprobs(
    hidden_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N: torch.Tensor, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weightᵀ)[target] per position in fp32 (differentiable w.r.t. hidden and weight),
    and the entropy of each position's distribution (not differentiable)."""
    chunk = chunk or chunk_rows(weight_VH.shape[0])
    logprobs_N, entropy_N, _ = _ChunkedTokenLogprobs.apply(hidden_NH, weight_VH, targets_N, chunk, False)
    return logprobs_N, entropy_N


def token_logprobs_with_log_sum_sq(
    hidden_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N: torch.Tensor, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`token_logprobs`, plus log Σ_v π(v)² of each position's distribution in fp32, not differentiable: the
    alignment term of WPO's weights (TRL's `log_sum_sq_probs`), from the same chunks of logits."""
    chunk = chunk or chunk_rows(weight_VH.shape[0])
    return _ChunkedTokenLogprobs.apply(hidden_NH, weight_VH, targets_N, chunk, True)


def choice_logprobs(
    hidden_NH: torch.Tensor, weight_VH: torch.Tensor, choices_C: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """`[N, C]` fp32: log softmax(hidden @ weightᵀ) at each position, read at the `choices` tokens only (the
    answers of a multiple-choice question); not differentiable."""
    chunk = chunk or chunk_rows(weight_VH.shape[0])
    out_NC = torch.empty(
        (hidden_NH.shape[0], choices_C.numel()), dtype=torch.float32, device=hidden_NH.device
    )
    with torch.no_grad():
        for start in range(0, hidden_NH.shape[0], chunk):
            logits = (hidden_NH[start : start + chunk] @ weight_VH.T).float()
            out_NC[start : start + chunk] = logits[:, choices_C] - logits.logsumexp(-1, keepdim=True)
    return out_NC


def plain_output_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """The decoder and the output projection when the logits are just `hidden @ Wᵀ` (no bias, no scaling or
    capping), so a caller may apply the projection itself; None when only the model's own forward can."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = causal_lm.get_output_embeddings()
    scaled = any(
        getattr(causal_lm.config, key, None)
        for key in ("final_logit_softcapping", "logit_scale", "logits_scaling")
    )
    if isinstance(head, torch.nn.Linear) and head.bias is None and not scaled:
        return decoder_of(causal_lm), head
    return None


@dataclass
class PromptLogprobs:
    """What a sequence's own tokens score under the model, for positions 1…T-1 (position 0 has no context)."""

    logprobs_N: torch.Tensor  # [T-1] fp32: log p(tokens[i+1] | tokens[:i+1])
    top_ids_NK: torch.Tensor  # [T-1, k] the k most likely tokens at each position, best first
    top_logprobs_NK: torch.Tensor  # [T-1, k] fp32, from the same log-softmax row as logprobs_N


def prompt_logprobs(
    model: torch.nn.Module, tokens: Sequence[int], top_k: int = 0, chunk: int | None = None
) -> PromptLogprobs:
    """Score a whole token sequence in one pass (no gradient, dropout off): each token's log-probability given
    the ones before it, and the `top_k` alternatives, returned on the CPU. Reductions run in fp32 whatever the
    model's dtype; a plain output projection is applied `chunk` positions at a time, so `[T, vocab]` logits
    never exist."""
    if len(tokens) < 1:
        raise ValueError("prompt_logprobs needs at least one token")
    plain = plain_output_head(model)
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if plain is not None:
                decoder, head = plain
                hidden_TH = decoder(input_ids=input_ids).last_hidden_state[0]
                logits_of = lambda start, end: head(hidden_TH[start:end]).float()
            else:  # a scaled or capped head: let the model's own forward apply it
                logits_TV = model(input_ids=input_ids).logits[0]
                logits_of = lambda start, end: logits_TV[start:end].float()
            vocab = model.get_output_embeddings().weight.shape[0]
            return _scored_positions(logits_of, input_ids[0], top_k, chunk or chunk_rows(vocab))
    finally:
        model.train(was_training)


def _scored_positions(
    logits_of: Callable[[int, int], torch.Tensor], tokens_T: torch.Tensor, top_k: int, chunk: int
) -> PromptLogprobs:
    n = tokens_T.shape[0] - 1  # position i predicts token i+1; the last position predicts nothing here
    logprobs_N = torch.empty(n, dtype=torch.float32)
    top_ids_NK = torch.empty((n, top_k), dtype=torch.long)
    top_logprobs_NK = torch.empty((n, top_k), dtype=torch.float32)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        logits = logits_of(start, end)
        row_logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        logprobs_N[start:end] = row_logprobs.gather(1, tokens_T[start + 1 : end + 1, None]).squeeze(1).cpu()
        if top_k:
            values, ids = row_logprobs.topk(top_k, dim=-1)
            top_logprobs_NK[start:end], top_ids_NK[start:end] = values.cpu(), ids.cpu()
    return PromptLogprobs(logprobs_N, top_ids_NK, top_logprobs_NK)
