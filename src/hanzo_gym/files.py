"""Crash-safe writes: a file or a folder is either the old one or the complete new one, never a part.

Everything is written aside, fsynced and renamed into place. Torch-free, so `gym synth` and the config layer
use it too.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


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


def publish_files_into(build: Callable[[Path], None], directory: Path, marker: str | None = None) -> None:
    """Run `build(tmp)` on a temporary folder, then move each file it wrote into `directory` (one rename each).

    `marker` names the file that says the set is complete (a PEFT adapter's adapter_config.json): the old one
    goes first and the new one moves last, so a crash part-way leaves no marker next to a mix of old and new
    files."""
    staging = directory / f".staging-{os.getpid()}"
    publish_directory(build, staging)
    if marker is not None:
        (directory / marker).unlink(missing_ok=True)
    for item in sorted(staging.iterdir(), key=lambda path: path.name == marker):
        os.replace(item, directory / item.name)
    staging.rmdir()
