"""Axolotl's kernel keys and plugins that change how fast a step runs or how much memory it holds, never what
it computes: Cut Cross Entropy, Liger's fused kernels, Axolotl's LoRA kernels, its fused RMSNorm + RoPE
attention kernel, xFormers' fused SwiGLU MLP, Gemma 4's per-layer mix of attention kernels, the Hugging Face
kernels plugin (MoE grouped GEMMs) and torch.compile. hanzo-gym runs the model's own PyTorch modules and its
chunked loss instead, which compute the same function, so a config that asks for them trains as written; the
run's first lines say, once per group, what runs in their place (`kernel_notes`). This is the rule the
optimizers follow (a fused or 8-bit AdamW falls back to plain AdamW, the same update rule). A plugin or key
that changes the result (a loss of its own, token scaling) is refused by name. The attention kernel
(`attn_implementation`, or Axolotl's older `flash_attention` switch) is chosen here too.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from hanzo_gym.config.feature import Feature

ATTENTION_KERNELS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
HUB_KERNEL = r"[\w.-]+/[\w.-]+(@[\w.-]+)?(:\w+)?"  # transformers' `owner/repo[@revision][:function]`

CUT_CROSS_ENTROPY = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"
LIGER = "axolotl.integrations.liger.LigerPlugin"
KERNELS = "axolotl.integrations.kernels.KernelsPlugin"
SPEED_ONLY_PLUGINS = (CUT_CROSS_ENTROPY, LIGER, KERNELS)

# Axolotl plugins that change what training does: what each does, for the refusal.
OTHER_PLUGINS = {
    "axolotl.integrations.diffusion.DiffusionPlugin": "diffusion language-model training",
    "axolotl.integrations.expert_parallel.ExpertParallelPlugin": "expert parallelism over GPUs",
    "axolotl.integrations.llm_compressor.LLMCompressorPlugin": "sparse fine-tuning with LLM Compressor",
    "axolotl.integrations.swanlab.SwanLabPlugin": "SwanLab experiment tracking",
    "axolotl.integrations.kd.KDPlugin": "knowledge distillation from a teacher's logits",
    "axolotl.integrations.lm_eval.LMEvalPlugin": "lm-eval runs after training",
    "axolotl.integrations.spectrum.SpectrumPlugin": "Spectrum's choice of layers to unfreeze",
    "axolotl.integrations.grokfast.GrokfastPlugin": "Grokfast gradient filtering",
}

LIGER_KEYS = (
    "liger_rope",
    "liger_rms_norm",
    "liger_rms_norm_gated",
    "liger_layer_norm",
    "liger_glu_activation",
    "liger_cross_entropy",
    "liger_fused_linear_cross_entropy",
)
LORA_KERNEL_KEYS = ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel")
HF_KERNEL_KEYS = ("use_kernels", "use_scattermoe", "use_sonicmoe")
CUDA_EXPERTS_KERNELS = ("scattermoe", "sonicmoe")
# key → the plugin Axolotl reads it through (its other keys are the core schema's)
PLUGIN_OF_KEY = {
    **dict.fromkeys(LIGER_KEYS, LIGER),
    "cut_cross_entropy": CUT_CROSS_ENTROPY,
    "use_scattermoe": KERNELS,
    "use_sonicmoe": KERNELS,
}


TORCH_COMPILE_ARGUMENTS = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")


class KernelKeys(Feature):
    # a transformers kernel name, or a kernel on the Hub (`kernels-community/flash-attn3`, run through `kernels`)
    attn_implementation: str | None = None
    # Axolotl's older switch: true means attn_implementation flash_attention_2
    flash_attention: bool | None = None
    plugins: list[str] = Field(default_factory=list)
    cut_cross_entropy: bool | None = None
    liger_rope: bool | None = None
    liger_rms_norm: bool | None = None
    liger_rms_norm_gated: bool | None = None
    liger_layer_norm: bool | None = None
    liger_glu_activation: bool | None = None
    liger_cross_entropy: bool | None = None
    liger_fused_linear_cross_entropy: bool | None = None
    lora_mlp_kernel: bool | None = None
    lora_qkv_kernel: bool | None = None
    lora_o_kernel: bool | None = None
    use_kernels: bool | None = None
    use_scattermoe: bool | None = None
    use_sonicmoe: bool | None = None
    fused_attn_kernel: bool | None = None  # Axolotl's Triton RMSNorm + RoPE kernel (Qwen3 families)
    flash_attn_fuse_mlp: bool | None = None  # xFormers' fused SwiGLU in place of the MLP
    # older Axolotl's FlashAttention RMSNorm and cross-entropy kernels (Axolotl 0.19 refuses both as retired)
    flash_attn_rms_norm: bool | None = None
    flash_attn_cross_entropy: bool | None = None
    # FlashAttention on Gemma 4's sliding-window layers, sdpa on its global ones
    gemma4_hybrid_attn_impl: bool | None = None
    # how an MoE layer runs its experts: transformers' own loops (eager, batched_mm, grouped_mm) or a CUDA
    # kernel of the kernels plugin (scattermoe, sonicmoe), in whose place transformers' default runs
    experts_implementation: Literal["eager", "batched_mm", "grouped_mm", "scattermoe", "sonicmoe"] | None = (
        None
    )
    torch_compile: bool | Literal["auto"] | None = None
    torch_compile_backend: str | None = None
    torch_compile_mode: Literal["default", "reduce-overhead", "max-autotune"] | None = None
    # the arguments torch.compile compiles FlexAttention with (attn_implementation: flex_attention)
    flex_attn_compile_kwargs: dict[str, Any] | None = None

    @field_validator("attn_implementation")
    @classmethod
    def _known_attention(cls, value: str | None) -> str | None:
        if value is None or value in ATTENTION_KERNELS or re.fullmatch(HUB_KERNEL, value):
            return value
        raise ValueError(
            f"unknown attention kernel; use one of {', '.join(ATTENTION_KERNELS)} or a kernel on the Hub "
            "(`owner/repo`, e.g. kernels-community/flash-attn3)"
        )

    def check(self) -> None:
        """Axolotl's own refusals of these keys are kept, so that a config that loads here loads there."""
        if self.flash_attention:
            if self.attn_implementation not in (None, "flash_attention_2"):
                raise ValueError(
                    f"flash_attention: true means attn_implementation flash_attention_2, and the config also says "
                    f"attn_implementation: {self.attn_implementation}; give one of them"
                )
            self.attn_implementation = "flash_attention_2"  # Axolotl's own normalization of the old switch
        if self.flash_attn_fuse_mlp and self.adapter:
            raise ValueError(
                f"flash_attn_fuse_mlp fuses the MLP's linear layers into one, which a LoRA adapter cannot target "
                f"(Axolotl refuses it with `adapter: {self.adapter}` too): remove it"
            )
        for key in ("torch_compile_backend", "torch_compile_mode"):
            if getattr(self, key) and not self.torch_compile:
                raise ValueError(
                    f"{key} says how torch_compile compiles, and torch_compile is not set: set it or remove {key}"
                )
        if self.flex_attn_compile_kwargs:
            if self.attn_implementation != "flex_attention":
                raise ValueError(
                    "flex_attn_compile_kwargs says how FlexAttention is compiled, and attn_implementation is "
                    f"{self.attn_implementation}, not flex_attention: set it or remove flex_attn_compile_kwargs"
                )
            unknown = sorted(set(self.flex_attn_compile_kwargs) - set(TORCH_COMPILE_ARGUMENTS))
            if unknown:
                raise ValueError(
                    f"flex_attn_compile_kwargs: {', '.join(unknown)} are not arguments of torch.compile "
                    f"({', '.join(TORCH_COMPILE_ARGUMENTS)})"
                )
        if self.gemma4_hybrid_attn_impl and self.attn_implementation not in (None, "flash_attention_2"):
            raise ValueError(
                "gemma4_hybrid_attn_impl runs FlashAttention 2 on Gemma 4's sliding-window layers, so Axolotl "
                f"requires `attn_implementation: flash_attention_2` with it, not {self.attn_implementation}: change "
                "one of them"
            )
        for plugin in self.plugins:
            if plugin in OTHER_PLUGINS:
                raise ValueError(
                    f"plugins: Axolotl's plugin `{plugin}` ({OTHER_PLUGINS[plugin]}) is not supported yet; "
                    "remove it"
                )
            if plugin not in SPEED_ONLY_PLUGINS:
                raise ValueError(
                    f"plugins: `{plugin}` is not an Axolotl plugin hanzo-gym knows; the ones that load are "
                    f"{', '.join(SPEED_ONLY_PLUGINS)}"
                )
        for key, plugin in PLUGIN_OF_KEY.items():
            if getattr(self, key) and plugin not in self.plugins:
                raise ValueError(
                    f"`{key}` is an option of Axolotl's plugin {plugin}, which `plugins` does not list "
                    "(Axolotl would not read it): add the plugin or remove the key"
                )


def transformers_experts_implementation(cfg: KernelKeys) -> str | None:
    """What from_pretrained is given as experts_implementation: transformers' default for a CUDA kernel."""
    return None if cfg.experts_implementation in CUDA_EXPERTS_KERNELS else cfg.experts_implementation


def kernel_notes(cfg: KernelKeys) -> list[str]:
    """One line per kind of kernel the config asks for, saying what runs instead."""
    notes = []
    if CUT_CROSS_ENTROPY in cfg.plugins or cfg.liger_fused_linear_cross_entropy:
        notes.append(
            "Cut Cross Entropy / Liger's fused linear cross entropy: not needed; the loss is computed in chunks "
            "of positions already, so the full logits are never held in memory"
        )
    asked = [key for key in (*LIGER_KEYS, *LORA_KERNEL_KEYS, *HF_KERNEL_KEYS) if getattr(cfg, key)]
    asked = [key for key in asked if key != "liger_fused_linear_cross_entropy"]
    asked += [
        key
        for key in (
            "fused_attn_kernel",
            "flash_attn_fuse_mlp",
            "flash_attn_rms_norm",
            "flash_attn_cross_entropy",
        )
        if getattr(cfg, key)
    ]
    if asked:
        notes.append(
            f"{', '.join(asked)}: fused kernels are not applied; the model's own PyTorch modules run, which "
            "compute the same function (the kernels only save time and memory on CUDA)"
        )
    if cfg.experts_implementation in CUDA_EXPERTS_KERNELS:
        notes.append(
            f"experts_implementation: {cfg.experts_implementation} is a CUDA kernel; transformers' own experts "
            "loop runs in its place (grouped_mm where torch has it), which computes the same function"
        )
    if cfg.torch_compile:
        notes.append(
            "torch_compile: the model runs eagerly; compiling it would fuse the same computation into fewer "
            "kernels (faster, not different), and is not applied yet"
        )
    if cfg.gemma4_hybrid_attn_impl:
        notes.append(
            "gemma4_hybrid_attn_impl: every layer runs sdpa (kernels are not mixed per layer here), which computes "
            "the same attention as FlashAttention on the sliding-window layers, more slowly"
        )
    return notes
