"""Axolotl's `peft:` section: `peft.loftq_config.loftq_bits` starts the LoRA adapter with LoftQ
(model/loftq.py). Axolotl's schema holds only that key (its `loftq_iter` is commented out), and so does this."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from hanzo_gym.config.feature import Feature


class LoftQSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    loftq_bits: Literal[4, 8] = 4  # the base is rounded through NF4 (4) or int8 (8), as PEFT does


class PeftSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    loftq_config: LoftQSettings | None = None


class PeftKeys(Feature):
    peft: PeftSection | None = None

    @property
    def loftq_bits(self) -> int | None:
        loftq = self.peft.loftq_config if self.peft else None
        return loftq.loftq_bits if loftq else None

    def check(self) -> None:
        if self.loftq_bits is None:
            return
        if self.adapter != "lora" or self.quantized_base:
            raise ValueError(
                "peft.loftq_config starts a LoRA adapter from the rounding error of a full-precision base (PEFT's "
                "LoftQ, as Axolotl applies it with `adapter: lora`): it goes with `adapter: lora` and no "
                "load_in_4bit / load_in_8bit"
            )
        if self.lora_target_parameters:
            raise ValueError(
                "peft.loftq_config with lora_target_parameters: LoftQ starts LoRA on linear layers (as PEFT's "
                "does), not on bare expert parameters; remove one of them"
            )
