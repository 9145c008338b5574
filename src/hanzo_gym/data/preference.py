"""Preference data: for `rl: dpo | ipo | orpo | simpo` each row becomes a prompt and two completions (chosen,
rejected), as tokens; for `rl: kto` a prompt, one completion and its `label` (desirable or not).

Two routes, as TRL 1.16's DPOTrainer tokenizes them:
- Text rows: Axolotl's `chatml.*` / `llama3.*` strategies write the prompt and the completions as text in a fixed
  template; `passthrough` rows hold `prompt` / `chosen` / `rejected` strings. The prompt is tokenized with the
  tokenizer's special tokens (a Llama BOS), each completion gets the eos token unless it ends with it.
- Conversations: `chat_template.*` strategies and `passthrough` rows of message lists are rendered by the run's
  renderer (HF template parity): the prompt with the generation prompt, prompt + completion as a conversation.
- Rows of the user's shape (a `type:` mapping or a `module.function` transform) become passthrough rows first
  (data/preference_transforms.py).

Either way the completion starts where the prompt's tokens and prompt + completion's tokens part (usually right
after the prompt; earlier when a token merges across the boundary), so the pair's tokens are exactly what the
model sees at training. Pairs longer than `sequence_len` are dropped (Axolotl's default `drop`), their completions cut
(`excess_length_strategy: truncate`; a prompt that alone fills `sequence_len` is dropped) or refused (`raise`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hanzo_gym.clock import paced
from hanzo_gym.config import Config, DatasetConfig
from hanzo_gym.data.dataset import DatasetStats, dedupe_shuffle_split, total_stats
from hanzo_gym.data.preference_transforms import as_passthrough
from hanzo_gym.data.sources import Row, read_rows
from hanzo_gym.data.strategies import StrategyContext, role_names
from hanzo_gym.errors import DataError
from hanzo_gym.renderers.base import RendererError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class PreferencePair:
    """A prompt and its two completions as token ids; each sequence the model scores is prompt + completion."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]

    @property
    def tokens(self) -> int:
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected)


@dataclass(frozen=True)
class KtoExample:
    """KTO's unpaired example: a prompt, one completion, and whether the completion is desirable."""

    prompt: list[int]
    completion: list[int]
    desirable: bool

    @property
    def tokens(self) -> int:
        return len(self.prompt) + len(self.completion)


@dataclass
class LoadedPreferences:
    train: list  # PreferencePair for dpo / ipo / orpo / simpo, KtoExample for kto
    val: list
    stats: list[DatasetStats]
    duplicates: int = 0  # left out by dataset_exact_deduplication


# -- Axolotl's text templates ----------------------------------------------------------------------------------

_TURNS = {
    "chatml": (
        "<|im_start|>system\n{}<|im_end|>\n",
        "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
        "{}<|im_end|>",
    ),
    "llama3": (
        "<|start_header_id|>system<|end_header_id|>\n\n{}<|eot_id|>",
        "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "{}<|eot_id|>",
    ),
}


def _first_present(row: Row, keys: tuple[str, ...]) -> str:
    return next((key for key in keys if key in row.data), keys[-1])


def _string(row: Row, key: str, index: int | None = None) -> str:
    """Row field `key` (or the content of its message `index`) as a string; DataError naming file, row, field."""
    value = row.data.get(key)
    if index is not None:
        turn = value[index] if isinstance(value, list) and len(value) > index else None
        value = turn.get("content") if isinstance(turn, dict) else None
        if not isinstance(value, str):
            raise DataError(f"{_where(row)}: field `{key}` needs message {index} with a `content` string")
        return value
    if not isinstance(value, str):
        raise DataError(f"{_where(row)}: field `{key}` is missing or not a string")
    return value


def _text_fields(row: Row, variant: str) -> tuple[str, str, str]:
    """(user prompt, chosen, rejected) as Axolotl's DPO strategy `variant` reads them from the row."""
    if variant == "argilla_chat":
        return _string(row, "chosen", 0), _string(row, "chosen", 1), _string(row, "rejected", 1)
    if variant == "ultra":
        return _string(row, "prompt"), _string(row, "chosen", 1), _string(row, "rejected", 1)
    prompt_keys = {
        "default": ("prompt", "input", "question", "instruction"),
        "icr": ("input",),
        "intel": ("question",),
        "prompt_pairs": ("prompt",),
    }[variant]
    chosen = "chosen" if variant != "default" else _first_present(row, ("chosen", "chosen_response"))
    rejected = "rejected" if variant != "default" else _first_present(row, ("rejected", "rejected_response"))
    return _string(row, _first_present(row, prompt_keys)), _string(row, chosen), _string(row, rejected)


def _kto_text_fields(row: Row, variant: str) -> tuple[str, str]:
    """(user prompt, completion) as Axolotl's KTO strategy `variant` reads them from the row."""
    if variant == "argilla_chat":
        return _string(row, "completion", 0), _string(row, "completion", 1)
    prompt_key = {"argilla": "instruction", "intel": "question", "prompt_pairs": "prompt", "ultra": "prompt"}
    return _string(row, prompt_key[variant]), _string(row, "completion")


def templated_texts(row: Row, ds_type: str, kto: bool = False) -> tuple[str, ...]:
    """The prompt and completions (chosen and rejected; KTO's one completion) as Axolotl's `chatml.*` /
    `llama3.*` strategies write them."""
    family, variant = ds_type.split(".", 1)
    system_turn, user_turn, completion = _TURNS[family]
    user, *answers = _kto_text_fields(row, variant) if kto else _text_fields(row, variant)
    system = row.data.get("system") if variant != "argilla_chat" else None
    prompt = (system_turn.format(system) if isinstance(system, str) and system else "") + user_turn.format(
        user
    )
    return prompt, *(completion.format(answer) for answer in answers)


# -- conversations ----------------------------------------------------------------------------------------------


def _message(value: Any, row: Row, ds: DatasetConfig, where: str, default_role: str) -> dict[str, str]:
    mapping = ds.mappings
    if isinstance(value, str):
        return {"role": default_role, "content": value}
    if not isinstance(value, dict):
        raise DataError(f"{_where(row)}: {where} is neither a string nor a message object")
    role, content = value.get(mapping.role), value.get(mapping.content)
    names = role_names(ds)
    if not isinstance(role, str) or role not in names:
        raise DataError(
            f"{_where(row)}: {where} has role {role!r}, which `roles` does not map (known: {', '.join(names)})"
        )
    if not isinstance(content, str):
        raise DataError(f"{_where(row)}: {where} has no `{mapping.content}` string")
    return {"role": names[role], "content": content}


def _messages(value: Any, row: Row, ds: DatasetConfig, field: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise DataError(f"{_where(row)}: field `{field}` is missing or not a list of messages")
    return [_message(turn, row, ds, f"`{field}` message {i}", "user") for i, turn in enumerate(value)]


def _last_message(row: Row, ds: DatasetConfig, field: str) -> dict[str, str]:
    value = row.data.get(field)
    if isinstance(value, list):
        if not value:
            raise DataError(f"{_where(row)}: field `{field}` is an empty list")
        value = value[-1]
    if value is None:
        raise DataError(f"{_where(row)}: row has no `{field}`")
    return _message(value, row, ds, f"`{field}`", "assistant")


def conversations(row: Row, ds: DatasetConfig) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt messages, chosen messages, rejected messages) for conversational types."""
    chosen_field, rejected_field = ds.field_chosen, ds.field_rejected
    if ds.type == "chat_template.default":
        prompt = _messages(row.data.get(ds.field_messages), row, ds, ds.field_messages)
        return prompt, [_last_message(row, ds, chosen_field)], [_last_message(row, ds, rejected_field)]
    if ds.type in ("chat_template.argilla_chat", "chat_template.argilla"):
        history = _messages(row.data.get(chosen_field), row, ds, chosen_field)[:-1]
        system = row.data.get("system")
        if isinstance(system, str) and system and ds.type == "chat_template.argilla":
            history.insert(0, {"role": "system", "content": system})
        return history, [_last_message(row, ds, chosen_field)], [_last_message(row, ds, rejected_field)]
    # passthrough with message lists (TRL's conversational preference format, explicit or implicit prompt)
    chosen = _messages(row.data.get(chosen_field), row, ds, chosen_field)
    rejected = _messages(row.data.get(rejected_field), row, ds, rejected_field)
    if "prompt" in row.data:
        return _messages(row.data["prompt"], row, ds, "prompt"), chosen, rejected
    shared = 0
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


# -- tokens -----------------------------------------------------------------------------------------------------


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def split_completions(prompt: list[int], *whole: list[int]) -> tuple[list[int], ...]:
    """TRL's rule: the completions start where the tokenized prompt and every prompt + completion first differ.
    Returns the prompt, then each completion."""
    length = min(common_prefix(prompt, sequence) for sequence in whole)
    return prompt[:length], *(sequence[length:] for sequence in whole)


def split_pair(prompt: list[int], prompt_chosen: list[int], prompt_rejected: list[int]) -> PreferencePair:
    return PreferencePair(*split_completions(prompt, prompt_chosen, prompt_rejected))


def _with_eos(text: str, tokenizer: PreTrainedTokenizerBase) -> str:
    # TRL appends the eos token to a text completion that lacks it (conversations end as the template says)
    eos = tokenizer.eos_token or ""
    return text if text.endswith(eos) else text + eos


def _desirable(row: Row) -> bool:
    label = row.data.get("label")
    if not isinstance(label, bool):
        raise DataError(
            f"{_where(row)}: field `label` is missing or not true/false (KTO: is the completion good?)"
        )
    return label


def kto_from_row(row: Row, ds: DatasetConfig, ctx: StrategyContext) -> KtoExample:
    """The row's KTO example (prompt, completion, label), untruncated."""
    tokenizer = ctx.tokenizer
    if ds.type == "passthrough" and isinstance(row.data.get("completion"), list):
        prompt_messages = _messages(row.data.get("prompt"), row, ds, "prompt")
        completion = _messages(row.data.get("completion"), row, ds, "completion")
        renderer = ctx.renderer
        try:
            prompt = renderer.build_generation_prompt(prompt_messages).to_ints()
            whole = renderer.render(prompt_messages + completion).tokens()
        except RendererError as exc:
            raise DataError(f"{_where(row)}: {exc}") from None
    else:
        if ds.type == "passthrough":
            prompt_text, completion_text = _string(row, "prompt"), _string(row, "completion")
        else:
            prompt_text, completion_text = templated_texts(row, ds.type, kto=True)
        prompt = tokenizer.encode(prompt_text)
        whole = tokenizer.encode(prompt_text + _with_eos(completion_text, tokenizer))
    prompt, completion_ids = split_completions(prompt, whole)
    return KtoExample(prompt, completion_ids, _desirable(row))


def is_conversational(row: Row, ds: DatasetConfig) -> bool:
    if ds.type.startswith("chat_template."):
        return True
    if ds.type == "passthrough":
        return isinstance(row.data.get(ds.field_chosen), list)
    return False


def pair_from_row(row: Row, ds: DatasetConfig, ctx: StrategyContext) -> PreferencePair:
    """The row's pair, untruncated. The renderer (`ctx.chat_template`) is resolved on the first conversation."""
    tokenizer = ctx.tokenizer
    if is_conversational(row, ds):
        prompt_messages, chosen, rejected = conversations(row, ds)
        renderer = ctx.renderer
        try:
            prompt = renderer.build_generation_prompt(prompt_messages).to_ints()
            with_chosen = renderer.render(prompt_messages + chosen).tokens()
            with_rejected = renderer.render(prompt_messages + rejected).tokens()
        except RendererError as exc:
            raise DataError(f"{_where(row)}: {exc}") from None
        return split_pair(prompt, with_chosen, with_rejected)
    if ds.type == "passthrough":
        texts = (_string(row, "prompt"), _string(row, ds.field_chosen), _string(row, ds.field_rejected))
    else:
        texts = templated_texts(row, ds.type)
    prompt, chosen, rejected = texts
    chosen, rejected = _with_eos(chosen, tokenizer), _with_eos(rejected, tokenizer)
    encode = tokenizer.encode
    return split_pair(encode(prompt), encode(prompt + chosen), encode(prompt + rejected))


def _completions(item: PreferencePair | KtoExample) -> tuple[list[int], ...]:
    return (item.completion,) if isinstance(item, KtoExample) else (item.chosen, item.rejected)


def _fitted(item, sequence_len: int, truncate: bool):
    """The pair or KTO example within `sequence_len` (prompt + each completion), or None when it is dropped."""
    room = sequence_len - len(item.prompt)
    if max(len(c) for c in _completions(item)) <= room:
        return item
    if not truncate or room < 1:
        return None
    if isinstance(item, KtoExample):
        return KtoExample(item.prompt, item.completion[:room], item.desirable)
    return PreferencePair(item.prompt, item.chosen[:room], item.rejected[:room])


def items_from_rows(
    rows: Iterable[Row],
    ds: DatasetConfig,
    ctx: StrategyContext,
    sequence_len: int,
    excess_length_strategy: str = "drop",
    kto: bool = False,
) -> tuple[list, DatasetStats]:
    """Each row's pair (KTO: example), fitted to `sequence_len`; items with an empty prompt or completion are
    dropped."""
    stats = DatasetStats(ds.path)
    kept = []
    for row in rows:
        whole = kto_from_row(row, ds, ctx) if kto else pair_from_row(row, ds, ctx)
        pair = _fitted(whole, sequence_len, excess_length_strategy == "truncate")
        if pair is not whole and excess_length_strategy == "raise":
            longest = len(whole.prompt) + max(len(c) for c in _completions(whole))
            raise DataError(
                f"{_where(row)}: prompt + completion is {longest} tokens, over sequence_len {sequence_len} "
                "(excess_length_strategy: raise); raise sequence_len or use `drop` / `truncate`"
            )
        if pair is None:
            stats.too_long += 1
            continue
        if not pair.prompt or not all(_completions(pair)):
            stats.dropped += 1
            continue
        stats.truncated += pair is not whole
        kept.append(pair)
        stats.examples += 1
        stats.tokens += pair.tokens
        stats.trained_tokens += sum(len(c) for c in _completions(pair))
    return kept, stats


def load_preferences(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> LoadedPreferences:
    """Every dataset's pairs (KTO: examples), shuffled with the run's seed and split into train and validation."""
    ctx = StrategyContext(tokenizer=tokenizer, chat_template=cfg.chat_template, eot_tokens=cfg.eot_tokens)
    strategy = cfg.excess_length_strategy
    stats: list[DatasetStats] = []

    def pairs_of(datasets: list[DatasetConfig], held_out: bool) -> list[PreferencePair]:
        pairs: list[PreferencePair] = []
        for index, ds in enumerate(datasets):
            rows = read_rows(ds.path, split=ds.split, data_files=ds.data_files, name=ds.name)
            if not held_out:  # a transform of the user's names its entry of `datasets`
                rows, ds = as_passthrough(cfg, index, rows, tokenizer)
            kept, ds_stats = items_from_rows(
                paced(rows, f"tokenizing {ds.path}"), ds, ctx, cfg.sequence_len, strategy, kto=cfg.rl == "kto"
            )
            pairs.extend(kept)
            stats.append(ds_stats)
        return pairs

    pairs = pairs_of(cfg.datasets, held_out=False)
    held_out = pairs_of(cfg.test_datasets, held_out=True) if cfg.test_datasets else None
    train, val, duplicates = dedupe_shuffle_split(pairs, cfg, held_out)
    return LoadedPreferences(train, val, [*stats, total_stats(stats)], duplicates)


def unteachable_notes(train: list, method: str) -> list[str]:
    """What in the training items cannot teach, said at load with counts: pairs whose chosen and rejected
    completions are the same (the preference term of their loss does not depend on the weights), or a KTO set
    with one label only."""
    if not train:
        return []
    if isinstance(train[0], KtoExample):
        desirable = sum(item.desirable for item in train)
        if 0 < desirable < len(train):
            return []
        kind, other = ("desirable", "undesirable") if desirable else ("undesirable", "desirable")
        message = (
            f"all {len(train)} KTO training examples are {kind}, none {other}: KTO weighs one kind against "
            "the other, so check the label field (`label`, true for desirable)"
        )
        return [message]
    same = sum(pair.chosen == pair.rejected for pair in train)
    if not same:
        return []
    taught = (
        "only ORPO's NLL of the chosen completion trains on them"
        if method == "orpo"
        else "they teach nothing"
    )
    message = (
        f"{same} of {len(train)} training pairs have the same chosen and rejected completion: their preference "
        f"term is the same whatever the weights, so {taught} (check field_chosen / field_rejected)"
    )
    return [message]


def _where(row: Row) -> str:
    return f"{row.file} row {row.line}"
