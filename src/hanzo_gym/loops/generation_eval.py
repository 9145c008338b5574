"""Axolotl's generation evaluation of SFT (`do_causal_lm_eval`, `eval_causal_lm_metrics`, `eval_table_size`): at
each evaluation the model completes held-out prompts greedily (`eval_max_new_tokens`), and the completions are
scored against the examples' own answers and written out.

An example's prompt is its tokens before the first trained one and its reference answer the trained tokens that
follow (for a single-turn example, Axolotl's split; Axolotl joins every untrained token of a conversation into
the prompt, which for a multi-turn one asks a question the data never asked). Both are decoded without special
tokens, as Axolotl decodes them; the model continues the prompt's own tokens.

Metrics (logged as `eval/<name>`): `sacrebleu`, `ter` and `chrf` are sacrebleu's corpus scores with its defaults,
which are those of the `evaluate` metrics Axolotl loads; `perplexity` is exp of the mean NLL of each reference
(re-tokenized with the tokenizer's special tokens, as Axolotl's metric does) over its first `eval_max_new_tokens`
tokens, Axolotl's window (Axolotl pads the references to one length and counts the pads; here they are left out).

`eval_table_size` predictions per evaluation (the first held-out examples) go to `eval_predictions.jsonl` and to
the trackers as a table ("Predictions vs Ground Truth", Axolotl's columns less the teacher-forced one).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from hanzo_gym.config import Config
from hanzo_gym.data.example import Example
from hanzo_gym.engine import Engine
from hanzo_gym.engine.distributed import gather_objects, shard
from hanzo_gym.records import IGNORE_INDEX, SamplingParams

# held-out prompts decoded together
DECODE_CHUNK = 64


@dataclass(frozen=True)
class HeldOut:
    prompt: list[int]
    reference: list[int]


def held_out_split(example: Example) -> HeldOut | None:
    """The prompt and the reference answer of an example; None when it has no prompt or nothing trained."""
    first = next((i for i, label in enumerate(example.labels) if label != IGNORE_INDEX), None)
    if not first:
        return None
    end = next((i for i in range(first, len(example)) if example.labels[i] == IGNORE_INDEX), len(example))
    return HeldOut(example.input_ids[:first], example.input_ids[first:end])


@dataclass(frozen=True)
class Prediction:
    prompt: str
    reference: str
    prediction: str


def predictions(engine: Engine, cfg: Config, items: list[HeldOut]) -> list[Prediction]:
    """Greedy completions of `items`' prompts (each process its share, gathered in order)."""
    tokenizer = engine.tokenizer
    params = SamplingParams(max_tokens=cfg.eval_max_new_tokens, seed=cfg.seed, temperature=0.0)
    mine: list[Prediction] = []
    share = shard(items)
    for start in range(0, len(share), DECODE_CHUNK):
        chunk = share[start : start + DECODE_CHUNK]
        groups = engine.sample([item.prompt for item in chunk], 1, params)
        for item, group in zip(chunk, groups):
            mine.append(
                Prediction(
                    tokenizer.decode(item.prompt, skip_special_tokens=True),
                    tokenizer.decode(item.reference, skip_special_tokens=True),
                    tokenizer.decode(group[0].tokens, skip_special_tokens=True),
                )
            )
    return [prediction for part in gather_objects(mine) for prediction in part]


def corpus_scores(names: list[str], hypotheses: list[str], references: list[str]) -> dict[str, float]:
    """sacrebleu's corpus BLEU, TER and chrF (one reference per hypothesis) for the names among them."""
    import sacrebleu

    scorers = {"sacrebleu": sacrebleu.corpus_bleu, "ter": sacrebleu.corpus_ter, "chrf": sacrebleu.corpus_chrf}
    return {
        f"eval/{name}": float(scorers[name](hypotheses, [references]).score)
        for name in names
        if name in scorers
    }


def reference_perplexity(
    references: list[str], cfg: Config, engine: Engine, mean_nll: Callable[[list[Example]], float]
) -> float | None:
    """exp of the mean NLL of the references' first eval_max_new_tokens tokens (see the module's docstring);
    None when no reference has two tokens."""
    window = cfg.eval_max_new_tokens
    examples = []
    for text in references:
        ids = engine.tokenizer.encode(text, add_special_tokens=True)[:window]
        if len(ids) >= 2:
            examples.append(Example(ids, list(ids)))
    return math.exp(mean_nll(examples)) if examples else None


class GenerationEval:
    """The generation part of an SFT evaluation: its metrics for the eval row, its table for the run."""

    def __init__(
        self, engine: Engine, cfg: Config, val: list[Example], write_table: Callable[[int, list], None]
    ):
        self.engine, self.cfg, self.write_table = engine, cfg, write_table
        self.items = [split for split in map(held_out_split, val) if split is not None]

    def __call__(self, step: int, mean_nll: Callable[[list[Example]], float]) -> dict[str, float]:
        cfg = self.cfg
        count = len(self.items) if cfg.do_causal_lm_eval else min(cfg.eval_table_size, len(self.items))
        done = predictions(self.engine, cfg, self.items[:count])
        if cfg.eval_table_size:
            self.write_table(step, done[: cfg.eval_table_size])
        if not cfg.do_causal_lm_eval:
            return {}
        hypotheses, references = [p.prediction for p in done], [p.reference for p in done]
        scores = corpus_scores(cfg.causal_lm_metrics, hypotheses, references)
        perplexity = None
        if "perplexity" in cfg.causal_lm_metrics:
            perplexity = reference_perplexity(references, cfg, self.engine, mean_nll)
        return scores if perplexity is None else {**scores, "eval/perplexity": perplexity}
