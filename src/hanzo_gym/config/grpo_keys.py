"""GRPO (`rl: grpo`, and Axolotl's `rl: gdpo`): its settings under TRL's names in `trl:`, and what GRPO cannot go
with. loops/grpo.py acts on them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from hanzo_gym.config.feature import Feature, StrictKeys
from hanzo_gym.config.vllm_keys import VllmTrlKeys
from hanzo_gym.errors import GymError


class TrlConfig(StrictKeys, VllmTrlKeys):  # the vLLM rollout keys: config/vllm_keys.py
    """GRPO settings under TRL's names (plus Tinker's `loss_fn` and `remove_constant_reward_groups`)."""

    num_generations: int = Field(4, ge=2)
    max_completion_length: int = Field(256, ge=1)
    # Axolotl's data producer protocol; without its async_prefetch (refused) each step's rollouts come from the
    # current policy, which is what GRPO does here anyway
    use_data_producer: bool = False
    beta: float = Field(0.0, ge=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    scale_rewards: Literal["group", "batch", "none", True, False] = True
    # sum the weighted rewards, then normalize (GRPO); or normalize each reward in its group, sum, and normalize
    # the sums over the batch (GDPO, Axolotl's `rl: gdpo`)
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    reward_funcs: list[str] = Field(default_factory=list)
    reward_weights: list[float] = Field(default_factory=list)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    loss_fn: Literal["ppo", "importance_sampling", "cispo", "dro"] = "ppo"
    epsilon: float = Field(0.2, gt=0)
    epsilon_high: float | None = Field(None, gt=0)
    num_iterations: int = Field(1, ge=1)
    mask_truncated_completions: bool = False
    # TRL's: at each logged step, the completions since the last one (prompt, completion, each reward, advantage)
    # to completions.jsonl and the trackers, and the first num_completions_to_print (None: all) printed
    log_completions: bool = False
    num_completions_to_print: int | None = Field(None, ge=0)
    remove_constant_reward_groups: bool = False

    @property
    def reward_scaling(self) -> str:
        """`scale_rewards` with TRL's boolean aliases resolved: true → group, false → none."""
        return {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)

    @field_validator("reward_funcs")
    @classmethod
    def _rewards_parse(cls, specs: list[str]) -> list[str]:
        from hanzo_gym.rewards import parse_reward

        for spec in specs:
            try:
                parse_reward(spec)
            except GymError as exc:
                raise ValueError(str(exc)) from None
        return specs


class GrpoKeys(Feature):
    trl: TrlConfig = TrlConfig()

    @model_validator(mode="before")
    @classmethod
    def _gdpo_is_grpo_with_decoupled_rewards(cls, data: Any) -> Any:
        """Axolotl's `rl: gdpo`: GRPO whose rewards are normalized one by one before they are summed (TRL's
        multi_objective_aggregation: normalize_then_sum, which Axolotl sets for it)."""
        if not isinstance(data, dict) or data.get("rl") != "gdpo":
            return data
        trl = dict(data.get("trl") or {})
        if trl.get("multi_objective_aggregation") == "sum_then_normalize":
            raise ValueError(
                "rl: gdpo with trl.multi_objective_aggregation: sum_then_normalize is GRPO (Axolotl's rule); use "
                "rl: grpo, or normalize_then_sum"
            )
        trl["multi_objective_aggregation"] = "normalize_then_sum"
        return {**data, "rl": "grpo", "trl": trl}

    def check(self) -> None:
        if (
            self.trl.multi_objective_aggregation == "normalize_then_sum"
            and self.trl.reward_scaling != "group"
        ):
            raise ValueError(
                f"trl.scale_rewards: {self.trl.scale_rewards} with multi_objective_aggregation: normalize_then_sum "
                "(GDPO): each reward is normalized in its group and the sums over the batch, whatever "
                "scale_rewards says (TRL's rule); remove scale_rewards"
            )
        if self.trl.num_completions_to_print is not None and not self.trl.log_completions:
            raise ValueError("trl.num_completions_to_print needs trl.log_completions: true (TRL's rule)")
        if self.rl != "grpo":
            return
        sft_only = next((ds.type for ds in self.datasets if ds.type in ("input_output", "pretrain")), None)
        if sft_only is not None:
            raise ValueError(
                f"type: {sft_only} is SFT's (labelled segments or raw text have no prompt to answer); rl: grpo "
                "reads chat_template, alpaca, completion or a transform of your own"
            )
        if self.excess_length_strategy != "drop":
            raise ValueError(
                f"excess_length_strategy: {self.excess_length_strategy} is implemented for SFT and preference "
                "data, not yet for rl: grpo (its prompts longer than sequence_len are dropped); remove it"
            )
        if not self.trl.reward_funcs:
            raise ValueError("rl: grpo needs `trl.reward_funcs`")
        if self.trl.reward_weights and len(self.trl.reward_weights) != len(self.trl.reward_funcs):
            raise ValueError(
                f"trl.reward_weights has {len(self.trl.reward_weights)} entries for "
                f"{len(self.trl.reward_funcs)} trl.reward_funcs; give one weight per function"
            )
