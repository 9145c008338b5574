"""Keys (and an optimizer name) of earlier Axolotl and transformers releases that users' configs still carry, each
read as what replaced it (the run's first lines say so). Older keys that change nothing here are config/inert_keys.py's."""

from __future__ import annotations

from pydantic import Field, PrivateAttr

from hanzo_gym.config.feature import Feature

# older name → the key that replaced it
RENAMED = {"eval_table_max_new_tokens": "eval_max_new_tokens"}


class OlderAxolotlKeys(Feature):
    eval_table_max_new_tokens: int | None = Field(None, ge=1)
    # where the model's config.json is read from, when not beside the weights
    base_model_config: str | None = None

    _renamed: list[str] = PrivateAttr(default_factory=list)

    def check(self) -> None:
        for old, new in RENAMED.items():
            value = getattr(self, old)
            if value is None:
                continue
            if new in self.model_fields_set and getattr(self, new) != value:
                raise ValueError(
                    f"{old}: {value} (older Axolotl's name of {new}) and {new}: {getattr(self, new)} disagree; "
                    f"give {new} only"
                )
            setattr(self, new, value)
            self._renamed.append(f"{old} is older Axolotl's name of {new}: {new}: {value}")
        if self.optimizer == "adamw_hf":
            self.optimizer = "adamw_torch"
            self._renamed.append(
                "optimizer: adamw_hf (transformers' own AdamW, which transformers 5 removed) runs as adamw_torch: "
                "the same rule, except that adamw_hf's eps acts as eps/√(1-β₂ᵗ) does in torch's (at step t) and its weight "
                "decay comes after the update rather than before"
            )
        if self.base_model_config not in (None, self.base_model):
            raise ValueError(
                f"base_model_config: {self.base_model_config} reads the model's config.json from another place "
                "than base_model's weights, which is not supported yet; remove it, or point base_model at a folder "
                "with both"
            )

    def notes(self) -> list[str]:
        lines = list(self._renamed)
        if self.base_model_config is not None:
            lines.append("base_model_config is base_model: the model's config.json is read from there")
        return lines
