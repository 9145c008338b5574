"""`gym serve --tinker` as a user starts it: a subprocess on a free loopback port, for the tests that talk to it
with the official tinker SDK (test_tinker_server.py) and run tinker-cookbook's recipes on it
(test_tinker_cookbook.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def gym_serve_command(model: str, *options: str, bf16: str = "false") -> list[str]:
    """`gym serve --model MODEL` on a free port, in fp32 by default: the tests compare against fp32 references."""
    return [
        sys.executable,
        "-m",
        "hanzo_gym.cli",
        "serve",
        "--model",
        model,
        "--port",
        "0",
        "--bf16",
        bf16,
        *options,
    ]


def start_gym_serve(
    model: str, runs: Path, served_name: str | None = None, cwd: Path | None = None, bf16: str = "false"
) -> tuple[subprocess.Popen, str]:
    """The server process and its TINKER_BASE_URL, once it listens; checkpoints go under `runs`."""
    command = gym_serve_command(model, "--tinker", bf16=bf16)
    if served_name is not None:
        command += ["--served-model-name", served_name]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, cwd=cwd, env={**os.environ, "HANZO_GYM_RUNS": str(runs)}
    )
    assert process.stdout.readline().startswith("precision: ")  # its first line
    line = process.stdout.readline()
    match = re.search(r"Tinker API on (http://127\.0\.0\.1:\d+) \(TINKER_BASE_URL=", line)
    if not match:
        stop(process)
        raise AssertionError(f"gym serve did not start: {line!r}")
    return process, match.group(1)


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(timeout=30)
