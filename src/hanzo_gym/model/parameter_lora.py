"""Axolotl's `lora_target_parameters`: LoRA on bare parameters rather than linear layers, for the stacked 3-D
expert weights of an MoE layer (`experts.gate_up_proj`, `experts.down_proj`), through PEFT's `target_parameters`
(its ParamWrapper: one low-rank pair per expert, W_e + scale · B_e · A_e added as a parametrization while the
layer runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.nn.utils import parametrize

from hanzo_gym.errors import ModelError


def _parameter_owners(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    """Every parameter's path as the user writes it, with its module and name: a quantized (parametrized)
    expert tensor under its own name, not as `parametrizations.<name>.original`."""
    owners = {}
    for module_path, module in model.named_modules():
        if ".parametrizations." in f".{module_path}.":
            continue  # the stores behind parametrized tensors
        names = [name for name, _ in module.named_parameters(recurse=False)]
        if parametrize.is_parametrized(module):
            names += list(module.parametrizations.keys())
        for name in names:
            owners[f"{module_path}.{name}" if module_path else name] = (module, name)
    return owners


def _shape(owner: tuple[torch.nn.Module, str]) -> torch.Size:
    module, name = owner
    return getattr(module, name).shape  # a quantized tensor is dequantized to tell its shape


def resolve_target_parameters(model: torch.nn.Module, entries: list[str], base_model_name: str) -> list[str]:
    """The full path of every parameter an entry names (PEFT's rule: the path is the entry or ends in
    `.entry`), sorted. PEFT matches a quantized expert tensor (one our loader or bitsandbytes parametrized)
    only by its full path, so the full paths are what it is given and what adapter_config.json records."""
    owners = _parameter_owners(model)
    found, unmatched = set(), []
    for entry in entries:
        hits = [path for path in owners if path == entry or path.endswith(f".{entry}")]
        if not hits:
            unmatched.append(entry)
        found.update(hits)
    if unmatched:
        stacked = sorted({".".join(path.split(".")[-2:]) for path in owners if "expert" in path.lower()})
        have = f"its expert parameters are {', '.join(stacked)}" if stacked else "it has no expert parameters"
        raise ModelError(
            f"lora_target_parameters: {', '.join(f'`{e}`' for e in unmatched)} names no parameter of "
            f"{base_model_name} ({have})"
        )
    for path in sorted(found):
        if len(_shape(owners[path])) not in (2, 3):
            raise ModelError(
                f"lora_target_parameters: {path} is a {len(_shape(owners[path]))}-D parameter; LoRA adapts 2-D "
                "weights and 3-D expert stacks only"
            )
    return sorted(found)


def smallest_side(model: torch.nn.Module, paths: list[str]) -> tuple[str, int] | None:
    """Of the parameters at `paths`, the one with the smallest side that one expert's A or B spans."""
    owners = _parameter_owners(model)
    sides = {path: min(_shape(owners[path])[-2:]) for path in paths if path in owners}
    if not sides:
        return None
    path = min(sides, key=sides.__getitem__)
    return path, sides[path]


def repair_parameter_wrappers(peft_model: torch.nn.Module) -> None:
    """Make each ParamWrapper add its ΔW once per forward over a tensor that is parametrized already (quantized
    experts), as it does over a plain one. PEFT 0.21.2 gets two things wrong there, each measured as a wrong
    forward in tests/test_expert_lora.py:
    - Two wrapped tensors of one module nest two wrappers, and the outer one opens parametrize's cache before
      the inner one adds its parametrization; the inner one reads its tensor first, so the cache keeps the
      value without ΔW, and the layer computes with that. The stale entry is dropped once the ΔW is on.
    - Its removal afterwards looks for its older proxy class only, so the single-adapter proxy it uses since
      its `baddbmm` fold stays behind and every forward stacks one more ΔW. It is removed by either class.
    """
    from peft.tuners.lora.layer import ParamWrapper, _LoraFactorsProxy, _LoraParameterProxy

    def remove(wrapper: ParamWrapper) -> None:
        owner = wrapper.get_base_layer()
        stack = owner.parametrizations[wrapper.parameter_name]
        if len(stack) == 1:
            parametrize.remove_parametrizations(owner, wrapper.parameter_name, leave_parametrized=False)
            return
        for index in reversed(range(len(stack))):
            if isinstance(stack[index], (_LoraFactorsProxy, _LoraParameterProxy)):
                del stack[index]
                return
        raise RuntimeError(f"no LoRA parametrization on {wrapper.parameter_name} to remove")

    def activating(wrapper: ParamWrapper) -> Callable:
        activate = wrapper._activate_lora

        @contextlib.contextmanager
        def with_fresh_value(active_adapters: list[str]) -> Iterator[None]:
            with activate(active_adapters):
                parametrize._cache.pop((id(wrapper.get_base_layer()), wrapper.parameter_name), None)
                yield

        return with_fresh_value

    for module in peft_model.modules():
        if isinstance(module, ParamWrapper) and not getattr(module, "_gym_repaired", False):
            module._remove_parametrizations = remove.__get__(module)
            module._activate_lora = activating(module)
            module._gym_repaired = True
