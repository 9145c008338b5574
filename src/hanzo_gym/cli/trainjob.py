"""`gym trainjob`: the container entry of a Kubeflow TrainJob, configured by environment variables.

The variables are the ones the hanzo broker sets on every fine-tuning TrainJob (and the runtime's defaults).
They map onto the same `Config` that `gym train` reads from YAML, with the same validation. Values are
trimmed, and an empty value counts as unset. Every problem names the variable, the value it had and what to
send instead; all problems are reported together, before anything is loaded.

What lands in OUTPUT_DIR (what the broker's deploy step serves):

    OUTPUT_DIR/              the merged model: config.json, model*.safetensors, tokenizer files
    OUTPUT_DIR/adapter/      the PEFT adapter (adapter_config.json, adapter_model.safetensors, tokenizer)
    OUTPUT_DIR/run/          the run directory: run_config.json (the resolved config), metrics.jsonl, …

With MERGE=false only adapter/ and run/ are written. METHOD=full (the hanzo-ft-full runtime) trains every weight:
the trained model itself is at the top and there is no adapter/ (an earlier job's is removed). Under torchrun only
rank 0 writes.

A job that fails (a bad data row, a reward that raises, a loss that diverges) leaves what an earlier job wrote
there as it was: the earlier merged model and adapter are replaced only once the new ones are complete, and the
run directory is staged until the new run has a checkpoint or its adapter (see `loops.run_dir`).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import yaml
from pydantic import ValidationError

from hanzo_gym.config import Config
from hanzo_gym.errors import ConfigError, DataError
from hanzo_gym.files import process_alive
from hanzo_gym.model.hub import MODEL_PATTERNS

DEFAULT_MODEL_DIR = "/workspace/model"
DEFAULT_DATASET_DIR = "/workspace/dataset"
DEFAULT_OUTPUT_DIR = "/workspace/output"
ADAPTER_SUBDIR = "adapter"
RUN_SUBDIR = "run"

TASKS = {"chat": "chat_template", "instruct": "alpaca", "completion": "completion"}
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")

# The variable that sets each numeric config key, its parser and the default the broker also sends.
NUMERIC: dict[str, tuple[str, type, int | float]] = {
    "MAX_SEQ_LEN": ("sequence_len", int, 2048),
    "LORA_RANK": ("lora_r", int, 16),
    "LORA_ALPHA": ("lora_alpha", float, 32.0),
    "LORA_DROPOUT": ("lora_dropout", float, 0.05),
    "BATCH_SIZE": ("micro_batch_size", int, 2),
    "GRAD_ACCUM": ("gradient_accumulation_steps", int, 8),
    "LEARNING_RATE": ("learning_rate", float, 2e-4),
    "WARMUP_RATIO": ("warmup_ratio", float, 0.03),
    "WEIGHT_DECAY": ("weight_decay", float, 0.01),
}
DEFAULT_EPOCHS = 3
# The largest value each whole-number variable takes: far beyond any real job, small enough that a typo
# (or an overflowing number) is refused here instead of failing hours later, or never.
MAXIMUM: dict[str, int] = {
    "EPOCHS": 10_000,
    "MAX_SEQ_LEN": 1 << 20,  # 1M tokens: longer than any model's context
    "LORA_RANK": 1 << 14,  # 16384: the hidden size of the largest open models (a full-rank update)
    "BATCH_SIZE": 1 << 16,
    "GRAD_ACCUM": 1 << 16,
}
# Every variable gym trainjob reads (HF_TOKEN is read by huggingface_hub itself and never printed).
VARIABLES = (
    "METHOD",
    "QUANT_4BIT",
    "GRADIENT_CHECKPOINTING",
    "TASK",
    "MODEL_DIR",
    "BASE_MODEL",
    "DATASET_DIR",
    "EPOCHS",
    "OUTPUT_DIR",
    *NUMERIC,
    "MERGE",
    "HF_TOKEN",
)

# Files `save_pretrained` writes for a model and its tokenizer: what a previous run's merged model left at
# OUTPUT_DIR's top level, replaced as a set by the new one so that no stale shard or index outlives it.
_MODEL_FILE_PATTERNS = (*MODEL_PATTERNS, "*.safetensors.index.json")
_STAGING_PREFIX = ".staging-"  # what files.publish_files_into stages in

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_WHOLE = re.compile(r"[+]?[0-9]+")


@dataclass(frozen=True)
class TrainJob:
    config: Config
    output_dir: Path  # OUTPUT_DIR: merged model at the top, adapter/ and run/ inside
    merge: bool
    base_model_name: str | None  # BASE_MODEL, written into adapter_config.json when MODEL_DIR was trained
    data_files: str = ""  # which DATASET_DIR files are trained on and which are skipped, in words

    @property
    def adapter_dir(self) -> Path:
        return self.output_dir / ADAPTER_SUBDIR


def read_env(env: Mapping[str, str]) -> dict[str, str]:
    """Trimmed values; empty ones dropped (an empty value counts as unset)."""
    return {key: value.strip() for key, value in env.items() if isinstance(value, str) and value.strip()}


class _Problems:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, line: str) -> None:
        self.lines.append(line)

    def raise_if_any(self) -> None:
        if self.lines:
            raise ConfigError("\n".join(self.lines))


def _parse_bool(name: str, raw: str | None, default: bool, problems: _Problems) -> bool:
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    problems.add(f"{name}={raw}: not a boolean; send true or false")
    return default


def _shown(raw: str, limit: int = 40) -> str:
    """A value as a message quotes it: a 5000-digit number is cut short."""
    return raw if len(raw) <= limit else f"{raw[:limit]}… ({len(raw)} characters)"


def _too_large(name: str, raw: str, problems: _Problems) -> None:
    problems.add(f"{name}={_shown(raw)}: too large; send at most {MAXIMUM[name]}")


def _parse_number(name: str, raw: str, kind: type, problems: _Problems) -> int | float | None:
    if kind is int:
        if not _WHOLE.fullmatch(raw):
            problems.add(
                f"{name}={_shown(raw)}: not a whole number; send an integer such as {NUMERIC[name][2]}"
            )
            return None
        digits = raw.lstrip("+").lstrip("0")
        # Compared as text first: int() refuses numbers of more than 4300 digits.
        if len(digits) > len(str(MAXIMUM[name])) or int(digits or "0") > MAXIMUM[name]:
            _too_large(name, raw, problems)
            return None
        return int(raw)
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        problems.add(f"{name}={_shown(raw)}: not a finite number; send a decimal such as {NUMERIC[name][2]}")
        return None
    return value


def _method(env: dict[str, str], problems: _Problems) -> str:
    """lora, qlora (a LoRA adapter on a 4-bit base: METHOD=qlora or QUANT_4BIT=true) or full."""
    # Unset means lora: the runtime that runs this image sets METHOD, and plain LoRA needs no bitsandbytes.
    raw = env.get("METHOD", "lora")
    method = raw.lower()
    if method not in ("lora", "qlora", "full"):
        problems.add(f"METHOD={raw}: unknown method; send METHOD=lora, qlora or full")
    four_bit = _parse_bool("QUANT_4BIT", env.get("QUANT_4BIT"), method == "qlora", problems)
    if method == "full":
        if four_bit:
            problems.add(
                f"METHOD={raw} with QUANT_4BIT={env['QUANT_4BIT']}: full fine-tuning trains every weight, which "
                "a 4-bit base cannot hold; send QUANT_4BIT=false (or leave it unset), or METHOD=qlora"
            )
        return "full"
    if method == "qlora" and "QUANT_4BIT" in env and not four_bit:
        problems.add(
            f"METHOD={raw} with QUANT_4BIT={env['QUANT_4BIT']}: QLoRA is a 4-bit base; send QUANT_4BIT=true "
            "(or leave it unset), or METHOD=lora"
        )
    return "qlora" if four_bit else "lora"


def _base_model(env: dict[str, str], problems: _Problems) -> tuple[str | None, str | None]:
    """(base_model, BASE_MODEL to record in the adapter). MODEL_DIR wins when it holds a model."""
    model_dir = env.get("MODEL_DIR", DEFAULT_MODEL_DIR)
    named = env.get("BASE_MODEL")
    if (Path(model_dir) / "config.json").is_file():
        return model_dir, named
    if named:
        return named, None
    state = "holds no config.json" if Path(model_dir).is_dir() else "is not a directory"
    problems.add(
        f"MODEL_DIR={model_dir} {state} and BASE_MODEL is unset: give the job a model initializer (it fills "
        f"{DEFAULT_MODEL_DIR}), point MODEL_DIR at a model folder, or set BASE_MODEL to a hub repo id"
    )
    return None, None


def dataset_files(dataset_dir: str) -> list[Path]:
    """Every .jsonl/.json/.parquet file under `dataset_dir`, recursively, sorted by path, skipping hidden
    files and folders (the hub's .cache). When file or folder names name splits (train-…, test/…), only the
    train split's files: a downloaded dataset repo must not train on its test rows."""
    return dataset_selection(dataset_dir)[0]


def dataset_selection(dataset_dir: str) -> tuple[list[Path], str]:
    """`dataset_files`, and a line that says which files were chosen and which skipped."""
    from hanzo_gym.data.sources import describe_selection, split_selection

    root = Path(dataset_dir)
    if not root.is_dir():
        raise ConfigError(
            f"DATASET_DIR={dataset_dir}: not a directory; give the job a dataset initializer (it fills "
            f"{DEFAULT_DATASET_DIR}) or point DATASET_DIR at a folder of .jsonl, .json or .parquet files"
        )
    found: list[str] = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        for name in files:
            if not name.startswith(".") and name.lower().endswith(DATA_SUFFIXES):
                found.append((Path(folder) / name).relative_to(root).as_posix())
    if not found:
        raise ConfigError(
            f"DATASET_DIR={dataset_dir}: no .jsonl, .json or .parquet files (hidden ones skipped)"
        )
    where = f"DATASET_DIR={dataset_dir}"
    try:
        chosen, skipped = split_selection(sorted(found), "train", where)
    except DataError as exc:  # say it as a problem with the variable
        raise ConfigError(str(exc)) from None
    return [root / name for name in chosen], describe_selection(where, "train", chosen, skipped)


def _output_dir(env: dict[str, str], problems: _Problems) -> Path:
    raw = env.get("OUTPUT_DIR", DEFAULT_OUTPUT_DIR)
    scheme = _SCHEME.match(raw)
    if scheme and scheme.group(1).lower() == "file":
        return _file_url_path(raw, problems)
    if scheme:
        problems.add(
            f"OUTPUT_DIR={raw}: only a local path is supported ({scheme.group(1)}:// uploads are not); leave "
            f"OUTPUT_DIR unset to write {DEFAULT_OUTPUT_DIR}, or mount the storage and give its path"
        )
        return Path(DEFAULT_OUTPUT_DIR)
    return Path(raw)


def _file_url_path(raw: str, problems: _Problems) -> Path:
    """The local path of a file:// URL (RFC 8089): file:///abs/path or file://localhost/abs/path."""
    url = urlsplit(raw)
    if url.netloc.lower() not in ("", "localhost"):
        problems.add(
            f"OUTPUT_DIR={raw}: names the host `{url.netloc}`, and only this machine's files can be written "
            f"(file:///path or file://localhost/path); mount that storage and give its path, or send "
            f"file:///{url.netloc}{url.path} if that was meant as a local path"
        )
    elif url.query or url.fragment or not url.path.startswith("/"):
        problems.add(f"OUTPUT_DIR={raw}: not a local file URL; send file:///absolute/path or a plain path")
    else:
        return Path(unquote(url.path))
    return Path(DEFAULT_OUTPUT_DIR)


def _epochs(env: dict[str, str], problems: _Problems) -> int:
    raw = env.get("EPOCHS")
    if raw is None:
        return DEFAULT_EPOCHS
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if value > MAXIMUM["EPOCHS"]:  # inf too (1e400); nan compares false
        _too_large("EPOCHS", raw, problems)
    elif not math.isfinite(value):
        problems.add(f"EPOCHS={_shown(raw)}: not a number; send a whole number of epochs such as 3")
    elif value < 1:
        problems.add(f"EPOCHS={raw}: must be at least 1")
    elif value != int(value):
        whole = f"{math.floor(value)} or {math.ceil(value)}"
        problems.add(f"EPOCHS={raw}: hanzo-gym trains a whole number of epochs; send {whole}")
    else:
        return int(value)
    return DEFAULT_EPOCHS


def trainjob_from_env(environ: Mapping[str, str]) -> TrainJob:
    """The TrainJob that these environment variables describe; ConfigError lists every problem."""
    env = read_env(environ)
    problems = _Problems()
    method = _method(env, problems)
    full = method == "full"
    checkpointing = _parse_bool("GRADIENT_CHECKPOINTING", env.get("GRADIENT_CHECKPOINTING"), False, problems)
    task = env.get("TASK")
    if task is None:
        problems.add(
            "TASK is unset: send TASK=chat (rows with a `messages` list), instruct (instruction/input/output "
            "rows) or completion (rows with a `text` field)"
        )
    elif task.lower() not in TASKS:
        problems.add(f"TASK={task}: must be chat, instruct or completion")
    base_model, base_model_name = _base_model(env, problems)
    dataset_dir = env.get("DATASET_DIR", DEFAULT_DATASET_DIR)
    try:
        files, data_files = dataset_selection(dataset_dir)
    except ConfigError as exc:
        problems.add(str(exc))
        files, data_files = [], ""
    epochs = _epochs(env, problems)
    output_dir = _output_dir(env, problems)
    numbers: dict[str, int | float] = {}
    for name, (key, kind, default) in NUMERIC.items():
        raw = env.get(name)
        value = default if raw is None else _parse_number(name, raw, kind, problems)
        if full and key.startswith("lora_"):
            # the broker sends its LoRA values as 0 for a full fine-tune: they set nothing then
            if raw is not None and value not in (None, 0):
                problems.add(
                    f"{name}={raw} with METHOD=full: full fine-tuning trains every weight, with no LoRA; send "
                    f"{name}=0 (or leave it unset), or METHOD=lora"
                )
            continue
        if value is not None:
            numbers[key] = value
    merge = _parse_bool("MERGE", env.get("MERGE"), True, problems)
    if full and not merge:
        problems.add(
            "MERGE=false with METHOD=full: a full fine-tune is the model itself, with no adapter to keep "
            "unmerged; leave MERGE unset"
        )
    if base_model and Path(base_model).is_dir() and Path(base_model).resolve() == output_dir.resolve():
        problems.add(f"OUTPUT_DIR={output_dir}: is the model folder itself; write the results elsewhere")
    problems.raise_if_any()

    data = {
        "base_model": base_model,
        "datasets": [{"path": str(path), "type": TASKS[task.lower()]} for path in files],
        "output_dir": str(output_dir / RUN_SUBDIR),
        **(
            {} if full else {"adapter": method, "load_in_4bit": method == "qlora", "lora_target_linear": True}
        ),
        "num_epochs": epochs,
        "gradient_checkpointing": checkpointing,
        "bf16": "auto",
        **numbers,
    }
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("\n".join(_describe(error, env) for error in exc.errors())) from None
    return TrainJob(
        config=config,
        output_dir=output_dir,
        merge=merge,
        base_model_name=base_model_name,
        data_files=data_files,
    )


_KEY_TO_VARIABLE = {key: name for name, (key, _, _) in NUMERIC.items()} | {"num_epochs": "EPOCHS"}


def _describe(error: dict, env: dict[str, str]) -> str:
    key = str(error["loc"][0]) if error["loc"] else ""
    message = error["msg"].removeprefix("Value error, ")
    name = _KEY_TO_VARIABLE.get(key)
    if name is None:
        return f"the resolved config is invalid at `{key}`: {message}"
    shown = env.get(name, f"{NUMERIC[name][2]} (default)" if name in NUMERIC else "(default)")
    return f"{name}={shown}: {message[:1].lower()}{message[1:]} (it sets `{key}`); send a value that fits"


def resolved_yaml(job: TrainJob) -> str:
    """The resolved config as YAML that `gym train` accepts, with the OUTPUT_DIR layout as comments."""
    header = [
        f"# gym trainjob: OUTPUT_DIR={job.output_dir}",
        *(
            [f"#   trained model: {job.output_dir} (METHOD=full: no adapter)"]
            if job.config.full_fine_tuning
            else [
                f"#   merged model: {job.output_dir}"
                if job.merge
                else "#   merged model: none (MERGE=false)",
                f"#   adapter:      {job.adapter_dir}",
            ]
        ),
        f"#   run files:    {job.config.output_dir}",
    ]
    if job.data_files:
        header.append(f"# {job.data_files}")
    body = yaml.safe_dump(job.config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
    return "\n".join(header) + "\n" + body


def _remove_abandoned_staging(output_dir: Path) -> None:
    """Staging folders of a job killed while it moved its merged model in: never trusted, removed."""
    for path in sorted(output_dir.glob(f"{_STAGING_PREFIX}*")):
        pid = path.name.removeprefix(_STAGING_PREFIX)
        if path.is_dir() and pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(path)
            print(f"{output_dir}: removed {path.name}, left by a job killed while it wrote the merged model")


def _remove_previous_model(output_dir: Path) -> None:
    """MERGE=false: an earlier job's merged model does not hold the new adapter; remove it."""
    stale = [path for pattern in _MODEL_FILE_PATTERNS for path in sorted(output_dir.glob(pattern))]
    stale = [path for path in stale if path.is_file()]
    config = output_dir / "config.json"
    for path in ([config] if config in stale else []) + [p for p in stale if p != config]:
        path.unlink()  # config.json first: without it nothing loads the rest as a model
    if stale:
        print(f"removed the previous run's {', '.join(p.name for p in stale)} from {output_dir}", flush=True)


def _record_base_model(adapter_dir: Path, name: str) -> None:
    """Name the hub model in adapter_config.json instead of the job-local MODEL_DIR path, so that
    `AutoPeftModelForCausalLM.from_pretrained(adapter)` works after the job's volume is gone."""
    from hanzo_gym.files import atomic_write_text

    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = name
    atomic_write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def _publish_merged(job: TrainJob) -> None:
    """Write the merged model into OUTPUT_DIR: built in a hidden staging folder, then each file renamed into
    place, config.json last, so that a crash never leaves something that loads as a half-written model."""
    from hanzo_gym.cli.merge import merged_from
    from hanzo_gym.files import publish_files_into

    model, tokenizer = merged_from(job.config, job.adapter_dir)

    def write(directory: Path) -> None:
        model.save_pretrained(str(directory))
        tokenizer.save_pretrained(str(directory))
        _readable_by_all(directory)

    stale = publish_files_into(write, job.output_dir, marker="config.json", replaces=_MODEL_FILE_PATTERNS)
    if stale:
        print(f"removed the previous run's {', '.join(stale)} from {job.output_dir}", flush=True)


def _publish_trained_model(job: TrainJob) -> None:
    """METHOD=full: the model the run wrote (in run/, where gym train writes it) copied to OUTPUT_DIR's top as
    the merged model is, config.json last; an earlier job's adapter/ does not belong to it and goes."""
    from hanzo_gym.files import publish_files_into, remove_entry

    run_dir = Path(job.config.output_dir)
    files = sorted(
        {path for pattern in _MODEL_FILE_PATTERNS for path in run_dir.glob(pattern) if path.is_file()}
    )

    def write(directory: Path) -> None:
        for path in files:
            shutil.copyfile(path, directory / path.name)
        _readable_by_all(directory)

    stale = publish_files_into(write, job.output_dir, marker="config.json", replaces=_MODEL_FILE_PATTERNS)
    if job.adapter_dir.exists():
        remove_entry(job.adapter_dir)
        stale.append(f"{ADAPTER_SUBDIR}/")
    if stale:
        print(f"removed the previous run's {', '.join(stale)} from {job.output_dir}", flush=True)


def _readable_by_all(directory: Path) -> None:
    """safetensors files come out owner-only (0600); a pod that serves OUTPUT_DIR may run as another user."""
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o644)


def run_trainjob(job: TrainJob) -> None:
    """Train (on every process under torchrun), then on rank 0 write the adapter and the merged model."""
    from hanzo_gym.engine.distributed import init_from_env, is_main, shutdown
    from hanzo_gym.loops.train import run_training

    init_from_env()
    try:
        if is_main():
            print("trainjob config:\n" + resolved_yaml(job), flush=True)
            if job.output_dir.exists() and not job.output_dir.is_dir():
                raise ConfigError(f"OUTPUT_DIR={job.output_dir}: exists and is not a directory")
            job.output_dir.mkdir(parents=True, exist_ok=True)
            _remove_abandoned_staging(job.output_dir)
        full = job.config.full_fine_tuning
        run_training(job.config, adapter_dir=None if full else job.adapter_dir)
        if not is_main():
            return
        if full:
            _publish_trained_model(job)
            print(f"wrote the trained model to {job.output_dir}", flush=True)
            return
        _readable_by_all(job.adapter_dir)
        if job.base_model_name:
            _record_base_model(job.adapter_dir, job.base_model_name)
        if job.merge:
            _publish_merged(job)
            print(f"wrote merged model to {job.output_dir}", flush=True)
        else:
            _remove_previous_model(job.output_dir)
    finally:
        shutdown()


def main_trainjob(environ: Mapping[str, str], dry_run: bool = False) -> None:
    job = trainjob_from_env(environ)
    if dry_run:
        print(resolved_yaml(job), end="")
        return
    run_trainjob(job)
