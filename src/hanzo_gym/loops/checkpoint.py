"""What a resumable checkpoint holds: the engine's state (the adapter as a PEFT folder and the optimizer's
moments, in the format of `engine.state_files`, which the Tinker client reads too), the RNG state and
where training stood (step, epoch, next accumulation window), plus a fingerprint of the data plan so that a
resume with different data or batch settings fails instead of silently diverging."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hanzo_gym.config import Config
from hanzo_gym.engine import Engine
from hanzo_gym.engine.distributed import gather_objects, say
from hanzo_gym.engine.state_files import (
    LEGACY_TRAINER_FILE,
    load_engine_state,
    read_legacy,
    save_engine_state,
)
from hanzo_gym.errors import GymError
from hanzo_gym.loops.run_dir import TRAINER_STATE, RunDir

RNG_FILE = "rng_state.safetensors"  # torch's generator states, so dropout and sampling continue exactly


@dataclass
class TrainerPosition:
    step: int  # optimizer steps taken
    epoch: int  # epoch of the next window
    window: int  # index of the next accumulation window in that epoch
    plan: dict  # fingerprint of the data plan and the adapter
    log_window: dict = field(
        default_factory=dict
    )  # the partly filled logging window, so rows match a straight run
    best: dict = field(default_factory=dict)  # early stopping's count and the best checkpoint (loops/tail.py)


# Fingerprint keys written only when set, so that checkpoints from before they existed still resume; a
# checkpoint that has one must still be refused by a run without it.
_FLAGS_WHEN_SET = frozenset(
    {
        "load_in_4bit",
        "load_in_8bit",
        "peft_use_rslora",
        "full_fine_tuning",
        "quantize_moe_experts",
        "llama4_linearized_experts",
    }
)
_WRITTEN_WHEN_SET = _FLAGS_WHEN_SET | {
    "revision_of_model",
    "unfrozen_parameters",
    "bnb_config_kwargs",
    "tokens",
    "lora_target_parameters",
    "loftq_bits",
}


def adapter_fingerprint(cfg: Config) -> dict:
    """What the saved adapter and optimizer state depend on: resuming with other values cannot work."""
    return {
        "base_model": cfg.base_model,
        "lora_r": cfg.lora_r,
        "lora_alpha": cfg.lora_alpha,
        "lora_targets": cfg.lora_targets,
        # Only when set, so that checkpoints written before these keys existed still resume.
        **({"load_in_4bit": True} if cfg.load_in_4bit else {}),
        **({"load_in_8bit": True} if cfg.load_in_8bit else {}),
        **({"peft_use_rslora": True} if cfg.peft_use_rslora else {}),
        **({"full_fine_tuning": True} if cfg.full_fine_tuning else {}),
        **({"quantize_moe_experts": True} if cfg.quantize_moe_experts else {}),
        **({"llama4_linearized_experts": True} if cfg.llama4_linearized_experts else {}),
        **({"revision_of_model": cfg.revision_of_model} if cfg.revision_of_model else {}),
        **({"unfrozen_parameters": cfg.unfrozen_parameters} if cfg.unfrozen_parameters else {}),
        **({"bnb_config_kwargs": cfg.bnb_4bit_settings} if cfg.bnb_4bit_settings else {}),
        **({"tokens": cfg.tokens} if cfg.tokens else {}),
        **({"loraplus_lr_ratio": cfg.loraplus_lr_ratio} if cfg.loraplus_lr_ratio else {}),
        **({"loftq_bits": cfg.loftq_bits} if cfg.loftq_bits else {}),
        **(
            {"lora_target_parameters": sorted(cfg.lora_target_parameters)}
            if cfg.lora_target_parameters
            else {}
        ),
    }


def write_checkpoint(directory: Path, engine: Engine, position: TrainerPosition) -> None:
    save_engine_state(engine, directory)
    save_file(_rng_tensors(), str(directory / RNG_FILE))
    # Written last: its presence is what marks the folder as a complete checkpoint.
    (directory / TRAINER_STATE).write_text(json.dumps(asdict(position), indent=2) + "\n")


def read_checkpoint(directory: Path, engine: Engine, plan: dict) -> TrainerPosition:
    """Restore adapter, optimizer and RNG from `directory` into `engine`; return where training stood."""
    state_file = directory / TRAINER_STATE
    if not state_file.is_file():
        raise GymError(
            f"{directory} is not a complete checkpoint (no {TRAINER_STATE}); pick another or start fresh"
        )
    position = _read_position(state_file)
    compared = [*plan, *sorted((_WRITTEN_WHEN_SET & position.plan.keys()) - plan.keys())]

    def value(fingerprint: dict, key: str) -> object:
        return fingerprint.get(key, False if key in _FLAGS_WHEN_SET else None)

    changed = {k: (value(position.plan, k), value(plan, k)) for k in compared}
    changed = {k: (old, new) for k, (old, new) in changed.items() if old != new}
    if changed:
        details = ", ".join(f"{k}: {old} → {new}" for k, (old, new) in changed.items())
        raise GymError(
            f"cannot resume from {directory}: these settings differ from the checkpoint's ({details}); "
            "resume with the checkpoint's settings, or start a new output_dir"
        )
    load_engine_state(engine, directory)
    _restore_rng(directory)
    return position


def _read_position(state_file: Path) -> TrainerPosition:
    damaged = f"{state_file}: the checkpoint is damaged (a copy cut short?): resume from another checkpoint"
    try:
        fields = json.loads(state_file.read_text(encoding="utf-8"))
        position = TrainerPosition(**fields)
    except (UnicodeDecodeError, ValueError, TypeError) as exc:  # not JSON, or not the keys written
        raise GymError(f"{damaged} ({str(exc)[:120]})") from None
    wrong = [
        name
        for name, kind in (
            ("step", int),
            ("epoch", int),
            ("window", int),
            ("plan", dict),
            ("log_window", dict),
            ("best", dict),
        )
        if not isinstance(getattr(position, name), kind)
    ]
    if wrong:
        raise GymError(f"{damaged} ({', '.join(wrong)} of the wrong type)")
    return position


def _rng_tensors() -> dict[str, torch.Tensor]:
    tensors = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda.{i}": state for i, state in enumerate(torch.cuda.get_rng_state_all())})
    return tensors


def _restore_rng(directory: Path) -> None:
    rng_file, legacy_file = directory / RNG_FILE, directory / LEGACY_TRAINER_FILE
    if rng_file.is_file():
        try:
            tensors = load_file(str(rng_file))
            cuda = [tensors[f"cuda.{i}"] for i in range(len(tensors) - 1)]
            cpu = tensors["cpu"]
        except (SafetensorError, OSError, KeyError) as exc:
            raise GymError(
                f"{rng_file}: unreadable ({exc}); the checkpoint is damaged (a copy cut short?): resume from "
                "another checkpoint or start fresh"
            ) from None
    else:  # a checkpoint from before the shared format
        legacy = read_legacy(legacy_file)
        if not isinstance(legacy, dict) or not isinstance(legacy.get("cpu_rng"), torch.Tensor):
            raise GymError(f"{legacy_file}: holds no RNG state; the checkpoint is damaged")
        cpu, cuda = legacy["cpu_rng"], legacy.get("cuda_rng") or []
    try:
        torch.set_rng_state(cpu)
    except (RuntimeError, TypeError) as exc:
        raise GymError(
            f"{directory}: the saved RNG state does not load ({exc}); the checkpoint is damaged"
        ) from None
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def starting_position(engine: Engine, run: RunDir, plan: dict, resume_from: Path | None) -> TrainerPosition:
    """Where a loop starts: step 0, or the checkpoint's position with its state restored into `engine` and the
    run's records after that step forgotten."""
    if resume_from is None:
        return TrainerPosition(step=0, epoch=0, window=0, plan=plan)
    _check_every_rank_sees(resume_from)
    position = read_checkpoint(resume_from, engine, plan)
    run.forget_after(position.step)
    say(f"resumed from {resume_from} at step {position.step}")
    return position


def _check_every_rank_sees(directory: Path) -> None:
    """Under torchrun rank 0 picks the checkpoint and every rank reads it: fail on all ranks at once (rather
    than leave the others waiting for a rank that died) when some cannot see it, as on a node-local disk."""
    seen = gather_objects((directory / TRAINER_STATE).is_file())
    blind = [str(rank) for rank, ok in enumerate(seen) if not ok]
    if not blind:
        return
    if not seen[0]:
        raise GymError(
            f"{directory} is not a complete checkpoint (no {TRAINER_STATE}); pick another or start fresh"
        )
    raise GymError(
        f"cannot resume from {directory}: rank(s) {', '.join(blind)} cannot see it (no {TRAINER_STATE}). "
        "Rank 0 picks the checkpoint and every process reads it, so with several nodes output_dir must "
        "be on storage that every node mounts at the same path"
    )
