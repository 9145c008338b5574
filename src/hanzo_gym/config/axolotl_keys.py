"""Axolotl keys hanzo-gym knows but does not implement yet, each with what it does in Axolotl, and the
"did you mean" rule for keys nobody knows.

A known key gets a sentence naming its feature ("Axolotl's `deepspeed` (DeepSpeed ZeRO sharding) is not
supported yet"), never a guess at another key: `peft_use_dora` is not a misspelling of `peft_use_rslora`. The
meanings come from Axolotl's schema and the keys its own examples use (reference/axolotl-keys-in-the-wild.md).
A key written empty, `false`, `[]` or `{}` asks for nothing Axolotl does by default, so it loads.
"""

from __future__ import annotations

from typing import Any

# key path ("key", "datasets[].key", "trl.key") → (what it does in Axolotl, what to do instead)
NOT_YET: dict[str, tuple[str, str]] = {
    "deepspeed": ("DeepSpeed ZeRO sharding", "multi-GPU data-parallel training runs under torchrun"),
    "fsdp": ("FSDP sharding of the model over GPUs", "multi-GPU data-parallel training runs under torchrun"),
    "fsdp_config": ("FSDP sharding settings", "multi-GPU data-parallel training runs under torchrun"),
    "fsdp_version": ("the FSDP version", "multi-GPU data-parallel training runs under torchrun"),
    "sdp_attention": ("the torch SDPA attention switch", "remove it; models load with sdpa already"),
    "xformers_attention": ("xFormers attention kernels", "remove it; models load with sdpa"),
    "tokens": ("adding tokens to the vocabulary", "remove it"),
    "peft_use_dora": ("DoRA (weight-decomposed LoRA)", "remove it; vLLM does not serve DoRA adapters"),
    "early_stopping_patience": ("stopping when the eval loss stops improving", "remove it"),
    "remove_unused_columns": (
        "dropping the dataset columns the trainer does not read",
        "remove it or set it false; a dataset type reads only its own fields",
    ),
    "dpo_use_liger_kernel": (
        "Liger's fused DPO loss kernel",
        "remove it; the loss is computed in chunks already",
    ),
    "pretraining_dataset": ("streaming pretraining data", "use a `completion` dataset"),
    "test_datasets": ("separate evaluation datasets", "use `val_set_size`"),
    "skip_prepare_dataset": ("skipping dataset preparation", "remove it"),
    "fp16": ("float16 mixed precision", "use `bf16` (or `bf16: false` for fp32)"),
    "hub_model_id": ("pushing the result to the Hugging Face Hub", "upload the run directory's adapter"),
    "auto_resume_from_checkpoints": (
        "resuming from the latest checkpoint",
        "use `resume_from_checkpoint: true`",
    ),
    "chat_template_jinja": ("a Jinja chat template in its own key", "give the Jinja text in `chat_template`"),
    "lr_scheduler_kwargs": ("extra arguments to the lr scheduler", "remove it"),
    "cosine_constant_lr_ratio": ("holding the lr constant at the end of cosine", "remove it"),
    "lr_quadratic_warmup": ("quadratic warmup", "remove it; warmup is linear"),
    "optim_args": ("extra arguments to the optimizer", "remove it"),
    "optim_target_modules": ("the modules an optimizer such as GaLore targets", "remove it"),
    "datasets[].ds_type": (
        "the file format of the dataset files",
        "remove it; the format is read from `path`",
    ),
    "datasets[].conversation": ("a FastChat conversation template", "use `type: chat_template`"),
    "datasets[].chat_template": ("a chat template for one dataset", "set the top-level `chat_template`"),
    "datasets[].shards": ("training on a shard of the dataset", "use `split` (e.g. train[:10%])"),
    "trl.vllm_enable_sleep_mode": (
        "freeing a colocated vLLM's memory while the trainer runs",
        "remove it; lower `trl.vllm_gpu_memory_utilization` instead",
    ),
    "trl.vllm_importance_sampling_correction": (
        "TRL's importance-ratio correction of the sampler-trainer mismatch",
        "remove it; `loss_fn: ppo` / `importance_sampling` weight by vLLM's sampled log-probabilities already",
    ),
    "trl.vllm_importance_sampling_mode": ("how TRL's mismatch correction clips or masks", "remove it"),
    "trl.vllm_importance_sampling_cap": ("the cap of TRL's mismatch correction", "remove it"),
    "trl.vllm_structured_outputs_regex": ("regex-constrained vLLM generation", "remove it"),
    "trl.vllm_guided_decoding_regex": ("regex-constrained vLLM generation", "remove it"),
    **{
        f"vllm.{key}": (what, "remove it")
        for key, what in (
            ("data_parallel_size", "several vLLM engine replicas"),
            ("enable_reasoning", "a reasoning parser on the vLLM server"),
            ("reasoning_parser", "a reasoning parser on the vLLM server"),
            ("serve_module", "Axolotl's own vLLM serve script"),
            ("worker_extension_cls", "a vLLM worker extension for NCCL weight sync"),
        )
    },
    "trl.use_data_producer": ("asynchronous rollout production", "remove it"),
    **{
        key: (what, "remove it")
        for key, what in (
            ("tokenizer_use_mistral_common", "Mistral's own tokenizer library"),
            ("experimental_skip_move_to_device", "leaving the model where it loaded"),
            ("debug", "Axolotl's debug output"),
            ("processor_type", "a multimodal processor class"),
            ("lora_target_parameters", "LoRA on bare parameters (MoE experts)"),
            ("context_parallel_size", "context parallelism over GPUs"),
            ("use_onebitllms", "1-bit (BitNet) layers"),
            ("trackio_project_name", "Trackio experiment tracking"),
            ("trackio_run_name", "Trackio experiment tracking"),
            ("trackio_space_id", "Trackio experiment tracking"),
            ("tensor_parallel_size", "tensor parallelism over GPUs"),
            ("dp_shard_size", "sharded data parallelism (FSDP)"),
            ("dp_replicate_size", "replicated data parallelism groups"),
            ("shuffle_merged_datasets", "the switch for shuffling the merged datasets"),
            ("save_strategy", "HF's checkpoint strategy"),
            ("eval_strategy", "HF's evaluation strategy"),
            ("evaluation_strategy", "HF's evaluation strategy"),
            ("model_quantization_config", "a quantization config class for the base model"),
            ("model_quantization_config_kwargs", "the base model's quantization settings"),
            ("model_config", "overrides of the model's config"),
            ("local_rank", "the process's GPU index (set by the launcher)"),
            ("llama4_linearized_experts", "Llama 4's linearized expert layers"),
            ("flash_attn_cross_entropy", "FlashAttention's cross-entropy kernel"),
            ("flash_attn_rms_norm", "FlashAttention's RMSNorm kernel"),
            ("experts_implementation", "the MoE experts' kernel"),
            ("eval_table_size", "a table of sampled eval predictions"),
            ("eval_max_new_tokens", "generation length of eval predictions"),
            ("eval_batch_size", "the eval batch size"),
            ("eval_causal_lm_metrics", "generation metrics at eval"),
            ("do_causal_lm_eval", "generation metrics at eval"),
            ("accelerator_config", "Accelerate's settings"),
            ("use_otel_metrics", "OpenTelemetry metrics"),
            ("otel_metrics_host", "OpenTelemetry metrics"),
            ("otel_metrics_port", "OpenTelemetry metrics"),
            ("use_eaft", "entropy-adaptive fine-tuning (EAFT)"),
            ("eaft_alpha", "entropy-adaptive fine-tuning (EAFT)"),
            ("eaft_k", "entropy-adaptive fine-tuning (EAFT)"),
            ("cls_model_config", "the classifier head of a reward model"),
            ("peft", "PEFT initialisation options such as LoftQ"),
            ("torchdistx_path", "torchdistx's deferred initialisation"),
            ("tokenizer_use_fast", "choosing the slow or fast tokenizer"),
            ("tokenizer_legacy", "the tokenizer's legacy mode"),
            ("save_safetensors", "the checkpoint file format"),
            ("sample_packing_sequentially", "packing examples in file order"),
            ("curriculum_sampling", "training on the data in file order"),
            ("relora", "ReLoRA (periodic merges of LoRA into the base)"),
            ("relora_prune_ratio", "ReLoRA's optimizer pruning"),
            ("relora_cpu_offload", "ReLoRA's CPU offload"),
            ("jagged_restart_steps", "ReLoRA's jagged lr restarts"),
            ("jagged_restart_warmup_steps", "ReLoRA's jagged lr restarts"),
            ("jagged_restart_anneal_steps", "ReLoRA's jagged lr restarts"),
            ("push_dataset_to_hub", "uploading the prepared dataset"),
            ("hf_use_auth_token", "a hub token for private data"),
            ("lora_fan_in_fan_out", "LoRA on Conv1D-style (fan-in × fan-out) weights"),
            ("llmcompressor", "LLM Compressor's sparsity recipe"),
            ("lisa_n_layers", "LISA (training a few sampled layers)"),
            ("lisa_step_interval", "LISA (training a few sampled layers)"),
            ("lisa_layers_attribute", "LISA (training a few sampled layers)"),
            ("gptq", "a GPTQ-quantized base model"),
            ("gptq_disable_exllama", "GPTQ's exllama kernels"),
            ("gptq_groupsize", "a GPTQ-quantized base model"),
            ("gptq_model_v1", "a GPTQ-quantized base model"),
            ("float16", "loading the model in float16"),
            ("flex_attn_compile_kwargs", "torch.compile settings of flex attention"),
            ("flash_optimum", "BetterTransformer attention"),
            ("max_packed_sequence_len", "the old packing length (use `sequence_len`)"),
            ("datasets[].field_thinking", "a field holding each turn's reasoning"),
            ("datasets[].template_thinking_key", "the template's name for the reasoning field"),
            ("trl.log_completions", "logging sampled completions"),
            ("trl.num_completions_to_print", "printing sampled completions"),
            ("trl.multi_objective_aggregation", "how GDPO combines several rewards"),
            ("trl.generation_kwargs", "extra vLLM sampling parameters"),
            ("trl.chat_template_kwargs", "extra chat-template variables for prompts"),
        )
    },
}

# (key, value) → the sentence: a key we have, with an Axolotl value we do not implement yet.
VALUES_NOT_YET: dict[tuple[str, Any], str] = {
    ("adapter", "full"): "full fine-tuning is `adapter` left out (or empty), as in Axolotl",
    ("adapter", "none"): "full fine-tuning is `adapter` left out (or empty), as in Axolotl",
    ("gradient_checkpointing", "offload_disk"): (
        "Axolotl's `gradient_checkpointing: offload_disk` (activations kept on disk) is not supported yet; use "
        "`gradient_checkpointing: offload` (host memory)"
    ),
    ("activation_offloading", "disk"): (
        "Axolotl's `activation_offloading: disk` (activations kept on disk) is not supported yet; use "
        "`activation_offloading: true` (host memory)"
    ),
    ("attn_implementation", "flex_attention"): (
        "Axolotl's `attn_implementation: flex_attention` (torch's flex attention) is not supported yet; use sdpa"
    ),
    (
        "rl",
        "gdpo",
    ): "Axolotl's `rl: gdpo` (GRPO with per-reward normalization) is not supported yet; use grpo",
}

# HF `optim` and scheduler names Axolotl users may write that have another update rule or shape than ours.
OTHER_OPTIMIZERS = (
    "adafactor",
    "sgd",
    "adagrad",
    "rmsprop",
    "lion_8bit",
    "lion_32bit",
    "paged_lion_8bit",
    "paged_lion_32bit",
    "schedule_free_adamw",
    "ademamix",
    "muon",
    "came_pytorch",
    "adopt_adamw",
    "optimi_adamw",
)
OTHER_SCHEDULERS = (
    "cosine_with_restarts",
    "reduce_lr_on_plateau",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
    "one_cycle",
    "rex",
)


def asks_for_nothing(value: Any) -> bool:
    """`key:`, `false`, `[]` and `{}`: what Axolotl does when the key is absent."""
    return value is None or value is False or (isinstance(value, list | dict) and not value)


def known_path(loc: tuple[str | int, ...]) -> str:
    """`("datasets", 0, "name")` → `datasets[].name`: the form of NOT_YET's keys."""
    text = ""
    for part in loc:
        text += "[]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def edit_distance(a: str, b: str) -> int:
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def close_misspelling(name: str, candidates: list[str]) -> str | None:
    """The candidate `name` is a typo of: at most one edit away for short names, two for names of eight
    characters or more. Farther names are other words (`fp16` is not `bf16` misspelt, but one edit is
    all it takes, which is why known Axolotl keys are looked up before this)."""
    limit = 1 if len(name) < 8 else 2
    scored = sorted((edit_distance(name, c), c) for c in candidates if c != name)
    if scored and scored[0][0] <= limit:
        return scored[0][1]
    return None
