"""Axolotl's `dataset_prepared_path`: a folder that keeps the tokenized datasets of a run, so that the next run
(or `gym train` after `gym preprocess`) reads them instead of tokenizing again.

Each entry is `<dataset_prepared_path>/<key>/`, where the key is a hash of everything the tokenized result
depends on: the content of every data file read, the tokenizer (its vocabulary, merges, normalization,
special tokens and chat template), the config keys the loaders read, the source file of a user transform
(`type: module.function`), and the hanzo-gym version. A changed
data file, tokenizer or key therefore prepares a new entry; nothing stale is ever read. (Axolotl hashes the
config alone, so an edited data file under the same path is not noticed.) `inputs.json` beside the data
says what the key was computed from. Entries are JSON (no pickled objects: a folder from elsewhere cannot
run code) and published whole, so a crash leaves none half-written.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hanzo_gym import __version__
from hanzo_gym.config.dataset_types import is_user_transform
from hanzo_gym.data.dataset import DatasetStats, LoadedData
from hanzo_gym.data.example import Example
from hanzo_gym.data.preference import KtoExample, LoadedPreferences, PreferencePair
from hanzo_gym.data.prepared_hub import DATA_FILE, INPUTS_FILE, hub_key, pull_entry, push_entry
from hanzo_gym.data.prompts import LoadedPrompts, Prompt
from hanzo_gym.data.sources import data_file_paths
from hanzo_gym.data.user_transforms import user_code_module
from hanzo_gym.errors import DataError
from hanzo_gym.files import publish_directory
from hanzo_gym.rewards.user_code import import_user_module

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hanzo_gym.config import Config

Loaded = TypeVar("Loaded", LoadedData, LoadedPreferences, LoadedPrompts)

FORMAT = (
    4  # 2: prompts keep their messages; 3: the count of duplicates left out; 4: completion texts in pieces
)
# Every config key a loader of `hanzo_gym.data` reads (dataset.py, preference.py, prompts.py).
DATA_KEYS = (
    "datasets",
    "sequence_len",
    "chat_template",
    "eot_tokens",
    "train_on_inputs",
    "excess_length_strategy",
    "special_tokens",
    "rl",
    "val_set_size",
    "test_datasets",
    "seed",
    "dataset_exact_deduplication",
)
_ITEM_TYPES = {cls.__name__: cls for cls in (Example, PreferencePair, KtoExample, Prompt)}
_LOADED_TYPES = {cls.__name__: cls for cls in (LoadedData, LoadedPreferences, LoadedPrompts)}


def load_prepared(
    cfg: Config,
    tokenizer: PreTrainedTokenizerBase,
    load: Callable[[Config, PreTrainedTokenizerBase], Loaded],
    write: bool = True,
) -> tuple[Loaded, str | None]:
    """`load(cfg, tokenizer)`, read from or saved to `cfg.dataset_prepared_path` when it is set, and with
    `push_dataset_to_hub` read from or pushed to that hub dataset repo (data/prepared_hub.py), and a line saying
    which (None when neither key is set). `write=False` (the other ranks under torchrun) never writes or pushes."""
    repo = cfg.push_dataset_to_hub
    if not cfg.dataset_prepared_path and not repo:
        return load(cfg, tokenizer), None
    inputs = prepared_inputs(cfg, tokenizer)
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]
    entry = Path(cfg.dataset_prepared_path).expanduser() / key if cfg.dataset_prepared_path else None
    if entry is not None and (entry / DATA_FILE).is_file():
        return _read(entry / DATA_FILE), f"dataset_prepared_path: read the prepared datasets from {entry}"
    pulled = pull_entry(repo, hub_key(inputs)) if repo else None
    loaded = _read(pulled) if pulled is not None else load(cfg, tokenizer)
    if not write:
        return loaded, None
    lines = []
    if pulled is not None:
        lines.append(f"push_dataset_to_hub: read the prepared datasets from hub dataset `{repo}`")
    if entry is not None:
        try:
            publish_directory(lambda tmp: _write(tmp, loaded, inputs), entry)
        except OSError as error:
            raise DataError(
                f"dataset_prepared_path: cannot write {entry} ({error}); point it at a writable folder or leave it "
                "empty"
            ) from None
        lines.append(f"dataset_prepared_path: saved the prepared datasets to {entry}")
    if repo and pulled is None:
        lines.append(push_entry(repo, hub_key(inputs), _document(loaded), inputs))
    return loaded, "\n".join(lines)


def prepared_inputs(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """What a prepared entry depends on, as JSON: its hash is the entry's name."""
    settings = cfg.model_dump(mode="json", include=set(DATA_KEYS))
    if not cfg.shuffles_at_load:  # only then, so that the entries written before the key still match
        settings["shuffle_merged_datasets"] = False
    if any(ds.type == "pretrain" for ds in cfg.datasets):  # packed windows, or each text cut short
        settings["sample_packing"] = cfg.sample_packing
    files = {
        str(path): _file_sha256(path)
        for ds in cfg.datasets
        for path in data_file_paths(ds.path, ds.split, ds.data_files, ds.name)
    }
    transforms = {
        ds.type: _file_sha256(Path(_transform_file(cfg, index)))
        for index, ds in enumerate(cfg.datasets)
        if is_user_transform(ds.type)
    }
    return {
        "format": FORMAT,
        "hanzo_gym": __version__,
        "config": settings,
        "data_files": files,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        **({"transforms": transforms} if transforms else {}),  # the source of each user transform's module
    }


def _transform_file(cfg: Config, index: int) -> str:
    what = f"datasets[{index}].type `{cfg.datasets[index].type}`"
    return import_user_module(what, user_code_module(cfg, index)).__file__


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of what the tokenizer turns text into: its full serialization where it has one (vocabulary,
    merges, normalizer, pre-tokenizer, post-processor), its special tokens and its chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = [
        type(tokenizer).__name__,
        backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items())),
        json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str),
        json.dumps(tokenizer.chat_template, sort_keys=True, default=str),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write(directory: Path, loaded: Any, inputs: dict) -> None:
    (directory / DATA_FILE).write_text(json.dumps(_document(loaded), separators=(",", ":")))
    (directory / INPUTS_FILE).write_text(json.dumps(inputs, indent=2, sort_keys=True) + "\n")


def _document(loaded: Any) -> dict[str, Any]:
    """What prepared.json holds: plain JSON of the loaded data."""
    document = {"format": FORMAT, "kind": type(loaded).__name__}
    for field in fields(loaded):
        value = getattr(loaded, field.name)
        if field.name in ("train", "val"):
            document[f"{field.name}_kind"] = type(value[0]).__name__ if value else None
            value = [asdict(item) for item in value]
        elif field.name == "stats":
            value = [asdict(stat) for stat in value]
        document[field.name] = value
    return document


def _read(path: Path) -> Any:
    try:
        document = json.loads(path.read_text())
        cls = _LOADED_TYPES[document["kind"]]
        values = {}
        for field in fields(cls):
            value = document[field.name]
            if field.name in ("train", "val"):
                item = _ITEM_TYPES[document[f"{field.name}_kind"]] if value else None
                value = [item(**entry) for entry in value]
            elif field.name == "stats":
                value = [DatasetStats(**stat) for stat in value]
            values[field.name] = value
        return cls(**values)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(
            f"dataset_prepared_path: {path} is damaged ({type(error).__name__}: {error}); delete {path.parent} "
            "and run again to prepare it anew"
        ) from None
