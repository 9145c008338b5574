"""Crash-safe writes: a file or a folder is either the old one or the complete new one, never a part.

Everything is written aside, fsynced and renamed into place. Torch-free, so `gym synth` and the config layer
use it too.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hanzo_gym.errors import GymError

SWAP_PLAN = ".swap-plan.json"  # in a staging folder: its swap into the parent has begun (see `swap_in`)


def atomic_write_text(path: Path, text: str) -> None:
    """`path` holds the old text or the new one, never a part: written aside, synced, renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def publish_directory(build: Callable[[Path], None], final: Path) -> None:
    """Run `build(tmp)` on a temporary sibling folder, then move it to `final`, replacing what was there."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def publish_files_into(
    build: Callable[[Path], None], directory: Path, marker: str | None = None, replaces: Iterable[str] = ()
) -> list[str]:
    """Run `build(tmp)` on a temporary folder, then move each file it wrote into `directory` (one rename each).

    `marker` names the file that says the set is complete (a PEFT adapter's adapter_config.json): the old one
    goes first and the new one moves last, so a crash part-way leaves no marker next to a mix of old and new
    files. `replaces`: glob patterns of an earlier set that the new one replaces in full; the files matching
    them that the new set does not overwrite (a stale shard of a differently sharded model) are removed after
    the old marker, before the new files move in. Returns the names removed."""
    staging = directory / f".staging-{os.getpid()}"
    publish_directory(build, staging)
    incoming = {item.name for item in staging.iterdir()}
    if marker is not None:
        (directory / marker).unlink(missing_ok=True)
    stale = sorted(
        {path.name for pattern in replaces for path in directory.glob(pattern) if path.is_file()} - incoming
    )
    for name in stale:
        (directory / name).unlink()
    for item in sorted(staging.iterdir(), key=lambda path: path.name == marker):
        os.replace(item, directory / item.name)
    staging.rmdir()
    return stale


def remove_entry(path: Path) -> None:
    """Remove a file or a folder. A folder is first renamed to a hidden name that nothing trusts, so a crash
    mid-delete never leaves a part of it under its own name (a checkpoint missing some files)."""
    if path.is_dir() and not path.is_symlink():
        trash = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, trash)
        shutil.rmtree(trash)
    elif path.exists() or path.is_symlink():
        path.unlink()


def swap_in(staging: Path, directory: Path, replaced: Iterable[str], marker: str | None = None) -> None:
    """Move every entry of `staging` (a folder inside `directory`) into `directory`, and remove the entries
    named in `replaced` that the staged set does not overwrite; then remove `staging`.

    The plan is written into `staging` first, so a process killed part-way leaves a staging folder that
    `finish_swap` completes: from the plan on, the new set wins. `marker` as in `publish_files_into`."""
    incoming = sorted(item.name for item in staging.iterdir() if not item.name.startswith("."))
    plan = {"incoming": incoming, "removes": sorted(set(replaced) - set(incoming)), "marker": marker}
    atomic_write_text(staging / SWAP_PLAN, json.dumps(plan) + "\n")
    finish_swap(staging, directory)


def finish_swap(staging: Path, directory: Path) -> None:
    """Carry out (or finish, after a crash) the swap planned in `staging`. Every move checks whether it is
    still to do, so running it again is harmless."""
    plan = json.loads((staging / SWAP_PLAN).read_text(encoding="utf-8"))
    marker = plan["marker"]
    if marker in plan["removes"] or (marker in plan["incoming"] and (staging / marker).exists()):
        (directory / marker).unlink(missing_ok=True)  # first: it would vouch for a mix of old and new
    for name in plan["removes"]:
        remove_entry(directory / name)
    for name in sorted(plan["incoming"], key=lambda name: name == marker):
        source = staging / name
        if source.exists() or source.is_symlink():  # not moved yet: what has that name is the old one
            remove_entry(directory / name)
            os.replace(source, directory / name)
    shutil.rmtree(staging)


def process_alive(pid: int) -> bool:
    """Whether the process that named a temporary after itself still runs (then it is not abandoned)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_jsonl(path: Path) -> list[dict]:
    """The rows of an appended-to JSON-lines record (metrics.jsonl): a torn last line, from a crash mid-append,
    ends it; everything before it is good."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows


HOLDER_FILE = ".gym-train.pid"  # who holds a directory, for the message of the process that cannot


@contextmanager
def held_exclusively(directory: Path, what: str) -> Iterator[None]:
    """Hold `directory` for this process alone while the block runs: a second process that asks fails at
    once, naming the process that holds it. An OS lock (flock) on the directory itself, so a process killed by
    any means lets go, and nothing is left in it after the block."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle = os.open(directory, os.O_RDONLY)
    except OSError as exc:
        raise GymError(f"cannot create output_dir {directory}: {exc.strerror}") from None
    holder = directory / HOLDER_FILE
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                pid = holder.read_text(encoding="utf-8").strip()
            except OSError:
                pid = "?"
            raise GymError(
                f"{directory} is in use by another {what} (process {pid}): wait for it to finish, or give this "
                "run another output_dir"
            ) from None
        holder.write_text(str(os.getpid()), encoding="utf-8")
        try:
            yield
        finally:
            holder.unlink(missing_ok=True)  # before the lock goes: the next holder writes its own
    finally:
        os.close(handle)


def disk_full(exc: BaseException) -> bool:
    """Whether a write failed for want of space: ENOSPC, or the message a library (safetensors) made of it."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    return "No space left on device" in str(exc) or "os error 28" in str(exc)


def out_of_space(directory: Path, what: str, needed: int | None, resumable: Path | None) -> GymError:
    """The one line for a write that found the disk full: where, what it was writing, how much room it wants
    against what is free, and what still stands."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    room = f"{free / 1e6:.0f} MB free" if free is not None else "the free space unknown"
    wants = f"about {needed / 1e6:.0f} MB needed, " if needed else ""
    kept = (
        f"{resumable.name} is intact: free some space and run the same command to continue from it"
        if resumable is not None
        else "nothing of it was kept: free some space and run again"
    )
    return GymError(f"no space left on the disk of {directory} while writing {what} ({wants}{room}); {kept}")
