"""Axolotl's sharding keys: DeepSpeed ZeRO (`deepspeed`, a JSON config) and FSDP (`fsdp`, `fsdp_config`,
`fsdp_version`). They split the model, its gradients and its optimizer state over processes; on one process
there is nothing to split, and the updates are those of plain training. So a run on one device reads them and
says so; a run of several processes refuses them at its start (loops/train.py), as sharding over processes is
not supported yet."""

from __future__ import annotations

from typing import Any

from hanzo_gym.config.feature import Feature


class ShardingKeys(Feature):
    deepspeed: str | dict[str, Any] | None = None
    fsdp: list[str] | str | None = None
    fsdp_config: dict[str, Any] | None = None
    fsdp_version: int | None = None

    @property
    def sharding_keys(self) -> list[str]:
        """The sharding keys that ask for something (`fsdp: []` and `deepspeed:` ask for nothing)."""
        return [key for key in ("deepspeed", "fsdp", "fsdp_config", "fsdp_version") if getattr(self, key)]

    def notes(self) -> list[str]:
        keys = self.sharding_keys
        if not keys:
            return []
        return [
            (
                f"{', '.join(keys)}: one process holds the whole model, its gradients and its optimizer state, so "
                "the updates are those ZeRO / FSDP make on one device, in more memory than they would take; "
                "sharding over several processes is not supported yet"
            )
        ]


def sharding_refusal(cfg: ShardingKeys, processes: int) -> str | None:
    """The sentence a run of `processes` processes stops with, when it was asked to shard."""
    keys = cfg.sharding_keys
    if processes <= 1 or not keys:
        return None
    return (
        f"{', '.join(keys)}: sharding the model over {processes} processes is not supported yet; remove "
        f"{'it' if len(keys) == 1 else 'them'} to train data parallel (each process holding the whole model), or "
        "run one process"
    )
