"""The one on-disk form of an engine's state, shared by `gym train` checkpoints and the Tinker client's
`save_state`: a plain PEFT adapter directory (adapter_config.json + adapter_model.safetensors) plus, for a
resumable state, `optimizer.safetensors` (AdamW's moments and step counts as tensors, its hyperparameters and
fp16's loss scale as JSON in the header).

Nothing here unpickles: safetensors and JSON hold only numbers and text, so a checkpoint handed over by
someone else cannot run code when it is loaded. States written before this format (`training_state.pt` by
`gym train`, `optimizer.pt` by the Tinker client) still load, through torch's tensors-only loader.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from hanzo_gym.engine.engine import Engine
from hanzo_gym.errors import GymError
from hanzo_gym.model.lora import read_adapter, write_adapter

OPTIMIZER_FILE = "optimizer.safetensors"
MODEL_WEIGHTS = "model.safetensors"  # full fine-tuning: the whole model in one file
SINGLE_FILE = "10000GB"  # save_pretrained's shard size that keeps any model in MODEL_WEIGHTS
OPTIMIZER_FORMAT = "hanzo-gym-adamw/1"
LEGACY_TRAINER_FILE = "training_state.pt"  # gym train before the shared format: {"optimizer": …, rng states}
LEGACY_CLIENT_FILE = "optimizer.pt"  # the Tinker client before it: the optimizer's state dict alone


def save_engine_state(engine: Engine, directory: Path, with_optimizer: bool = True) -> None:
    """The adapter as a PEFT folder, or in full fine-tuning the whole model as transformers saves it (config.json,
    one model.safetensors: a checkpoint is a model folder from_pretrained loads); then the optimizer."""
    if engine.full_fine_tuning:
        engine.model.save_pretrained(str(directory), max_shard_size=SINGLE_FILE)
    else:
        write_adapter(directory, engine.adapter_config, engine.weights())
    if with_optimizer:
        tensors, header = optimizer_to_tensors(engine.optimizer_state())
        save_file(tensors, str(directory / OPTIMIZER_FILE), metadata=header)


def load_engine_state(engine: Engine, directory: Path, with_optimizer: bool = True) -> None:
    """Restore the adapter (and the optimizer, unless `with_optimizer` is False: then it starts fresh). Every
    file is read before the engine changes, so a missing optimizer state leaves the engine as it was."""
    weights = read_model_weights(directory) if engine.full_fine_tuning else read_adapter(directory)[1]
    optimizer = read_optimizer_state(directory) if with_optimizer else None
    engine.load_state_dict({"adapter": weights, "optimizer": optimizer})


def read_model_weights(directory: Path) -> dict[str, torch.Tensor]:
    """A full fine-tuning checkpoint's weights (the model.safetensors save_engine_state wrote)."""
    path = directory / MODEL_WEIGHTS
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise GymError(
            f"{path}: unreadable ({exc}); the checkpoint is damaged (a copy cut short?): resume from another "
            "checkpoint or start fresh"
        ) from None


def optimizer_to_tensors(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """torch's optimizer state dict → flat tensors `state.<param>.<key>` and a JSON header."""
    tensors = {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor):
                raise GymError(f"optimizer state {key!r} of parameter {index} is not a tensor")
            tensors[f"state.{index}.{key}"] = value.detach().to("cpu").contiguous()
    header = {"format": OPTIMIZER_FORMAT, "param_groups": json.dumps(state["param_groups"])}
    if "loss_scale" in state:  # fp16's GradScaler: its scale and growth count, numbers only
        header["loss_scale"] = json.dumps(state["loss_scale"])
    return tensors, header


def tensors_to_optimizer(tensors: dict[str, torch.Tensor], header: dict[str, str], source: Path) -> dict:
    if header.get("format") != OPTIMIZER_FORMAT:
        raise GymError(f"{source}: not a hanzo-gym optimizer state (format {header.get('format')!r})")
    groups = json.loads(header["param_groups"])
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = tensor
    restored = {"state": state, "param_groups": groups}
    if "loss_scale" in header:
        restored["loss_scale"] = json.loads(header["loss_scale"])
    return restored


def read_optimizer_state(directory: Path) -> dict:
    """The optimizer state dict saved in `directory`, in the current format or a legacy one."""
    path = directory / OPTIMIZER_FILE
    if path.is_file():
        try:
            with safe_open(str(path), framework="pt") as handle:
                header = handle.metadata() or {}
            return tensors_to_optimizer(load_file(str(path)), header, path)
        except (SafetensorError, OSError, ValueError, KeyError) as exc:
            raise _damaged(path, exc) from None
    legacy = directory / LEGACY_TRAINER_FILE
    if legacy.is_file():
        state = read_legacy(legacy)
        if not isinstance(state, dict) or not isinstance(state.get("optimizer"), dict):
            raise GymError(f"{legacy}: holds no optimizer state; the checkpoint is damaged")
        return state["optimizer"]
    legacy = directory / LEGACY_CLIENT_FILE
    if legacy.is_file():
        return read_legacy(legacy)
    raise GymError(
        f"{directory} holds no optimizer state (a sampler checkpoint or a final adapter?); save it with "
        "save_state, or load it as weights only"
    )


def read_legacy(path: Path) -> Any:
    """A `.pt` file of an older hanzo-gym, read with torch's tensors-only loader (no code runs)."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        refusal = next((line.strip() for line in str(exc).splitlines() if "Unsupported global" in line), None)
        if refusal is None:
            raise _damaged(path, exc) from None
        raise GymError(
            f"{path}: refused: it holds more than tensors and plain values, so loading it could run code "
            f"({refusal.removeprefix('WeightsUnpickler error: ')[:120]}). hanzo-gym never writes such a file; "
            "if you trust it, load it yourself and re-save the state with a current hanzo-gym"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a cut-off or garbled file trips torch's reader in many ways
        raise _damaged(path, exc) from None


def _damaged(path: Path, exc: Exception) -> GymError:
    detail = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return GymError(
        f"{path}: unreadable ({detail[:120]}); the checkpoint is damaged (a copy cut short?): resume from "
        "another checkpoint or start fresh"
    )
