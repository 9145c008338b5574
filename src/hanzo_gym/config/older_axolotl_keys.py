"""Keys of earlier Axolotl releases that users' configs still carry: each either becomes the key that replaced it
(the run's first lines say so) or, where today's Axolotl reads it for nothing, is accepted with one line saying
why it changes nothing here."""

from __future__ import annotations

from pydantic import Field, PrivateAttr

from hanzo_gym.config.feature import Feature

# Older Axolotl's model-family flags: it read them to pick the patches of a family; today's only declares them
# ("internal use only") and reads the family from the model's config.
FAMILY_FLAGS = (
    "is_falcon_derived_model",
    "is_llama_derived_model",
    "is_mistral_derived_model",
    "is_qwen_derived_model",
)
# older name → the key that replaced it
RENAMED = {"eval_table_max_new_tokens": "eval_max_new_tokens"}


class OlderAxolotlKeys(Feature):
    is_falcon_derived_model: bool | None = None
    is_llama_derived_model: bool | None = None
    is_mistral_derived_model: bool | None = None
    is_qwen_derived_model: bool | None = None
    eval_table_max_new_tokens: int | None = Field(None, ge=1)
    # where the model's config.json is read from, when not beside the weights
    base_model_config: str | None = None
    # datasets' `keep_in_memory` while Axolotl preprocessed them
    dataset_keep_in_memory: bool | None = None
    # the system message of Axolotl's chatml template, which has none to replace today
    default_system_message: str | None = None

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
        if self.base_model_config not in (None, self.base_model):
            raise ValueError(
                f"base_model_config: {self.base_model_config} reads the model's config.json from another place "
                "than base_model's weights, which is not supported yet; remove it, or point base_model at a folder "
                "with both"
            )

    def notes(self) -> list[str]:
        flags = [flag for flag in FAMILY_FLAGS if getattr(self, flag) is not None]
        lines = list(self._renamed)
        if flags:
            lines.append(
                f"{', '.join(flags)}: older Axolotl's model-family flags change nothing: the family is read from "
                "base_model's config.json"
            )
        if self.base_model_config is not None:
            lines.append("base_model_config is base_model: the model's config.json is read from there")
        if self.dataset_keep_in_memory is not None:
            lines.append(
                "dataset_keep_in_memory changes nothing: the tokenized datasets are held in memory while they train"
            )
        if self.default_system_message:
            lines.append(
                "default_system_message changes nothing: Axolotl replaces the default system message of its "
                "chatml template, which has none; give conversations their own system turn"
            )
        return lines
