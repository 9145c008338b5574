"""The engine: one model with its LoRA adapter and optimizer behind Tinker's primitives (`forward`,
`forward_backward`, `optim_step`, `sample`), with the losses, the chunked log-probabilities, the
prefix-sharing layout, the KV-cache sampler, the engine's state on disk and the data-parallel collectives it
uses. It knows no loop and no front end."""

from hanzo_gym.engine.engine import (
    Engine,
    ForwardBackwardOutput,
    check_datums,
    check_finite_inputs,
    check_loss_inputs,
    default_tokens_per_pass,
)

__all__ = [
    "Engine",
    "ForwardBackwardOutput",
    "check_datums",
    "check_finite_inputs",
    "check_loss_inputs",
    "default_tokens_per_pass",
]
