"""`gym train`: config → tokenizer, data, model + adapter, engine → the SFT loop → the run directory."""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel, prepare_model_for_kbit_training
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hanzo_gym.config import Config
from hanzo_gym.config.feature import feature_notes
from hanzo_gym.config.preference_keys import PREFERENCE_METHODS
from hanzo_gym.config.sharding_keys import sharding_refusal
from hanzo_gym.data.bench import bench_questions, bench_rows
from hanzo_gym.data.dataset import excess_length_note, load_examples
from hanzo_gym.data.debug_print import describe_item
from hanzo_gym.data.preference import load_preferences, unteachable_notes
from hanzo_gym.data.prepared import load_prepared
from hanzo_gym.data.prompts import load_prompts
from hanzo_gym.engine import Engine
from hanzo_gym.engine.distributed import (
    broadcast_object,
    broadcast_parameters,
    init_from_env,
    is_main,
    say,
    world_size,
)
from hanzo_gym.engine.optimizers import build_optimizer_factory, with_loraplus
from hanzo_gym.engine.state_files import save_engine_state
from hanzo_gym.errors import GymError, ModelError
from hanzo_gym.files import held_exclusively, publish_directory
from hanzo_gym.loops.grpo import GrpoResult, train_grpo
from hanzo_gym.loops.hub_push import start_hub_push
from hanzo_gym.loops.preference import PreferenceResult, train_preference
from hanzo_gym.loops.run_dir import RunDir
from hanzo_gym.loops.sft import SftResult, train_sft
from hanzo_gym.loops.tail import check_finite_adapter
from hanzo_gym.loops.trackers import open_trackers
from hanzo_gym.model.embedding_noise import add_embedding_noise
from hanzo_gym.model.hub import (
    ModelSource,
    Precision,
    added_tokens_of,
    choose_precision,
    load_causal_lm,
    load_tokenizer,
    model_source,
    resolve_adapter,
)
from hanzo_gym.model.load_plan import LoadPlan
from hanzo_gym.model.loader_keys import (
    apply_tf32,
    check_loader_class,
    compile_flex_attention_with,
    enable_checkpointing,
    fit_embeddings,
)
from hanzo_gym.model.loftq import loftq_bits, start_loftq
from hanzo_gym.model.lora import attach_lora, linear_module_names, load_trainable_lora, read_adapter_config
from hanzo_gym.model.unfreeze import train_only_matching
from hanzo_gym.renderers.axolotl_templates import FAMILY_TEMPLATES, check_template_family


def build_engine(cfg: Config, plan: LoadPlan, tokenizer: PreTrainedTokenizerBase | None = None) -> Engine:
    """The engine `cfg` trains, its model loaded and prepared as `plan` (built from `cfg`) says."""
    say(*plan.notes, apply_tf32(cfg.tf32, plan.device))
    if plan.flex_attention_compile:
        compile_flex_attention_with(plan.flex_attention_compile)
    say(f"loading {plan.source.base_model} …")  # the longest silence of a start, on a loaded machine minutes
    started = time.perf_counter()
    model = load_base(plan)
    say(f"loaded the model in {time.perf_counter() - started:.1f} s")
    if plan.embeddings.may_grow:
        vocabulary = tokenizer if tokenizer is not None else load_run_tokenizer(cfg, plan.source)
        say(fit_embeddings(model, len(vocabulary), cfg, added_tokens_of(vocabulary)))
    if plan.activations.checkpointing:
        enable_checkpointing(model, plan.activations.reentrant)
    if plan.embeddings.noise_alpha is not None:
        add_embedding_noise(model, plan.embeddings.noise_alpha)
    optimizer_factory, fallback_note = build_optimizer_factory(cfg.optimizer, plan.device)
    say(fallback_note)
    if plan.adapter is None:
        if plan.unfrozen_parameters:
            train_only_matching(model, plan.unfrozen_parameters)
        else:
            model.requires_grad_(True)
    else:
        torch.manual_seed(cfg.seed)  # the adapter's initial A matrices
        model = with_adapter(model, cfg, plan)
        if cfg.loraplus_lr_ratio:
            optimizer_factory = with_loraplus(optimizer_factory, model, cfg.loraplus_lr_ratio)
    return Engine(
        model,
        tokenizer,
        optimizer_factory=optimizer_factory,
        activation_offloading=plan.activations.offloading,
        autocast_dtype=plan.autocast_dtype,
        loss_scaling=torch.float16 in (plan.base.dtype, plan.autocast_dtype),
    )


def load_base(plan: LoadPlan) -> PreTrainedModel:
    """The plan's base model, checked against Axolotl's model_type, prepared for training when quantized."""
    model = load_causal_lm(plan.base)
    check_loader_class("model_type", plan.model_class, model, plan.source.base_model)
    if plan.base.quantization.bits is not None:
        # peft's preparation for k-bit training: the frozen base's remaining layers (norms, embeddings, output)
        # in fp32, which keeps a bf16 QLoRA run stable. Checkpointing is set up apart, non-reentrant.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return model


def with_adapter(model: PreTrainedModel, cfg: Config, plan: LoadPlan) -> PeftModel:
    """`model` wrapped with the plan's LoRA adapter: a fresh one, or the saved one it continues."""
    adapter, base_model = plan.adapter, plan.source.base_model
    if adapter.starting_dir is not None:
        peft_model = continued_adapter(model, cfg, adapter.starting_dir)
    else:
        peft_model = attach_lora(
            model,
            r=adapter.r,
            alpha=adapter.alpha,
            dropout=adapter.dropout,
            target_modules=adapter.target_modules,
            base_model_name=base_model,
            rslora=adapter.rslora,
            modules_to_save=adapter.modules_to_save,
            target_parameters=adapter.target_parameters,
        )
        if adapter.loftq_bits:
            start_loftq(peft_model, adapter.loftq_bits)
    # adapter_config.json's `revision`: the base it was trained on, as PEFT records it
    if plan.source.revision:
        peft_model.peft_config["default"].revision = plan.source.revision
    return peft_model


def continued_adapter(model: PreTrainedModel, cfg: Config, name: str) -> PeftModel:
    """`lora_model_dir`: the saved adapter, trainable, with a line for the config's lora_* keys it overrides."""
    directory = resolve_adapter(name)
    note = starting_adapter_note(cfg, directory, model)
    peft_model = load_trainable_lora(model, directory, cfg.base_model)
    if cfg.rl == "grpo" and peft_model.peft_config["default"].modules_to_save:
        raise ModelError(
            f"lora_model_dir {directory}: the adapter trains whole modules too (modules_to_save), and the "
            "GRPO sampler folds only LoRA deltas into its weights; continue it with SFT or DPO"
        )
    say(note)
    return peft_model


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
    """The checkpoint this run continues from: the one asked for, or, when resume_from_checkpoint is unset, the
    newest of an interrupted run of this same config in output_dir (a re-run keeps the work done)."""
    wanted = cfg.resume_from_checkpoint
    if wanted is None and cfg.auto_resume_from_checkpoints is not False:
        return interrupted_run_to_continue(cfg, run)
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


# Keys that say how to start, not what is trained: an interrupted run is this run whatever they were.
_HOW_TO_START = ("resume_from_checkpoint", "auto_resume_from_checkpoints")


def interrupted_run_to_continue(cfg: Config, run: RunDir) -> Path | None:
    """output_dir's newest checkpoint when it holds an interrupted run (checkpoints, no final output) whose
    run_config.json is this config; otherwise None, and a run with another config is left to start over."""
    latest = run.latest_checkpoint()
    previous = run.previous_config()
    if latest is None or previous is None or run.finished():
        return None
    current = cfg.model_dump(mode="json")
    differ = sorted(
        key
        for key in previous.keys() | current.keys()
        if key not in _HOW_TO_START and previous.get(key) != current.get(key)
    )
    if differ:
        print(
            f"{run.path} holds an interrupted run with another config ({', '.join(differ[:5])} differ"
            f"{', …' if len(differ) > 5 else ''}): this run starts over; its {latest.name} stays until this "
            "run has its first checkpoint (`resume_from_checkpoint: true` continues it instead)",
            flush=True,
        )
        return None
    print(
        f"{run.path} holds this config's interrupted run: continuing it from {latest.name} "
        "(`resume_from_checkpoint: false` starts over)",
        flush=True,
    )
    return latest


def load_run_tokenizer(cfg: Config, source: ModelSource | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer the config names (tokenizer_config, or base_model's at revision_of_model), with `tokens` added
    and special_tokens set; base_model is looked for again unless `source` is where it was found."""
    return load_tokenizer(
        cfg.base_model,
        cfg.tokenizer_config,
        cfg.special_token_roles,
        cfg.trust_remote_code,
        cfg.revision_of_model,
        cfg.tokens,
        cfg.uses_mistral_common,
        model_dir=source.directory if source is not None else None,
        extra_special_tokens=cfg.special_tokens.additional_special_tokens if cfg.special_tokens else None,
    )


def load_run_data(
    cfg: Config, tokenizer: PreTrainedTokenizerBase, write: bool = True, source: ModelSource | None = None
) -> tuple[Any, str]:
    """The run's tokenized data (SFT examples, preference pairs or GRPO prompts) and what its items are called;
    read from or saved to `dataset_prepared_path` when that is set (saved only where `write`). `source`: where
    base_model was found, if it was."""
    if cfg.chat_template in FAMILY_TEMPLATES:  # only then does the model's type matter
        source = source or model_source(cfg.base_model, cfg.trust_remote_code, cfg.revision_of_model)
        check_template_family(cfg.chat_template, source.model_type, cfg.base_model)
    if cfg.rl == "grpo":
        load, what = load_prompts, "prompts"
    elif cfg.rl in PREFERENCE_METHODS:
        load, what = load_preferences, ("pairs" if cfg.rl != "kto" else "examples")
    else:
        load, what = load_examples, "examples"
    data, note = load_prepared(cfg, tokenizer, load, write=write)
    say(note)
    if data.duplicates:
        say(f"dataset_exact_deduplication: left out {data.duplicates} duplicate {what}")
    if cfg.rl in PREFERENCE_METHODS:
        say(*unteachable_notes(data.train, cfg.rl))
    if cfg.rl == "grpo" and data.dropped:
        say(f"dropped {data.dropped} prompts longer than sequence_len {cfg.sequence_len}")
    if cfg.debug and data.train:
        say(f"debug: the first training {what[:-1]}:\n{describe_item(data.train[0], tokenizer)}")
    return data, what


def run_precision(cfg: Config) -> Precision:
    """What the run computes in, on which device, and why; full fine-tuning's mixed recipe said too."""
    precision = choose_precision(cfg.bf16, cfg.fp16)
    if cfg.full_fine_tuning and precision.dtype != torch.float32:
        reason = (
            f"{precision.reason}; full fine-tuning: fp32 weights and AdamW state, {precision.name} matmuls "
            "(autocast)"
        )
        return Precision(precision.device, precision.dtype, reason)
    return precision


def training_data(cfg: Config, tokenizer: PreTrainedTokenizerBase, source: ModelSource) -> tuple[Any, str]:
    """load_run_data's items, written by the main process only; GymError where none are left to train on."""
    data, what = load_run_data(cfg, tokenizer, write=is_main(), source=source)
    if cfg.rl != "grpo":
        say(excess_length_note(cfg, data.stats, what))  # over-long items dropped or truncated, how many
    if not data.train:
        if data.val:
            raise GymError(
                f"val_set_size {cfg.val_set_size} holds out all {len(data.val)} {what}: none are left to train on"
            )
        raise GymError(f"no training {what} left after tokenization: see `gym preprocess` for the counts")
    return data, what


def run_training(cfg: Config, adapter_dir: Path | None = None) -> SftResult | GrpoResult | PreferenceResult:
    """Train and write the run directory (rank 0 only under torchrun). The final adapter goes to the run
    directory's top level, or into `adapter_dir` (a folder of its own) when given. output_dir is this run's
    alone while it runs: a second `gym train` on it fails at once."""
    init_from_env(cfg.ddp_timeout)
    with held_exclusively(Path(cfg.output_dir), "gym train") if is_main() else nullcontext():
        return _train(cfg, adapter_dir)


def _train(cfg: Config, adapter_dir: Path | None) -> SftResult | GrpoResult | PreferenceResult:
    refused = sharding_refusal(cfg, world_size())
    if refused:
        raise GymError(refused)
    precision = run_precision(cfg)
    device, dtype = precision.device, precision.dtype
    say(precision.describe())  # the run's first line: what it computes in, and why
    say(*feature_notes(cfg))  # older spellings as they were read, keys that change nothing here
    plan = LoadPlan.from_config(cfg, device, dtype)  # base_model found and its config.json read, once
    tokenizer = load_run_tokenizer(cfg, plan.source)
    check_loader_class(
        "tokenizer_type", cfg.tokenizer_type, tokenizer, cfg.tokenizer_config or cfg.base_model
    )
    data, what = training_data(cfg, tokenizer, plan.source)
    # read before the model loads, so that a wrong bench_dataset costs no wait
    bench = bench_questions(bench_rows(cfg.bench_source), tokenizer) if cfg.do_bench_eval else None
    engine = build_engine(cfg, plan, tokenizer)
    broadcast_parameters(engine.trainable)  # every process starts from rank 0's adapter
    run = RunDir(cfg.output_dir, full_model=cfg.full_fine_tuning)
    processes = f", {world_size()} processes" if world_size() > 1 else ""
    say(
        f"train {len(data.train)} {what}, val {len(data.val)}, trainable parameters "
        f"{engine.trainable_parameter_count:,}, device {device.type}, "
        f"dtype {str(dtype).removeprefix('torch.')}{processes}"
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
        hub = start_hub_push(cfg, run.path, tokenizer, run.trackers)  # hub_model_id: a push at each save too
        extra = {"bench": bench} if bench else {}
        result = loop(engine, cfg, data.train, data.val, run, resume_from=resume_from, **extra)
        check_finite_adapter(engine, result.steps, cfg)
        if adapter_dir is not None:
            run.finish()
            if is_main():
                publish_directory(final, Path(adapter_dir))
        else:
            run.publish_final(final, size=engine.trainable_parameter_count * 4)
        run.trackers.final(final)  # wandb_log_model: the final adapter as an artifact
        run.trackers.finish()
    except BaseException as stopped:
        run.trackers.finish(failed=True)
        if run.discard():
            print(
                f"the new run stopped before its first checkpoint: {run.path} holds the previous run",
                flush=True,
            )
        latest = run.latest_checkpoint() if is_main() else None
        if isinstance(stopped, KeyboardInterrupt) and latest is not None:
            print(
                f"{latest} holds the run up to its step: run the same command to continue from there "
                "(`resume_from_checkpoint: false` in the config starts over instead)",
                flush=True,
            )
        raise
    say(f"wrote {'model' if cfg.full_fine_tuning else 'adapter'} to {adapter_dir or run.path}")
    if hub is not None:  # after everything is on disk: a failed push (HubPushError) loses nothing
        hub.push_end(Path(adapter_dir) if adapter_dir is not None else run.path)
    return result
