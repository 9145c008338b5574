"""NEFTune: while the model trains, its input embeddings get uniform noise in ±alpha / sqrt(length × width), the
length and width of the embedded batch (HF Trainer's `neftune_noise_alpha`, the rule of its forward hook). In
eval mode (evaluation, sampling, the reference model's scores) the embeddings are left as they are."""

from __future__ import annotations

import torch
from torch import nn


def add_embedding_noise(model: nn.Module, alpha: float) -> torch.utils.hooks.RemovableHandle:
    """Noise on `model`'s input embeddings in training mode; the handle removes it."""

    def noisy(module: nn.Module, _inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        # in float32, as HF computes it, so that a seeded run draws the same noise
        bound = (alpha / torch.tensor(float(output.size(1) * output.size(2))).sqrt()).item()
        return output + torch.zeros_like(output).uniform_(-bound, bound)

    return model.get_input_embeddings().register_forward_hook(noisy)
