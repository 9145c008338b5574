"""Axolotl's overrides of the model's own config (`overrides_of_model_config`, written `model_config` as Axolotl's
schema also reads it): each key is set on the base model's config before its weights load. A key the model's
config does not have fails when the model is found (model/load_plan.py), before anything loads.

Of what the overrides can turn on, the training loop has to act on one itself: `output_router_logits` on a
mixture-of-experts model adds its router's load-balancing loss, `router_aux_loss_coef` times it, to the loss, as the
model's own forward does (Engine: router_balance_loss_of)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import PrivateAttr, model_validator

from hanzo_gym.config.feature import Feature


class ModelOverridesKeys(Feature):
    overrides_of_model_config: dict[str, Any] | None = None

    # read before validation, as the key it becomes
    OLDER_NAMES: ClassVar[tuple[str, ...]] = ("model_config",)

    _spelled: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _model_config_is_the_overrides(cls, data: Any) -> Any:
        """`model_config`: the name Axolotl's schema reads the overrides under (pydantic keeps the name for itself)."""
        if not isinstance(data, dict) or "model_config" not in data:
            return data
        data = dict(data)
        value = data.pop("model_config")
        if data.get("overrides_of_model_config", value) != value:
            raise ValueError(
                "model_config and overrides_of_model_config (the same key) disagree; give one of them"
            )
        data["overrides_of_model_config"] = value
        return data

    @property
    def model_config_overrides(self) -> tuple[tuple[str, Any], ...]:
        return tuple((self.overrides_of_model_config or {}).items())

    def check(self) -> None:
        for key in self.overrides_of_model_config or {}:
            if not isinstance(key, str) or not key.isidentifier():
                raise ValueError(f"model_config: `{key}` is not the name of a config field")
