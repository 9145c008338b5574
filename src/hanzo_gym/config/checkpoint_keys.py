"""When a run saves (`save_steps` or `saves_per_epoch`), how many checkpoints it keeps, in which format, and where
it resumes from (loops/checkpoint.py and loops/tail.py act on them)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from hanzo_gym.config.feature import Feature, StepsOrFraction, zero_means_unset


class CheckpointKeys(Feature):
    save_steps: StepsOrFraction | None = None
    saves_per_epoch: int | None = Field(None, ge=1)  # Axolotl's other way to say save_steps
    save_total_limit: int | None = Field(None, ge=1)  # keep only the newest N checkpoints (None: all)
    save_safetensors: bool = True  # HF's checkpoint format: hanzo-gym writes safetensors only
    resume_from_checkpoint: str | bool | None = None

    _saves_per_epoch = field_validator("saves_per_epoch", mode="before")(zero_means_unset)

    def check(self) -> None:
        if self.save_steps is not None and self.saves_per_epoch is not None:
            raise ValueError(
                "`save_steps` and `saves_per_epoch` say the same thing two ways; give one of them"
            )
        if isinstance(self.resume_from_checkpoint, str) and not Path(self.resume_from_checkpoint).is_dir():
            raise ValueError(f"resume_from_checkpoint: {self.resume_from_checkpoint} is not a directory")
        if not self.save_safetensors:
            raise ValueError(
                "save_safetensors: false asks for pickled .bin checkpoints; hanzo-gym writes safetensors only "
                "(and never unpickles on resume): remove it"
            )
