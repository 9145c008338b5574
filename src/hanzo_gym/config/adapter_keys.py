"""What trains: a LoRA adapter (`adapter: lora`, or `qlora` on a 4-bit base) with its rank, scale, targets and
whole modules trained beside it, started fresh or from a PEFT directory (`lora_model_dir`); or, without `adapter`,
every weight (full fine-tuning), or only those `unfrozen_parameters` names. model/lora.py, model/unfreeze.py and
loops/train.py act on them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, field_validator

from hanzo_gym.config.feature import Feature
from hanzo_gym.config.model_quantization_keys import BnbConfigKwargs
from hanzo_gym.config.parameter_patterns import ROW_RANGE, name_pattern

# DPO, IPO and KTO compare the policy with a reference model. hanzo-gym's reference is the base model (the
# adapter disabled); TRL 1.16, handed a model that already has an adapter, makes a frozen copy of that starting
# adapter the reference instead, and Axolotl hands these methods a fresh adapter (the directory's weights unused).
REFERENCE_METHODS = ("dpo", "ipo", "kto")
# modules whose LoRA vLLM refuses
UNTRAINABLE_BY_LORA = {"lm_head", "embed_tokens", "wte", "embed_out"}
# `adapter: lora` with `load_in_4bit: true`: Axolotl before 0.13 handed transformers `load_in_4bit=True`, whose
# bitsandbytes defaults are FP4 without double quantization (0.13 stopped passing it: the base loads unquantized)
OLDER_AXOLOTL_4BIT = BnbConfigKwargs(bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False)


def looks_like_local_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or Path(value).expanduser().exists()


class AdapterKeys(Feature):
    # absent or empty: full fine-tuning (every weight trains), as in Axolotl
    adapter: Literal["lora", "qlora"] | None = None
    lora_r: int = Field(8, gt=0)
    lora_alpha: float = Field(16.0, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    peft_use_rslora: bool = False  # rank-stabilised LoRA: scale alpha / sqrt(r) instead of alpha / r
    # module names, or one regular expression over full module paths (PEFT's rule: the whole path matches)
    lora_target_modules: list[str] | str = Field(default_factory=list)
    # whole modules trained beside the adapter (Axolotl's; typically [embed_tokens, lm_head]), saved in it
    lora_modules_to_save: list[str] | None = None
    lora_target_linear: bool = False
    # bare parameters adapted too, an MoE layer's 3-D expert stacks (`experts.gate_up_proj`): PEFT's rule, a
    # parameter whose path is the entry or ends in `.entry` (model/parameter_lora.py)
    lora_target_parameters: list[str] | None = None
    lora_model_dir: str | None = None  # start from this PEFT adapter (its own r, alpha and targets)
    # full fine-tuning of only the parameters these name patterns match (model/unfreeze.py)
    unfrozen_parameters: list[str] | None = None

    _lora_on_4bit: bool = PrivateAttr(False)
    _saved_whole: list[str] = PrivateAttr(
        default_factory=list
    )  # targets that lora_modules_to_save trains whole

    @field_validator("lora_target_parameters", mode="before")
    @classmethod
    def _one_parameter_or_a_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value  # Axolotl takes either

    @property
    def full_fine_tuning(self) -> bool:
        return self.adapter is None

    @property
    def lora_targets(self) -> list[str] | str:
        """What the adapter targets: `all-linear`, sorted module names, or the regular expression."""
        if self.lora_target_linear:
            return "all-linear"
        if isinstance(self.lora_target_modules, str):
            return self.lora_target_modules
        return sorted(self.lora_target_modules)

    def check(self) -> None:
        if self.unfrozen_parameters:
            self._check_unfrozen_parameters()
        if self.adapter is None:
            self._check_full_fine_tuning()
        else:
            self._check_lora()
        if self.lora_modules_to_save:
            if self.rl == "grpo":
                raise ValueError(
                    "lora_modules_to_save with rl: grpo: the sampler folds only the LoRA deltas into its weights, "
                    "so rollouts would not come from the trained modules; train them with SFT or DPO"
                )
            if self.lora_model_dir is not None:
                raise ValueError(
                    "lora_modules_to_save with lora_model_dir: the adapter directory's own settings govern, so "
                    "the key would do nothing; remove one of them"
                )
        if self.lora_model_dir is not None:
            self._check_lora_model_dir()

    def notes(self) -> list[str]:
        lines = []
        if self._saved_whole:
            lines.append(
                f"lora_target_modules: {', '.join(self._saved_whole)} also in lora_modules_to_save, which trains them "
                "whole: they get no LoRA, as PEFT builds such an adapter"
            )
        if not self._lora_on_4bit:
            return lines
        kind = self.bnb_config_kwargs.bnb_4bit_quant_type.upper()
        return [
            *lines,
            (
                f"adapter: lora with load_in_4bit: true trains LoRA on a 4-bit {kind} base, as Axolotl before 0.13 "
                "read it (transformers' load_in_4bit: FP4, no double quantization); `adapter: qlora` is today's "
                "spelling (NF4, double quantization)"
            ),
        ]

    def _check_unfrozen_parameters(self) -> None:
        if self.adapter:
            raise ValueError(
                "`unfrozen_parameters` chooses the weights that full fine-tuning trains; with "
                f"`adapter: {self.adapter}` Axolotl freezes the adapter too (its maintainers: not supported with "
                "LoRA), so nothing would train: remove it, or list whole modules in lora_modules_to_save"
            )
        for entry in self.unfrozen_parameters or []:
            if ROW_RANGE.match(entry):
                raise ValueError(
                    f"unfrozen_parameters: `{entry}`: training only some rows of a parameter (Axolotl's "
                    "[start:end]) is not supported yet; unfreeze the whole parameter"
                )
            try:
                name_pattern(entry)
            except re.error as exc:
                raise ValueError(
                    f"unfrozen_parameters: `{entry}` is not a valid regular expression: {exc}"
                ) from None

    def _check_lora(self) -> None:
        if self.adapter == "lora" and self.load_in_4bit and not self.load_in_8bit:
            self.adapter, self._lora_on_4bit = "qlora", True
            if self.bnb_config_kwargs is None:
                self.bnb_config_kwargs = OLDER_AXOLOTL_4BIT
        if (self.adapter == "qlora") != self.load_in_4bit:
            raise ValueError(
                "adapter: qlora and load_in_4bit: true go together (QLoRA: a LoRA adapter on a 4-bit base); "
                "set both, or `adapter: lora` without load_in_4bit"
            )
        if self.load_in_8bit and self.adapter != "lora":
            raise ValueError(
                "load_in_8bit: true trains a LoRA adapter on an 8-bit base: it goes with `adapter: lora` (a 4-bit "
                "base is `adapter: qlora` with load_in_4bit), not with both"
            )
        if not (self.lora_target_linear or self.lora_target_modules or self.lora_target_parameters):
            raise ValueError(
                "lora needs `lora_target_modules`, `lora_target_linear: true` or `lora_target_parameters`"
            )
        if self.lora_target_parameters and self.lora_dropout:
            raise ValueError(
                f"`lora_target_parameters` with lora_dropout {self.lora_dropout}: LoRA on a bare parameter adds its "
                "ΔW to the weight, so there is no separate input to drop out (PEFT refuses it; Axolotl's examples "
                "set 0): set lora_dropout: 0"
            )
        if isinstance(self.lora_target_modules, str):
            try:
                re.compile(self.lora_target_modules)
            except re.error as exc:
                raise ValueError(f"lora_target_modules is not a valid regular expression: {exc}") from None
        names = [] if isinstance(self.lora_target_modules, str) else self.lora_target_modules
        # PEFT wraps a module of modules_to_save whole and puts no LoRA on it, whatever target_modules say
        self._saved_whole = [
            n for n in names if n in UNTRAINABLE_BY_LORA and n in (self.lora_modules_to_save or [])
        ]
        if self._saved_whole:
            self.lora_target_modules = names = [n for n in names if n not in self._saved_whole]
        untrainable = sorted(set(names) & UNTRAINABLE_BY_LORA)
        if untrainable:
            raise ValueError(
                f"lora_target_modules {untrainable}: LoRA on the embedding or output layer is not supported "
                "(vLLM refuses such adapters); adapt the attention and MLP projections"
            )

    def _check_full_fine_tuning(self) -> None:
        if self.load_in_4bit or self.load_in_8bit:
            raise ValueError(
                "no `adapter` means full fine-tuning, which trains every weight: a 4- or 8-bit base cannot "
                "hold trained weights; set `adapter: qlora` (4-bit) or `adapter: lora` (8-bit)"
            )
        if self.rl in REFERENCE_METHODS:
            # The reference is the starting model: its log-probs are computed before the first step (TRL's
            # precompute_ref_log_probs), instead of a second copy of the model in memory as TRL keeps. KTO's
            # KL pairs of every planned micro-batch are among them (loops/preference.py).
            self.precompute_ref_log_probs = True
        given = sorted(
            key
            for key in self.model_fields_set
            if (key.startswith("lora_") or key == "peft_use_rslora")
            and getattr(self, key) not in (None, [], False, type(self).model_fields[key].default)
        )
        if given:
            raise ValueError(
                f"{', '.join(given)}: no `adapter` means full fine-tuning, where LoRA settings do nothing; "
                "remove them, or set `adapter: lora`"
            )

    def _check_lora_model_dir(self) -> None:
        value = self.lora_model_dir
        if looks_like_local_path(value):
            path = Path(value).expanduser()
            if not path.is_dir():
                raise ValueError(f"lora_model_dir: {value} is not a directory (a PEFT adapter directory)")
            if not (path / "adapter_config.json").is_file():
                raise ValueError(
                    f"lora_model_dir: {value} has no adapter_config.json; point it at a PEFT adapter directory "
                    "(a run's output_dir or one of its checkpoint-N folders)"
                )
        if self.rl in REFERENCE_METHODS:
            raise ValueError(
                f"lora_model_dir with rl: {self.rl} is not supported yet: the reference model would be the base "
                "model here, but a copy of the starting adapter in TRL (and Axolotl does not load the directory "
                "for this method at all); train from a fresh adapter, or use rl: orpo / simpo (no reference)"
            )
        if self.rl == "grpo" and self.trl.beta > 0:
            raise ValueError(
                "lora_model_dir with rl: grpo and trl.beta > 0 is not supported yet: the KL reference would be the "
                "base model here, but a copy of the starting adapter in TRL; set trl.beta: 0 or start fresh"
            )
