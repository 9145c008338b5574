"""LoRA through peft: attach an adapter, save it as a plain PEFT directory, fold it into the base weights."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from hanzo_gym.errors import ModelError
from hanzo_gym.model.decoder import decoder_of
from hanzo_gym.model.loftq import loftq_bits, mark_loftq, round_base, without_loftq_start
from hanzo_gym.model.parameter_lora import (
    repair_parameter_wrappers,
    resolve_target_parameters,
    smallest_side,
)


def attach_lora(
    model: PreTrainedModel,
    *,
    r: int,
    alpha: float,
    dropout: float,
    target_modules: list[str] | str,
    base_model_name: str,
    rslora: bool = False,
    modules_to_save: list[str] | None = None,
    target_parameters: list[str] | None = None,
) -> PeftModel:
    """Wrap `model` with a fresh adapter; `target_modules="all-linear"` adapts every linear layer but the output.

    The adapter stays free of bias and DoRA. `rslora`: scale the LoRA path by alpha / sqrt(r) (rank-stabilised
    LoRA), recorded in adapter_config.json as PEFT does. `modules_to_save` (Axolotl's lora_modules_to_save,
    e.g. embed_tokens and lm_head) trains a full copy of each named module beside the adapter; on a model
    whose input and output embeddings are one matrix they stay one (PEFT's ensure_weight_tying), so a merged
    model keeps the architecture its config states. vLLM does not load such adapters. `target_parameters`
    (Axolotl's lora_target_parameters) adapts bare parameters, an MoE layer's 3-D expert stacks, with one
    low-rank pair per expert (model/parameter_lora.py).
    """
    if target_modules == "all-linear":
        target_modules = linear_module_names(model)
    _check_rank_fits(model, r, target_modules, base_model_name)
    if target_parameters:
        target_parameters = resolve_target_parameters(model, target_parameters, base_model_name)
        _check_rank_fits_parameters(model, r, target_parameters, base_model_name)
    if modules_to_save:
        _check_modules_exist(model, modules_to_save)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules or None,  # none: only target_parameters
        target_parameters=target_parameters or None,
        use_rslora=rslora,
        bias="none",
        task_type="CAUSAL_LM",
        modules_to_save=list(modules_to_save) if modules_to_save else None,
        ensure_weight_tying=bool(modules_to_save)
        and bool(getattr(model.config, "tie_word_embeddings", False)),
    )
    try:
        with warnings.catch_warnings():
            # peft 0.21 calls a transformers 5 method that was renamed; nothing for the user to change.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            # autocast_adapter_dtype: on a bf16 (or fp16) base the adapter is made fp32, and peft's LoRA layers
            # cast their input to it (the mixed recipe: frozen base in bf16, adapter and AdamW state in fp32).
            peft_model = get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as exc:
        raise ModelError(f"cannot attach LoRA to {model.config.model_type}: {exc}") from None
    repair_parameter_wrappers(peft_model)
    keep_adapter_fp32(peft_model)
    peft_model.peft_config["default"].base_model_name_or_path = base_model_name
    return peft_model


def load_trainable_lora(model: PreTrainedModel, directory: str | Path, base_model_name: str) -> PeftModel:
    """Axolotl's `lora_model_dir`: wrap `model` with the adapter saved in `directory`, trainable, as Axolotl
    does (PeftModel.from_pretrained(..., is_trainable=True)). The directory's adapter_config.json governs the
    adapter's shape (r, alpha, targets, dropout, rsLoRA, a LoftQ start), not the config's lora_* keys."""
    config = read_adapter_config(directory)  # a clear error for a directory that holds no LoRA adapter
    extras = [
        name
        for name, present in (
            ("use_dora", bool(config.use_dora)),
            (f"bias: {config.bias}", config.bias != "none"),
        )
        if present
    ]
    if extras:
        raise ModelError(
            f"lora_model_dir {directory}: the adapter has {', '.join(extras)}, which hanzo-gym does not train "
            "(vLLM refuses such adapters); start from a plain LoRA adapter"
        )
    try:
        peft_model = open_adapter(model, directory, trainable=True)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise ModelError(
            f"lora_model_dir {directory}: the adapter does not fit base_model `{base_model_name}` ({exc})"
        ) from None
    repair_parameter_wrappers(peft_model)
    keep_adapter_fp32(peft_model)
    peft_model.peft_config["default"].base_model_name_or_path = base_model_name
    return peft_model


def open_adapter(model: PreTrainedModel, directory: str | Path, trainable: bool) -> PeftModel:
    """PEFT's from_pretrained, but a LoftQ adapter's base is rounded here, as PEFT rounds it on a GPU (its own
    rounding needs CUDA): the adapter applies to the base it was trained on."""
    config = read_adapter_config(directory)
    bits = loftq_bits(config)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = PeftModel.from_pretrained(
            model,
            str(directory),
            is_trainable=trainable,
            autocast_adapter_dtype=True,
            config=without_loftq_start(config) if bits else None,
        )
    if bits:
        round_base(peft_model, bits)
        mark_loftq(peft_model.peft_config["default"], bits)
    return peft_model


def keep_adapter_fp32(model: torch.nn.Module) -> None:
    """Every trainable (adapter) parameter in fp32, whatever the base's dtype: a bf16 adapter would round each
    small update away (bf16 keeps 8 significant bits) and AdamW's moments, made like the parameters, with it.
    Over a bf16 base, trained copies of the embeddings and the output layer (modules_to_save) are hooked so
    that the layers get their own dtype from the input copy and the output copy gets its own from them."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad and parameter.is_floating_point() and parameter.dtype != torch.float32:
                parameter.data = parameter.data.float()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layer_dtype = next((p.dtype for p in decoder_of(base).parameters() if p.is_floating_point()), None)
    if layer_dtype in (None, torch.float32):
        return
    for wrapper in (base.get_input_embeddings(), base.get_output_embeddings()):
        for copy in getattr(wrapper, "modules_to_save", {}).values():
            if getattr(copy, "_gym_dtype_hooks", False):
                continue
            copy._gym_dtype_hooks = True
            if wrapper is base.get_input_embeddings():
                copy.register_forward_hook(lambda _module, _inputs, output: output.to(layer_dtype))
            else:  # the output copy takes the layers' hidden states in its own dtype
                copy.register_forward_pre_hook(
                    lambda module, inputs: tuple(x.to(module.weight.dtype) for x in inputs)
                )


def _check_modules_exist(model: torch.nn.Module, names: list[str]) -> None:
    paths = [path for path, _ in model.named_modules()]
    # PEFT's rule: a name matches a module whose path is it or ends in `.name`
    missing = sorted(n for n in set(names) if not any(p == n or p.endswith(f".{n}") for p in paths))
    if missing:
        raise ModelError(
            f"lora_modules_to_save {missing}: {model.config.model_type} has no module of that name (its "
            f"embeddings are `{_short(model.get_input_embeddings(), model)}`, its output layer "
            f"`{_short(model.get_output_embeddings(), model)}`)"
        )


def _short(module: torch.nn.Module | None, model: torch.nn.Module) -> str:
    return next((path.rsplit(".", 1)[-1] for path, m in model.named_modules() if m is module), "?")


def _check_rank_fits(
    model: torch.nn.Module, r: int, target_modules: list[str] | str, base_model_name: str
) -> None:
    """A rank above a layer's smaller side adds nothing but memory (A is r × in, B is out × r); a huge one
    would allocate gigabytes before anything fails, so refuse it while nothing is allocated."""
    smallest = None
    for path, module in model.named_modules():
        if not is_target(path, target_modules):
            continue
        if isinstance(module, torch.nn.Linear):  # bitsandbytes' 4-bit layers too: their weight is packed
            sides = (module.in_features, module.out_features)
        elif isinstance(module, Conv1D):
            sides = tuple(module.weight.shape)
        else:
            continue
        if smallest is None or min(sides) < min(smallest[1]):
            smallest = (path, sides)
    if smallest is not None and r > min(smallest[1]):
        path, (inputs, outputs) = smallest
        raise ModelError(
            f"lora_r (LoRA rank) {r} is larger than the layers it adapts in {base_model_name}: {path} is "
            f"{inputs} → {outputs}, so the rank can be at most {min(inputs, outputs)}; set lora_r to at most "
            f"{min(inputs, outputs)}"
        )


def _check_rank_fits_parameters(
    model: torch.nn.Module, r: int, paths: list[str], base_model_name: str
) -> None:
    smallest = smallest_side(model, paths)
    if smallest is not None and r > smallest[1]:
        raise ModelError(
            f"lora_r (LoRA rank) {r} is larger than the parameters lora_target_parameters adapts in "
            f"{base_model_name}: each expert of {smallest[0]} has a side of {smallest[1]}; set lora_r to at most "
            f"{smallest[1]}"
        )


def is_target(path: str, target_modules: list[str] | str) -> bool:
    """PEFT's rule: a string is a regular expression the whole module path matches; a list names modules by
    their last name or full path."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, path) is not None
    return path.rsplit(".", 1)[-1] in target_modules or path in target_modules


def linear_module_names(model: PreTrainedModel) -> list[str]:
    """Short names of every linear layer except the output projection (q_proj, …, down_proj on Llama/Qwen3).

    peft's own "all-linear" writes full module paths into adapter_config.json; short names are what users
    and serving stacks expect there.
    """
    return sorted(set(linear_layer_paths(model).values()))


def linear_layer_paths(model: torch.nn.Module) -> dict[str, str]:
    """Module path → short name of every linear layer but the output projection, read before any adapter
    wraps them."""
    output = model.get_output_embeddings()
    return {
        path: path.rsplit(".", 1)[-1]
        for path, module in model.named_modules()
        if isinstance(module, (torch.nn.Linear, Conv1D)) and module is not output
    }


ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def adapter_weights(model: PeftModel, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """A CPU copy of adapter `adapter_name`'s weights, keyed as in adapter_model.safetensors."""
    from peft.utils import get_peft_model_state_dict

    with warnings.catch_warnings():
        # peft looks for the base model's config.json to detect resized embeddings; a .gguf or hub-id base has
        # none at that path. hanzo-gym never resizes embeddings, so the warning says nothing.
        warnings.filterwarnings("ignore", message="Could not find a config file")
        state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


def write_adapter(directory: str | Path, config: LoraConfig, weights: dict[str, torch.Tensor]) -> None:
    """A plain PEFT adapter directory (what peft, transformers and vLLM load)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / ADAPTER_WEIGHTS))
    fields = config.to_dict()
    targets = fields["target_modules"] or []
    # a regular expression stays as written; a set of names is written sorted, so that the file is stable
    fields.update(
        peft_type="LORA",
        inference_mode=True,
        target_modules=targets if isinstance(targets, str) else sorted(targets),
        target_parameters=sorted(fields.get("target_parameters") or []) or None,
    )
    (directory / ADAPTER_CONFIG).write_text(json.dumps(fields, indent=2, default=str) + "\n")


def read_adapter_config(directory: str | Path) -> LoraConfig:
    """The LoraConfig of a PEFT LoRA adapter directory (its weights are not read)."""
    directory = Path(directory)
    config_file, weights_file = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights_file.is_file():
        raise ModelError(
            f"{directory} is not a PEFT adapter directory (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
        )
    try:
        fields = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ModelError(
            f"{config_file}: not a JSON adapter config ({exc}); the adapter is damaged"
        ) from None
    if not isinstance(fields, dict):
        raise ModelError(f"{config_file}: not a JSON object; the adapter is damaged")
    if fields.get("peft_type", "LORA") != "LORA":
        raise ModelError(f"{config_file}: peft_type {fields['peft_type']} is not LoRA")
    known = set(LoraConfig.__dataclass_fields__)
    try:
        return LoraConfig(**{k: v for k, v in fields.items() if k in known and k != "peft_type"})
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{config_file}: not a usable LoRA config ({exc}); the adapter is damaged") from None


def read_adapter(directory: str | Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """The config and weights of a PEFT LoRA adapter directory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_adapter_config(directory)
    weights_file = Path(directory) / ADAPTER_WEIGHTS
    try:
        return config, load_file(str(weights_file))
    except (SafetensorError, OSError) as exc:
        raise ModelError(
            f"{weights_file}: unreadable ({exc}); the adapter is damaged (a copy cut short?): use another "
            "checkpoint or copy it again"
        ) from None


def set_adapter_weights(
    model: PeftModel, weights: dict[str, torch.Tensor], adapter_name: str = "default", source: str = "weights"
) -> None:
    """Weights keyed as in adapter_model.safetensors into adapter `adapter_name`; keys it lacks are an error."""
    from peft.utils import set_peft_model_state_dict

    device = next(model.parameters()).device
    with torch.no_grad():
        moved = {key: value.to(device) for key, value in weights.items()}
        result = set_peft_model_state_dict(model, moved, adapter_name=adapter_name)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ModelError(
            f"{source}: do not match adapter `{adapter_name}` of this model (unexpected {unexpected[:3]})"
        )


def merged_model(model: PeftModel) -> PreTrainedModel:
    """The base model with the adapter folded in (W + alpha/r · B·A), as a plain transformers model."""
    with torch.no_grad():
        return model.merge_and_unload()
