"""What the benchmarks share: each side runs in its own subprocess (so its peak resident set is its own) on the
same de-quantised model and the same data file, and reports a JSON dict back."""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

INTERNAL = ("--model-dir", "--data", "--work-dir", "--result")


def peak_rss_bytes() -> int:
    """This process's peak resident set. Read from VmHWM, not `ru_maxrss`: Linux carries `ru_maxrss` across
    exec, so a side started by a parent that holds 1.7 GB (converting the GGUF) would report at least that."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no /proc: KB on Linux, bytes on macOS


# The four sides of a precision comparison: each trainer in fp32 and at its bf16 setting.
SIDE_NAMES = {
    "trl-fp32": "TRL fp32",
    "trl-bf16": "TRL bf16=True",
    "ours-fp32": "hanzo-gym fp32",
    "ours-bf16": "hanzo-gym bf16",
}


def precision_sides(
    run_trl: Callable[..., dict], run_ours: Callable[..., dict]
) -> dict[str, Callable[..., dict]]:
    """SIDE_NAMES' sides as the runners they call, each given `bf16=` after the workload's arguments."""
    runners = {"trl": run_trl, "ours": run_ours}
    return {key: partial(runners[key.split("-")[0]], bf16=key.endswith("bf16")) for key in SIDE_NAMES}


def add_side_arguments(parser: argparse.ArgumentParser, sides: dict) -> None:
    """The hidden arguments a side's subprocess is started with."""
    parser.add_argument("--side", choices=sides, help=argparse.SUPPRESS)
    for internal in INTERNAL:
        parser.add_argument(internal, help=argparse.SUPPRESS)


def finish_side(opts: argparse.Namespace, run: Callable[[], dict]) -> None:
    """In a side's subprocess: run it and write its result, with its peak memory, where the parent reads it."""
    result = run()
    result["peak_rss_bytes"] = peak_rss_bytes()
    Path(opts.result).write_text(json.dumps(result))


def compare_sides(
    script: str, rows: list[dict], steps: int, forwarded: list[str], may_fail: Sequence[str] = ()
) -> tuple[dict, dict, float]:
    """Run TRL's side, then ours, on `rows`; return both results and the load average before they started.
    A side named in `may_fail` that fails comes back as {"failed": its last log lines}."""
    results, load_at_start = run_sides(script, ("trl", "ours"), rows, steps, forwarded, may_fail)
    return results["trl"], results["ours"], load_at_start


def run_sides(
    script: str,
    sides: Sequence[str],
    rows: list[dict],
    steps: int,
    forwarded: list[str],
    may_fail: Sequence[str] = (),
) -> tuple[dict[str, dict], float]:
    """Run each of `sides` in turn on `rows`; return their results by name and the load average before they
    started."""
    from hanzo_gym.model.hub import real_model_gguf, resolve_model

    # Converting the GGUF once here keeps the one-off de-quantisation out of both sides' time and memory.
    model_dir = resolve_model(str(real_model_gguf()))
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix=f"{Path(script).stem}-") as tmp:
        work_dir = Path(tmp)
        data_path = work_dir / "data.jsonl"
        data_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        results = {
            side: _run_side(script, side, model_dir, data_path, work_dir, steps, forwarded, side in may_fail)
            for side in sides
        }
    return results, load_at_start


def _run_side(
    script: str,
    side: str,
    model_dir: Path,
    data_path: Path,
    work_dir: Path,
    steps: int,
    forwarded: list[str],
    may_fail: bool = False,
) -> dict:
    result_path = work_dir / f"{side}.json"
    log_path = work_dir / f"{side}.log"
    command = [
        sys.executable,
        script,
        "--side",
        side,
        "--model-dir",
        str(model_dir),
        "--data",
        str(data_path),
        "--work-dir",
        str(work_dir / side),
        "--result",
        str(result_path),
        "--steps",
        str(steps),
        *forwarded,
    ]
    print(f"running {side} ({steps} steps) ...", file=sys.stderr, flush=True)
    # Other jobs on a 2-core machine slow a side down (two OpenMP threads stall whenever one core is taken):
    # the load each side started under says how far to trust the comparison.
    load_at_start = os.getloadavg()[0]
    with open(log_path, "w") as log:
        finished = subprocess.run(command, check=False, stdout=log, stderr=subprocess.STDOUT)
    if finished.returncode != 0 and may_fail:
        return {"failed": "\n".join(log_path.read_text().splitlines()[-3:])}
    if finished.returncode != 0:
        sys.exit(
            f"{side} failed (exit {finished.returncode}); last lines of its log:\n"
            + "\n".join(log_path.read_text().splitlines()[-30:])
        )
    return {**json.loads(result_path.read_text()), "load_at_start": load_at_start}


def start_tinker_server(
    model: str,
    bf16: str,
    root: str,
    keys: Sequence[str],
    extra: Sequence[str] = (),
    entry: Sequence[str] = (),
) -> tuple[subprocess.Popen, str]:
    """`gym serve --tinker` on a free port with these API keys and checkpoints under `root`; the process and its
    URL. `entry` replaces `-m hanzo_gym.cli` (a `-c` program that patches something, then runs the CLI)."""
    command = [sys.executable, *(entry or ["-m", "hanzo_gym.cli"]), "serve", "--tinker", "--model", model]
    command += ["--port", "0", "--bf16", bf16, *extra]
    for key in keys:
        command += ["--api-key", key]
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, env={**os.environ, "HANZO_GYM_RUNS": root}
    )
    for _ in range(5):
        match = re.search(r"Tinker API on (\S+) ", server.stdout.readline())
        if match:
            return server, match.group(1)
    server.terminate()
    raise SystemExit("gym serve did not say where its Tinker API listens")
