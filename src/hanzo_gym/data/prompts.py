"""RL prompts from the same datasets and strategies as SFT: what the model is asked, and the reference answer
the rewards compare against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hanzo_gym.clock import paced
from hanzo_gym.config import Config, DatasetConfig
from hanzo_gym.config.dataset_types import is_user_transform
from hanzo_gym.data.dataset import dedupe_shuffle_split
from hanzo_gym.data.sources import Row, read_rows
from hanzo_gym.data.strategies import canonical_role, chat_messages, instruction_prompt
from hanzo_gym.data.user_transforms import load_user_transform
from hanzo_gym.errors import DataError
from hanzo_gym.renderers import Renderer
from hanzo_gym.renderers.chat_templates import resolve_renderer
from hanzo_gym.renderers.instruction_formats import field_names

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class Prompt:
    tokens: list[int]
    text: str
    answer: str | None
    messages: list[dict] | None = None  # the conversation the prompt renders, for chat and alpaca rows
    columns: dict | None = None  # the row's other fields (TRL hands them to reward functions by name)


@dataclass
class LoadedPrompts:
    train: list[Prompt]
    val: list[Prompt]
    dropped: int  # longer than sequence_len
    duplicates: int = 0  # left out by dataset_exact_deduplication


def _row_answer(row: Row) -> str | None:
    for key in ("answer", "solution"):
        if isinstance(row.data.get(key), str):
            return row.data[key]
    return None


def prompt_from_row(
    row: Row, ds: DatasetConfig, tokenizer: PreTrainedTokenizerBase, renderer: Renderer | None
) -> Prompt:
    """chat_template: the turns before the last assistant turn, opened for a new assistant turn, with that
    turn's content as the answer (no assistant turn: all turns, answer from the row's `answer`/`solution`);
    alpaca: the instruction (and input) as one user turn, answer = output; completion: the text itself; a
    transform of the user's: TRL's `prompt` field, a message list or a string (data/user_transforms.py)."""
    if is_user_transform(ds.type):
        return _trl_prompt(row, ds, tokenizer, renderer)
    if ds.type == "completion":
        text = row.string(ds.field, "field")
        columns = _other_columns(row, (ds.field,))
        return Prompt(tokenizer.encode(text, add_special_tokens=True), text, _row_answer(row), None, columns)
    if _text_format(ds):
        # alpaca:<style> or a format of the user's: the prompt is its text, as SFT on the same rows trains it
        text, answer = instruction_prompt(row, ds)
        columns = _other_columns(row, ds.instruction_fields)
        return Prompt(tokenizer.encode(text, add_special_tokens=True), text, answer, None, columns)
    if ds.type == "alpaca":
        instruction = row.string(ds.field_instruction, "field_instruction")
        extra = row.data.get(ds.field_input)
        content = f"{instruction}\n\n{extra}" if isinstance(extra, str) and extra else instruction
        messages, answer = [{"role": "user", "content": content}], row.data.get(ds.field_output)
    else:
        messages = chat_messages(row, ds)
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            answer = _row_answer(row)
        else:
            messages, answer = messages[:last], messages[last]["content"]
    if renderer is None:
        raise DataError(f"{row.file}: {ds.type} prompts need a chat template")
    tokens = renderer.build_generation_prompt(messages).to_ints()
    columns = _other_columns(row, (ds.field_messages, ds.field_instruction, ds.field_input))
    return Prompt(
        tokens, tokenizer.decode(tokens), answer if isinstance(answer, str) else None, messages, columns
    )


def _text_format(ds: DatasetConfig) -> bool:
    """An instruction format whose prompt is text of its own; plain `alpaca` asks through the chat template."""
    return ds.instruction_format is not None and ds.type != "alpaca"


def _trl_prompt(
    row: Row, ds: DatasetConfig, tokenizer: PreTrainedTokenizerBase, renderer: Renderer | None
) -> Prompt:
    prompt = row.data.get("prompt")
    columns = _other_columns(row, ("prompt",))
    if isinstance(prompt, str):
        return Prompt(
            tokenizer.encode(prompt, add_special_tokens=True), prompt, _row_answer(row), None, columns
        )
    if not isinstance(prompt, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt
    ):
        raise DataError(
            f"{row.file} row {row.line}: {ds.type} gave no `prompt` as a string or a list of "
            "{role, content} messages (TRL's prompt format)"
        )
    if renderer is None:
        raise DataError(f"{row.file}: chat prompts need a chat template")
    messages = [{**m, "role": canonical_role(m["role"])} for m in prompt]
    tokens = renderer.build_generation_prompt(messages).to_ints()
    return Prompt(tokens, tokenizer.decode(tokens), _row_answer(row), messages, columns)


def _other_columns(row: Row, prompt_fields: tuple) -> dict:
    read = field_names(prompt_fields)
    return {key: value for key, value in row.data.items() if key not in read}


def load_prompts(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> LoadedPrompts:
    every = (*cfg.datasets, *(cfg.test_datasets or []))
    needs_template = any(ds.type != "completion" and not _text_format(ds) for ds in every)
    renderer = resolve_renderer(cfg.chat_template, tokenizer) if needs_template else None
    dropped = 0

    def prompts_of(datasets: list[DatasetConfig]) -> list[Prompt]:
        nonlocal dropped
        prompts: list[Prompt] = []
        for index, ds in enumerate(datasets):
            rows = read_rows(ds.path, split=ds.split, data_files=ds.data_files, name=ds.name)
            if is_user_transform(ds.type):  # of `datasets` only (test_datasets hold none)
                rows = list(map(load_user_transform(cfg, index, tokenizer), rows))
            for row in paced(rows, f"tokenizing {ds.path}"):
                prompt = prompt_from_row(row, ds, tokenizer, renderer)
                if len(prompt.tokens) > cfg.sequence_len:
                    dropped += 1  # a cut prompt would ask a different question: drop it
                    continue
                prompts.append(prompt)
        return prompts

    prompts = prompts_of(cfg.datasets)
    held_out = prompts_of(cfg.test_datasets) if cfg.test_datasets else None
    train, val, duplicates = dedupe_shuffle_split(prompts, cfg, held_out)
    return LoadedPrompts(train, val, dropped, duplicates)
