"""The unit the data pipeline produces and the trainer consumes."""

from __future__ import annotations

from dataclasses import dataclass

from hanzo_gym.records import IGNORE_INDEX


@dataclass
class Example:
    """One tokenized training sequence. `labels[i]` is `input_ids[i]` where token i is trained, else IGNORE_INDEX
    (unshifted: the trainer predicts token i from tokens before it)."""

    input_ids: list[int]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def trained_tokens(self) -> int:
        """Trained positions that a model can predict: position 0 has no token before it, so never counts."""
        return sum(1 for label in self.labels[1:] if label != IGNORE_INDEX)
