"""What torchrun told this process, read from its environment alone (no torch), for the layers that only need
to know whether they speak for the job: rank 0 prints, the others keep quiet."""

from __future__ import annotations

import os

from hanzo_gym.errors import GymError


def launched_world_size(env: dict[str, str] | None = None) -> int:
    """WORLD_SIZE as torchrun (and Kubeflow's torch plugin, through torchrun) sets it; 1 when unset."""
    env = os.environ if env is None else env
    raw = env.get("WORLD_SIZE", "").strip() or "1"
    try:
        size = int(raw)
    except ValueError:
        raise GymError(f"WORLD_SIZE={raw}: not an integer; launch with torchrun, which sets it") from None
    if size < 1:
        raise GymError(f"WORLD_SIZE={raw}: must be >= 1")
    return size


def is_launched_main(env: dict[str, str] | None = None) -> bool:
    """Whether this process is rank 0 of its job (or runs alone): torchrun sets RANK before any process group
    exists."""
    env = os.environ if env is None else env
    return (env.get("RANK", "").strip() or "0") == "0"
