"""Pushing a run to the Hugging Face Hub: Axolotl's `hub_model_id`, `hub_strategy`, `hub_revision` and
`hf_use_auth_token`, and HF Trainer's `push_to_hub` and `hub_private_repo` (loops/hub_push.py acts on them).

As in Axolotl, `hub_model_id` alone turns pushing on, and the repo it creates is private unless
`hub_private_repo: false` says otherwise (Axolotl always asks HF's Trainer for a private repo); an existing repo
keeps its visibility. `hub_strategy` is HF's (`transformers.trainer_utils.HubStrategy`; Axolotl hands it over):
`end` pushes once, at the end; `every_save` (HF's default) also at each save; `checkpoint` also pushes the newest
checkpoint into `last-checkpoint/` at each save; `all_checkpoints` pushes each checkpoint folder under its name.
`push_dataset_to_hub` shares the tokenized datasets through a private hub dataset repo (data/prepared_hub.py).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import field_validator

from hanzo_gym.config.feature import Feature

# huggingface_hub's repo id rule (utils/_validators.py): `name` or `owner/name`, each part of word characters,
# `-` and `.`, not starting or ending with `-` / `.`, no `--` or `..`, a name of at most 96 characters.
_REPO_ID = re.compile(r"(?:\b[\w\-.]+\b/)?\b[\w\-.]{1,96}\b")
_SAVE_TIME_STRATEGIES = ("every_save", "checkpoint", "all_checkpoints")


def is_repo_id(value: str) -> bool:
    return (
        bool(_REPO_ID.fullmatch(value))
        and "--" not in value
        and ".." not in value
        and not value.endswith(".git")
    )


class HubKeys(Feature):
    hub_model_id: str | None = (
        None  # the repo to push to: `owner/name`, or `name` in the token's own namespace
    )
    hub_strategy: Literal["end", "every_save", "checkpoint", "all_checkpoints"] | None = (
        None  # HF's: every_save
    )
    hub_private_repo: bool | None = None  # a repo created private (None: Axolotl's, private)
    hub_revision: str | None = None  # the branch to push to (created when missing); the Hub's default: main
    push_to_hub: bool | None = None  # HF's switch: hub_model_id alone turns it on, `false` turns it off
    # Axolotl's: use the saved token (HF_TOKEN or `hf auth login`) for hub datasets. huggingface_hub reads that
    # token itself for every download and push, so either value loads and changes nothing.
    hf_use_auth_token: bool | None = None
    # Axolotl's: the tokenized datasets shared through this private hub dataset repo (data/prepared_hub.py)
    push_dataset_to_hub: str | None = None

    @field_validator("hub_model_id", "push_dataset_to_hub")
    @classmethod
    def _repo_id(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not is_repo_id(value):
            raise ValueError(
                "not a Hub repo id: write `owner/name` or `name` (letters, digits, `-`, `_`, `.`; no `--` or `..`)"
            )
        return value

    @field_validator("hub_revision")
    @classmethod
    def _revision(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or value != value.strip()):
            raise ValueError("name the branch to push to (e.g. `main`), without spaces around it")
        return value

    @property
    def pushes_to_hub(self) -> bool:
        return self.hub_model_id is not None and self.push_to_hub is not False

    @property
    def hub_private(self) -> bool:
        """Whether a repo the run creates is private: Axolotl's `True` unless `hub_private_repo: false`."""
        return self.hub_private_repo is not False

    def check(self) -> None:
        if self.push_dataset_to_hub is not None and self.hf_use_auth_token is not True:
            raise ValueError(
                "push_dataset_to_hub pushes to and reads from a private repo: set hf_use_auth_token: true with it "
                "(Axolotl's rule)"
            )
        if self.push_to_hub and self.hub_model_id is None:
            raise ValueError(
                "push_to_hub: true needs `hub_model_id` (the repo to push to, `owner/name` or `name`); "
                "hanzo-gym does not make one up from output_dir"
            )
        for key in ("hub_strategy", "hub_private_repo", "hub_revision"):
            if getattr(self, key) is not None and self.hub_model_id is None:
                raise ValueError(f"{key} needs `hub_model_id` (the repo to push to, `owner/name` or `name`)")
        saves = self.save_steps is not None or self.saves_per_epoch is not None
        if self.hub_strategy in _SAVE_TIME_STRATEGIES and not saves:
            raise ValueError(
                f"hub_strategy: {self.hub_strategy} pushes at each save, and this run saves no checkpoints: "
                "set save_steps or saves_per_epoch, or use hub_strategy: end"
            )
