"""Synth samplers: each kind's distribution from a seeded generator, within tolerances, and conditional params."""

from __future__ import annotations

import re
from collections import Counter
from datetime import datetime

import numpy as np
import pytest
from pydantic import ValidationError

from hanzo_gym.synth import parse_design, synthesize
from hanzo_gym.synth.samplers import SAMPLERS, SamplerError

N = 4000


def draws(kind: str, row: dict | None = None, count: int = N, seed: int = 0, **params):
    sampler = SAMPLERS[kind].model_validate(params)
    rng = np.random.default_rng(seed)
    return [sampler.draw(rng, dict(row or {})) for _ in range(count)]


def test_category_follows_relative_weights_and_keeps_value_types():
    counts = Counter(draws("category", values=["a", 7, 2.5], weights=[2, 1, 1]))
    assert set(counts) == {"a", 7, 2.5}
    assert counts["a"] / N == pytest.approx(0.5, abs=0.03)
    assert counts[7] / N == pytest.approx(0.25, abs=0.03)


def test_category_without_weights_is_uniform():
    counts = Counter(draws("category", values=["x", "y", "z", "w"]))
    assert all(c / N == pytest.approx(0.25, abs=0.03) for c in counts.values())


def test_subcategory_draws_from_the_parent_values_list():
    values = {"math": ["algebra", "calculus"], 7: ["seven"]}
    assert set(draws("subcategory", {"topic": "math"}, parent="topic", values=values)) == {
        "algebra",
        "calculus",
    }
    assert set(draws("subcategory", {"topic": 7}, count=20, parent="topic", values=values)) == {"seven"}


def test_uniform_float_stays_in_half_open_range_with_matching_mean():
    values = draws("uniform", low=2.0, high=4.0)
    assert all(2.0 <= v < 4.0 and isinstance(v, float) for v in values)
    assert np.mean(values) == pytest.approx(3.0, abs=0.05)


def test_uniform_integer_is_inclusive_at_both_ends():
    values = draws("uniform", low=1, high=6, integer=True)
    assert set(values) == {1, 2, 3, 4, 5, 6}
    assert all(type(v) is int for v in values)


def test_uniform_rounds_to_decimal_places():
    assert all(v == round(v, 1) for v in draws("uniform", count=200, low=0, high=1, decimal_places=1))


def test_gaussian_mean_std_and_truncation():
    free = draws("gaussian", mean=10, std=2)
    assert np.mean(free) == pytest.approx(10, abs=0.15)
    assert np.std(free) == pytest.approx(2, abs=0.15)
    bounded = draws("gaussian", mean=0, std=1, min=-0.5, max=0.5)
    assert min(bounded) >= -0.5 and max(bounded) <= 0.5


def test_gaussian_that_keeps_missing_its_window_fails_the_row():
    with pytest.raises(SamplerError, match="1000 draws fell outside"):
        draws("gaussian", count=1, mean=0, std=1, min=50, max=51)


def test_bernoulli_binomial_poisson_moments():
    bern = draws("bernoulli", p=0.3)
    assert set(bern) == {0, 1} and np.mean(bern) == pytest.approx(0.3, abs=0.03)
    binom = draws("binomial", n=10, p=0.4)
    assert np.mean(binom) == pytest.approx(4.0, abs=0.1)
    assert np.var(binom) == pytest.approx(2.4, abs=0.25)
    assert min(binom) >= 0 and max(binom) <= 10
    pois = draws("poisson", mean=3.5)
    assert np.mean(pois) == pytest.approx(3.5, abs=0.12)
    assert np.var(pois) == pytest.approx(3.5, abs=0.35)


def test_uuid_forms():
    full = draws("uuid", count=500)
    assert len(set(full)) == 500
    assert all(re.fullmatch(r"[0-9a-f]{12}4[0-9a-f]{3}[89ab][0-9a-f]{15}", u) for u in full)
    short = draws("uuid", count=5, prefix="id-", short_form=True, uppercase=True)
    assert all(re.fullmatch(r"id-[0-9A-F]{8}", u) for u in short)


def test_datetime_range_unit_and_format():
    values = draws(
        "datetime", count=500, start="2024-01-01", end="2024-01-03", unit="h", format="%Y-%m-%d %H:%M"
    )
    parsed = [datetime.strptime(v, "%Y-%m-%d %H:%M") for v in values]
    assert all(datetime(2024, 1, 1) <= p < datetime(2024, 1, 3) and p.minute == 0 for p in parsed)
    assert len({p.date() for p in parsed}) == 2


def test_timedelta_adds_whole_units_to_the_reference():
    values = draws(
        "timedelta", {"start": "2024-03-01T00:00:00"}, count=300, reference="start", min=1, max=4, unit="D"
    )
    offsets = {(datetime.fromisoformat(v) - datetime(2024, 3, 1)).days for v in values}
    assert offsets == {1, 2, 3}


@pytest.mark.parametrize(
    "kind, params, message",
    [
        ("category", {"values": []}, "category needs at least one value"),
        ("category", {"values": [1, 2], "weights": [1]}, "1 weights for 2 values"),
        (
            "category",
            {"values": [1], "weights": [0]},
            "weights must be non-negative and sum to more than zero",
        ),
        ("uniform", {"low": 3, "high": 3}, "uniform needs high > low"),
        ("gaussian", {"mean": 0, "std": 0}, "gaussian needs std > 0"),
        ("gaussian", {"mean": 0, "std": 1, "min": 2, "max": 1}, "gaussian needs min <= max"),
        ("bernoulli", {"p": 1.5}, "less than or equal to 1"),
        ("datetime", {"start": "2024-02-01", "end": "2024-01-01"}, "datetime needs start < end"),
        ("datetime", {"start": "2024-01-01", "end": "2024-02-01", "format": "plain"}, "bad datetime format"),
        ("timedelta", {"reference": "t", "min": 3, "max": 3}, "timedelta needs max > min"),
    ],
)
def test_parameter_checks(kind, params, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        SAMPLERS[kind].model_validate(params)


def _design(columns: list[dict], **top) -> dict:
    return {"rows": 300, "random_seed": 3, "columns": columns, **top}


def test_conditional_params_apply_to_rows_matching_their_condition():
    design = parse_design(
        _design(
            [
                {"name": "tier", "sampler": "category", "values": ["free", "pro"]},
                {
                    "name": "seats",
                    "sampler": "uniform",
                    "low": 1,
                    "high": 3,
                    "integer": True,
                    "conditional_params": {"tier == 'pro'": {"low": 50, "high": 60}},
                },
            ]
        )
    )
    rows = synthesize(design, preview=300).rows
    assert {r["tier"] for r in rows} == {"free", "pro"}
    assert all((50 <= r["seats"] <= 60) if r["tier"] == "pro" else (1 <= r["seats"] <= 3) for r in rows)


def test_random_seed_makes_sampler_rows_identical_across_runs_and_distinct_across_seeds():
    columns = [
        {"name": "x", "sampler": "gaussian", "mean": 0, "std": 1},
        {"name": "id", "sampler": "uuid"},
        {"name": "c", "sampler": "category", "values": ["a", "b", "c"]},
    ]
    first = synthesize(parse_design(_design(columns)), preview=50).rows
    again = synthesize(parse_design(_design(columns)), preview=50).rows
    other = synthesize(parse_design(_design(columns, random_seed=4)), preview=50).rows
    assert first == again
    assert first != other
