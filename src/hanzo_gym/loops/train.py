"""`gym train`: config → tokenizer, data, model + adapter, engine → the SFT loop → the run directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import prepare_model_for_kbit_training
from transformers import PreTrainedTokenizerBase

from hanzo_gym.config import Config
from hanzo_gym.config.kernel_keys import kernel_notes, transformers_experts_implementation
from hanzo_gym.config.model_quantization_keys import model_quantization
from hanzo_gym.config.preference_keys import PREFERENCE_METHODS
from hanzo_gym.data.dataset import excess_length_note, load_examples
from hanzo_gym.data.debug_print import describe_item
from hanzo_gym.data.preference import load_preferences
from hanzo_gym.data.prepared import load_prepared
from hanzo_gym.data.prompts import load_prompts
from hanzo_gym.engine import Engine
from hanzo_gym.engine.distributed import (
    broadcast_object,
    broadcast_parameters,
    init_from_env,
    is_main,
    world_size,
)
from hanzo_gym.engine.optimizers import build_optimizer_factory
from hanzo_gym.engine.state_files import save_engine_state
from hanzo_gym.errors import GymError, ModelError
from hanzo_gym.files import publish_directory
from hanzo_gym.loops.grpo import GrpoResult, train_grpo
from hanzo_gym.loops.preference import PreferenceResult, train_preference
from hanzo_gym.loops.run_dir import RunDir
from hanzo_gym.loops.sft import SftResult, train_sft
from hanzo_gym.loops.tail import check_finite_adapter
from hanzo_gym.loops.trackers import open_trackers
from hanzo_gym.model.hub import (
    Precision,
    base_model_type,
    choose_precision,
    load_causal_lm,
    load_tokenizer,
    resolve_adapter,
)
from hanzo_gym.model.loader_keys import (
    apply_tf32,
    attention_kernel,
    check_loader_class,
    compile_flex_attention_with,
    enable_checkpointing,
    fit_embeddings,
    skip_move_note,
)
from hanzo_gym.model.loftq import loftq_bits, start_loftq
from hanzo_gym.model.lora import attach_lora, linear_module_names, load_trainable_lora, read_adapter_config
from hanzo_gym.model.unfreeze import train_only_matching
from hanzo_gym.renderers.axolotl_templates import FAMILY_TEMPLATES, check_template_family


def build_engine(
    cfg: Config, device: torch.device, dtype: torch.dtype, tokenizer: PreTrainedTokenizerBase | None = None
) -> Engine:
    """The engine `cfg` trains, computing in `dtype`. A LoRA run's frozen base is loaded in `dtype`; a full
    fine-tuning run keeps its weights (the ones it trains) in fp32, so that small updates are not rounded away,
    and computes the forward and backward passes in `dtype` under autocast: mixed precision, where Axolotl
    would hold the weights and the optimizer state in bf16."""
    autocast = dtype if cfg.full_fine_tuning and dtype != torch.float32 else None
    dtype = torch.float32 if cfg.full_fine_tuning else dtype
    attention, attention_note = attention_kernel(cfg.attn_implementation, device)
    if cfg.gemma4_hybrid_attn_impl:
        # FlashAttention cannot run Gemma 4's global layers (head_dim 512) and one kernel serves all layers
        # here: sdpa, as kernel_notes says.
        attention, attention_note = "sdpa", None
    if attention == "flex_attention" and cfg.flex_attn_compile_kwargs:
        compile_flex_attention_with(cfg.flex_attn_compile_kwargs)
    notes = (
        attention_note,
        apply_tf32(cfg.tf32, device),
        skip_move_note(cfg.experimental_skip_move_to_device),
    )
    for note in (*notes, *kernel_notes(cfg)):
        if note and is_main():
            print(note, flush=True)
    model = load_causal_lm(
        cfg.base_model,
        dtype,
        load_in_4bit=cfg.load_in_4bit,
        load_in_8bit=cfg.load_in_8bit,
        device=device,
        attn_implementation=attention,
        trust_remote_code=cfg.trust_remote_code,
        revision=cfg.revision_of_model,
        quantize_moe_experts=cfg.quantize_moe_experts,
        bnb_4bit=cfg.bnb_4bit_settings,
        experts_implementation=transformers_experts_implementation(cfg),
        mxfp4=model_quantization(cfg),
        linearized_llama4_experts=cfg.llama4_linearized_experts,
    )
    check_loader_class("model_type", cfg.model_type, model, cfg.base_model)
    if cfg.load_in_4bit or cfg.load_in_8bit:
        # peft's preparation for k-bit training: the frozen base's remaining layers (norms, embeddings, output)
        # in fp32, which keeps a bf16 QLoRA run stable. Checkpointing is set up below, non-reentrant.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    offloading, checkpointing, offload_note = activation_memory_plan(cfg, device)
    if offload_note and is_main():
        print(offload_note, flush=True)
    if cfg.tokens or cfg.resize_token_embeddings_to_32x:
        tokenizer_length = len(tokenizer if tokenizer is not None else load_run_tokenizer(cfg))
        note = fit_embeddings(model, tokenizer_length, cfg)
        if note and is_main():
            print(note, flush=True)
    if checkpointing:
        enable_checkpointing(model, cfg.gradient_checkpointing_kwargs.use_reentrant)
    optimizer_factory, fallback_note = build_optimizer_factory(cfg.optimizer, device)
    if fallback_note and is_main():
        print(fallback_note, flush=True)
    if cfg.full_fine_tuning:
        if cfg.unfrozen_parameters:
            train_only_matching(model, cfg.unfrozen_parameters)
        else:
            model.requires_grad_(True)
        return Engine(
            model,
            tokenizer,
            optimizer_factory=optimizer_factory,
            activation_offloading=offloading,
            autocast_dtype=autocast,
        )
    torch.manual_seed(cfg.seed)  # the adapter's initial A matrices
    targets = cfg.lora_targets
    if cfg.lora_model_dir is not None:
        directory = resolve_adapter(cfg.lora_model_dir)
        note = starting_adapter_note(cfg, directory, model)
        peft_model = load_trainable_lora(model, directory, cfg.base_model)
        if cfg.rl == "grpo" and peft_model.peft_config["default"].modules_to_save:
            raise ModelError(
                f"lora_model_dir {directory}: the adapter trains whole modules too (modules_to_save), and the "
                "GRPO sampler folds only LoRA deltas into its weights; continue it with SFT or DPO"
            )
        if note and is_main():
            print(note, flush=True)
    else:
        peft_model = attach_lora(
            model,
            cfg.lora_r,
            cfg.lora_alpha,
            cfg.lora_dropout,
            targets,
            cfg.base_model,
            cfg.peft_use_rslora,
            cfg.lora_modules_to_save,
            cfg.lora_target_parameters,
        )
        if cfg.loftq_bits:
            start_loftq(peft_model, cfg.loftq_bits)
    # adapter_config.json's `revision`: the base it was trained on, as PEFT records it
    if cfg.revision_of_model:
        peft_model.peft_config["default"].revision = cfg.revision_of_model
    return Engine(
        peft_model, tokenizer, optimizer_factory=optimizer_factory, activation_offloading=offloading
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


def starting_adapter_note(cfg: Config, directory: Path, model: torch.nn.Module) -> str | None:
    """`lora_model_dir`: the adapter directory's own r, alpha, targets, dropout and rsLoRA govern, as in
    Axolotl (PEFT loads the saved adapter_config.json); a line naming each lora_* value of the config that
    differs from the directory's, so that no written key goes unused without a word."""
    saved = read_adapter_config(directory)
    targets = cfg.lora_targets
    if targets == "all-linear":
        targets = sorted(linear_module_names(model))
    saved_targets = saved.target_modules or []
    pairs = {
        "lora_r": (cfg.lora_r, saved.r),
        "lora_alpha": (cfg.lora_alpha, saved.lora_alpha),
        "lora_dropout": (cfg.lora_dropout, saved.lora_dropout),
        "peft_use_rslora": (cfg.peft_use_rslora, bool(saved.use_rslora)),
        "lora_target_modules": (
            targets,
            saved_targets if isinstance(saved_targets, str) else sorted(saved_targets),
        ),
        "peft.loftq_config.loftq_bits": (cfg.loftq_bits, loftq_bits(saved)),
    }
    written = cfg.model_fields_set | (
        {"lora_target_modules"} if "lora_target_linear" in cfg.model_fields_set else set()
    )
    if cfg.peft is not None:
        written |= {"peft.loftq_config.loftq_bits"}
    differ = [
        f"{key} {mine} (the adapter's: {theirs})"
        for key, (mine, theirs) in pairs.items()
        if key in written and mine != theirs
    ]
    if not differ:
        return None
    return (
        f"lora_model_dir {cfg.lora_model_dir}: training continues with the adapter's own settings, as in "
        f"Axolotl; the config's {', '.join(differ)} do not apply"
    )


def resume_point(cfg: Config, run: RunDir) -> Path | None:
    wanted = cfg.resume_from_checkpoint
    if wanted in (None, False):
        return None
    if wanted is True:
        latest = run.latest_checkpoint()
        if latest is None:
            print(
                f"resume_from_checkpoint: true, but {run.path} has no complete checkpoint yet: starting fresh"
            )
        return latest
    return Path(wanted)  # the config checked that it is a directory


def load_run_tokenizer(cfg: Config) -> PreTrainedTokenizerBase:
    """The tokenizer the config names (tokenizer_config, or base_model's at revision_of_model), with `tokens` added
    and special_tokens set."""
    return load_tokenizer(
        cfg.base_model,
        cfg.tokenizer_config,
        cfg.special_token_roles,
        cfg.trust_remote_code,
        cfg.revision_of_model,
        cfg.tokens,
        cfg.uses_mistral_common,
    )


def load_run_data(cfg: Config, tokenizer: PreTrainedTokenizerBase, write: bool = True) -> tuple[Any, str]:
    """The run's tokenized data (SFT examples, preference pairs or GRPO prompts) and what its items are called;
    read from or saved to `dataset_prepared_path` when that is set (saved only where `write`)."""
    if cfg.chat_template in FAMILY_TEMPLATES:  # only then does the model's type matter
        model_type = base_model_type(cfg.base_model, cfg.trust_remote_code, cfg.revision_of_model)
        check_template_family(cfg.chat_template, model_type, cfg.base_model)
    if cfg.rl == "grpo":
        load, what = load_prompts, "prompts"
    elif cfg.rl in PREFERENCE_METHODS:
        load, what = load_preferences, ("pairs" if cfg.rl != "kto" else "examples")
    else:
        load, what = load_examples, "examples"
    data, note = load_prepared(cfg, tokenizer, load, write=write)
    if note and is_main():
        print(note, flush=True)
    if data.duplicates and is_main():
        print(f"dataset_exact_deduplication: left out {data.duplicates} duplicate {what}", flush=True)
    if cfg.rl == "grpo" and data.dropped and is_main():
        print(f"dropped {data.dropped} prompts longer than sequence_len {cfg.sequence_len}", flush=True)
    if cfg.debug and data.train and is_main():
        print(
            f"debug: the first training {what[:-1]}:\n{describe_item(data.train[0], tokenizer)}", flush=True
        )
    return data, what


def run_training(cfg: Config, adapter_dir: Path | None = None) -> SftResult | GrpoResult | PreferenceResult:
    """Train and write the run directory (rank 0 only under torchrun). The final adapter goes to the run
    directory's top level, or into `adapter_dir` (a folder of its own) when given."""
    init_from_env()
    precision = choose_precision(cfg.bf16)
    device, dtype = precision.device, precision.dtype
    if cfg.full_fine_tuning and dtype != torch.float32:
        reason = (
            f"{precision.reason}; full fine-tuning: fp32 weights and AdamW state, bf16 matmuls (autocast)"
        )
        precision = Precision(device, dtype, reason)
    if is_main():
        print(precision.describe(), flush=True)  # the run's first line: what it computes in, and why
    tokenizer = load_run_tokenizer(cfg)
    check_loader_class(
        "tokenizer_type", cfg.tokenizer_type, tokenizer, cfg.tokenizer_config or cfg.base_model
    )
    data, what = load_run_data(cfg, tokenizer, write=is_main())
    if cfg.rl != "grpo":
        note = excess_length_note(cfg, data.stats, what)  # over-long items dropped or truncated, how many
        if note and is_main():
            print(note, flush=True)
    if not data.train:
        if data.val:
            raise GymError(
                f"val_set_size {cfg.val_set_size} holds out all {len(data.val)} {what}: none are left to train on"
            )
        raise GymError(f"no training {what} left after tokenization: see `gym preprocess` for the counts")
    engine = build_engine(cfg, device, dtype, tokenizer)
    broadcast_parameters(engine.trainable)  # every process starts from rank 0's adapter
    run = RunDir(cfg.output_dir, full_model=cfg.full_fine_tuning)
    if is_main():
        processes = f", {world_size()} processes" if world_size() > 1 else ""
        print(
            f"train {len(data.train)} {what}, val {len(data.val)}, trainable parameters "
            f"{engine.trainable_parameter_count:,}, device {device.type}, "
            f"dtype {str(dtype).removeprefix('torch.')}{processes}",
            flush=True,
        )
    resume_from = broadcast_object(resume_point(cfg, run) if is_main() else None)
    if resume_from is None:
        replaced = run.start_fresh()
        if replaced:
            print(
                f"starting a new run in {run.path}: the previous run's {', '.join(replaced)} stay until this "
                "run has its first checkpoint or its adapter",
                flush=True,
            )

    def final(directory: Path) -> None:  # the adapter, or in full fine-tuning the model
        save_engine_state(engine, directory, with_optimizer=False)
        tokenizer.save_pretrained(str(directory))

    torch.manual_seed(cfg.seed)
    loop = {"grpo": train_grpo, **dict.fromkeys(PREFERENCE_METHODS, train_preference)}.get(cfg.rl, train_sft)
    try:
        run.trackers = open_trackers(cfg, engine.model)  # W&B / TensorBoard / MLflow, main process only
        result = loop(engine, cfg, data.train, data.val, run, resume_from=resume_from)
        check_finite_adapter(engine, result.steps, cfg)
        if adapter_dir is not None:
            run.finish()
            if is_main():
                publish_directory(final, Path(adapter_dir))
        else:
            run.publish_final(final)
        run.trackers.final(final)  # wandb_log_model: the final adapter as an artifact
        run.trackers.finish()
    except BaseException:
        run.trackers.finish(failed=True)
        if run.discard():
            print(
                f"the new run stopped before its first checkpoint: {run.path} holds the previous run",
                flush=True,
            )
        raise
    if is_main():
        what = "model" if cfg.full_fine_tuning else "adapter"
        print(f"wrote {what} to {adapter_dir or run.path}", flush=True)
    return result
