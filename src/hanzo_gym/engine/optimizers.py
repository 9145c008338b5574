"""The optimizers a config may name (Hugging Face's `optim` names, as Axolotl writes them), all AdamW.

Each name differs from plain AdamW only in how it runs (fused kernels) or how it stores its moments (8-bit,
paged): the update rule is the same. Where the device lacks the implementation, the plain torch AdamW runs
instead and `build_optimizer_factory` returns one line saying so. The hyperparameters (lr, betas, eps, weight
decay) are set on every step by `Engine.optim_step`, so the factories construct with lr 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hanzo_gym.errors import GymError

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]

# name → (optim_bits, paged) of bitsandbytes' AdamW, as transformers' Trainer builds them.
BITSANDBYTES_ADAMW = {
    "adamw_bnb_8bit": (8, False),
    "adamw_8bit": (8, False),
    "paged_adamw_8bit": (8, True),
    "paged_adamw_32bit": (32, True),
}
# HF's names of torchao's low-bit AdamW: the same update, moments stored in 4 or 8 bits.
TORCHAO_ADAMW = {"adamw_torch_4bit": "4-bit", "adamw_torch_8bit": "8-bit"}
# bitsandbytes keeps moments of tensors smaller than this in 32 bits; the probe must reach the 8-bit path.
_PROBE_NUMEL = 8192


def plain_adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.0)


def with_loraplus(factory: OptimizerFactory, model: torch.nn.Module, ratio: float) -> OptimizerFactory:
    """LoRA+'s groups (PEFT's `create_loraplus_optimizer`): the LoRA B matrices and every 1-D parameter at
    `ratio` times the learning rate, the rest at it, no group decaying weights. Each group says so in
    `lr_scale` and `decays`, which Engine.optim_step reads every step."""
    names = {id(p): name for name, p in model.named_parameters()}

    def fast(param: torch.nn.Parameter) -> bool:
        return "lora_B" in names[id(param)] or param.ndim == 1

    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        groups = [
            {"params": [p for p in params if not fast(p)], "lr_scale": 1.0, "decays": False},
            {"params": [p for p in params if fast(p)], "lr_scale": ratio, "decays": False},
        ]
        return factory([group for group in groups if group["params"]])

    return make


def build_optimizer_factory(name: str, device: torch.device) -> tuple[OptimizerFactory, str | None]:
    """The factory for optimizer `name` on `device`, and a one-line note when it falls back to plain AdamW."""
    if name == "adamw_torch":
        return plain_adamw, None
    if name == "adamw_torch_fused":
        problem = _probe(lambda probe: torch.optim.AdamW(probe, lr=0.0, fused=True), device)
        if problem is None:
            return (lambda params: torch.optim.AdamW(params, lr=0.0, fused=True)), None
        return plain_adamw, (
            f"optimizer adamw_torch_fused: torch has no fused AdamW on {device.type} ({problem}); "
            "using the plain AdamW (the same update)"
        )
    if name in BITSANDBYTES_ADAMW:
        return _bitsandbytes_factory(name, device)
    if name in TORCHAO_ADAMW:
        return plain_adamw, (
            f"optimizer {name}: torchao's {TORCHAO_ADAMW[name]} AdamW is not used (its quantized moments are tensor "
            "subclasses that the safetensors checkpoints cannot hold); using the plain torch AdamW, the same "
            "update with moments in full precision"
        )
    raise ValueError(f"unknown optimizer {name!r}")


def _bitsandbytes_factory(name: str, device: torch.device) -> tuple[OptimizerFactory, str | None]:
    bits, paged = BITSANDBYTES_ADAMW[name]
    fallback = f"optimizer {name}: using the plain torch AdamW (the same update, moments in full precision)"
    if paged and device.type != "cuda":
        # Paging moves optimizer state between GPU and host memory; elsewhere there is nothing to page.
        if bits == 32:
            return (
                plain_adamw,
                f"{fallback}: bitsandbytes pages optimizer state only on CUDA, not {device.type}",
            )
        paged = False
        note = f"optimizer {name}: bitsandbytes pages optimizer state only on CUDA; unpaged 8-bit AdamW on {device.type}"
    else:
        note = None
    try:
        import bitsandbytes  # optional: imported only when a config asks for it
    except ImportError:
        return plain_adamw, f"{fallback}: bitsandbytes is not installed (pip install bitsandbytes)"

    def factory(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return bitsandbytes.optim.AdamW(params, lr=0.0, optim_bits=bits, is_paged=paged)

    problem = _probe(factory, device)
    if problem is not None:
        return plain_adamw, f"{fallback}: bitsandbytes' optimizer does not run on {device.type} ({problem})"
    return factory, note


def _probe(factory: OptimizerFactory, device: torch.device) -> str | None:
    """Build the optimizer over a throwaway parameter on `device` and take one step; the error if that fails."""
    try:
        probe = torch.nn.Parameter(torch.zeros(_PROBE_NUMEL, device=device))
        probe.grad = torch.ones_like(probe)
        optimizer = factory([probe])
        optimizer.param_groups[0]["lr"] = 1e-3
        optimizer.step()
    except Exception as exc:  # noqa: BLE001 (any failure means "not on this device"; the note says why)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'failed'}"
    return None


def is_bitsandbytes(optimizer: torch.optim.Optimizer | None) -> bool:
    return optimizer is not None and type(optimizer).__module__.startswith("bitsandbytes")


def state_as_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state with every per-parameter value a tensor, as the safetensors checkpoint needs:
    bitsandbytes keeps its step count as an int and nests its quantisation state in a dict of its own
    (its `load_state_dict` takes the nested keys flat as well) and shares one quantisation map between all
    parameters, which safetensors refuses to write twice: each parameter gets its own copy."""
    seen: set[int] = set()
    for index, entry in state["state"].items():
        flat: dict[str, Any] = {}
        for key, value in entry.items():
            if isinstance(value, dict):
                for inner_key, tensor in value.items():
                    shared = isinstance(tensor, torch.Tensor) and tensor.data_ptr() in seen
                    flat[inner_key] = tensor.clone() if shared else tensor
                    if isinstance(tensor, torch.Tensor):
                        seen.add(tensor.data_ptr())
            elif isinstance(value, int | float) and not isinstance(value, bool):
                flat[key] = torch.tensor(value)
            else:
                flat[key] = value
        state["state"][index] = flat
    return state


def state_for_optimizer(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A saved state made loadable into `optimizer`: it must come from the same kind of optimizer (torch's
    AdamW keeps `exp_avg`, bitsandbytes' `state1`), bitsandbytes gets its int step counts back, and the
    current groups keep their implementation flags (a fused state resumes unfused where fused is missing)."""
    bnb_now = is_bitsandbytes(optimizer)
    state = {}
    for index, entry in saved["state"].items():
        entry = state[index] = dict(entry)  # a copy: the caller's state stays as it was
        if ("state1" in entry) != bnb_now:
            written = "bitsandbytes' AdamW" if "state1" in entry else "torch's AdamW"
            running = "bitsandbytes' AdamW" if bnb_now else "torch's AdamW"
            raise GymError(
                f"the saved optimizer state was written by {written}, but this run uses {running}; resume "
                "with the `optimizer` the checkpoint was trained with (or start the optimizer fresh)"
            )
        if bnb_now and isinstance(entry.get("step"), torch.Tensor):
            entry["step"] = int(entry["step"].item())
    groups = []
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups, strict=False):
        flags = {k: group[k] for k in ("fused", "foreach", "capturable") if k in group}
        groups.append({**saved_group, **flags})
    return {"state": state, "param_groups": groups}
