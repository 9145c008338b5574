"""Tinker's REST view of training runs and checkpoints (`RestClient`: training_runs, checkpoints,
weights_info), read from the checkpoint folders under the service's root, so it answers the same after a
restart. A run is what its checkpoints recorded (`gym_checkpoint.json`: base model, trained layers, the user's
metadata; the newest checkpoint speaks for the run). The cookbook reads a run's `user_metadata` to check that a
checkpoint is resumed with the renderer it was trained with."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hanzo_gym.errors import GymError
from hanzo_gym.files import atomic_write_text, process_alive, remove_entry
from hanzo_gym.model.lora import read_adapter_config
from hanzo_gym.serve.api_keys import LOCAL_USER
from hanzo_gym.tinker.paths import KINDS, check_name, check_run_id
from hanzo_gym.tinker.training_client import read_run_record

CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler"}  # folder kind → Tinker's type
OWNER = "local"  # what the REST view names as every run's model_owner
OWNER_FILE = ".owner"  # in a run's folder: the user (a digest of the API key) whose key made it


class NotFound(GymError):
    """A run or checkpoint the root does not hold (answered 404)."""


@dataclass
class _Checkpoint:
    run_id: str
    kind: str  # weights | sampler_weights
    name: str
    folder: Path
    record: dict[str, Any]
    modified: float

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"

    def as_json(self) -> dict[str, Any]:
        return {
            "checkpoint_id": f"{self.kind}/{self.name}",
            "checkpoint_type": CHECKPOINT_TYPES[self.kind],
            "time": _iso(self.modified),
            "tinker_path": self.tinker_path,
            "size_bytes": sum(f.stat().st_size for f in self.folder.iterdir() if f.is_file()),
            "public": False,
        }


class TrainingRuns:
    """The runs under `root`; `display_name(base_model)` is what clients call a recorded base model (the
    served name rather than its folder)."""

    def __init__(self, root: Path, display_name: Callable[[str], str]):
        self.root = root
        self.display_name = display_name
        removed = sweep_leftovers(root)
        if removed:
            print(
                f"{root}: removed {len(removed)} checkpoint(s) that a killed server left half-written or half-deleted "
                f"({', '.join(removed[:3])}{', …' if len(removed) > 3 else ''})",
                flush=True,
            )

    # -- who owns a run ------------------------------------------------------------------------------------
    def set_owner(self, run_id: str, user: str) -> None:
        """Record the user whose key made the run (a server without keys has one user, LOCAL_USER)."""
        check_run_id(run_id)
        (self.root / run_id).mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.root / run_id / OWNER_FILE, user)

    def owner(self, run_id: str) -> str:
        try:
            return (self.root / run_id / OWNER_FILE).read_text(encoding="utf-8").strip()
        except OSError:
            return LOCAL_USER  # made in-process, or before servers had keys

    def require_owner(self, run_id: str, user: str) -> None:
        """NotFound, as for a run that does not exist, unless `user` owns it: existence is private too."""
        check_run_id(run_id)
        if self.owner(run_id) != user:
            raise NotFound(f"no training run {run_id!r} here")

    # -- the REST view ---------------------------------------------------------------------------------------
    def run(self, run_id: str, user: str = LOCAL_USER) -> dict[str, Any]:
        return self._run_json(run_id, self._known_run(run_id, user))

    def _known_run(self, run_id: str, user: str) -> list[_Checkpoint]:
        self.require_owner(run_id, user)
        checkpoints = self._checkpoints(run_id)
        if not checkpoints:
            raise NotFound(f"no training run {run_id!r} here: it has saved no checkpoint")
        return checkpoints

    def runs(self, limit: int, offset: int, user: str = LOCAL_USER) -> dict[str, Any]:
        """Newest first, as the hosted service lists them; only `user`'s."""
        found = [(run_id, self._checkpoints(run_id)) for run_id in self._run_ids(user)]
        found = [(run_id, ckpts) for run_id, ckpts in found if ckpts]
        found.sort(key=lambda item: max(c.modified for c in item[1]), reverse=True)
        page = found[offset : offset + limit]
        return {
            "training_runs": [self._run_json(run_id, ckpts) for run_id, ckpts in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(found)},
        }

    def checkpoints(self, run_id: str, user: str = LOCAL_USER) -> dict[str, Any]:
        return {"checkpoints": [c.as_json() for c in self._known_run(run_id, user)]}

    def all_checkpoints(self, limit: int, offset: int, user: str = LOCAL_USER) -> dict[str, Any]:
        every = [c for run_id in self._run_ids(user) for c in self._checkpoints(run_id)]
        every.sort(key=lambda c: c.modified, reverse=True)
        return {
            "checkpoints": [c.as_json() for c in every[offset : offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(every)},
        }

    def weights_info(self, run_id: str, kind: str, name: str, user: str = LOCAL_USER) -> dict[str, Any]:
        self.require_owner(run_id, user)
        checkpoint = self._checkpoint(run_id, kind, name)
        config = read_adapter_config(checkpoint.folder)
        record = checkpoint.record
        return {
            "base_model": self.display_name(record.get("base_model") or config.base_model_name_or_path or ""),
            "is_lora": True,
            "lora_rank": int(config.r),
            "train_mlp": record.get("train_mlp"),
            "train_attn": record.get("train_attn"),
            "train_unembed": record.get("train_unembed"),
        }

    def delete(self, run_id: str, kind: str, name: str, user: str = LOCAL_USER) -> None:
        """Moved aside, then removed: a crash midway leaves no half checkpoint under its name."""
        self.require_owner(run_id, user)
        checkpoint = self._checkpoint(run_id, kind, name)
        trash = checkpoint.folder.with_name(f".deleting-{name}-{uuid.uuid4().hex[:8]}")
        checkpoint.folder.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)

    # -- reading the folders -------------------------------------------------------------------------------
    def _run_ids(self, user: str) -> list[str]:
        if not self.root.is_dir():
            return []
        found = (p.name for p in self.root.iterdir() if p.is_dir() and _plain_run_id(p.name))
        return sorted(run_id for run_id in found if self.owner(run_id) == user)

    def _checkpoints(self, run_id: str) -> list[_Checkpoint]:
        """The run's finished checkpoints, oldest first (a folder still being written is not one yet)."""
        check_run_id(run_id)
        found = []
        for kind in KINDS:
            folder = self.root / run_id / kind
            if not folder.is_dir():
                continue
            for checkpoint in folder.iterdir():
                if checkpoint.name.startswith(".") or not (checkpoint / "adapter_config.json").is_file():
                    continue
                record = read_run_record(checkpoint)
                modified = (checkpoint / "adapter_config.json").stat().st_mtime
                found.append(_Checkpoint(run_id, kind, checkpoint.name, checkpoint, record, modified))
        found.sort(key=lambda c: c.modified)
        return found

    def _checkpoint(self, run_id: str, kind: str, name: str) -> _Checkpoint:
        check_run_id(run_id)
        check_name(name)
        if kind not in KINDS:
            raise GymError(f"checkpoint kind {kind!r}: use one of {', '.join(KINDS)}")
        for checkpoint in self._checkpoints(run_id):
            if (checkpoint.kind, checkpoint.name) == (kind, name):
                return checkpoint
        raise NotFound(f"no checkpoint tinker://{run_id}/{kind}/{name} here")

    def _run_json(self, run_id: str, checkpoints: list[_Checkpoint]) -> dict[str, Any]:
        """A damaged newest checkpoint marks the run `corrupted` rather than failing the listing."""
        newest = checkpoints[-1]
        try:
            config = read_adapter_config(newest.folder)
        except GymError:
            config = None
        recorded = newest.record.get("base_model") or (config and config.base_model_name_or_path) or ""
        last = {kind: next((c for c in reversed(checkpoints) if c.kind == kind), None) for kind in KINDS}
        return {
            "training_run_id": run_id,
            "base_model": self.display_name(recorded),
            "model_owner": OWNER,
            "is_lora": True,
            "corrupted": config is None,
            "lora_rank": int(config.r) if config is not None else None,
            "last_request_time": _iso(newest.modified),
            "last_checkpoint": last["weights"] and last["weights"].as_json(),
            "last_sampler_checkpoint": last["sampler_weights"] and last["sampler_weights"].as_json(),
            "user_metadata": newest.record.get("user_metadata"),
        }


def _plain_run_id(name: str) -> bool:
    try:
        check_run_id(name)
    except GymError:
        return False
    return not name.startswith(".")


def sweep_leftovers(root: Path) -> list[str]:
    """What a killed server left under each run's checkpoint folders, removed: a checkpoint being written
    (`.NAME.tmp-PID`, `.NAME.old-PID` of a process that is gone) or being deleted (`.deleting-…`). Each is a
    whole checkpoint's size, and none is ever listed or loaded. Returns their paths under `root`."""
    removed = []
    for folder in _kind_folders(root):
        for entry in sorted(folder.glob(".*")):
            pid = entry.name.rsplit("-", 1)[-1]
            abandoned = entry.name.startswith(".deleting-") or (
                pid.isdigit()
                and (".tmp-" in entry.name or ".old-" in entry.name)
                and not process_alive(int(pid))
            )
            if abandoned:
                remove_entry(entry)
                removed.append(str(entry.relative_to(root)))
    return removed


def _kind_folders(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [run / kind for run in sorted(root.iterdir()) for kind in KINDS if (run / kind).is_dir()]


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat()
