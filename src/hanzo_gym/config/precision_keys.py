"""The dtype a run computes in: `bf16` (auto: bf16 where the device computes it fast), `fp16` (float16 with HF's
dynamic loss scaling, for GPUs without bf16), Axolotl's older `bfloat16` switch, and CUDA's TF32 matmuls (`tf32`,
no effect on a CPU). model/hub.py's choose_precision acts on them."""

from __future__ import annotations

from typing import Literal

from pydantic import PrivateAttr

from hanzo_gym.config.feature import Feature


class PrecisionKeys(Feature):
    bf16: Literal["auto", True, False] = "auto"
    # Axolotl's older switch for weights cast to bfloat16: true is `bf16: true` (the base in bf16; LoRA and
    # AdamW stay fp32, as PEFT keeps an adapter on a bf16 base)
    bfloat16: bool | None = None
    tf32: Literal["auto", True, False] | None = None  # CUDA's TF32 matmuls; no effect on a CPU
    # float16 compute (a LoRA base in fp16, full fine-tuning's fp32 weights under fp16 autocast) with HF's
    # dynamic loss scaling (engine/engine.py)
    fp16: bool | None = None

    _fp16_over_bf16: bool = PrivateAttr(False)

    def check(self) -> None:
        if self.fp16 and self.bf16 is True:  # Axolotl's resolve_dtype: bf16 wins and fp16 is turned off
            self.fp16, self._fp16_over_bf16 = False, True
        if self.fp16 and self.bfloat16:
            raise ValueError(
                "fp16: true computes in float16, and bfloat16: true casts the model to bf16; give one"
            )
        if self.bfloat16:
            if self.bf16 is False:
                raise ValueError(
                    "bfloat16: true casts the model to bf16, and the config also says bf16: false"
                )
            self.bf16 = True

    def notes(self) -> list[str]:
        if not self._fp16_over_bf16:
            return []
        return [
            "fp16: true with bf16: true: the run computes in bf16, as Axolotl resolves the two (fp16 turned off)"
        ]
