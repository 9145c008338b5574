"""Axolotl's loader keys: `model_type` and `tokenizer_type` (the classes to load with: checked against what the
base model loads as), `attn_implementation` (the attention kernel, where this machine has it), `tf32` (CUDA's
TensorFloat-32 matmuls), `gradient_checkpointing_kwargs` and `resize_token_embeddings_to_32x`."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hanzo_gym.errors import ModelError

if TYPE_CHECKING:
    from hanzo_gym.config import Config

AUTO_CLASSES = {"model_type": "AutoModelForCausalLM", "tokenizer_type": "AutoTokenizer"}
DEFAULT_ATTENTION = "sdpa (eager where the model has no sdpa)"
FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def _same_class(wanted: str, loaded: type) -> bool:
    # transformers 5 has one tokenizer class per model, `…Fast` kept as an alias of it
    names = {klass.__name__.removesuffix("Fast") for klass in loaded.__mro__}
    if wanted.endswith("ForConditionalGeneration") and loaded.__name__.endswith("ForCausalLM"):
        # a multimodal class (Llama4ForConditionalGeneration) whose checkpoint AutoModelForCausalLM loads as the
        # same family's text model: the text-only training Axolotl's text examples do with it
        return wanted.removesuffix("ForConditionalGeneration") == loaded.__name__.removesuffix("ForCausalLM")
    return wanted.removesuffix("Fast") in names


def check_loader_class(key: str, wanted: str | None, loaded: object, base_model: str) -> None:
    """ModelError unless `wanted` (Axolotl's `model_type` / `tokenizer_type`) is the auto class or a class the
    loaded object is: a config written for another model fails here rather than training something else."""
    if wanted is None or wanted == AUTO_CLASSES[key]:
        return
    if not _same_class(wanted, type(loaded)):
        raise ModelError(
            f"{key}: {wanted}, but base_model `{base_model}` loads as {type(loaded).__name__}; remove {key} "
            f"(hanzo-gym loads with {AUTO_CLASSES[key]}) or point base_model at a {wanted} model"
        )


def attention_kernel(requested: str | None, device: torch.device) -> tuple[str | None, str | None]:
    """The `attn_implementation` to load with, and a line to print when it is not the one requested. A flash
    kernel, or one on the Hub (`kernels-community/vllm-flash-attn3`: FlashAttention built for the `kernels`
    package), needs its package and a CUDA device; where either is missing the model loads with transformers'
    default kernel: sdpa (the same attention, computed by torch), or eager for a model sdpa cannot run (gpt-oss's
    attention sinks)."""
    if requested == "flex_attention" and device.type != "cuda":
        note = f"torch's FlexAttention has no backward pass on {device.type}; using {DEFAULT_ATTENTION}"
        return None, f"attn_implementation: flex_attention: {note}"
    hub_kernel = (
        requested is not None and "/" in requested
    )  # run by the `kernels` package, fetched from the Hub
    if requested is None or not (hub_kernel or requested in FLASH_PACKAGES):
        return requested, None
    package = "kernels" if hub_kernel else FLASH_PACKAGES[requested]
    if device.type != "cuda":
        return (
            None,
            f"attn_implementation: {requested} runs on CUDA only; using {DEFAULT_ATTENTION} on {device.type}",
        )
    if importlib.util.find_spec(package) is None:
        return (
            None,
            f"attn_implementation: {requested} needs the `{package}` package, not installed; using {DEFAULT_ATTENTION}",
        )
    return requested, None


def compile_flex_attention_with(arguments: dict) -> None:
    """Axolotl's `flex_attn_compile_kwargs`: transformers compiles FlexAttention once per process, with
    torch.compile's defaults; from here on it compiles it with these arguments (Axolotl's patch of the same
    wrapper, which Axolotl applies under torch 2.6 only)."""
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as integration

    class CompiledWithArguments(integration.WrappedFlexAttention):
        _compiled: object = None

        def __init__(self, training: bool) -> None:
            if CompiledWithArguments._compiled is None:
                CompiledWithArguments._compiled = torch.compile(flex_attention, **arguments)

        def __call__(self) -> object:
            return CompiledWithArguments._compiled

    integration.WrappedFlexAttention = CompiledWithArguments


def skip_move_note(skip_move: bool | None) -> str | None:
    """Axolotl's `experimental_skip_move_to_device` leaves the loaded model off the GPU for FSDP to shard; without
    sharding, the model trains on the one device it is loaded onto, so there is no move to skip."""
    if not skip_move:
        return None
    return (
        "experimental_skip_move_to_device: no effect here; without FSDP the model trains on the one device it loads "
        "onto"
    )


def apply_tf32(tf32: bool | str | None, device: torch.device) -> str | None:
    """Set CUDA's TF32 switches as `tf32` says (`auto`: on where the GPU has TF32, compute capability 8.0+);
    return a line to print when the setting cannot apply (TF32 is an NVIDIA tensor-core format)."""
    if tf32 is None:
        return None
    if device.type != "cuda":
        # off is what every other device does anyway
        return None if tf32 is False else f"tf32: {tf32} has no effect on {device.type} (TF32 is NVIDIA's)"
    enabled = torch.cuda.get_device_capability(device)[0] >= 8 if tf32 == "auto" else bool(tf32)
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return None


def enable_checkpointing(model: torch.nn.Module, reentrant: bool) -> None:
    """Recompute each decoder layer in the backward pass. The reentrant kind (`use_reentrant: true`) gives no
    gradient unless the layers' input requires one, which a frozen base's embeddings do not: as transformers
    and PEFT do for it, the embedding output is made to require grad (the gradients are the same either way)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers' new name; the old one warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if reentrant:
        model.enable_input_require_grads()


def fit_embeddings(
    model: torch.nn.Module, tokenizer_length: int, cfg: Config, added: Sequence[str] = ()
) -> str | None:
    """Make the embedding matrix (and the output layer) hold the tokenizer's vocabulary, `tokens` included, as
    Axolotl does: grown only when it has fewer rows than the tokenizer's length (rounded up to a multiple of 32
    under `resize_token_embeddings_to_32x`), the new rows drawn by the model's own initialisation, or at the mean
    of the old with `mean_resizing_embeddings` (Axolotl passes it to transformers, whose default it overrides).
    A line to print when it grew. Added tokens (in new rows or in rows the model had spare) start untrained,
    so under an adapter the embeddings must train beside it (lora_modules_to_save); a grown matrix could not
    be carried to the published base otherwise either. That fails, naming the modules. `added`: the tokens
    the tokenizer's loading added (`tokens`, special tokens it lacked)."""
    rows = model.get_input_embeddings().num_embeddings
    wanted = math.ceil(tokenizer_length / 32) * 32 if cfg.resize_token_embeddings_to_32x else tokenizer_length
    grows = rows < wanted
    if cfg.adapter and (grows or cfg.tokens or added):
        missing = [m for m in _embedding_module_names(model) if m not in (cfg.lora_modules_to_save or [])]
        if missing:
            if cfg.tokens:
                why = f"tokens adds {len(cfg.tokens)} to the vocabulary"
            elif added:
                why = f"special_tokens adds {', '.join(added)} to the vocabulary (Axolotl adds a special token it lacks)"
            else:
                why = f"resize_token_embeddings_to_32x grows the {rows} embedding rows to {wanted}"
            raise ModelError(
                f"{why}, whose embeddings must train, and `adapter: {cfg.adapter}` trains only LoRA matrices: "
                f"add {', '.join(f'`{m}`' for m in missing)} to lora_modules_to_save (trained and saved whole "
                "beside the adapter), or fine-tune fully"
            )
    if not grows:
        return None  # Axolotl leaves a matrix that is large enough as it is
    model.resize_token_embeddings(wanted, mean_resizing=cfg.mean_resizing_embeddings)
    return f"embeddings: {rows} rows grown to {wanted} for the tokenizer's {tokenizer_length} tokens"


def _embedding_module_names(model: torch.nn.Module) -> list[str]:
    """The short names (`embed_tokens`, `lm_head`) of the model's input and output embedding modules."""
    order = {id(model.get_input_embeddings()): 0, id(model.get_output_embeddings()): 1}
    found = {order[id(m)]: name.rsplit(".", 1)[-1] for name, m in model.named_modules() if id(m) in order}
    return [found[i] for i in sorted(found)]
