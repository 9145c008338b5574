"""What a run loads and how, decided once from its config: the base model (found and its config.json read once),
its dtype, device and quantization, the kernels it runs with, and what trains on it. `gym train` builds one
`LoadPlan`; `gym merge` and the model host build its `BaseModelPlan` part (model/hub.py, which loads it) alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hanzo_gym.config.kernel_keys import kernel_notes, transformers_experts_implementation
from hanzo_gym.config.model_quantization_keys import model_quantization
from hanzo_gym.model.hub import BaseModelPlan, ModelSource, Quantization, checked_overrides
from hanzo_gym.model.loader_keys import attention_kernel, skip_move_note

if TYPE_CHECKING:
    from hanzo_gym.config import Config

# the base's part of the plan lives beside load_causal_lm, which takes it
__all__ = [
    "ActivationPlan",
    "AdapterPlan",
    "BaseModelPlan",
    "EmbeddingPlan",
    "LoadPlan",
    "Quantization",
    "activation_memory_plan",
]


@dataclass(frozen=True)
class AdapterPlan:
    """The LoRA adapter that trains: a fresh one of these settings, or the one saved in `starting_dir`
    (Axolotl's lora_model_dir, whose own settings then govern)."""

    r: int
    alpha: float
    dropout: float
    target_modules: list[str] | str
    rslora: bool = False
    modules_to_save: list[str] | None = None
    target_parameters: list[str] | None = None
    loftq_bits: int | None = None
    starting_dir: str | None = None


@dataclass(frozen=True)
class EmbeddingPlan:
    """The tokens the config may add to the vocabulary (Axolotl's `tokens`, special tokens the tokenizer may lack),
    `resize_token_embeddings_to_32x`, and NEFTune's noise on the input embeddings while training (`noise_alpha`,
    model/embedding_noise.py)."""

    new_tokens: tuple[str, ...] = ()
    resize_to_32x: bool = False
    noise_alpha: float | None = None

    @property
    def may_grow(self) -> bool:
        return bool(self.new_tokens) or self.resize_to_32x


@dataclass(frozen=True)
class ActivationPlan:
    """Whether saved activations go to host memory, whether decoder layers are recomputed in the backward
    pass, and with which checkpointing kind."""

    offloading: bool = False
    checkpointing: bool = False
    reentrant: bool = False


@dataclass(frozen=True)
class LoadPlan:
    """Everything `gym train` loads and prepares before the engine takes the model. `adapter` is None for full
    fine-tuning, whose fp32 weights compute under autocast in `autocast_dtype` (None: in fp32); only then do
    `unfrozen_parameters` apply. `notes` are the lines the plan has to say (a kernel not available here, a key
    that has no effect)."""

    base: BaseModelPlan
    adapter: AdapterPlan | None
    autocast_dtype: torch.dtype | None = None
    unfrozen_parameters: list[str] | None = None
    embeddings: EmbeddingPlan = EmbeddingPlan()
    activations: ActivationPlan = ActivationPlan()
    model_class: str | None = None
    flex_attention_compile: dict | None = None
    notes: tuple[str, ...] = ()

    @property
    def source(self) -> ModelSource:
        return self.base.source

    @property
    def device(self) -> torch.device:
        return self.base.device

    @classmethod
    def from_config(cls, cfg: Config, device: torch.device, dtype: torch.dtype) -> LoadPlan:
        """The plan of `cfg` computing in `dtype` on `device`. A LoRA run's frozen base loads in `dtype`; a
        full fine-tuning run keeps its weights (the ones it trains) in fp32, so that small updates are not
        rounded away, and computes in `dtype` under autocast: mixed precision, where Axolotl would hold the
        weights and the optimizer state in bf16."""
        attention, attention_note = planned_attention(cfg, device)
        offloading, checkpointing, offload_note = activation_memory_plan(cfg, device)
        base = BaseModelPlan.of(
            cfg.base_model,
            torch.float32 if cfg.full_fine_tuning else dtype,
            device,
            revision=cfg.revision_of_model,
            trust_remote_code=cfg.trust_remote_code,
            quantization=planned_quantization(cfg),
            attention=attention,
            experts_implementation=transformers_experts_implementation(cfg),
            linearized_llama4_experts=cfg.llama4_linearized_experts,
            config_overrides=cfg.model_config_overrides,
        )
        if base.config_overrides:
            checked_overrides(base.source, base.config_overrides)  # a wrong key fails before anything loads
        notes = (attention_note, skip_move_note(cfg.experimental_skip_move_to_device), *kernel_notes(cfg))
        return cls(
            base=base,
            adapter=None if cfg.full_fine_tuning else planned_adapter(cfg),
            autocast_dtype=dtype if cfg.full_fine_tuning and dtype != torch.float32 else None,
            unfrozen_parameters=cfg.unfrozen_parameters,
            embeddings=EmbeddingPlan(
                cfg.tokens_the_config_may_add, cfg.resize_token_embeddings_to_32x, cfg.embedding_noise_alpha
            ),
            activations=ActivationPlan(
                offloading, checkpointing, cfg.gradient_checkpointing_kwargs.use_reentrant
            ),
            model_class=cfg.model_type,
            flex_attention_compile=cfg.flex_attn_compile_kwargs if attention == "flex_attention" else None,
            notes=tuple(note for note in (*notes, offload_note) if note),
        )


def planned_attention(cfg: Config, device: torch.device) -> tuple[str | None, str | None]:
    """The attention kernel to load with, and a line when it is not the one asked for."""
    if cfg.gemma4_hybrid_attn_impl:
        # FlashAttention cannot run Gemma 4's global layers (head_dim 512) and one kernel serves all layers
        # here: sdpa, as kernel_notes says.
        return "sdpa", None
    return attention_kernel(cfg.attn_implementation, device)


def planned_quantization(cfg: Config) -> Quantization:
    bits = 4 if cfg.load_in_4bit else 8 if cfg.load_in_8bit else None
    return Quantization(bits, cfg.bnb_4bit_settings, cfg.quantize_moe_experts, model_quantization(cfg))


def planned_adapter(cfg: Config) -> AdapterPlan:
    return AdapterPlan(
        r=cfg.lora_r,
        alpha=cfg.lora_alpha,
        dropout=cfg.lora_dropout,
        target_modules=cfg.lora_targets,
        rslora=cfg.peft_use_rslora,
        modules_to_save=cfg.lora_modules_to_save,
        target_parameters=cfg.lora_target_parameters,
        loftq_bits=cfg.loftq_bits,
        starting_dir=cfg.lora_model_dir,
    )


def activation_memory_plan(cfg: Config, device: torch.device) -> tuple[bool, bool, str | None]:
    """Whether to offload activations to host memory, whether to checkpoint (recompute) layers, and a line to
    print. As in Axolotl, `activation_offloading: true` / `legacy` offloads every saved activation of an adapter
    run instead of recomputing (an adapter's activations are few enough to move), and offloads only the
    checkpointed layers' inputs of a full fine-tuning run or under `hidden_states`. On a CPU the activations
    are in host memory already, so nothing moves and checkpointing stays as set."""
    if not cfg.activation_offloading:
        return False, bool(cfg.gradient_checkpointing), None
    if device.type == "cpu":
        note = "activation_offloading: on cpu the activations are in host memory already; nothing to move"
        return False, True, note
    recompute = cfg.full_fine_tuning or cfg.activation_offloading == "hidden_states"
    return True, recompute, None
