"""Axolotl's `llama4_linearized_experts`: Llama 4's routed experts as one linear layer per expert and projection
(`experts.gate_projs.N`, `up_projs.N`, `down_projs.N`) instead of transformers' two stacked 3-D parameters, so that
a 4-bit base quantizes them like every other linear layer and LoRA can name them.

Two checkpoint layouts load: Axolotl's linearized one (its `axolotl-quants/Llama-4-…-Linearized-…` repos, whose
keys are those of the linear layers), its MoE layers built with these linear experts while the model loads;
and the stacked layout of Meta's checkpoints, split into the linear layers once the model is loaded (its experts
pass through memory in 16 bits once, then a 4- or 8-bit base quantizes them). `delinearized` turns the layers
back into transformers' stacked parameters, which `gym merge` writes, so the merged model loads anywhere.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from transformers.activations import ACT2FN

from hanzo_gym.errors import ModelError


class LinearizedLlama4Experts(nn.Module):
    """transformers' Llama4TextExperts with each expert's gate, up and down projection a linear layer; the same
    input (rows grouped by expert) and output, the same numbers in fp32 (tested)."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_local_experts
        self.hidden_size = config.hidden_size
        self.expert_dim = config.intermediate_size
        self.gate_projs = nn.ModuleList(self._linears(self.hidden_size, self.expert_dim))
        self.up_projs = nn.ModuleList(self._linears(self.hidden_size, self.expert_dim))
        self.down_projs = nn.ModuleList(self._linears(self.expert_dim, self.hidden_size))
        self.act_fn = ACT2FN[config.hidden_act]

    def _linears(self, inputs: int, outputs: int) -> list[nn.Linear]:
        return [nn.Linear(inputs, outputs, bias=False) for _ in range(self.num_experts)]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        grouped = hidden_states.view(self.num_experts, -1, self.hidden_size)
        outputs = [
            self.down_projs[i](self.up_projs[i](rows) * self.act_fn(self.gate_projs[i](rows)))
            for i, rows in enumerate(grouped)
        ]
        return torch.stack(outputs).view(-1, self.hidden_size)


def _stacked_experts_class() -> type:
    from transformers.models.llama4 import modeling_llama4

    return modeling_llama4.Llama4TextExperts


def is_linearized_checkpoint(model_dir: Path) -> bool:
    """Whether the checkpoint stores its experts as Axolotl's linear layers (keys `experts.gate_projs.N.…`)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = json.loads(index.read_text())["weight_map"]
    else:
        from safetensors import safe_open

        names = []
        for path in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                names += list(handle.keys())
    return any(".experts.gate_projs." in name for name in names)


@contextlib.contextmanager
def loading_linearized_experts() -> Iterator[None]:
    """While open, transformers builds Llama 4's MoE layers with linearized experts (Axolotl's patch), so a
    linearized checkpoint's keys find their layers, and quantized loading reaches them as linear layers."""
    from transformers.models.llama4 import modeling_llama4

    # The MoE layer's own constructor is wrapped rather than the expert class renamed (Axolotl's way), because
    # transformers' weight initialisation tests modules against that name and would reach for stacked weights.
    moe_init = modeling_llama4.Llama4TextMoe.__init__

    def linearized_moe_init(self, config):
        moe_init(self, config)
        self.experts = LinearizedLlama4Experts(config)

    modeling_llama4.Llama4TextMoe.__init__ = linearized_moe_init
    try:
        yield
    finally:
        modeling_llama4.Llama4TextMoe.__init__ = moe_init


@torch.no_grad()
def linearize_experts(model: nn.Module, quantize: dict | None = None) -> int:
    """Split every stacked Llama 4 expert module of a loaded model into linear layers; with `quantize`, each
    becomes a bitsandbytes layer as a 4- or 8-bit base's linear layers are (`{"bits": 4, "compute_dtype": …,
    "quant_type": …, "double_quant": …}` or `{"bits": 8, "threshold": …}`). Returns how many modules were split."""
    stacked_class = _stacked_experts_class()
    found = [(path, m) for path, m in model.named_modules() if isinstance(m, stacked_class)]
    for path, stacked in found:
        with torch.device("meta"):  # its layers are replaced below
            linear = LinearizedLlama4Experts(_text_config(model))
        width = stacked.expert_dim
        gate_up, down = stacked.gate_up_proj.detach(), stacked.down_proj.detach()
        for i in range(stacked.num_experts):
            # transformers multiplies x @ W (W: in × out); a linear layer holds W transposed (out × in)
            weights = (gate_up[i, :, :width].T, gate_up[i, :, width:].T, down[i].T)
            for layers, weight in zip((linear.gate_projs, linear.up_projs, linear.down_projs), weights):
                layers[i] = _frozen_linear(weight.contiguous(), quantize)
        linear.train(stacked.training)  # a bitsandbytes 8-bit layer computes differently in training mode
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, linear)
    return len(found)


def _text_config(model: nn.Module):
    config = model.config
    return getattr(config, "text_config", None) or config


def _frozen_linear(weight: torch.Tensor, quantize: dict | None) -> nn.Module:
    out_features, in_features = weight.shape
    if quantize is None:
        layer = nn.Linear(in_features, out_features, bias=False, device="meta")
        layer.weight = nn.Parameter(weight, requires_grad=False)
        return layer
    import bitsandbytes as bnb

    if quantize["bits"] == 4:  # as transformers' bitsandbytes loading builds a 4-bit layer
        layer = bnb.nn.Linear4bit(
            in_features,
            out_features,
            bias=False,
            compute_dtype=quantize["compute_dtype"],
            compress_statistics=quantize["double_quant"],
            quant_type=quantize["quant_type"],
            device="meta",
        )
        layer.weight = bnb.nn.Params4bit(
            weight,
            requires_grad=False,
            compress_statistics=quantize["double_quant"],
            quant_type=quantize["quant_type"],
        ).to(weight.device)
        layer.support_avx512bf16_for_cpu = (
            False  # the training path (model/hub.py's _keep_4bit_weights_trainable)
        )
        return layer
    layer = bnb.nn.Linear8bitLt(
        in_features,
        out_features,
        bias=False,
        has_fp16_weights=False,
        threshold=quantize["threshold"],  # LLM.int8()'s outlier columns, computed in 16 bits
        device="meta",
    )
    layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False).to(weight.device)
    return layer


@torch.no_grad()
def delinearized(model: nn.Module) -> int:
    """Every linearized expert module of a full-precision model back to transformers' stacked parameters (the
    layout every Llama 4 loader reads). Returns how many modules were joined."""
    stacked_class = _stacked_experts_class()
    found = [(path, m) for path, m in model.named_modules() if isinstance(m, LinearizedLlama4Experts)]
    for path, linear in found:
        if not all(isinstance(layer, nn.Linear) for layer in linear.gate_projs):
            raise ModelError(
                f"{path}: quantized expert layers cannot be written back as full-precision weights"
            )
        weight = linear.gate_projs[0].weight
        with torch.device("meta"):
            stacked = stacked_class(_text_config(model))
        gate_up = torch.stack(
            [torch.cat([g.weight.T, u.weight.T], dim=1) for g, u in zip(linear.gate_projs, linear.up_projs)]
        )
        down = torch.stack([d.weight.T for d in linear.down_projs])
        stacked.gate_up_proj = nn.Parameter(gate_up.to(weight.dtype), requires_grad=False)
        stacked.down_proj = nn.Parameter(down.to(weight.dtype), requires_grad=False)
        stacked.train(linear.training)
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, stacked)
    return len(found)
