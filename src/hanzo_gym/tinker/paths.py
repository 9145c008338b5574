"""Checkpoint paths: `gym://<run>/weights/<name>` (state: adapter + optimizer) and
`gym://<run>/sampler_weights/<name>` (a PEFT adapter), resolved under the service's root folder. Plain
filesystem paths are accepted wherever a gym:// path is."""

from __future__ import annotations

import os
from pathlib import Path

from hanzo_gym.errors import GymError
from hanzo_gym.model.hub import cache_root

SCHEME = "gym://"
KINDS = ("weights", "sampler_weights")


def default_root() -> Path:
    """`$HANZO_GYM_RUNS`, else `runs/` in hanzo-gym's cache folder."""
    configured = os.environ.get("HANZO_GYM_RUNS", "").strip()
    return Path(configured).expanduser() if configured else cache_root() / "runs"


def checkpoint_path(run_id: str, kind: str, name: str) -> str:
    check_run_id(run_id)
    check_name(name)
    return f"{SCHEME}{run_id}/{kind}/{name}"


def _is_plain_name(part: str) -> bool:
    """One folder name that stays where it is put: not empty, no separator, not `.` or `..`."""
    return bool(part) and "/" not in part and "\\" not in part and part not in (".", "..")


def check_run_id(run_id: str) -> None:
    if not _is_plain_name(run_id):
        raise GymError(f"run id {run_id!r}: use a non-empty name without slashes, `.` or `..`")


def check_name(name: str) -> None:
    if not _is_plain_name(name):
        raise GymError(f"checkpoint name {name!r}: use a non-empty name without slashes")


def resolve(path: str, root: Path, kind: str | None = None) -> Path:
    """The local folder behind `path`. With `kind`, a gym:// path must be of that kind. A gym:// path names
    a folder two levels under `root` and never one outside it."""
    if not path.startswith(SCHEME):
        return Path(path).expanduser()
    parts = path[len(SCHEME) :].split("/")
    if len(parts) != 3 or not all(map(_is_plain_name, parts)) or parts[1] not in KINDS:
        raise GymError(
            f"{path}: a checkpoint path is gym://<run>/weights/<name> or gym://<run>/sampler_weights/<name>, "
            "where run and name are plain folder names (no slashes, `.` or `..`)"
        )
    if kind is not None and parts[1] != kind:
        raise GymError(f"{path}: expected a gym://<run>/{kind}/<name> path here")
    return root.joinpath(*parts)
