"""Axolotl and HF Trainer keys that change nothing in what hanzo-gym computes: each is accepted, and the run's
first lines say, per key written, why it changes nothing here. A key that would change the numbers does not
belong here; it is implemented or refused."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from hanzo_gym.config.feature import Feature

# key → why it changes nothing here
WHY_INERT = {
    # older Axolotl's model-family flags, which it read to pick a family's patches
    **{
        flag: "older Axolotl's model-family flag: the family is read from base_model's config.json"
        for flag in (
            "is_falcon_derived_model",
            "is_llama_derived_model",
            "is_mistral_derived_model",
            "is_qwen_derived_model",
        )
    },
    "dataset_processes": "the datasets are tokenized in the training process",
    "dataset_keep_in_memory": "the tokenized datasets are held in memory while they train",
    "dataloader_num_workers": "the tokenized examples are batched in the training process, with no loader workers",
    "dataloader_pin_memory": "the tokenized examples are batched in the training process, with no loader workers",
    "dataloader_prefetch_factor": "the tokenized examples are batched in the training process, with no loader workers",
    "remove_unused_columns": "a dataset type reads only its own fields",
    "sample_packing_eff_est": "the packed rows are counted exactly before the run plans its steps",
    "flash_attn_fuse_qkv": "a speed patch of older Axolotl's FlashAttention; attention computes the same",
    "lora_on_cpu": "Axolotl's placement of the adapter while merging; training holds it beside the model",
    "lora_fan_in_fan_out": "PEFT sets it from each layer's kind (true for GPT-2's Conv1D, false for Linear)",
    "sdp_attention": "attention is torch's SDPA unless attn_implementation names another kernel",
    "save_only_model": "checkpoints keep the optimizer state too, so that a run resumes from them exactly",
    "optim_args": (
        "HF's Trainer hands optim_args only to the optimizers that read them (GaLore, APOLLO, AdEMAMix, RMSprop, …), "
        "never to AdamW, the optimizer here; set adam_epsilon, adam_beta1 or adam_beta2 instead"
    ),
    "device_map": "the model is loaded whole onto the training device",
    "max_memory": "the per-device memory cap of a device_map load; the model is loaded whole onto the training device",
    "ddp": "data parallelism follows the launcher (torchrun's WORLD_SIZE), as Axolotl sets ddp when it is unset",
    "auto_find_batch_size": (
        "micro_batch_size is trained as given; one that does not fit fails with out-of-memory rather than being "
        "halved"
    ),
}


class InertKeys(Feature):
    is_falcon_derived_model: bool | None = None
    is_llama_derived_model: bool | None = None
    is_mistral_derived_model: bool | None = None
    is_qwen_derived_model: bool | None = None
    dataset_processes: int | None = Field(None, ge=1)
    dataset_keep_in_memory: bool | None = None
    dataloader_num_workers: int | None = Field(None, ge=0)
    dataloader_pin_memory: bool | None = None
    dataloader_prefetch_factor: int | None = Field(None, ge=1)
    remove_unused_columns: bool | None = None
    sample_packing_eff_est: float | None = Field(None, gt=0, le=1)
    flash_attn_fuse_qkv: bool | None = None
    device_map: str | dict[str, Any] | None = None
    lora_on_cpu: bool | None = None
    lora_fan_in_fan_out: bool | None = None
    sdp_attention: bool | None = None
    save_only_model: bool | None = None
    auto_find_batch_size: bool | None = None
    optim_args: str | dict[str, Any] | None = None
    max_memory: dict[str | int, str | int] | None = None
    ddp: bool | None = None

    def notes(self) -> list[str]:
        by_reason: dict[str, list[str]] = {}
        for key, why in WHY_INERT.items():
            if getattr(self, key) not in (None, False, ""):
                by_reason.setdefault(why, []).append(key)
        return [f"{', '.join(keys)}: changes nothing here: {why}" for why, keys in by_reason.items()]
