"""Axolotl's benchmark evaluation (`do_bench_eval`, `bench_dataset`): multiple-choice questions, each answered by
one letter A–G, read and tokenized as Axolotl's bench callback reads them.

A row holds `input` (the question with its choices), `output` (the answer letter) and `subject`
(`name: subject`, its accuracy reported under `name`, lowercased with `-` as `_`; `all` when there is no `:`).
Its tokens are the tokenizer's BOS text and `input`, then `output` and the EOS text, each part tokenized
without special tokens and cut to 2048 tokens. A question is kept when the token before EOS is one of the
letters' tokens (Axolotl's filter); the model's answer is the letter it ranks highest at the answer's first
token, the reference is that token's letter (or none, counted wrong, when it is not a letter). Where the
tokenizer has no BOS token, nothing is put before the question (Axolotl writes the text `None` there).

`bench_dataset` is a local .json/.jsonl file, `owner/name/path/in/repo.json` (a file of a hub dataset:
Axolotl's default is pharaouk/dharma-1/dharma_1_mini.json), or `mmlu-zs` / `mmlu-fs` (the zero- and five-shot
MMLU validation files of openaccess-ai-collective/mmlu-evals, grouped by their `subject`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hanzo_gym.config.eval_keys import MMLU_BENCH_NAMES
from hanzo_gym.data.sources import read_rows
from hanzo_gym.errors import DataError

BENCH_LETTERS = "ABCDEFG"
MMLU_REPO = "openaccess-ai-collective/mmlu-evals"
MMLU_FILES = dict(zip(MMLU_BENCH_NAMES, ("zero_shot_mmlu_val.json", *["five_shot_mmlu_val.json"] * 2)))
MAX_PART_TOKENS = 2048  # Axolotl's cut of the question and of the answer


@dataclass(frozen=True)
class BenchQuestion:
    name: str  # the group its accuracy is reported under
    tokens: list[int]  # the question's tokens, then the answer's
    answer_at: int  # index in `tokens` of the answer's first token
    reference: int  # index of the answer's letter in BENCH_LETTERS; -1 when it is not a letter


def bench_rows(value: str) -> list[dict]:
    """The rows of the bench dataset `value` names (see the module's docstring)."""
    local = Path(value).expanduser()
    if local.is_file():
        rows = read_rows(str(local))
    elif value in MMLU_FILES:
        rows = read_rows(MMLU_REPO, data_files=[MMLU_FILES[value]])
    else:
        owner, name, file = value.split("/", 2)
        rows = read_rows(f"{owner}/{name}", data_files=[file])
    for row in rows:
        for field in ("input", "output", "subject"):
            row.string(field, f"bench_dataset `{value}`")
    return [row.data for row in rows]


def group_name(subject: str) -> str:
    """Axolotl's group of a row: `subject` before its first `:`, stripped, lowercased, `-` as `_`."""
    return subject.split(":")[0].strip().lower().replace("-", "_")


def letter_tokens(tokenizer) -> list[int]:
    """Each letter's first token, as it is read alone (Axolotl's `abcd_idx`)."""
    return [tokenizer(letter, add_special_tokens=False).input_ids[0] for letter in BENCH_LETTERS]


def bench_questions(rows: list[dict], tokenizer) -> list[BenchQuestion]:
    """The rows as tokenized questions, those whose answer does not end in a letter's token left out."""
    letters = letter_tokens(tokenizer)
    bos, eos = tokenizer.bos_token or "", tokenizer.eos_token or ""

    def tokens(text: str) -> list[int]:
        return tokenizer(
            text, max_length=MAX_PART_TOKENS, truncation=True, add_special_tokens=False
        ).input_ids

    questions = []
    for row in rows:
        source, target = tokens(f"{bos}{row['input']}"), tokens(f"{row['output']}{eos}")
        if len(target) < 2 or target[-2] not in letters or not source:
            continue
        reference = letters.index(target[0]) if target[0] in letters else -1
        questions.append(BenchQuestion(group_name(row["subject"]), source + target, len(source), reference))
    if not questions:
        raise DataError(
            "bench_dataset: no question has an answer that is one of the letters "
            f"{', '.join(BENCH_LETTERS)} (its `output`)"
        )
    return questions
