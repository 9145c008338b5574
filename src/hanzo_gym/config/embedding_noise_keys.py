"""NEFTune (`neftune_noise_alpha`, HF Trainer's key that Axolotl passes through, and `noisy_embedding_alpha`, its
older Axolotl name): uniform noise on the input embeddings while training, of magnitude alpha / sqrt(length ×
width). model/embedding_noise.py adds it."""

from __future__ import annotations

from pydantic import Field

from hanzo_gym.config.feature import Feature


class EmbeddingNoiseKeys(Feature):
    neftune_noise_alpha: float | None = Field(None, gt=0)
    noisy_embedding_alpha: float | None = Field(None, gt=0)

    @property
    def embedding_noise_alpha(self) -> float | None:
        return self.neftune_noise_alpha or self.noisy_embedding_alpha

    def check(self) -> None:
        older, newer = self.noisy_embedding_alpha, self.neftune_noise_alpha
        if older is not None and newer is not None and older != newer:
            raise ValueError(
                f"noisy_embedding_alpha: {older} (older Axolotl's name of neftune_noise_alpha) and "
                f"neftune_noise_alpha: {newer} disagree; give neftune_noise_alpha only"
            )
        if self.embedding_noise_alpha is not None and self.rl == "grpo":
            raise ValueError(
                "neftune_noise_alpha adds noise to the embeddings of supervised (and preference) training; rl: grpo "
                "scores its own samples, which the noise would change: remove it"
            )

    def notes(self) -> list[str]:
        if self.noisy_embedding_alpha is None:
            return []
        return [
            f"noisy_embedding_alpha is older Axolotl's name of neftune_noise_alpha: {self.noisy_embedding_alpha}"
        ]
