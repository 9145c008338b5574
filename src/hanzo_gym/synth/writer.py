"""Row-ordered output with a checkpoint, so re-running the same command continues after the last complete row.

Next to the output sits a hidden folder `.<output name>.synth/` holding `state.json`: the design fingerprint,
the random seed, rows delivered, the next row attempt, the byte length of the complete rows and the running
counts. A `.jsonl` output is the row file itself, one line appended and flushed per row. A `.parquet` output
cannot grow in place, so its rows stream to `rows.jsonl` in the checkpoint folder and the parquet file is
written from them when the run ends or stops — to a temporary name, then renamed, so a reader never sees half a
file. Its schema is inferred from every row, so no key is lost whichever row first carries it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from hanzo_gym.errors import ConfigError, DataError
from hanzo_gym.files import atomic_write_text
from hanzo_gym.synth.values import row_json

STATE_VERSION = 1


def checkpoint_dir(output: Path) -> Path:
    return output.parent / f".{output.name}.synth"


class RowSink:
    """Appends rows in order and records, after each row attempt, how far the run got."""

    def __init__(self, output: Path, fingerprint: str, random_seed: int | None, key_order: list[str]):
        self.output = output
        self.dir = checkpoint_dir(output)
        self.state_path = self.dir / "state.json"
        self.is_parquet = output.suffix == ".parquet"
        self.rows_path = self.dir / "rows.jsonl" if self.is_parquet else output
        self.key_order = key_order
        self.fingerprint = fingerprint
        self.delivered = 0
        self.next_attempt = 0
        self.stats: dict[str, Any] = {}
        self.random_seed = random_seed
        self._bytes = 0
        self._resume_or_start()
        self._handle = self.rows_path.open("a", encoding="utf-8")
        self._bytes = self.rows_path.stat().st_size

    def _resume_or_start(self) -> None:
        self.output.parent.mkdir(parents=True, exist_ok=True)
        state = self._read_state()
        if state is not None and not self.is_parquet and not self.output.exists():
            state = None  # the user deleted the output to start over; its checkpoint goes with it
        if state is None:
            if self.output.exists():
                raise ConfigError(
                    f"output `{self.output}` exists but has no synth checkpoint ({self.dir}); move it away or "
                    "choose another `output`"
                )
            self.dir.mkdir(exist_ok=True)
            self.rows_path.write_bytes(b"")
            if self.random_seed is None:
                self.random_seed = int.from_bytes(os.urandom(4), "little")
            self.save(0, {})
            return
        if state.get("fingerprint") != self.fingerprint:
            raise ConfigError(
                f"output `{self.output}` was written by a different design (columns, models, seed or "
                f"random_seed changed); delete it and {self.dir} to start over, or choose another `output`"
            )
        self.delivered = state["delivered"]
        self.next_attempt = state["next_attempt"]
        self.stats = state.get("stats", {})
        self.random_seed = state["random_seed"]
        complete = state["bytes"]
        size = self.rows_path.stat().st_size if self.rows_path.exists() else -1
        if size < complete:
            raise DataError(
                f"{self.rows_path} is shorter than its checkpoint says ({size} < {complete} bytes); delete "
                f"{self.output} and {self.dir} to start over"
            )
        # A row written after the last checkpoint (or half-written when the run died) is dropped and redone.
        with self.rows_path.open("r+b") as handle:
            handle.truncate(complete)

    def _read_state(self) -> dict | None:
        if not self.state_path.exists():
            return None
        try:
            state = json.loads(self.state_path.read_text(encoding="utf-8"))
        except ValueError:
            return None
        return state if state.get("version") == STATE_VERSION else None

    def append(self, row: dict) -> None:
        line = row_json(row) + "\n"
        self._handle.write(line)
        self._handle.flush()
        self._bytes += len(line.encode("utf-8"))
        self.delivered += 1

    def save(self, next_attempt: int, stats: dict[str, Any]) -> None:
        """Record progress; everything before `next_attempt` is settled and written."""
        self.next_attempt = next_attempt
        self.stats = stats
        state = {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint,
            "random_seed": self.random_seed,
            "delivered": self.delivered,
            "next_attempt": next_attempt,
            "bytes": self._bytes,
            "stats": stats,
        }
        atomic_write_text(self.state_path, json.dumps(state, indent=1))

    def close(self) -> None:
        self._handle.close()
        if self.is_parquet:
            write_parquet(self.rows_path, self.output, self.key_order)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63


def _arrow_type(values: list[Any]) -> pa.DataType:
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return pa.bool_()
    if present and all(_is_int(v) for v in present):
        return pa.int64()
    if present and all(_is_int(v) or isinstance(v, float) for v in present):
        return pa.float64()
    return pa.string()  # text, nested objects (as JSON text), mixed kinds, or no value at all


def _to_cell(value: Any, kind: pa.DataType) -> Any:
    if value is None:
        return None
    if kind == pa.string() and not isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if kind == pa.float64():
        return float(value)
    return value


def write_parquet(rows_path: Path, output: Path, key_order: list[str]) -> None:
    """Write every row of `rows_path` (jsonl) to `output` in one replace; columns cover every key of every row."""
    rows = [json.loads(line) for line in rows_path.read_text(encoding="utf-8").splitlines() if line]
    keys = list(
        dict.fromkeys([*(k for k in key_order if any(k in r for r in rows)), *(k for r in rows for k in r)])
    )
    arrays, fields = [], []
    for key in keys:
        values = [row.get(key) for row in rows]
        kind = _arrow_type(values)
        arrays.append(pa.array([_to_cell(v, kind) for v in values], type=kind))
        fields.append(pa.field(key, kind))
    table = pa.Table.from_arrays(arrays, schema=pa.schema(fields))
    fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, output)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
