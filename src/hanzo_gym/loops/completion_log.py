"""TRL's `log_completions` for GRPO: the completions sampled in the steps a metrics row covers — prompt, completion,
each reward function's score and the advantage, every process's gathered — go, at the row's step, to
`completions.jsonl` and to the trackers as a table (TRL's `completions`), and the first `num_completions_to_print`
(TRL's default None: all) are printed. TRL writes a parquet file per row under completions/; here one JSONL."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hanzo_gym.engine.distributed import gather_objects
from hanzo_gym.loops.run_dir import RunDir
from hanzo_gym.rewards.base import Completion

SHOWN_CHARACTERS = 200  # of a prompt or completion in a printed line


class CompletionLog:
    def __init__(self, run: RunDir, to_print: int | None, say: Callable[[str], None]):
        self.run, self.to_print, self.say = run, to_print, say
        self.pending: list[dict] = []

    def add(
        self, completions: Sequence[Completion], scores: dict[str, list[float]], advantages: Sequence[float]
    ) -> None:
        """This process's completions of one step, in order, with their scores and advantages."""
        for i, completion in enumerate(completions):
            prompt = list(completion.prompt_messages) if completion.prompt_messages else completion.prompt
            record = {"prompt": prompt, "completion": completion.text}
            record.update({name: values[i] for name, values in scores.items()})
            self.pending.append({**record, "advantage": advantages[i]})

    def flush(self, step: int) -> None:
        """At a logged row (on every process: the records are gathered)."""
        records = [{"step": step, **r} for part in gather_objects(self.pending) for r in part]
        self.pending = []
        self.run.log_completions(step, records)
        for record in records if self.to_print is None else records[: self.to_print]:
            shown = " ".join(
                f"{key} {_short(value)}"
                for key, value in record.items()
                if key not in ("step", "prompt", "completion")
            )
            self.say(
                f"step {step} completion: {_short(record['prompt'])} → {_short(record['completion'])} {shown}"
            )


def _short(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARACTERS else text[: SHOWN_CHARACTERS - 1] + "…"
