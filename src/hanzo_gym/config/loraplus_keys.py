"""Axolotl's LoRA+ (`loraplus_lr_ratio`, `loraplus_lr_embedding`): the LoRA B matrices learn `loraplus_lr_ratio`
times faster than the A matrices, as PEFT's `create_loraplus_optimizer` groups them (its B group also takes every
1-D trainable parameter) and Axolotl calls it: with no weight decay in any group (PEFT's `loraplus_weight_decay`,
which Axolotl leaves at 0), the schedule scaling every group alike (engine/optimizers.py builds the groups).
`loraplus_lr_embedding` is the rate of LoRA on embedding layers, which hanzo-gym does not put LoRA on: it changes
nothing, and says so."""

from __future__ import annotations

from pydantic import Field

from hanzo_gym.config.feature import Feature


class LoraPlusKeys(Feature):
    loraplus_lr_ratio: float | None = Field(None, gt=0)
    loraplus_lr_embedding: float | None = Field(None, gt=0)

    def check(self) -> None:
        if (self.loraplus_lr_ratio or self.loraplus_lr_embedding) and self.full_fine_tuning:
            key = "loraplus_lr_ratio" if self.loraplus_lr_ratio else "loraplus_lr_embedding"
            raise ValueError(
                f"{key} sets the learning rates of a LoRA adapter's matrices: it needs `adapter: lora` or qlora"
            )

    def notes(self) -> list[str]:
        lines = []
        if self.loraplus_lr_ratio and self.weight_decay:
            lines.append(
                f"loraplus_lr_ratio: LoRA+ trains without weight decay (PEFT's LoRA+ groups, as Axolotl builds "
                f"them), so weight_decay {self.weight_decay} changes nothing"
            )
        if self.loraplus_lr_embedding:  # without loraplus_lr_ratio Axolotl does not read it either
            lines.append(
                "loraplus_lr_embedding changes nothing here: it is the rate of LoRA on embedding layers, which "
                "hanzo-gym does not put LoRA on"
            )
        return lines
