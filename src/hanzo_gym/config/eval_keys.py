"""Axolotl's keys of what evaluation measures and what it decides: the eval batch size, early stopping and the best
checkpoint as the final model, generation metrics on the held-out examples, a multiple-choice benchmark
(`do_bench_eval`), and the debug print of tokenized examples; and when to evaluate (`eval_steps` or
`evals_per_epoch`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from hanzo_gym.config.feature import Feature, StepsOrFraction, zero_means_unset

# Axolotl's default metric list (`comet` needs a model of its own from the hub, which hanzo-gym does not fetch)
DEFAULT_CAUSAL_LM_METRICS = ("sacrebleu", "comet", "ter", "chrf")
CAUSAL_LM_METRICS = ("sacrebleu", "ter", "chrf", "perplexity")
EVAL_MAX_NEW_TOKENS = 128  # Axolotl's default completion length of eval predictions
DEFAULT_BENCH_DATASET = "pharaouk/dharma-1/dharma_1_mini.json"  # Axolotl's (a file of a hub dataset)
MMLU_BENCH_NAMES = ("mmlu-zs", "mmlu-fs", "mmlu")


class EvalKeys(Feature):
    eval_steps: StepsOrFraction | None = None
    evals_per_epoch: int | None = Field(None, ge=1)  # Axolotl's other way to say eval_steps
    # examples per eval micro-batch; micro_batch_size when unset
    eval_batch_size: int | None = Field(None, ge=1)
    # stop after this many evaluations in a row without a lower eval loss (HF's EarlyStoppingCallback)
    early_stopping_patience: int | None = Field(None, ge=1)
    # end with the saved checkpoint of the lowest eval loss (HF's rule; Axolotl turns it on with early stopping)
    load_best_model_at_end: bool = False
    do_causal_lm_eval: bool = False  # at each evaluation, greedy completions of the held-out prompts, scored
    eval_causal_lm_metrics: list[str] | None = None
    eval_max_new_tokens: int = Field(EVAL_MAX_NEW_TOKENS, ge=1)  # completion length of eval predictions
    eval_table_size: int = Field(0, ge=0)  # how many eval predictions each evaluation writes out
    # at each evaluation, accuracy on multiple-choice questions (data/bench.py, loops/bench_eval.py)
    do_bench_eval: bool = False
    bench_dataset: str | None = None  # DEFAULT_BENCH_DATASET when unset
    # print the first tokenized training item, each token with its label (data/debug_print.py)
    debug: bool = False

    _evals_per_epoch = field_validator("evals_per_epoch", mode="before")(zero_means_unset)

    @field_validator("eval_max_new_tokens", mode="before")
    @classmethod
    def _zero_is_the_default(cls, value: object) -> object:
        """Axolotl reads `eval_max_new_tokens or 128`: 0 is its default."""
        return EVAL_MAX_NEW_TOKENS if zero_means_unset(value) is None else value

    @property
    def eval_micro_batch_size(self) -> int:
        return self.eval_batch_size or self.micro_batch_size

    @property
    def causal_lm_metrics(self) -> list[str]:
        return list(self.eval_causal_lm_metrics or DEFAULT_CAUSAL_LM_METRICS)

    @property
    def bench_source(self) -> str:
        return self.bench_dataset or DEFAULT_BENCH_DATASET

    @property
    def generates_at_eval(self) -> bool:
        return self.do_causal_lm_eval or self.eval_table_size > 0

    def check(self) -> None:
        if self.eval_steps is not None and self.evals_per_epoch is not None:
            raise ValueError(
                "`eval_steps` and `evals_per_epoch` say the same thing two ways; give one of them"
            )
        if self.rl == "grpo":
            used = [
                key
                for key in ("early_stopping_patience", "do_causal_lm_eval", "eval_table_size")
                if getattr(self, key)
            ] + (["load_best_model_at_end"] if self.load_best_model_at_end else [])
            if used:
                raise ValueError(
                    f"{used[0]} works on an eval loss and held-out completions of SFT or preference data; rl: grpo "
                    "evaluates rewards of greedy completions (eval/reward) already: remove it"
                )
        if (self.early_stopping_patience or self.load_best_model_at_end) and not self.holds_out:
            key = "early_stopping_patience" if self.early_stopping_patience else "load_best_model_at_end"
            raise ValueError(
                f"{key} compares eval losses: it needs a held-out set (val_set_size > 0 or test_datasets)"
            )
        evals = self.eval_steps is not None or self.evals_per_epoch is not None
        saves = self.save_steps is not None or self.saves_per_epoch is not None
        if self.load_best_model_at_end and not (evals and saves):
            raise ValueError(
                "load_best_model_at_end picks among checkpoints by their eval loss: it needs `eval_steps` (or "
                "evals_per_epoch) and `save_steps` (or saves_per_epoch) a multiple of it (Axolotl's and HF's rule)"
            )
        if self.rl == "kto" and self.eval_batch_size == 1:
            raise ValueError(
                "rl: kto needs eval_batch_size ≥ 2: its KL term pairs each prompt with another example's completion "
                "of the same micro-batch"
            )
        if self.generates_at_eval and not self.holds_out:
            key = "do_causal_lm_eval" if self.do_causal_lm_eval else "eval_table_size"
            raise ValueError(
                f"{key} completes held-out prompts: it needs a held-out set (val_set_size > 0 or test_datasets)"
            )
        if self.generates_at_eval and self.rl is not None:
            raise ValueError(
                f"do_causal_lm_eval / eval_table_size complete the prompts of SFT examples; rl: {self.rl} (pairs) "
                "is not supported yet: remove them"
            )
        self._check_bench()
        if self.do_causal_lm_eval:
            if "comet" in self.causal_lm_metrics:
                where = "is in Axolotl's default list" if self.eval_causal_lm_metrics is None else "is listed"
                raise ValueError(
                    f"eval_causal_lm_metrics: `comet` {where}; it scores with a COMET model fetched from the hub, "
                    f"which is not supported: give the metrics to compute, from {', '.join(CAUSAL_LM_METRICS)}"
                )
            unknown = [name for name in self.causal_lm_metrics if name not in CAUSAL_LM_METRICS]
            if unknown:
                raise ValueError(
                    f"eval_causal_lm_metrics: `{unknown[0]}` is not one of {', '.join(CAUSAL_LM_METRICS)}"
                )
        elif self.eval_causal_lm_metrics is not None:
            raise ValueError(
                "eval_causal_lm_metrics are computed with do_causal_lm_eval: true; set it or remove them"
            )

    def _check_bench(self) -> None:
        if not self.do_bench_eval:
            if self.bench_dataset is not None:
                raise ValueError("bench_dataset is what do_bench_eval: true scores; set it or remove bench_dataset")
            return
        if self.rl is not None:
            raise ValueError(
                f"do_bench_eval scores SFT evaluations (Axolotl runs it for SFT only); rl: {self.rl} is not "
                "supported: remove it"
            )
        if not self.holds_out:
            raise ValueError(
                "do_bench_eval runs at each evaluation: it needs a held-out set (val_set_size > 0 or test_datasets)"
            )
        value = self.bench_source
        if not (value in MMLU_BENCH_NAMES or Path(value).expanduser().is_file() or len(value.split("/", 2)) == 3):
            raise ValueError(
                f"bench_dataset `{value}` is neither a local .json/.jsonl file, nor a hub dataset's file "
                "(`owner/name/file.json`), nor mmlu-zs / mmlu-fs"
            )
