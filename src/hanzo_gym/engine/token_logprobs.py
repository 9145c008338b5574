"""Log-probabilities of chosen tokens without keeping `[tokens, vocab]` logits alive.

The output projection is applied in chunks of positions. The forward pass keeps only the hidden states and one
log-sum-exp per position; the backward pass recomputes each chunk's logits and touches only positions whose
incoming gradient is non-zero (in SFT that skips every prompt token).
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 1024


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, chunk):
        n = hidden_NH.shape[0]
        logprobs_N = torch.empty(n, dtype=torch.float32, device=hidden_NH.device)
        logsumexp_N = torch.empty(n, dtype=torch.float32, device=hidden_NH.device)
        entropy_N = torch.empty(n, dtype=torch.float32, device=hidden_NH.device)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            logits = (hidden_NH[start:end] @ weight_VH.T).float()
            lse = torch.logsumexp(logits, dim=-1)
            logsumexp_N[start:end] = lse
            picked = logits.gather(1, targets_N[start:end, None]).squeeze(1)
            logprobs_N[start:end] = picked - lse
            # H = lse − Σ p·logits
            entropy_N[start:end] = lse - (torch.exp(logits - lse[:, None]) * logits).sum(-1)
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, logsumexp_N)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(entropy_N)
        return logprobs_N, entropy_N

    @staticmethod
    def backward(ctx, grad_N, _grad_entropy):
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
            grad_logits = torch.exp(logits - logsumexp_N[rows, None]).mul_(-grad_N[rows, None])
            grad_logits[torch.arange(rows.numel(), device=rows.device), targets_N[rows]] += grad_N[rows]
            grad_logits = grad_logits.to(hidden_NH.dtype)
            if need_hidden:
                grad_hidden[rows] = grad_logits @ weight_VH
            if need_weight:
                grad_weight += (grad_logits.T @ h).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight_VH.dtype)
        return grad_hidden, grad_weight, None, None


def token_logprobs(
    hidden_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N: torch.Tensor, chunk: int = DEFAULT_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weightᵀ)[target] per position in fp32 (differentiable w.r.t. hidden and weight),
    and the entropy of each position's distribution (not differentiable)."""
    return _ChunkedTokenLogprobs.apply(hidden_NH, weight_VH, targets_N, chunk)
