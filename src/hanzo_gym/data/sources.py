"""Read dataset rows from a local file, a local directory or a Hugging Face Hub dataset repo.

Every row keeps the file and line it came from, so later validation errors can point at it.
A split is `name` or `name[lo:hi]`, where each bound is empty, a row index or a percent (`10%`).
"""

from __future__ import annotations

import codecs
import contextvars
import difflib
import fnmatch
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from huggingface_hub import (
    constants,
    get_cached_repo_tree,
    hf_hub_download,
    list_repo_files,
    snapshot_download,
)
from huggingface_hub.errors import (
    CachedRepoTreeNotFoundError,
    HfHubHTTPError,
    HFValidationError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
)

from hanzo_gym.config.splits import Split
from hanzo_gym.errors import DataError
from hanzo_gym.launch import is_launched_main

logger = logging.getLogger(__name__)

DATA_EXTENSIONS = (".jsonl", ".json", ".parquet")
SPLIT_WORDS = ("train", "test", "validation", "valid", "dev")
# Set while `data_file_paths` lists files for a fingerprint: the selection is printed when the rows are read.
_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("quiet_selection", default=False)

# HfHubHTTPError subclasses httpx2.HTTPError, so this covers hub error answers and lost connections alike.
HUB_UNAVAILABLE = (OfflineModeIsEnabled, httpx2.HTTPError, LocalEntryNotFoundError)

# The words of a file or folder name: runs of letters, runs of digits (split on `-_. ` and the like).
_TOKEN_RE = re.compile(r"[^\W\d_]+|\d+")


@dataclass(frozen=True)
class Row:
    """One JSON object, the file it came from and its 1-based line (jsonl) or row number (json, parquet)."""

    data: dict
    file: str
    line: int

    def string(self, field: str, setting: str) -> str:
        """The row's `field`, which must be a string; DataError naming the row and the setting that named it."""
        value = self.data.get(field)
        if not isinstance(value, str):
            raise DataError(
                f"{self.file} row {self.line}: row has no `{field}` string ({setting} = `{field}`)"
            )
        return value


def read_rows(
    path: str, split: str | None = None, data_files: list[str] | None = None, name: str | None = None
) -> list[Row]:
    """Rows of `path` (a file, a directory or a hub dataset id) for `split` (default train), in file order;
    `name` picks one of the dataset's configurations (its README's `configs`), as `load_dataset(path, name)`."""
    spec = Split.parse("train" if split is None else split)
    if name is not None:
        data_files = config_data_files(path, name, spec.name, data_files)
    files = _source_files(path, spec.name, data_files)
    rows = [row for label, local in files for row in _read_file(local, label)]
    lo, hi = spec.bounds(len(rows))
    return rows[lo:hi]


def data_file_paths(
    path: str, split: str | None = None, data_files: list[str] | None = None, name: str | None = None
) -> list[Path]:
    """The local files `read_rows` reads for this dataset, without printing the folder's file selection
    (`read_rows` prints it when it reads them)."""
    token = _QUIET.set(True)
    try:
        split_name = Split.parse(split or "train").name
        if name is not None:
            data_files = config_data_files(path, name, split_name, data_files)
        return [local for _, local in _source_files(path, split_name, data_files)]
    finally:
        _QUIET.reset(token)


def config_data_files(path: str, name: str, split_name: str, data_files: list[str] | None) -> list[str]:
    """The files of configuration `name` for `split_name`, from the `configs` block of the dataset's README
    front matter (the Hugging Face Hub's dataset-card format): each `data_files` pattern, matched against
    the dataset's files."""
    where = f"dataset `{path}`"
    if data_files:
        raise DataError(f"{where}: give `name` (a configuration) or `data_files`, not both")
    local = Path(path).expanduser()
    if local.is_file():
        raise DataError(
            f"{where} is a single file; `name` picks a configuration of a dataset folder or hub repo"
        )
    if local.is_dir():
        listing = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        readme = (local / "README.md").read_text(encoding="utf-8") if (local / "README.md").is_file() else ""
    else:
        token = _QUIET.set(True)
        try:
            [(_, card)] = _hub_files(path, split_name, ["README.md"])  # the hub's errors, said once, here
        finally:
            _QUIET.reset(token)
        readme, listing = card.read_text(encoding="utf-8"), _hub_listing(path)
    configs = _card_configs(readme)
    if name not in configs:
        known = ", ".join(sorted(configs)) or "none (its README has no `configs` block)"
        raise DataError(f"{where} has no configuration `{name}`; its configurations: {known}")
    patterns = configs[name].get(split_name)
    if patterns is None:
        raise DataError(
            f"{where}, configuration `{name}`, has no split `{split_name}`; its splits: {', '.join(configs[name])}"
        )
    chosen = [file for file in listing if any(fnmatch.fnmatch(file, pattern) for pattern in patterns)]
    if not chosen:
        raise DataError(f"{where}, configuration `{name}`, split `{split_name}`: no file matches {patterns}")
    return chosen


def _hub_listing(repo_id: str) -> list[str]:
    """Every file of a hub dataset: from the hub, else from the cache (which `_hub_files` just used)."""
    try:
        return list_repo_files(repo_id, repo_type="dataset")
    except HUB_UNAVAILABLE:
        try:
            return [entry.path for entry in get_cached_repo_tree(repo_id, repo_type="dataset")]
        except CachedRepoTreeNotFoundError:
            snapshot = Path(snapshot_download(repo_id, repo_type="dataset", local_files_only=True))
            return [file.relative_to(snapshot).as_posix() for file in snapshot.rglob("*") if file.is_file()]


def _card_configs(readme: str) -> dict[str, dict[str, list[str]]]:
    """config name → split → file patterns, from a dataset card's YAML front matter."""
    if not readme.startswith("---"):
        return {}
    front = readme.split("---", 2)[1] if readme.count("---") >= 2 else ""
    try:
        card = yaml.safe_load(front) or {}
    except yaml.YAMLError:
        return {}
    configs = {}
    for entry in card.get("configs") or []:
        if not isinstance(entry, dict) or "config_name" not in entry:
            continue
        files = entry.get("data_files", [])
        splits: dict[str, list[str]] = {}
        for item in files if isinstance(files, list) else [files]:
            if isinstance(item, dict):
                paths = item.get("path", [])
                splits.setdefault(str(item.get("split", "train")), []).extend(
                    [paths] if isinstance(paths, str) else paths
                )
            elif isinstance(item, str):
                splits.setdefault("train", []).append(item)
        configs[str(entry["config_name"])] = splits
    return configs


def _source_files(path: str, split_name: str, data_files: list[str] | None) -> list[tuple[str, Path]]:
    """(name used in rows and messages, local path) of each file to read, in reading order."""
    local = Path(path).expanduser()
    if path in FILE_BUILDERS and not local.exists():
        return _builder_files(path, data_files)
    if local.is_file():
        if data_files:
            raise DataError(
                f"data_files is set but `{path}` is a single file: remove data_files, or set the path to the "
                "directory that holds those files"
            )
        return [(path, local)]
    if local.is_dir():
        return _directory_files(local, split_name, data_files)
    if names_a_local_path(path):
        raise DataError(_no_such_path(path, local))
    return _hub_files(path, split_name, data_files)


# Endings of local data files: a path with one names a file (a hub dataset id is `owner/name`), as does one that
# starts like a folder
_FILE_ENDINGS = (*DATA_EXTENSIONS, ".csv", ".tsv", ".txt", ".arrow", ".gz", ".zst", ".bz2", ".xz")


def names_a_local_path(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~", ".\\")) or path.lower().endswith(_FILE_ENDINGS)


def _no_such_path(path: str, local: Path) -> str:
    """A missing local path, with the nearest name in its folder (no hub call: the hub has no such id)."""
    folder = local.parent
    if not folder.is_dir():
        return f"`{path}`: no such file or folder (and no folder {folder}); fix the path"
    near = difflib.get_close_matches(local.name, sorted(entry.name for entry in folder.iterdir()), n=1)
    hint = f"; did you mean `{folder / near[0] if str(folder) != '.' else near[0]}`?" if near else "; fix the path"
    return f"`{path}`: no such file or folder{hint}"


# `datasets.load_dataset`'s builders named by file format: `path: json` with `data_files` reads those files
FILE_BUILDERS = ("json", "parquet", "csv", "text")


def _builder_files(builder: str, data_files: list[str] | None) -> list[tuple[str, Path]]:
    if not data_files:
        raise DataError(f"path: {builder} names a file format: give the files to read in `data_files`")
    if builder in ("csv", "text"):
        raise DataError(
            f"path: {builder}: {builder} files are not read yet; convert them to .jsonl or .parquet"
        )
    for name in data_files:
        if not Path(name).expanduser().is_file():
            raise DataError(f"data_files entry `{name}` (path: {builder}) is not a file; fix the name")
    return [(name, Path(name).expanduser()) for name in data_files]


def _directory_files(
    directory: Path, split_name: str, data_files: list[str] | None
) -> list[tuple[str, Path]]:
    if data_files:
        for name in data_files:
            if not (directory / name).is_file():
                raise DataError(
                    f"data_files entry `{name}` not found: {directory / name} is not a file; "
                    "fix the name or remove it from data_files"
                )
        names = list(data_files)
    else:
        found = sorted(
            entry.name for entry in directory.iterdir() if entry.is_file() and _is_data_file(entry.name)
        )
        names, skipped = split_selection(found, split_name, str(directory))
        _report_selection(str(directory), split_name, names, skipped)
    return [(str(directory / name), directory / name) for name in names]


def _is_data_file(name: str) -> bool:
    return name.lower().endswith(DATA_EXTENSIONS)


def names_split(path: str, split_name: str) -> bool:
    """Whether a folder or file name on `path` holds the words of `split_name` as whole words, in a row. Names
    are cut into lower-case words at anything but letters and digits and where letters meet digits, so
    `train-00000-of-00002.parquet`, `Train.jsonl`, `train0.jsonl` and `data/train/x.jsonl` name `train`,
    `train_sft-0.parquet` names `train_sft` (and `train`), and `constraints.jsonl` names no split."""
    wanted = _words(split_name)
    for part in path.split("/"):
        words = _words(part)
        if wanted and any(words[i : i + len(wanted)] == wanted for i in range(len(words) - len(wanted) + 1)):
            return True
    return False


def _words(text: str) -> list[str]:
    return _TOKEN_RE.findall(text.lower())


def split_selection(names: list[str], split_name: str, where: str) -> tuple[list[str], list[str]]:
    """(chosen, skipped) of `names` for `split_name`: the files that name the split (Hugging Face's
    `{split}[-._0-9]` rule, see `names_split`); when none does, the files that name no split at all."""
    chosen = [name for name in names if names_split(name, split_name)]
    if not chosen:
        chosen = [name for name in names if not any(names_split(name, word) for word in SPLIT_WORDS)]
    if not chosen:
        raise DataError(
            f"no data files for split `{split_name}` in {where}: files seen: {_name_list(names)}. "
            f"Use a split name that appears in a file name, or list the files in data_files"
        )
    kept = set(chosen)
    return chosen, [name for name in names if name not in kept]


def describe_selection(where: str, split_name: str, chosen: list[str], skipped: list[str]) -> str:
    """One line that says which files a split reads and which it skips (and why)."""
    line = f"{where}: split `{split_name}` reads {len(chosen)} file(s): {_name_list(chosen)}"
    if not skipped:
        return line
    named = any(names_split(name, split_name) for name in chosen)
    reason = f"not named for split `{split_name}`" if named else "named for another split"
    return f"{line}; skipped {len(skipped)} {reason}: {_name_list(skipped)}"


def _report_selection(where: str, split_name: str, chosen: list[str], skipped: list[str]) -> None:
    """Print the file selection of a folder or hub dataset (rank 0 alone under torchrun)."""
    if is_launched_main() and not _QUIET.get():
        message = describe_selection(where, split_name, chosen, skipped)
        if skipped:
            message += " (list the files in data_files to choose them yourself)"
        print(message, flush=True)


def _name_list(names: list[str], limit: int = 20) -> str:
    if not names:
        return "none with extension .jsonl, .json or .parquet"
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names) - limit} more)"


def _hub_files(repo_id: str, split_name: str, data_files: list[str] | None) -> list[tuple[str, Path]]:
    try:
        listing = list_repo_files(repo_id, repo_type="dataset")
    except HFValidationError:
        problem = "it is not a valid hub dataset id either (expected `owner/name`)"
        raise DataError(_not_found(repo_id, problem)) from None
    except HUB_UNAVAILABLE as error:
        return _cached_hub_files(repo_id, split_name, data_files, error)
    names = _hub_selection(listing, split_name, data_files, f"hub dataset `{repo_id}`")
    files = []
    for name in names:
        try:
            files.append((f"{repo_id}/{name}", Path(hf_hub_download(repo_id, name, repo_type="dataset"))))
        except HUB_UNAVAILABLE as error:
            raise DataError(
                f"could not download {name} of hub dataset `{repo_id}` ({_first_line(error)}); "
                "check the network connection and run again"
            ) from error
    return files


def _hub_selection(
    listing: list[str], split_name: str, data_files: list[str] | None, where: str
) -> list[str]:
    if not data_files:
        names, skipped = split_selection(
            sorted(name for name in listing if _is_data_file(name)), split_name, where
        )
        _report_selection(where, split_name, names, skipped)
        return names
    for name in data_files:
        if name not in listing:
            raise DataError(
                f"data_files entry `{name}` not found in {where}; files there: {_name_list(sorted(listing))}"
            )
    return list(data_files)


def _cached_hub_files(
    repo_id: str, split_name: str, data_files: list[str] | None, hub_error: Exception
) -> list[tuple[str, Path]]:
    try:
        snapshot = Path(snapshot_download(repo_id, repo_type="dataset", local_files_only=True))
    except IncompleteSnapshotError as error:  # other files of the repo are missing; this split's may not be
        snapshot = Path(error.snapshot_path)
    except LocalEntryNotFoundError:
        raise DataError(_not_found(repo_id, _hub_problem(hub_error))) from None
    if not isinstance(hub_error, OfflineModeIsEnabled):
        logger.warning(
            "hub dataset `%s`: %s; using the cached copy in %s", repo_id, _first_line(hub_error), snapshot
        )
    try:
        # The cached tree lists the whole revision, so a shard that never finished downloading is noticed.
        listing = [entry.path for entry in get_cached_repo_tree(repo_id, repo_type="dataset")]
    except CachedRepoTreeNotFoundError:
        listing = [file.relative_to(snapshot).as_posix() for file in snapshot.rglob("*") if file.is_file()]
    where = f"the cached copy of hub dataset `{repo_id}` ({snapshot})"
    names = _hub_selection(listing, split_name, data_files, where)
    missing = [name for name in names if not (snapshot / name).is_file()]
    if missing:
        raise DataError(
            f"{where} is incomplete: {_name_list(missing)} not downloaded, and the hub is unavailable "
            f"({_first_line(hub_error)}); run once with network access (HF_HUB_OFFLINE unset) "
            "to download them"
        )
    return [(f"{repo_id}/{name}", snapshot / name) for name in names]


def _not_found(path: str, problem: str) -> str:
    return (
        f"`{path}` is neither a local file/directory nor a reachable or cached Hugging Face Hub dataset: "
        f"{problem}"
    )


def _hub_problem(error: Exception) -> str:
    """Why the hub could not be used, and what to do about it."""
    if isinstance(error, OfflineModeIsEnabled):
        return (
            f"HF_HUB_OFFLINE=1 is set and the hub cache ({constants.HF_HUB_CACHE}) does not have it. "
            "Fix the path, or unset HF_HUB_OFFLINE and run once with network access to download it"
        )
    if isinstance(error, RepositoryNotFoundError):
        return (
            "the hub has no dataset repo by that name. Fix the path; if the repo is private or gated, "
            "log in with `hf auth login`"
        )
    if isinstance(error, HfHubHTTPError):
        return f"the hub answered with an error ({_first_line(error)}). Fix the path, or try again later"
    return (
        f"the hub could not be reached ({type(error).__name__}: {_first_line(error)}) and the hub cache "
        f"({constants.HF_HUB_CACHE}) does not have it. Fix the path, or check the network connection"
    )


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _read_file(local: Path, label: str) -> list[Row]:
    reader = _READERS.get(local.suffix.lower())
    if reader is None:
        raise DataError(
            f"{label}: unsupported file type `{local.suffix or '(no extension)'}`; "
            "use .jsonl (one JSON object per line), .json (an array of objects) or .parquet"
        )
    try:
        return reader(local, label)
    except OSError as error:
        raise DataError(f"cannot read {label}: {error.strerror or error}") from error


# Python's JSON parser recurses once per level and stops at the interpreter's recursion limit.
_TOO_DEEP = "JSON nested too deeply to read (hundreds of levels); no dataset row is, so check the file"


def _read_jsonl(local: Path, label: str) -> list[Row]:
    rows = []
    with local.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            if not raw.strip():
                continue
            try:
                data = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise DataError(f"{label} line {number}: not UTF-8 text; save the file as UTF-8") from None
            except RecursionError:
                raise DataError(f"{label} line {number}: {_TOO_DEEP}") from None
            except json.JSONDecodeError as error:
                raise DataError(
                    f"{label} line {number}: invalid JSON ({error.msg} at column {error.colno}); "
                    "each line must hold one complete JSON object"
                ) from None
            if not isinstance(data, dict):
                raise DataError(
                    f"{label} line {number}: expected a JSON object, found a JSON {_json_kind(data)}"
                )
            rows.append(Row(data, label, number))
    return rows


def _read_json_array(local: Path, label: str) -> list[Row]:
    try:
        data = json.loads(local.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise DataError(f"{label}: not UTF-8 text; save the file as UTF-8") from None
    except RecursionError:
        raise DataError(f"{label}: {_TOO_DEEP}") from None
    except json.JSONDecodeError as error:
        if error.msg == "Extra data" and local.read_bytes().lstrip(codecs.BOM_UTF8).lstrip()[:1] == b"{":
            # one object per line: HF's json loader (and so Axolotl) reads a .json file of JSON lines too
            return _read_jsonl(local, label)
        raise DataError(f"{label} line {error.lineno} column {error.colno}: invalid JSON ({error.msg})") from None
    if not isinstance(data, list):
        raise DataError(
            f"{label}: expected a JSON array of objects, found a JSON {_json_kind(data)}; "
            "wrap the rows in [ ... ] or write them one per line to a .jsonl file"
        )
    for index, item in enumerate(data):
        if not isinstance(item, dict):
            raise DataError(
                f"{label} row {index + 1}: expected a JSON object, found a JSON {_json_kind(item)}"
            )
    return [Row(item, label, index + 1) for index, item in enumerate(data)]


def _read_parquet(local: Path, label: str) -> list[Row]:
    try:
        records = pq.read_table(local).to_pylist()
    except pa.ArrowException as error:
        raise DataError(
            f"cannot read {label} as Parquet ({error}); check that it is a valid Parquet file"
        ) from error
    return [Row(record, label, index + 1) for index, record in enumerate(records)]


def _json_kind(value: object) -> str:
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


_READERS: dict[str, Callable[[Path, str], list[Row]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json_array,
    ".parquet": _read_parquet,
}
