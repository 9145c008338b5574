"""Several LoRA adapters of one base in one pass: each token goes through its own adapter.

PEFT applies the active adapter to every token, and its mixed-batch mode picks an adapter per row of a padded
batch, at inference only. The engine packs many datums into one row, so the choice here is per token: inside
`TokenAdapters`, PEFT's own LoRA branch is off (the base layers alone run, as `disable_adapter` does) and a
hook on each LoRA layer adds adapter a's update B·A·x·scale to the tokens that are a's, and nothing elsewhere
(LoRA without dropout: a dropout mask would be drawn per adapter).
The base model's work (every large matmul, attention) is then done once for all adapters' tokens, and autograd
carries each adapter's gradient to its own weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Self

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer

from hanzo_gym.errors import GymError

# LoRA layers whose update is exactly B(A(x)) · scale over a linear base: what the hook computes
_PLAIN_LORA_LAYERS = ("Linear", "Linear8bitLt", "Linear4bit")


def _lora_layers(model: torch.nn.Module) -> list[LoraLayer]:
    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def takes_token_adapters(model: torch.nn.Module, adapter: str) -> str | None:
    """None when adapter `adapter` can share a pass with others through `TokenAdapters`; else why not."""
    if not isinstance(model, PeftModel):
        return "the model has no LoRA adapters"
    output = model.get_output_embeddings()
    holders = [layer for layer in _lora_layers(model) if adapter in layer.r]  # `r`: every kind of LoRA layer
    if not holders:
        return f"adapter `{adapter}` adapts no linear layer"
    for layer in holders:
        if layer is output or layer.get_base_layer() is output:
            return f"adapter `{adapter}` adapts the output layer"  # the sampler scores only the last position
        if type(layer).__name__ not in _PLAIN_LORA_LAYERS or adapter not in layer.lora_A:
            return f"adapter `{adapter}` adapts a {type(layer).__name__} layer"
        if adapter in getattr(layer, "lora_variant", {}):
            return f"adapter `{adapter}` is a LoRA variant (DoRA or the like)"
        if getattr(layer, "lora_bias", {}).get(adapter):
            return f"adapter `{adapter}` trains a LoRA bias"
        if isinstance(layer.lora_dropout[adapter], torch.nn.Dropout) and layer.lora_dropout[adapter].p > 0:
            return f"adapter `{adapter}` has LoRA dropout (drawn per adapter; Tinker's adapters have none)"
    return None


class TokenAdapters:
    """While entered: PEFT's own LoRA branch is off, and every LoRA layer adds to each run of positions the
    update of the adapter that `route` last named for it (runs of the flattened batch × sequence positions, in
    order; a run of None, padding say, gets the base model alone). With `trains`, the adapters named have their
    weights' requires_grad on until exit, so a backward inside fills each adapter's gradients (autograd drops
    the gradient of a weight whose requires_grad went off before the backward). Afterwards the model is as it
    was: its active adapter, and only that one, trainable."""

    def __init__(
        self, model: PeftModel, adapters: Iterable[str], trains: bool, dtype: torch.dtype | None = None
    ):
        """`adapters`: those that train (with `trains`); without it, route may name any adapter of the model.
        `dtype`: compute the updates in it (the sampler's dtype over a bf16 base on CPU, engine/decoding.py);
        by default as PEFT does, in the adapter's dtype unless autocast casts."""
        self.model = model
        self.adapters = list(dict.fromkeys(adapters))
        self.trains = trains
        self.dtype = dtype
        self.runs: list[tuple[str | None, int]] = []
        self._routed: list[str] = []
        self._masks: dict[tuple, torch.Tensor] = {}
        self._stack = contextlib.ExitStack()

    def route(self, runs: Sequence[tuple[str | None, int]]) -> None:
        """`runs`: (adapter name or None, number of positions), covering every position in order."""
        named = {name for name, _ in runs if name is not None}
        if self.trains and named - set(self.adapters):
            raise ValueError(
                f"route: adapters {sorted(named - set(self.adapters))} were not named at the start"
            )
        unloaded = named - set(getattr(self.model, "peft_config", {}))
        if unloaded:
            raise GymError(f"no adapter named {min(unloaded)!r} is loaded")
        self.runs = list(runs)
        self._routed = list(dict.fromkeys(name for name, _ in runs if name is not None))
        self._masks: dict[tuple, torch.Tensor] = {}

    def __enter__(self) -> Self:
        with contextlib.ExitStack() as stack:
            for layer in _lora_layers(self.model):
                # PEFT's branch off (it would add the active adapter everywhere), layer by layer: the model's
                # disable_adapter first surveys every module's status, a tenth of a small pass's time. On exit
                # each layer and each weight's requires_grad are put back as they were.
                stack.callback(_restore, layer, layer.disable_adapters, _grad_flags(layer))
                layer.enable_adapters(False)
                if self.trains:
                    for name in self.adapters:
                        if name in layer.lora_A:
                            layer.lora_A[name].requires_grad_(True)
                            layer.lora_B[name].requires_grad_(True)
                stack.enter_context(layer.register_forward_hook(self._add_updates, with_kwargs=True))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.route([])
        self._stack.close()

    def _add_updates(self, layer: LoraLayer, args: tuple, kwargs: dict, result: torch.Tensor) -> torch.Tensor:
        present = [name for name in self._routed if name in layer.lora_A]
        if not present:
            return result
        x = args[0] if args else kwargs["x"]
        inputs = x.reshape(-1, x.shape[-1])
        if len(inputs) != sum(length for _, length in self.runs):
            raise GymError(
                f"the pass has {len(inputs)} positions but its adapters were routed for "
                f"{sum(length for _, length in self.runs)}"
            )
        autocast = torch.is_autocast_enabled(x.device.type)
        if self.dtype is not None:
            inputs = inputs.to(self.dtype)
        elif not autocast:  # as PEFT: the adapter's dtype; autocast casts
            inputs = inputs.to(layer.lora_A[present[0]].weight.dtype)
        # Every adapter's A stacked: one matmul down for all tokens, a mask that keeps each token's own adapter's
        # rows (times its scale), one matmul up. Some wasted work on the small rank dimension buys a few matmuls
        # instead of six per adapter per layer, which on a small model cost more than the base's own.
        down = torch.cat([layer.lora_A[name].weight for name in present])
        up = torch.cat([layer.lora_B[name].weight for name in present], dim=1)
        if self.dtype is not None:
            down, up = down.to(self.dtype), up.to(self.dtype)
        hidden = torch.nn.functional.linear(inputs, down) * self._mask(layer, present, inputs.device)
        update = torch.nn.functional.linear(hidden if autocast else hidden.to(up.dtype), up)
        return result + update.to(result.dtype).view_as(result)

    def _mask(self, layer: LoraLayer, present: list[str], device: torch.device) -> torch.Tensor:
        """[positions, Σ ranks of `present`]: a token's adapter's scale on that adapter's rows, else 0."""
        key = tuple((name, layer.r[name], layer.scaling[name]) for name in present)
        if key not in self._masks:
            columns, start = {}, 0
            for name, rank, _ in key:
                columns[name] = (start, start + rank)
                start += rank
            mask = torch.zeros(sum(length for _, length in self.runs), start)
            row = 0
            for name, length in self.runs:
                if name in columns:
                    first, last = columns[name]
                    mask[row : row + length, first:last] = layer.scaling[name]
                row += length
            self._masks[key] = mask.to(device)
        return self._masks[key]


def _grad_flags(layer: LoraLayer) -> dict[torch.nn.Parameter, bool]:
    return {
        p: p.requires_grad for name in layer.adapter_layer_names for p in getattr(layer, name).parameters()
    }


def _restore(layer: LoraLayer, disabled: bool, flags: dict[torch.nn.Parameter, bool]) -> None:
    layer.enable_adapters(
        not disabled
    )  # PEFT's re-enable also makes the active adapter trainable: undone below
    for parameter, flag in flags.items():
        parameter.requires_grad_(flag)
