"""From a parsed design to a runnable plan: cross-column checks, the seed rows, models and the generation order.

Order is Kahn's algorithm, taking the earliest-declared ready column first, so a design's order is kept
wherever dependencies allow it. Dependencies are template variables, a subcategory's parent, a timedelta's
reference, the columns a conditional parameter reads and a judge's `columns`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from hanzo_gym.synth.columns import Column, LlmColumn, SamplerColumn
from hanzo_gym.synth.design import DEFAULT_MODEL_ALIAS, Design, ErrorList
from hanzo_gym.synth.llm import ModelSettings
from hanzo_gym.synth.samplers import (
    CategorySampler,
    DatetimeSampler,
    SubcategorySampler,
    TimedeltaSampler,
    reference_format_problem,
    value_key,
)
from hanzo_gym.synth.validators import Validator
from hanzo_gym.synth.values import NotJSON, json_value

logger = logging.getLogger(__name__)


@dataclass
class Plan:
    design: Design
    order: list[Column]
    validators: list[Validator]
    seed_rows: list[dict]
    models: dict[str, ModelSettings]
    api_keys: dict[str, str | None]
    # column name → that column and everything computed from it, in generation order (what a retry redoes)
    downstream: dict[str, list[Column]] = field(default_factory=dict)

    @property
    def output_keys(self) -> list[str]:
        """Keys of a delivered row, in order: seed fields, then each kept column's keys in generation order."""
        seed_keys = list(dict.fromkeys(k for row in self.seed_rows for k in row))
        column_keys = [k for c in self.order if not c.drop for k in c.output_keys()]
        return seed_keys + column_keys

    @property
    def dropped_keys(self) -> set[str]:
        return {k for c in self.order if c.drop for k in c.output_keys()}


def _read_seed(design: Design, errors: ErrorList) -> list[dict]:
    seed = design.keys.seed
    if seed is None:
        return []
    from hanzo_gym.data.sources import read_rows

    rows = []
    for index, row in enumerate(read_rows(seed.path, seed.split)):
        try:
            rows.append(json_value(row.data))  # a parquet timestamp becomes ISO text, as in any column
        except NotJSON as exc:
            errors.add(("seed", "path"), f"seed row {index}: a value is not JSON: {exc}")
            return []
    if not rows:
        errors.add(("seed", "path"), f"seed dataset is empty: {seed.path}")
    return rows


def _column_indices(design: Design) -> dict[str, int]:
    return {column.name: i for i, column in enumerate(design.columns)}


def make_plan(design: Design, environ: Mapping[str, str] | None = None) -> Plan:
    """Check everything that spans columns, read the seed dataset and fix the order; raise one ConfigError."""
    environ = os.environ if environ is None else environ
    errors = ErrorList(design.source, design.lines)
    seed_rows = _read_seed(design, errors)
    seed_fields = {k for row in seed_rows for k in row}
    columns: dict[str, Column] = {}
    for i, column in enumerate(design.columns):
        label = f"column `{column.name}`"
        if column.name in columns:
            errors.add(("columns", i, "name"), f"column `{column.name}` is defined twice")
        elif column.name in seed_fields:
            errors.add(
                ("columns", i, "name"), "a field of the seed dataset has this name; rename the column", label
            )
        columns[column.name] = column
    produced = {k: c.name for c in columns.values() for k in c.output_keys()}

    for i, column in enumerate(design.columns):
        at = ("columns", i)
        label = f"column `{column.name}`"
        for ref in sorted(column.references()):
            if ref == column.name:
                errors.add(at, "references itself", label)
            elif ref not in produced and ref not in seed_fields:
                errors.add(at, f"references `{ref}`, which is not a column", label)
        if isinstance(column, SamplerColumn):
            _check_sampler_links(column, columns, at, label, errors)

    models = design.keys.model_settings()
    used = _assign_models(design, columns, models, errors)
    api_keys = _api_keys(design, used, models, environ, errors)
    validators = _check_validators(design, columns, produced, seed_fields, errors)
    order = _order(design, columns, produced, errors)
    errors.raise_if_any()

    for column in order:
        if isinstance(column, LlmColumn) and not (column.references() - {column.name}):
            logger.warning(
                "column `%s`: prompt references no column: every row gets the same prompt", column.name
            )
    plan = Plan(design, order, validators, seed_rows, {a: models[a] for a in used}, api_keys)
    plan.downstream = _downstream(order, produced)
    return plan


def _check_sampler_links(
    column: SamplerColumn, columns: dict[str, Column], at: tuple, label: str, errors: ErrorList
) -> None:
    samplers = [column.sampler, *(s for _, s in column.conditional)]
    for sampler in samplers:
        if isinstance(sampler, SubcategorySampler):
            parent = columns.get(sampler.parent)
            if not (isinstance(parent, SamplerColumn) and isinstance(parent.sampler, CategorySampler)):
                errors.add(
                    (*at, "parent"), f"parent `{sampler.parent}` must be a category sampler column", label
                )
                return
            parent_values = {
                value_key(v) for s in [parent.sampler, *(s for _, s in parent.conditional)] for v in s.values
            }
            missing = sorted(parent_values - set(sampler.values))
            unknown = sorted(set(sampler.values) - parent_values)
            if missing or unknown:
                errors.add(
                    (*at, "values"),
                    f"values must cover parent `{sampler.parent}` exactly: missing {missing}, unknown {unknown}",
                    label,
                )
                return
        if isinstance(sampler, TimedeltaSampler):
            reference = columns.get(sampler.reference)
            if not (isinstance(reference, SamplerColumn) and isinstance(reference.sampler, DatetimeSampler)):
                errors.add(
                    (*at, "reference"),
                    f"reference `{sampler.reference}` must be a datetime sampler column",
                    label,
                )
                return
            problem = reference_format_problem(reference.sampler.format)
            if problem is not None:
                errors.add(
                    (*at, "reference"),
                    f"reference `{sampler.reference}` has format `{reference.sampler.format}`, which a timedelta "
                    f"cannot read back ({problem}); give `{sampler.reference}` a format with the full date",
                    label,
                )
                return
            sampler._reference_format = reference.sampler.format


def _assign_models(
    design: Design, columns: dict[str, Column], models: dict[str, ModelSettings], errors: ErrorList
) -> list[str]:
    """Resolve each LLM column's model alias; return the aliases in use."""
    used: list[str] = []
    index = _column_indices(design)
    for column in columns.values():
        if not isinstance(column, LlmColumn):
            continue
        at = ("columns", index[column.name])
        label = f"column `{column.name}`"
        if not models:
            errors.add(at, "llm columns need `model`", label)
            continue
        if column.model is None:
            if len(models) > 1:
                errors.add(
                    at, f"several models are declared ({', '.join(models)}); choose one with `model:`", label
                )
                continue
            column.model = next(iter(models))
        elif column.model not in models:
            where = "`models`" if design.keys.models else "`model` (a single model is called `default`)"
            errors.add((*at, "model"), f"model `{column.model}` is not declared in {where}", label)
            continue
        if column.model not in used:
            used.append(column.model)
    return used


def _api_keys(
    design: Design,
    used: list[str],
    models: dict[str, ModelSettings],
    environ: Mapping[str, str],
    errors: ErrorList,
) -> dict[str, str | None]:
    keys: dict[str, str | None] = {}
    for alias in used:
        variable = models[alias].api_key_env
        if not variable:
            keys[alias] = None
            continue
        if variable not in environ:
            at = (
                ("model", "api_key_env")
                if alias == DEFAULT_MODEL_ALIAS and design.keys.model
                else ("models", alias)
            )
            errors.add(at, f"model: `{variable}` is not set (api_key_env)")
        keys[alias] = environ.get(variable)
    return keys


def _check_validators(
    design: Design,
    columns: dict[str, Column],
    produced: dict[str, str],
    seed_fields: set[str],
    errors: ErrorList,
) -> list[Validator]:
    for i, validator in enumerate(design.validators):
        at = ("validators", i)
        label = f"validators[{i}]"
        if validator.column not in produced:
            errors.add((*at, "column"), f"validator on `{validator.column}`: not a column", label)
            continue
        for ref in sorted(validator.references() - {validator.column}):
            if ref not in produced and ref not in seed_fields:
                errors.add((*at, "expression"), f"references `{ref}`, which is not a column", label)
    return list(design.validators)


def _order(
    design: Design, columns: dict[str, Column], produced: dict[str, str], errors: ErrorList
) -> list[Column]:
    position = {name: i for i, name in enumerate(columns)}
    needs = {
        name: {produced[r] for r in column.references() if r in produced and produced[r] != name}
        for name, column in columns.items()
    }
    order: list[str] = []
    done: set[str] = set()
    while len(order) < len(columns):
        ready = [n for n in columns if n not in done and needs[n] <= done]
        if not ready:
            cycle = _cycle_members({n: needs[n] - done for n in columns if n not in done})
            cycle.sort(key=position.__getitem__)
            errors.add(
                ("columns", position[cycle[0]]),
                f"columns depend on each other in a cycle: {', '.join(cycle)}",
            )
            return []
        chosen = min(ready, key=position.__getitem__)
        order.append(chosen)
        done.add(chosen)
    return [columns[n] for n in order]


def _cycle_members(needs: dict[str, set[str]]) -> list[str]:
    """Columns that can reach themselves, leaving out those merely waiting on a cycle."""

    def reachable(start: str) -> set[str]:
        seen, stack = set(), list(needs[start])
        while stack:
            name = stack.pop()
            if name not in seen:
                seen.add(name)
                stack.extend(needs.get(name, ()))
        return seen

    return [name for name in needs if name in reachable(name)]


def _downstream(order: list[Column], produced: dict[str, str]) -> dict[str, list[Column]]:
    downstream: dict[str, list[Column]] = {}
    for i, column in enumerate(order):
        affected = {column.name}
        for later in order[i + 1 :]:
            if {produced.get(r) for r in later.references()} & affected:
                affected.add(later.name)
        downstream[column.name] = [c for c in order if c.name in affected]
    # Validators name output keys; a judge's `<name>_reasoning` belongs to the judge column.
    for key, owner in produced.items():
        downstream.setdefault(key, downstream[owner])
    return downstream
