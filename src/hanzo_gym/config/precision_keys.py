"""The dtype a run computes in: `bf16` (auto: bf16 where the device computes it fast), Axolotl's older `bfloat16`
switch, and CUDA's TF32 matmuls (`tf32`, no effect on a CPU). model/hub.py's choose_precision acts on them."""

from __future__ import annotations

from typing import Literal

from hanzo_gym.config.feature import Feature


class PrecisionKeys(Feature):
    bf16: Literal["auto", True, False] = "auto"
    # Axolotl's older switch for weights cast to bfloat16: true is `bf16: true` (the base in bf16; LoRA and
    # AdamW stay fp32, as PEFT keeps an adapter on a bf16 base)
    bfloat16: bool | None = None
    tf32: Literal["auto", True, False] | None = None  # CUDA's TF32 matmuls; no effect on a CPU

    def check(self) -> None:
        if self.bfloat16:
            if self.bf16 is False:
                raise ValueError(
                    "bfloat16: true casts the model to bf16, and the config also says bf16: false"
                )
            self.bf16 = True
