"""What a resumable checkpoint holds: the adapter (a PEFT folder), the optimizer moments, the RNG state and
where training stood (step, epoch, next accumulation window), plus a fingerprint of the data plan so that a
resume with different data or batch settings fails instead of silently diverging."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hanzo_gym.config import Config
from hanzo_gym.distributed import gather_objects, is_main
from hanzo_gym.engine import Engine
from hanzo_gym.errors import GymError
from hanzo_gym.model.lora import load_adapter_weights, save_adapter
from hanzo_gym.rundir import TRAINER_STATE, RunDir

TRAINING_STATE = "training_state.pt"


@dataclass
class TrainerPosition:
    step: int  # optimizer steps taken
    epoch: int  # epoch of the next window
    window: int  # index of the next accumulation window in that epoch
    plan: dict  # fingerprint of the data plan and the adapter
    log_window: dict = field(
        default_factory=dict
    )  # the partly filled logging window, so rows match a straight run


def adapter_fingerprint(cfg: Config) -> dict:
    """What the saved adapter and optimizer state depend on: resuming with other values cannot work."""
    return {
        "base_model": cfg.base_model,
        "lora_r": cfg.lora_r,
        "lora_alpha": cfg.lora_alpha,
        "lora_targets": "all-linear" if cfg.lora_target_linear else sorted(cfg.lora_target_modules),
        # Only when set, so that checkpoints written before QLoRA existed still resume.
        **({"load_in_4bit": True} if cfg.load_in_4bit else {}),
    }


def write_checkpoint(directory: Path, engine: Engine, position: TrainerPosition) -> None:
    save_adapter(engine.model, directory)
    torch.save(
        {
            "optimizer": engine.optimizer.state_dict(),
            "cpu_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        },
        directory / TRAINING_STATE,
    )
    # Written last: its presence is what marks the folder as a complete checkpoint.
    (directory / TRAINER_STATE).write_text(json.dumps(asdict(position), indent=2) + "\n")


def read_checkpoint(directory: Path, engine: Engine, plan: dict) -> TrainerPosition:
    """Restore adapter, optimizer and RNG from `directory` into `engine`; return where training stood."""
    state_file = directory / TRAINER_STATE
    if not state_file.is_file():
        raise GymError(
            f"{directory} is not a complete checkpoint (no {TRAINER_STATE}); pick another or start fresh"
        )
    position = TrainerPosition(**json.loads(state_file.read_text()))
    changed = {k: (position.plan.get(k), v) for k, v in plan.items() if position.plan.get(k) != v}
    if changed:
        details = ", ".join(f"{k}: {old} → {new}" for k, (old, new) in changed.items())
        raise GymError(
            f"cannot resume from {directory}: these settings differ from the checkpoint's ({details}); "
            "resume with the checkpoint's settings, or start a new output_dir"
        )
    load_adapter_weights(engine.model, directory)
    saved = torch.load(directory / TRAINING_STATE, weights_only=False)
    engine.optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["cpu_rng"])
    if saved["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda_rng"])
    return position


def starting_position(engine: Engine, run: RunDir, plan: dict, resume_from: Path | None) -> TrainerPosition:
    """Where a loop starts: step 0, or the checkpoint's position with its state restored into `engine` and the
    run's records after that step forgotten."""
    if resume_from is None:
        return TrainerPosition(step=0, epoch=0, window=0, plan=plan)
    _check_every_rank_sees(resume_from)
    position = read_checkpoint(resume_from, engine, plan)
    run.forget_after(position.step)
    if is_main():
        print(f"resumed from {resume_from} at step {position.step}", flush=True)
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
