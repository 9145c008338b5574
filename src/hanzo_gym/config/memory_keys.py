"""Axolotl's keys of activation memory: recomputing layers in the backward pass (`gradient_checkpointing`, with
torch's kind in `gradient_checkpointing_kwargs`) and keeping saved activations in host memory until the backward
pass needs them (`activation_offloading`; model/loader_keys.py and loops/train.py act on them), and collecting
freed memory every N steps (`gc_collect_steps`, and `gc_steps`, its older name: Python's garbage collector, then
the CUDA allocator's cache where there is one, as Axolotl's callback does; loops/tail.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PrivateAttr

from hanzo_gym.config.feature import Feature, StrictKeys


class CheckpointingKwargs(StrictKeys):
    """Axolotl's `gradient_checkpointing_kwargs`: which of torch's checkpointing kinds recomputes the layers."""

    use_reentrant: bool = False


class MemoryKeys(Feature):
    # `offload`: Axolotl's older spelling of true plus activation_offloading; `unsloth`: its name before that
    gradient_checkpointing: bool | Literal["offload", "unsloth"] = False
    gradient_checkpointing_kwargs: CheckpointingKwargs = CheckpointingKwargs()
    # saved activations in host memory until the backward pass; legacy / hidden_states are Axolotl's variants
    activation_offloading: bool | Literal["legacy", "hidden_states"] = False
    gc_collect_steps: int | None = Field(None, ge=1)
    gc_steps: int | None = Field(None, ge=1)  # Axolotl's older name of gc_collect_steps

    @property
    def collect_every(self) -> int | None:
        return self.gc_collect_steps or self.gc_steps

    _checkpointing_as_written: str | None = PrivateAttr(None)

    def check(self) -> None:
        if self.gradient_checkpointing == "unsloth":
            self._checkpointing_as_written = "unsloth"
            self.gradient_checkpointing = "offload"
        if self.gradient_checkpointing == "offload":  # Axolotl's normalization of its older spelling
            self.gradient_checkpointing, self.activation_offloading = True, True
        if self.activation_offloading and not self.gradient_checkpointing:
            raise ValueError(
                "activation_offloading needs `gradient_checkpointing: true`, as in Axolotl: set it, or remove "
                "activation_offloading"
            )

    def notes(self) -> list[str]:
        if self._checkpointing_as_written != "unsloth":
            return []
        return [
            (
                "gradient_checkpointing: unsloth is older Axolotl's name of `gradient_checkpointing: offload`: "
                "checkpointed layers, their saved activations kept in host memory"
            )
        ]
