"""The run directory: config.json, metrics.jsonl, checkpoints.jsonl and checkpoint folders.

Files are replaced atomically and a checkpoint folder only gets its final name once everything in it is on disk
(`hanzo_gym.files`), so a crash never leaves a checkpoint that resume would trust.

Under torchrun only rank 0 writes: on the other ranks a RunDir reads (latest_checkpoint, metrics) but every
method that would write does nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from hanzo_gym.engine.distributed import is_main
from hanzo_gym.errors import GymError
from hanzo_gym.files import atomic_write_text, publish_directory

CHECKPOINT_PREFIX = "checkpoint-"
TRAINER_STATE = "trainer_state.json"


class RunDir:
    def __init__(self, path: str | Path, writer: bool | None = None):
        self.path = Path(path)
        self.writer = is_main() if writer is None else writer
        self.metrics_path = self.path / "metrics.jsonl"
        self.checkpoints_path = self.path / "checkpoints.jsonl"
        if not self.writer:
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise GymError(f"cannot create output_dir {self.path}: {exc.strerror}") from None
        self._remove_abandoned_temporaries()

    def _remove_abandoned_temporaries(self) -> None:
        """Temporary folders whose writer process is gone (killed mid-write) are never trusted: delete them."""
        for path in self.path.glob(".*"):
            pid = path.name.rsplit("-", 1)[-1]
            if path.is_dir() and pid.isdigit() and not _process_alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)

    def start_fresh(self) -> list[str]:
        """A new run in an output_dir that holds an earlier one: drop the earlier run's records and
        checkpoints, so that metrics and `resume_from_checkpoint: true` can only see this run. Returns what
        was removed."""
        removed = []
        if not self.writer:
            return removed
        for path in (self.metrics_path, self.checkpoints_path):
            if path.exists():
                path.unlink()
                removed.append(path.name)
        for path in sorted(self.path.glob(f"{CHECKPOINT_PREFIX}*")):
            if path.is_dir():
                shutil.rmtree(path)
                removed.append(path.name)
        return removed

    def write_config(self, resolved: dict) -> None:
        if self.writer:
            atomic_write_text(self.path / "config.json", json.dumps(resolved, indent=2) + "\n")

    def log(self, row: dict) -> None:
        if not self.writer:
            return
        with open(self.metrics_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")

    def metrics(self) -> list[dict]:
        return _read_jsonl(self.metrics_path)

    def forget_after(self, step: int) -> None:
        """On resume: drop metric and checkpoint records of steps the resumed run will redo."""
        if not self.writer:
            return
        for path in (self.metrics_path, self.checkpoints_path):
            if path.exists():
                kept = [row for row in _read_jsonl(path) if row.get("step", 0) <= step]
                atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in kept))

    def save_checkpoint(self, step: int, epoch: float, build: Callable[[Path], None]) -> Path:
        final = self.path / f"{CHECKPOINT_PREFIX}{step}"
        if not self.writer:
            return final
        publish_directory(build, final)
        record = {"name": final.name, "step": step, "epoch": epoch, "path": str(final)}
        with open(self.checkpoints_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        return final

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint folder (temporary folders of an interrupted write never qualify)."""
        complete = [
            p
            for p in self.path.glob(f"{CHECKPOINT_PREFIX}*")
            if p.is_dir()
            and p.name.removeprefix(CHECKPOINT_PREFIX).isdigit()
            and (p / TRAINER_STATE).is_file()
        ]
        return max(complete, key=lambda p: int(p.name.removeprefix(CHECKPOINT_PREFIX)), default=None)


class Progress:
    """A progress bar on an interactive terminal, plain log lines otherwise."""

    def __init__(self, total: int, done: int):
        self.interactive = sys.stderr.isatty()
        self.quiet = not is_main()  # under torchrun rank 0 speaks for all
        self.bar = tqdm(
            total=total,
            initial=done,
            disable=self.quiet or not self.interactive,
            unit="step",
            dynamic_ncols=True,
        )

    def say(self, text: str) -> None:
        if self.quiet:
            return
        if self.interactive:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def advance(self, **postfix: str) -> None:
        self.bar.update(1)
        if postfix:
            self.bar.set_postfix(**postfix)

    def close(self) -> None:
        self.bar.close()


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line from a crash mid-append: everything before it is good
    return rows
