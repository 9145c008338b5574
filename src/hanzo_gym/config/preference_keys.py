"""The config keys of preference training (`rl: dpo | ipo | orpo | simpo | kto`), with Axolotl's names and TRL's
defaults, and the dataset types each `rl` reads."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hanzo_gym.config.dataset_types import KTO_TYPES, PAIR_TYPES, is_user_transform
from hanzo_gym.config.feature import Feature

PAIR_METHODS = ("dpo", "ipo", "orpo", "simpo")
PREFERENCE_METHODS = (*PAIR_METHODS, "kto")

_SET_ONLY_FOR_PREFERENCE = ("dpo_beta", "rpo_alpha", "orpo_alpha", "dpo_loss_type", "dpo_loss_weights")


class PreferenceKeys(Feature):
    rl_beta: float | None = Field(None, gt=0)  # β of DPO / IPO / KTO / SimPO (TRL's default 0.1)
    dpo_beta: float | None = Field(None, gt=0)  # Axolotl's deprecated name of rl_beta
    dpo_label_smoothing: float = Field(0.0, ge=0, lt=0.5)  # ε of conservative DPO
    dpo_loss_type: list[Literal["sigmoid", "ipo", "sft"]] | None = None
    dpo_loss_weights: list[float] | None = None
    rpo_alpha: float | None = Field(None, ge=0)  # weight of the chosen NLL added to DPO (RPO)
    precompute_ref_log_probs: bool = False
    dpo_use_weighting: bool = False  # WPO: each pair's loss × its policy probability (TRL's `use_weighting`)
    orpo_alpha: float | None = Field(None, gt=0)  # λ of ORPO (TRL's ORPO `beta`, default 0.1)
    simpo_gamma: float = Field(0.5, ge=0)
    cpo_alpha: float = Field(1.0, ge=0)  # weight of the chosen NLL in SimPO (TRL's CPOConfig default)
    kto_desirable_weight: float = Field(1.0, gt=0)
    kto_undesirable_weight: float = Field(1.0, gt=0)

    @property
    def preference_beta(self) -> float:
        """β as Axolotl hands it to TRL: rl_beta (or its old name dpo_beta), for ORPO orpo_alpha; else 0.1."""
        for value in (self.rl_beta, self.dpo_beta, self.orpo_alpha if self.rl == "orpo" else None):
            if value is not None:
                return value
        return 0.1

    @property
    def dpo_terms(self) -> dict[str, float]:
        """The DPO loss as TRL's weighted list of terms: `sigmoid` or `ipo`, plus `sft` (RPO's chosen NLL)."""
        types = self.dpo_loss_type or (["ipo"] if self.rl == "ipo" else ["sigmoid"])
        weights = self.dpo_loss_weights or [1.0] * len(types)
        terms = dict(zip(types, weights))
        if self.rpo_alpha is not None:
            terms["sft"] = self.rpo_alpha
        return terms

    def check(self) -> None:
        method = self.rl
        if self.dpo_use_weighting and method not in ("dpo", "ipo"):
            if method not in PREFERENCE_METHODS:
                raise ValueError(
                    "`dpo_use_weighting` is a preference-training key; it needs `rl: dpo` or `rl: ipo`"
                )
            raise ValueError(
                f"dpo_use_weighting (WPO) applies to rl: dpo or ipo, not rl: {method}: TRL's DPOTrainer has "
                "`use_weighting`, its ORPO, CPO (SimPO) and KTO trainers have no such option"
            )
        if method not in PREFERENCE_METHODS:
            used = [key for key in _SET_ONLY_FOR_PREFERENCE if getattr(self, key) is not None]
            if used:
                raise ValueError(
                    f"`{used[0]}` is a preference-training key; it needs `rl: dpo` (or ipo, orpo, …)"
                )
            for ds in self.datasets:
                if ds.type in PAIR_TYPES or ds.type in KTO_TYPES:
                    raise ValueError(
                        f"datasets type `{ds.type}` holds preference data; it needs `rl: dpo` (or ipo, orpo, simpo, kto)"
                    )
            return
        if self.sample_packing:
            raise ValueError(f"rl: {method} does not pack samples (chosen and rejected are scored as a pair)")
        if method == "kto" and self.micro_batch_size < 2:
            raise ValueError(
                "rl: kto needs micro_batch_size ≥ 2: its KL term pairs each prompt with another example's completion "
                "of the same micro-batch"
            )
        if self.rl_beta is not None and self.dpo_beta is not None and self.rl_beta != self.dpo_beta:
            raise ValueError("rl_beta and dpo_beta (its old name) disagree; give rl_beta only")
        allowed = KTO_TYPES if method == "kto" else PAIR_TYPES
        for ds in self.datasets:
            if isinstance(ds.type, str) and ds.type not in allowed and not is_user_transform(ds.type):
                raise ValueError(
                    f"rl: {method} reads datasets of type {', '.join(allowed)}, a transform of your own "
                    f"(module.function) or a `type:` mapping of your format; got `{ds.type}`"
                )
        if self.dpo_loss_type is not None or self.dpo_loss_weights is not None:
            if method != "dpo":
                raise ValueError(f"dpo_loss_type / dpo_loss_weights apply to rl: dpo, not rl: {method}")
            types = self.dpo_loss_type or []
            if len([t for t in types if t != "sft"]) != 1 or len(set(types)) != len(types):
                raise ValueError(
                    "dpo_loss_type is one of sigmoid or ipo, optionally with sft (e.g. [sigmoid, sft])"
                )
            if self.dpo_loss_weights is not None and len(self.dpo_loss_weights) != len(types):
                raise ValueError("dpo_loss_weights needs one weight per dpo_loss_type entry")
            if "sft" in types and self.rpo_alpha is not None:
                raise ValueError(
                    "rpo_alpha and dpo_loss_type `sft` both weight the chosen NLL; give one of them"
                )
        if self.dpo_label_smoothing and method != "dpo":
            raise ValueError(f"dpo_label_smoothing applies to rl: dpo (sigmoid), not rl: {method}")
        if self.dpo_label_smoothing and "ipo" in self.dpo_terms:
            raise ValueError("dpo_label_smoothing does not apply to the ipo loss")
        if self.dpo_use_weighting and "sft" in self.dpo_terms:
            raise ValueError(
                "dpo_use_weighting with the chosen NLL (rpo_alpha, or dpo_loss_type sft) has no TRL behaviour to "
                "follow: TRL 1.16's DPOTrainer fails on that combination; drop one of them"
            )
