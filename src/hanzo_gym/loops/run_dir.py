"""The run directory: run_config.json, metrics.jsonl, checkpoints.jsonl, checkpoint folders and the final adapter
(or, in full fine-tuning, the final model: its own config.json, model.safetensors and tokenizer, as Axolotl
writes it, so that from_pretrained(output_dir) loads it).

Files are replaced atomically and a checkpoint folder only gets its final name once everything in it is on disk
(`hanzo_gym.files`), so a crash never leaves a checkpoint that resume would trust.

A new run in an output_dir that holds an earlier one is written into a hidden staging folder,
`.new-run-<pid>`, and takes the earlier run's place only once it has something to replace it with: its first
checkpoint or its final adapter. A run that fails before that leaves the earlier run exactly as it was. The
swap is planned on disk before it starts, so a run killed part-way through it is finished by the next one;
whatever a killed run left (a staging folder, a half-written checkpoint) is recovered or removed by the next
run, which says so.

Under torchrun only rank 0 writes: on the other ranks a RunDir reads (latest_checkpoint, metrics) but every
method that would write does nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from hanzo_gym.clock import duration
from hanzo_gym.engine.distributed import is_main
from hanzo_gym.errors import GymError
from hanzo_gym.files import (
    SWAP_PLAN,
    atomic_write_text,
    disk_full,
    finish_swap,
    out_of_space,
    process_alive,
    publish_directory,
    publish_files_into,
    read_jsonl,
    remove_entry,
    swap_in,
)
from hanzo_gym.loops.trackers import Trackers

CHECKPOINT_PREFIX = "checkpoint-"
TRAINER_STATE = "trainer_state.json"
STAGING_PREFIX = ".new-run-"
ADAPTER_MARKER = "adapter_config.json"  # written last: a PEFT folder without it is not an adapter
MODEL_MARKER = "model.safetensors"  # full fine-tuning's final model: written last, likewise
RUN_CONFIG = "run_config.json"  # the resolved config (not config.json: that name is a model's)
# What a run writes at the top level besides its checkpoints (tokenizer files are overwritten, not counted);
# config.json is an earlier version's run config, or a full fine-tuning run's model config.
RUN_FILES = (
    RUN_CONFIG,
    "metrics.jsonl",
    "checkpoints.jsonl",
    "eval_predictions.jsonl",
    "completions.jsonl",
    ADAPTER_MARKER,
    "adapter_model.safetensors",
    "config.json",
    "generation_config.json",
    MODEL_MARKER,
)


class RunDir:
    def __init__(self, path: str | Path, writer: bool | None = None, full_model: bool = False):
        self.path = Path(path)  # output_dir: where the run's files end up, and what its records name
        # the file whose arrival completes the final output: the adapter's config, or the full model's weights
        self.marker = MODEL_MARKER if full_model else ADAPTER_MARKER
        self._home = self.path  # where they are written now: the staging folder while the run is staged
        self.writer = is_main() if writer is None else writer
        # W&B / TensorBoard / MLflow (`loops.trackers`): every metrics row and checkpoint goes to them too
        self.trackers = Trackers()
        if not self.writer:
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise GymError(f"cannot create output_dir {self.path}: {exc.strerror}") from None
        self._recover_abandoned()

    @property
    def metrics_path(self) -> Path:
        return self._home / "metrics.jsonl"

    @property
    def checkpoints_path(self) -> Path:
        return self._home / "checkpoints.jsonl"

    @property
    def staged(self) -> bool:
        return self._home != self.path

    def _recover_abandoned(self) -> None:
        """What a killed run left, named with its process id: a staging folder whose swap had begun is swapped
        in (the new run had its checkpoint); any other one, and temporaries, are never trusted and removed."""
        for path in sorted(self.path.glob(".*")):
            pid = path.name.rsplit("-", 1)[-1]
            if not pid.isdigit() or process_alive(int(pid)):
                continue
            if path.name.startswith(STAGING_PREFIX) and (path / SWAP_PLAN).is_file():
                finish_swap(path, self.path)
                _say(
                    f"{self.path}: finished moving in the run staged in {path.name}, which was killed while it "
                    "replaced the previous run"
                )
            elif path.name.startswith(STAGING_PREFIX):
                shutil.rmtree(path, ignore_errors=True)
                _say(
                    f"{self.path}: removed {path.name}, a new run killed before its first checkpoint; the "
                    "previous run there was left as it was"
                )
            elif path.is_dir() or path.is_file():
                remove_entry(path)
                _say(f"{self.path}: removed {path.name}, left by a run killed while writing it")

    def previous_run(self) -> list[str]:
        """The entries of an earlier run at the top level: its records, adapter and checkpoints."""
        names = [name for name in RUN_FILES if (self.path / name).is_file()]
        return names + [path.name for path in _checkpoint_folders(self.path)]

    def previous_config(self) -> dict | None:
        """The resolved config of the run output_dir holds, None where there is none (or it does not read)."""
        try:
            config = json.loads((self.path / RUN_CONFIG).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return None
        return config if isinstance(config, dict) else None

    def finished(self) -> bool:
        """Whether output_dir's run wrote its final adapter (or full model): an interrupted one has not."""
        return (self.path / self.marker).is_file()

    def start_fresh(self) -> list[str]:
        """A new run: when output_dir holds an earlier run, stage this one until it can replace it (see the
        module's docstring). Returns the earlier run's entries that it is to replace."""
        if not self.writer:
            return []
        previous = self.previous_run()
        if previous:
            self._home = self.path / f"{STAGING_PREFIX}{os.getpid()}"
            self._home.mkdir()
        return previous

    def discard(self) -> bool:
        """A staged run failed: remove it, leaving the earlier run as it was. True when there was one. A
        swap that has begun is left for the next run to finish: the earlier run is already part gone."""
        if not self.staged or (self._home / SWAP_PLAN).exists():
            return False
        shutil.rmtree(self._home, ignore_errors=True)
        self._home = self.path
        return True

    def finish(self) -> None:
        """A staged run now has something to replace the earlier one with: swap it in."""
        if not self.staged:
            return
        replaced = self.previous_run()
        swap_in(self._home, self.path, replaced, marker=self.marker)
        self._home = self.path
        _say(f"{self.path}: this run replaced the previous run's {', '.join(replaced)}")

    def write_config(self, resolved: dict) -> None:
        if self.writer:
            atomic_write_text(self._home / RUN_CONFIG, json.dumps(resolved, indent=2) + "\n")

    def log(self, row: dict) -> None:
        if not self.writer:
            return
        line = json.dumps(row, allow_nan=False)  # NaN and Infinity are not JSON: the loops stop first
        with open(self.metrics_path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
        self.trackers.log(row)

    @property
    def predictions_path(self) -> Path:
        return self._home / "eval_predictions.jsonl"

    def log_predictions(self, step: int, rows: list) -> None:
        """An evaluation's completions (eval_table_size): one line each, and a table to the trackers."""
        if not self.writer:
            return
        records = [
            {"step": step, "id": i, "prompt": r.prompt, "reference": r.reference, "prediction": r.prediction}
            for i, r in enumerate(rows)
        ]
        with open(self.predictions_path, "a", encoding="utf-8") as handle:
            handle.write("".join(json.dumps(record) + "\n" for record in records))
        self.trackers.table("eval_predictions", records, step)

    @property
    def completions_path(self) -> Path:
        return self._home / "completions.jsonl"

    def log_completions(self, step: int, records: list[dict]) -> None:
        """GRPO's sampled completions of the steps a metrics row covers (trl.log_completions): one line each,
        and a table to the trackers."""
        if not self.writer or not records:
            return
        with open(self.completions_path, "a", encoding="utf-8") as handle:
            handle.write("".join(json.dumps(record) + "\n" for record in records))
        self.trackers.table("completions", records, step)

    def metrics(self) -> list[dict]:
        return read_jsonl(self.metrics_path)

    def forget_after(self, step: int) -> None:
        """On resume: drop metric and checkpoint records of steps the resumed run will redo."""
        if not self.writer:
            return
        for path in (self.metrics_path, self.checkpoints_path, self.predictions_path, self.completions_path):
            if path.exists():
                kept = [row for row in read_jsonl(path) if row.get("step", 0) <= step]
                atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in kept))

    def save_checkpoint(
        self,
        step: int,
        epoch: float,
        build: Callable[[Path], None],
        keep: int | None = None,
        spare: int | None = None,
        size: int | None = None,
    ) -> Path:
        """Write checkpoint-<step>; with `keep`, then remove all but the newest `keep` checkpoints of this run
        (only once the new one is complete, so there is always one to resume from), never the one of step
        `spare` (the best checkpoint, which HF's rotation keeps too). `size`: about how many bytes it takes,
        for the message when the disk is full."""
        final = self.path / f"{CHECKPOINT_PREFIX}{step}"
        if not self.writer:
            return final
        try:
            publish_directory(build, self._home / final.name)
        except Exception as exc:
            if not disk_full(exc):
                raise
            raise out_of_space(self.path, final.name, size, self.latest_checkpoint()) from None
        record = {"name": final.name, "step": step, "epoch": epoch, "path": str(final)}
        with open(self.checkpoints_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        self.finish()
        self.trackers.checkpoint(self._home / final.name, step, epoch)
        if keep is not None:
            self._keep_newest_checkpoints(keep, spare)
        return final

    def checkpoint_path(self, step: int) -> Path:
        return self._home / f"{CHECKPOINT_PREFIX}{step}"

    def _keep_newest_checkpoints(self, keep: int, spare: int | None) -> None:
        folders = sorted(
            _checkpoint_folders(self._home), key=lambda p: int(p.name.removeprefix(CHECKPOINT_PREFIX))
        )
        names = [path.name for path in folders]
        kept = names[-keep:]
        best = f"{CHECKPOINT_PREFIX}{spare}"
        if best in names and best not in kept:
            # HF's rotation: the best stays in place of the oldest kept one, beside the newest at least
            kept = [best, *names[-max(keep - 1, 1) :]]
        removed = set(names) - set(kept)
        if not removed:
            return
        # The record first: a crash between the two leaves a folder the record no longer names, never a
        # record naming a folder that is gone.
        kept = [row for row in read_jsonl(self.checkpoints_path) if row.get("name") not in removed]
        atomic_write_text(self.checkpoints_path, "".join(json.dumps(row) + "\n" for row in kept))
        for name in sorted(removed):
            remove_entry(self._home / name)

    def publish_final(self, build: Callable[[Path], None], size: int | None = None) -> None:
        """The final adapter (or full model) at the top level, next to the run files, as Axolotl puts it."""
        if not self.writer:
            return
        try:
            publish_files_into(build, self._home, marker=self.marker)
        except Exception as exc:
            if not disk_full(exc):
                raise
            what = "the final model" if self.marker == MODEL_MARKER else "the final adapter"
            raise out_of_space(self.path, what, size, self.latest_checkpoint()) from None
        self.finish()

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint folder (temporary folders of an interrupted write never qualify)."""
        complete = [p for p in _checkpoint_folders(self.path) if (p / TRAINER_STATE).is_file()]
        return max(complete, key=lambda p: int(p.name.removeprefix(CHECKPOINT_PREFIX)), default=None)


class Progress:
    """A progress bar on an interactive terminal, plain log lines otherwise: there, when `QUIET_SECONDS` pass
    with no line (a large logging_steps, slow steps), a line of the step and the time left."""

    QUIET_SECONDS = 30.0

    def __init__(self, total: int, done: int):
        self.interactive = sys.stderr.isatty()
        self.quiet = not is_main()  # under torchrun rank 0 speaks for all
        self.total, self.first, self.done = total, done, done
        self.started = self.last_line = time.monotonic()
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
        self.last_line = time.monotonic()

    def advance(self, **postfix: str) -> None:
        self.bar.update(1)
        self.done += 1
        if postfix:
            self.bar.set_postfix(**postfix)
        now = time.monotonic()
        if not self.interactive and now - self.last_line >= self.QUIET_SECONDS and self.done < self.total:
            left = (now - self.started) / (self.done - self.first) * (self.total - self.done)
            self.say(f"step {self.done}/{self.total} · {duration(left)} left")

    def close(self) -> None:
        self.bar.close()


def _say(text: str) -> None:
    tqdm.write(text)  # between the progress bar's redraws on a terminal, a plain line otherwise
    sys.stdout.flush()


def _checkpoint_folders(directory: Path) -> list[Path]:
    return sorted(
        path
        for path in directory.glob(f"{CHECKPOINT_PREFIX}*")
        if path.is_dir() and path.name.removeprefix(CHECKPOINT_PREFIX).isdigit()
    )
