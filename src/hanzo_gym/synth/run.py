"""Generate rows until `rows` pass every validator or the `max_attempts` budget is spent.

The budget counts row generations: each row attempt costs one, and each validator retry inside it one more
(settled in index order, so where the budget runs out does not depend on timing). An attempt begun within the
budget finishes its own retries.

Row attempt i draws from its own generator seeded by (random_seed, i) and takes its seed-dataset row from i, so
what an attempt produces does not depend on concurrency. Attempts run concurrently but are settled in index
order, and the delivered rows are the first `rows` attempts that pass: the same design, seed and endpoint
answers give the same file, and a resumed run continues at the first unsettled attempt.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import numpy as np

from hanzo_gym.errors import ConfigError, GymError
from hanzo_gym.synth.columns import Column, ColumnFailed, RowContext
from hanzo_gym.synth.design import Design, load_design
from hanzo_gym.synth.expressions import TemplateTooCostly
from hanzo_gym.synth.llm import ChatClient, ModelUsage
from hanzo_gym.synth.plan import Plan, make_plan
from hanzo_gym.synth.writer import RowSink

# Model settings that change how fast rows come, not what they hold: a resumed run may change them.
_OPERATIONAL_MODEL_KEYS = ("concurrency", "timeout", "retries", "retry_backoff")
_STREAM_ROW, _STREAM_SEED_ORDER = 0, 1


class SynthShortfall(GymError):
    """Fewer rows than `rows` were delivered; the message lists the causes."""


@dataclass
class Outcome:
    attempt: int
    row: dict | None = None
    dropped_by: str | None = None  # validator label
    failed_column: str | None = None
    reason: str = ""
    retries: int = 0  # validator retries this attempt made; each costs one of `max_attempts`


@dataclass
class Tally:
    """Settled attempts and why the unsuccessful ones did not become rows; saved in the checkpoint."""

    attempts: int = 0
    dropped: Counter = field(default_factory=Counter)
    failed: Counter = field(default_factory=Counter)
    reasons: dict[str, str] = field(default_factory=dict)  # "validator X" / "column Y" → last reason
    usage: dict[str, dict[str, int]] = field(default_factory=dict)
    retries: int = 0

    @property
    def spent(self) -> int:
        """What counts against `max_attempts`: row attempts plus validator retries."""
        return self.attempts + self.retries

    def settle(self, outcome: Outcome) -> None:
        self.attempts += 1
        self.retries += outcome.retries
        if outcome.dropped_by is not None:
            self.dropped[outcome.dropped_by] += 1
            self.reasons[f"validator {outcome.dropped_by}"] = outcome.reason
        elif outcome.failed_column is not None:
            self.failed[outcome.failed_column] += 1
            self.reasons[f"column {outcome.failed_column}"] = outcome.reason

    def to_json(self) -> dict[str, Any]:
        return {
            "attempts": self.attempts,
            "dropped": dict(self.dropped),
            "failed": dict(self.failed),
            "reasons": self.reasons,
            "usage": self.usage,
            "retries": self.retries,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Tally:
        return cls(
            data.get("attempts", 0),
            Counter(data.get("dropped", {})),
            Counter(data.get("failed", {})),
            dict(data.get("reasons", {})),
            {k: dict(v) for k, v in data.get("usage", {}).items()},
            data.get("retries", 0),
        )


@dataclass
class SynthReport:
    requested: int
    delivered: int
    budget: int
    tally: Tally
    models: dict[str, str]  # alias → "name @ endpoint"
    output: Path | None = None
    resumed_rows: int = 0
    seconds: float = 0.0
    rows: list[dict] = field(default_factory=list)  # preview only

    @property
    def shortfall(self) -> str | None:
        if self.delivered >= self.requested:
            return None
        causes = [
            f"dropped by validator `{v}` ×{n} (last: {self.tally.reasons.get(f'validator {v}', '')})"
            for v, n in self.tally.dropped.most_common()
        ]
        causes += [
            f"failed in column `{c}` ×{n} (last: {self.tally.reasons.get(f'column {c}', '')})"
            for c, n in self.tally.failed.most_common()
        ]
        return (
            f"delivered {self.delivered} of {self.requested} rows: max_attempts ({self.budget}) spent after "
            f"{self.tally.attempts} row attempts{self._retries_text}; "
            + ("; ".join(causes) or "no attempt failed")
            + ". Raise `max_attempts` and run the same command again to continue."
        )

    @property
    def _retries_text(self) -> str:
        return f" + {self.tally.retries} retries" if self.tally.retries else ""

    def format(self) -> str:
        where = f" to {self.output}" if self.output else ""
        resumed = f", continuing after row {self.resumed_rows}" if self.resumed_rows else ""
        lines = [
            f"synth: {self.delivered}/{self.requested} rows delivered{where} ("
            + f"{self.tally.attempts} row attempts{self._retries_text}{resumed}; {self.seconds:.1f} s)"
        ]
        if self.tally.dropped:
            lines.append(
                "  dropped by validator: "
                + ", ".join(f"{v} {n}" for v, n in self.tally.dropped.most_common())
            )
        if self.tally.failed:
            lines.append(
                "  failed rows by column: "
                + ", ".join(f"{c} {n}" for c, n in self.tally.failed.most_common())
            )
        for alias, usage in self.tally.usage.items():
            lines.append(
                f"  model {alias} ({self.models.get(alias, '?')}): {usage.get('calls', 0)} calls, "
                f"{usage.get('failed_calls', 0)} failed; tokens {usage.get('prompt_tokens', 0)} prompt + "
                f"{usage.get('completion_tokens', 0)} completion"
            )
        return "\n".join(lines)


def design_fingerprint(design: Design) -> str:
    """What decides the rows' content; `rows`, `max_attempts`, `output` and pacing settings are left out."""
    data = {k: v for k, v in design.data.items() if k not in ("rows", "max_attempts", "output")}
    for key in ("model", "models"):
        if isinstance(data.get(key), dict):
            entries = {None: data[key]} if key == "model" else data[key]
            entries = {
                alias: {k: v for k, v in m.items() if k not in _OPERATIONAL_MODEL_KEYS}
                if isinstance(m, dict)
                else m
                for alias, m in entries.items()
            }
            data[key] = entries[None] if key == "model" else entries
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class RowMaker:
    """Builds one row attempt: seed row, every column in order, then the validators with their retries."""

    def __init__(self, plan: Plan, random_seed: int, clients: dict[str, ChatClient]):
        self.plan = plan
        self.random_seed = random_seed
        self.clients = clients
        self._dropped_keys = plan.dropped_keys
        self._seed_orders: dict[int, np.ndarray] = {}

    def seed_row(self, attempt: int) -> dict:
        rows = self.plan.seed_rows
        if not rows:
            return {}
        if self.plan.design.keys.seed.sampling == "ordered":
            return rows[attempt % len(rows)]
        sweep = attempt // len(rows)
        if sweep not in self._seed_orders:
            rng = np.random.default_rng([self.random_seed, _STREAM_SEED_ORDER, sweep])
            self._seed_orders[sweep] = rng.permutation(len(rows))
        return rows[int(self._seed_orders[sweep][attempt % len(rows)])]

    async def make(self, attempt: int) -> Outcome:
        ctx = RowContext(np.random.default_rng([self.random_seed, _STREAM_ROW, attempt]), self.clients)
        row = dict(self.seed_row(attempt))
        validators = self.plan.validators
        retries = 0
        try:
            for column in self.plan.order:
                await _fill(column, row, ctx)
            budgets = [v.retries for v in validators]
            position = 0
            while position < len(validators):
                validator = validators[position]
                try:
                    why = validator.failure(row)
                except TemplateTooCostly as exc:
                    raise TemplateTooCostly(f"{validator.label}: {exc}") from None
                if why is None:
                    position += 1
                    continue
                if budgets[position] == 0:
                    return Outcome(attempt, dropped_by=validator.label, reason=why, retries=retries)
                budgets[position] -= 1
                retries += 1
                # Sampler-only columns never await anything: let other rows and the event loop run.
                await asyncio.sleep(0)
                for column in self.plan.downstream[validator.column]:
                    await _fill(column, row, ctx)
                position = 0
        except ColumnFailed as exc:
            return Outcome(attempt, failed_column=exc.column, reason=exc.reason, retries=retries)
        row = {k: v for k, v in row.items() if k not in self._dropped_keys}
        return Outcome(attempt, row=row, retries=retries)


async def _fill(column: Column, row: dict, ctx: RowContext) -> None:
    try:
        await column.fill(row, ctx)
    except TemplateTooCostly as exc:
        raise TemplateTooCostly(f"column `{column.name}`: {exc}") from None


async def _settle_in_order(
    maker: RowMaker,
    need: int,
    start: int,
    budget: int,
    window: int,
    settle: Callable[[Outcome], None],
) -> None:
    """Run attempts `start`, `start+1`, … up to `window` at a time; hand outcomes to `settle` in index order.

    `budget` is what is left of `max_attempts`: each settled attempt spends one plus its retries. Stops once
    `need` settled outcomes carried a row, or the budget is spent; an attempt that finished but whose turn
    comes after the budget ran out is not settled (a resumed run with a larger budget redoes it). More attempts
    start only while the rows in hand plus those in flight fall short of `need`, and while the budget could
    still reach them, so no calls are spent on rows that could not be used.
    """
    in_flight: dict[int, asyncio.Task] = {}
    finished: dict[int, Outcome] = {}
    next_attempt, next_settle, delivered, spent = start, start, 0, 0
    try:
        while delivered < need and spent < budget:
            in_hand = delivered + sum(1 for o in finished.values() if o.row is not None)
            while (
                len(in_flight) < window
                and spent + len(in_flight) + len(finished) < budget
                and in_hand + len(in_flight) < need
            ):
                in_flight[next_attempt] = asyncio.create_task(maker.make(next_attempt))
                next_attempt += 1
            if not in_flight:
                break
            done, _ = await asyncio.wait(in_flight.values(), return_when=asyncio.FIRST_COMPLETED)
            for attempt in [a for a, t in in_flight.items() if t in done]:
                finished[attempt] = in_flight.pop(attempt).result()  # fatal errors surface here
            while next_settle in finished and delivered < need and spent < budget:
                outcome = finished.pop(next_settle)
                next_settle += 1
                delivered += outcome.row is not None
                spent += 1 + outcome.retries
                settle(outcome)
    finally:
        for task in in_flight.values():
            task.cancel()
        await asyncio.gather(*in_flight.values(), return_exceptions=True)


def _merged_usage(
    previous: dict[str, dict[str, int]], clients: dict[str, ChatClient]
) -> dict[str, dict[str, int]]:
    merged = {alias: dict(usage) for alias, usage in previous.items()}
    for alias, client in clients.items():
        total = ModelUsage(**merged.get(alias, {}))
        total.add(client.usage.as_dict())
        merged[alias] = total.as_dict()
    return merged


async def _generate(
    plan: Plan,
    random_seed: int,
    need: int,
    start: int,
    budget: int,
    settle: Callable[[Outcome, dict[str, ChatClient]], None],
) -> dict[str, ChatClient]:
    # trust_env: proxies and NO_PROXY from the environment apply, as for any HTTP tool.
    async with httpx2.AsyncClient(trust_env=True) as http:
        clients = {
            alias: ChatClient(alias, settings, plan.api_keys[alias], http)
            for alias, settings in plan.models.items()
        }
        window = max(1, sum(settings.concurrency for settings in plan.models.values()))
        maker = RowMaker(plan, random_seed, clients)
        await _settle_in_order(maker, need, start, budget, window, lambda outcome: settle(outcome, clients))
        return clients


ProgressFn = Callable[[int, int, Tally], None]


def synthesize(
    design: Design | str | Path,
    preview: int | None = None,
    progress: ProgressFn | None = None,
    environ: dict[str, str] | None = None,
) -> SynthReport:
    """Run a design: `preview` rows in memory, or the design's `rows` into its `output` (resuming if there)."""
    if not isinstance(design, Design):
        design = load_design(design)
    plan = make_plan(design, environ)
    keys = design.keys
    models = {alias: f"{m.name} @ {m.endpoint}" for alias, m in plan.models.items()}
    started = time.monotonic()
    if preview is not None:
        return _preview(plan, preview, models, started)
    if keys.output is None:
        raise ConfigError(f"{design.where(())}: `output` is required unless --preview is given")
    output = Path(keys.output)
    sink = RowSink(output, design_fingerprint(design), keys.random_seed, plan.output_keys)
    tally = Tally.from_json(sink.stats)
    report = SynthReport(
        keys.rows, sink.delivered, keys.attempt_budget, tally, models, output, sink.delivered
    )

    def settle(outcome: Outcome, clients: dict[str, ChatClient]) -> None:
        if outcome.row is not None:
            sink.append(outcome.row)
        tally.settle(outcome)
        current = Tally(**{**tally.__dict__, "usage": _merged_usage(tally.usage, clients)})
        sink.save(outcome.attempt + 1, current.to_json())
        report.delivered = sink.delivered
        if progress is not None:
            progress(sink.delivered, keys.rows, tally)

    clients: dict[str, ChatClient] = {}
    try:
        need = keys.rows - sink.delivered
        budget_left = keys.attempt_budget - tally.spent
        if need > 0 and budget_left > 0:
            clients = asyncio.run(
                _generate(plan, sink.random_seed, need, sink.next_attempt, budget_left, settle)
            )
    finally:
        sink.close()
        report.seconds = time.monotonic() - started
    tally.usage = _merged_usage(tally.usage, clients)
    sink.save(sink.next_attempt, tally.to_json())
    return report


def _preview(plan: Plan, rows: int, models: dict[str, str], started: float) -> SynthReport:
    keys = plan.design.keys
    budget = keys.max_attempts if keys.max_attempts is not None else 3 * rows
    tally = Tally()
    report = SynthReport(rows, 0, budget, tally, models)

    def settle(outcome: Outcome, clients: dict[str, ChatClient]) -> None:
        tally.settle(outcome)
        if outcome.row is not None:
            report.rows.append(outcome.row)
            report.delivered += 1

    seed = keys.random_seed if keys.random_seed is not None else int(np.random.default_rng().integers(2**32))
    clients = asyncio.run(_generate(plan, seed, rows, 0, budget, settle))
    tally.usage = _merged_usage({}, clients)
    report.seconds = time.monotonic() - started
    return report
