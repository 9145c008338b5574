"""Preference rows in a shape of the user's, turned into TRL's (`prompt` / `chosen` / `rejected`; KTO: `prompt` /
`completion` / `label`), after which they read as `passthrough` rows.

Two ways, as Axolotl has them: a `type:` mapping (its user-defined DPO and KTO formats: which fields hold the
prompt, the system text and the completions, and a format string for each), or a transform of the user's
(`type: module.function`, loaded as for GRPO prompts: data/user_transforms.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hanzo_gym.config.dataset_keys import DatasetTypeMapping
from hanzo_gym.config.dataset_types import is_user_transform
from hanzo_gym.data.sources import Row
from hanzo_gym.data.user_transforms import RowTransform, load_user_transform
from hanzo_gym.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hanzo_gym.config import Config, DatasetConfig


def as_passthrough(
    cfg: Config, index: int, rows: list[Row], tokenizer: PreTrainedTokenizerBase
) -> tuple[list[Row], DatasetConfig]:
    """The dataset's rows in TRL's shape and the dataset as `passthrough` reads them; other types unchanged."""
    ds = cfg.datasets[index]
    if isinstance(ds.type, DatasetTypeMapping):
        transform = mapping_transform(ds.type, kto=cfg.rl == "kto")
    elif is_user_transform(ds.type):
        transform = load_user_transform(cfg, index, tokenizer)
    else:
        return rows, ds
    passthrough = ds.model_copy(
        update={"type": "passthrough", "field_chosen": "chosen", "field_rejected": "rejected"}
    )
    return [transform(row) for row in rows], passthrough


def mapping_transform(mapping: DatasetTypeMapping, kto: bool) -> RowTransform:
    """Axolotl's user-defined formats: the prompt as `prompt_format` (its `{system}` filled from `field_system`,
    empty when the row has none), each completion as its format; for KTO the label from `field_label`."""
    prompt_format = mapping.prompt_format or "{prompt}"
    field_prompt = mapping.field_prompt or "prompt"
    if kto:
        completions = {"completion": (mapping.field_completion or "completion", mapping.completion_format)}
    else:
        completions = {
            "chosen": (mapping.field_chosen or "chosen", mapping.chosen_format),
            "rejected": (mapping.field_rejected or "rejected", mapping.rejected_format),
        }

    def transform(row: Row) -> Row:
        system = row.data.get(mapping.field_system)
        new = dict(row.data)
        new["prompt"] = prompt_format.format(
            prompt=row.string(field_prompt, "field_prompt"),
            system=system if isinstance(system, str) else "",
        )
        for name, (field, form) in completions.items():
            new[name] = (form or f"{{{name}}}").format(**{name: row.string(field, f"field_{name}")})
        if kto:
            field_label = mapping.field_label or "label"
            if field_label not in row.data:
                raise DataError(
                    f"{row.file} row {row.line}: row has no `{field_label}` (field_label = `{field_label}`)"
                )
            new["label"] = row.data[field_label]
        return Row(new, row.file, row.line)

    return transform
