"""Design YAML errors name the file, the line and the key; load-time cross-column checks; generation order."""

from __future__ import annotations

import textwrap
from datetime import UTC, datetime, timedelta

import pytest

from hanzo_gym.errors import ConfigError
from hanzo_gym.synth import load_design, synthesize
from hanzo_gym.synth.plan import make_plan


def _write(tmp_path, text: str):
    path = tmp_path / "design.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def error_of(tmp_path, text: str, environ: dict | None = None) -> str:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        make_plan(load_design(path), environ or {})
    return str(caught.value)


def test_unknown_top_level_key_suggests_the_nearest(tmp_path):
    message = error_of(
        tmp_path,
        """
        columns:
          - {name: a, sampler: uuid}
        row: 5
        """,
    )
    assert message == f"{tmp_path}/design.yaml:3: unknown key `row`; did you mean `rows`?"


def test_unknown_sampler_parameter_names_column_key_and_line(tmp_path):
    message = error_of(
        tmp_path,
        """
        rows: 3
        columns:
          - name: topic
            sampler: category
            values: [a, b]
            wieghts: [1, 2]
        """,
    )
    assert (
        message == f"{tmp_path}/design.yaml:6: column `topic`: unknown key `wieghts`; did you mean `weights`?"
    )


def test_bad_parameter_value_points_at_its_key(tmp_path):
    message = error_of(
        tmp_path,
        """
        columns:
          - name: topic
            sampler: category
            values: [a, b, c]
            weights: [1, 2]
        """,
    )
    assert message.startswith(f"{tmp_path}/design.yaml:2: column `topic`: ")
    assert "2 weights for 3 values" in message


def test_column_needs_exactly_one_kind(tmp_path):
    message = error_of(
        tmp_path,
        """
        columns:
          - {name: a, sampler: uuid}
          - {name: b, sampler: uuid, expression: "{{ a }}"}
        """,
    )
    assert message == f"{tmp_path}/design.yaml:3: column `b`: give one of sampler, llm, expression"


def test_unknown_sampler_kind_and_llm_kind(tmp_path):
    message = error_of(
        tmp_path,
        """
        columns:
          - {name: a, sampler: gausian, mean: 0, std: 1}
          - {name: b, llm: essay, prompt: hi}
        """,
    )
    lines = message.splitlines()
    assert lines[0].startswith(
        f"{tmp_path}/design.yaml:2: column `a`: unknown sampler `gausian`; did you mean `gaussian`?"
    )
    assert lines[1].startswith(f"{tmp_path}/design.yaml:3: column `b`: unknown llm kind `essay`")


def test_every_problem_is_reported_at_once_in_line_order(tmp_path):
    message = error_of(
        tmp_path,
        """
        rows: 0
        columns:
          - {name: a, sampler: uniform, low: 5, high: 1}
          - {name: b, llm: text}
        validators:
          - {column: a, kind: regex, on_fail: sometimes}
        """,
    )
    lines = message.splitlines()
    assert lines[0].startswith(f"{tmp_path}/design.yaml:1: `rows` = 0")
    assert any(
        line.startswith(f"{tmp_path}/design.yaml:3: column `a`: uniform needs high > low") for line in lines
    )
    assert any(line == f"{tmp_path}/design.yaml:4: column `b`: `prompt` is required" for line in lines)
    assert any(
        "design.yaml:6: validators[0]: `on_fail` = 'sometimes': on_fail `sometimes`: use drop or retry:<n>"
        in line
        for line in lines
    )


def test_validator_parameter_checks(tmp_path):
    message = error_of(
        tmp_path,
        """
        columns:
          - {name: a, sampler: uuid}
        validators:
          - {column: a, kind: regex}
          - {column: a, kind: length}
          - {column: a, kind: regex, pattern: "("}
          - {column: a, kind: expression}
          - {column: zzz, kind: python}
        """,
    )
    assert "design.yaml:4: validators[0]: validator on `a`: regex needs `pattern`" in message
    assert "design.yaml:5: validators[1]: validator on `a`: length needs `min` or `max`" in message
    assert "design.yaml:6: validators[2]: validator on `a`: bad pattern" in message
    assert "design.yaml:7: validators[3]: validator on `a`: needs `expression`" in message
    # A reference error surfaces once the schema is clean.
    message = error_of(
        tmp_path,
        """
        columns:
          - {name: a, sampler: uuid}
        validators:
          - {column: zzz, kind: python}
          - {column: a, kind: expression, expression: "b > 1"}
        """,
    )
    assert "design.yaml:4: validators[0]: validator on `zzz`: not a column" in message
    assert "design.yaml:5: validators[1]: references `b`, which is not a column" in message


def test_reference_checks(tmp_path):
    message = error_of(
        tmp_path,
        """
        columns:
          - {name: a, expression: "{{ nope }}"}
          - {name: b, expression: "{{ b }}"}
          - {name: a, sampler: uuid}
        """,
    )
    assert "design.yaml:2: column `a`: references `nope`, which is not a column" in message
    assert "design.yaml:3: column `b`: references itself" in message
    assert "design.yaml:4: column `a` is defined twice" in message


def test_cycle_names_its_members_only(tmp_path):
    message = error_of(
        tmp_path,
        """
        columns:
          - {name: waiting, expression: "{{ b }}"}
          - {name: a, expression: "{{ b }}"}
          - {name: b, expression: "{{ a }}"}
        """,
    )
    assert message == f"{tmp_path}/design.yaml:3: columns depend on each other in a cycle: a, b"


def test_subcategory_links(tmp_path):
    message = error_of(
        tmp_path,
        """
        columns:
          - {name: n, sampler: uniform, low: 0, high: 1}
          - {name: family, sampler: category, values: [dog, cat]}
          - {name: kind, sampler: subcategory, parent: family, values: {dog: [pug], bird: [owl]}}
          - {name: other, sampler: subcategory, parent: n, values: {x: [y]}}
        """,
    )
    assert (
        "design.yaml:4: column `kind`: values must cover parent `family` exactly: missing ['cat'], unknown ['bird']"
        in message
    )
    assert "design.yaml:5: column `other`: parent `n` must be a category sampler column" in message


def test_llm_columns_need_a_model_and_its_key(tmp_path):
    message = error_of(
        tmp_path,
        """
        columns:
          - {name: a, llm: text, prompt: "hi"}
        """,
    )
    assert message == f"{tmp_path}/design.yaml:2: column `a`: llm columns need `model`"
    message = error_of(
        tmp_path,
        """
        model: {name: m, api_key_env: NOPE_SYNTH_KEY}
        columns:
          - {name: a, llm: text, prompt: "hi"}
        """,
    )
    assert message == f"{tmp_path}/design.yaml:1: model: `NOPE_SYNTH_KEY` is not set (api_key_env)"


def test_model_aliases(tmp_path):
    message = error_of(
        tmp_path,
        """
        models:
          writer: {name: big, api_key_env: null}
          judge: {name: small, api_key_env: null}
        columns:
          - {name: a, llm: text, prompt: "hi"}
          - {name: b, llm: text, prompt: "{{ a }}", model: critic}
        """,
    )
    assert (
        "design.yaml:5: column `a`: several models are declared (writer, judge); choose one with `model:`"
        in message
    )
    assert "design.yaml:6: column `b`: model `critic` is not declared in `models`" in message


def test_template_syntax_error_points_at_the_prompt(tmp_path):
    message = error_of(
        tmp_path,
        """
        model: {name: m, api_key_env: null}
        columns:
          - name: a
            llm: text
            prompt: "{{ oops"
        """,
    )
    assert message.startswith(f"{tmp_path}/design.yaml:5: column `a`: `prompt` = '{{{{ oops': bad template")


def test_structured_and_judge_parameters(tmp_path):
    message = error_of(
        tmp_path,
        """
        model: {name: m, api_key_env: null}
        columns:
          - {name: s, llm: structured, prompt: hi, json_schema: {type: 12}}
          - {name: j, llm: judge, prompt: hi, rubric: {}, columns: [s]}
        """,
    )
    assert "design.yaml:3: column `s`: `json_schema` = {'type': 12}: not a valid JSON Schema" in message
    assert "design.yaml:4: column `j`: judge needs a rubric and columns" in message


def test_output_extension_and_requirement(tmp_path):
    message = error_of(
        tmp_path,
        """
        output: out.csv
        columns:
          - {name: a, sampler: uuid}
        """,
    )
    assert message.startswith(
        f"{tmp_path}/design.yaml:1: `output` = 'out.csv': output `out.csv`: use a .jsonl or .parquet"
    )
    path = _write(tmp_path, "columns:\n  - {name: a, sampler: uuid}\n")
    with pytest.raises(ConfigError, match="`output` is required unless --preview is given"):
        synthesize(path)


def test_duplicate_yaml_key_is_caught_by_the_loader(tmp_path):
    message = error_of(tmp_path, "rows: 1\nrows: 2\ncolumns: []\n")
    assert "design.yaml:2: key `rows` appears twice" in message


def test_generation_order_keeps_declaration_order_where_dependencies_allow(tmp_path):
    path = _write(
        tmp_path,
        """
        columns:
          - {name: full, expression: "{{ first }} {{ last }}"}
          - {name: last, sampler: category, values: [Lee, Kim]}
          - {name: first, sampler: category, values: [Ann, Bo]}
          - {name: kind, sampler: subcategory, parent: family, values: {dog: [pug], cat: [tabby]}}
          - {name: family, sampler: category, values: [dog, cat]}
        """,
    )
    plan = make_plan(load_design(path), {})
    assert [c.name for c in plan.order] == ["last", "first", "full", "family", "kind"]
    assert [c.name for c in plan.downstream["last"]] == ["last", "full"]


def test_model_endpoint_must_be_a_url_and_a_constant_prompt_is_warned_about(tmp_path, caplog):
    message = error_of(
        tmp_path,
        """
        model: {name: m, endpoint: "localhost:8000/v1", api_key_env: null}
        columns:
          - {name: a, llm: text, prompt: "Tell a joke."}
        """,
    )
    assert message.startswith(
        f"{tmp_path}/design.yaml:1: `model.endpoint` = 'localhost:8000/v1': endpoint must be"
    )
    path = _write(
        tmp_path,
        """
        model: {name: m, endpoint: "http://localhost:8000/v1", api_key_env: null}
        columns:
          - {name: a, llm: text, prompt: "Tell a joke."}
        """,
    )
    with caplog.at_level("WARNING"):
        make_plan(load_design(path), {})
    assert "column `a`: prompt references no column: every row gets the same prompt" in caplog.text


def test_whitespace_control_keeps_a_single_expression_typed(tmp_path):
    path = _write(
        tmp_path,
        """
        random_seed: 0
        columns:
          - {name: n, sampler: uniform, low: 1, high: 5, integer: true}
          - {name: double, expression: "{{- n * 2 -}}"}
          - {name: text, expression: "  {{- n }} and {{ n -}}  !"}
        """,
    )
    report = synthesize(load_design(path), preview=3)
    for row in report.rows:
        assert row["double"] == 2 * row["n"] and type(row["double"]) is int
        assert row["text"] == f"{row['n']} and {row['n']}!"


def test_expression_syntax_errors_are_config_errors_with_file_line_and_column(tmp_path):
    message = error_of(
        tmp_path,
        """
        columns:
          - {name: n, sampler: uniform, low: 1, high: 5}
          - name: broken
            expression: "{{- n +* 2 -}}"
          - name: multi
            expression: |
              first line
              {{ n ) }}
        """,
    )
    lines = message.splitlines()
    assert lines[0].startswith(
        f"{tmp_path}/design.yaml:4: column `broken`: `expression` = '{{{{- n +* 2 -}}}}'"
    )
    assert "bad template" in lines[0] and "unexpected '*'" in lines[0]
    assert lines[1].startswith(f"{tmp_path}/design.yaml:6: column `multi`: ")
    assert "(template line 2): unexpected ')'" in lines[1]


@pytest.mark.parametrize(
    "params, key",
    [
        ("sampler: uniform, low: 0, high: .inf", "high"),
        ("sampler: uniform, low: .nan, high: 1", "low"),
        ("sampler: poisson, mean: .inf", "mean"),
        ("sampler: gaussian, mean: 0, std: .nan", "std"),
        ("sampler: category, values: [a, b], weights: [1, .inf]", "weights[1]"),
        ("sampler: uniform, low: -1.0e308, high: 1.0e308", None),
        ("sampler: poisson, mean: 1.0e30", "mean"),
        ("sampler: binomial, n: 100000000000000000000, p: 0.5", "n"),
    ],
)
def test_non_finite_or_undrawable_sampler_parameters_are_load_errors(tmp_path, params, key):
    message = error_of(tmp_path, f"columns:\n  - {{name: x, {params}}}\n")
    prefix = f"{tmp_path}/design.yaml:2: column `x`: "
    assert message.startswith(prefix + (f"`{key}` = " if key else ""))
    if key in ("high", "low", "mean", "std", "weights[1]") and "e30" not in params:
        assert "finite number" in message


def test_timezone_aware_datetimes_keep_their_offset(tmp_path):
    path = _write(
        tmp_path,
        """
        random_seed: 0
        columns:
          - name: at
            sampler: datetime
            start: 2024-01-01T00:00:00+02:00
            end: 2024-01-01T00:00:00+00:00
            format: "%Y-%m-%dT%H:%M:%S%z"
        """,
    )
    rows = synthesize(load_design(path), preview=20).rows
    assert all(row["at"].endswith("+0200") for row in rows)
    instants = [datetime.strptime(row["at"], "%Y-%m-%dT%H:%M:%S%z") for row in rows]
    low, high = datetime(2023, 12, 31, 22, tzinfo=UTC), datetime(2024, 1, 1, tzinfo=UTC)
    assert all(low <= t < high for t in instants)  # the two real hours between the instants

    message = error_of(
        tmp_path,
        """
        columns:
          - {name: at, sampler: datetime, start: 2024-01-01T00:00:00+02:00, end: 2024-02-01}
        """,
    )
    assert message.startswith(f"{tmp_path}/design.yaml:2: column `at`: ")
    assert "both with a UTC offset or both without" in message


@pytest.mark.parametrize("fmt", ["%B", "%d/%m", "%Y-%m-%d %I:%M"])
def test_timedelta_refuses_a_reference_format_it_cannot_read_back(tmp_path, fmt):
    message = error_of(
        tmp_path,
        f"""
        columns:
          - {{name: t, sampler: datetime, start: 2024-01-01, end: 2024-12-01, format: "{fmt}"}}
          - name: later
            sampler: timedelta
            reference: t
            min: 1
            max: 3
        """,
    )
    assert message.startswith(f"{tmp_path}/design.yaml:5: column `later`: reference `t` has format `{fmt}`")
    assert "cannot read back" in message


def test_timedelta_accepts_a_date_only_or_offset_reference_format(tmp_path):
    path = _write(
        tmp_path,
        """
        random_seed: 0
        columns:
          - {name: t, sampler: datetime, start: 2024-01-01, end: 2024-02-01, format: "%d %B %Y"}
          - {name: later, sampler: timedelta, reference: t, min: 1, max: 2, format: "%Y-%m-%d"}
        """,
    )
    for row in synthesize(load_design(path), preview=10).rows:
        assert datetime.strptime(row["later"], "%Y-%m-%d") - datetime.strptime(row["t"], "%d %B %Y") == (
            timedelta(days=1)
        )


def test_data_designer_parameter_names_are_accepted(tmp_path):
    path = _write(
        tmp_path,
        """
        random_seed: 0
        rows: 200
        columns:
          - {name: g, sampler: gaussian, mean: 10, stddev: 0.001, decimal_places: 1}
          - {name: die, sampler: uniform, low: 1, high: 6, convert_to: int}
          - {name: cut, sampler: gaussian, mean: 2.7, stddev: 0.001, convert_to: int}
          - {name: topic, sampler: category, values: [math, art]}
          - {name: sub, sampler: subcategory, category: topic, values: {math: [algebra], art: [drawing]}}
          - {name: t, sampler: datetime, start: 2024-01-01, end: 2024-01-02, convert_to: "%Y-%m-%d"}
          - {name: later, sampler: timedelta, reference_column_name: t, dt_min: 2, dt_max: 3, unit: D}
        """,
    )
    rows = synthesize(load_design(path), preview=200).rows
    assert {row["g"] for row in rows} == {10.0}
    assert {row["die"] for row in rows} == {1, 2, 3, 4, 5, 6}  # ours: both ends included
    assert {row["cut"] for row in rows} == {2}  # int() truncates, as in Data Designer
    assert all(row["sub"] == {"math": "algebra", "art": "drawing"}[row["topic"]] for row in rows)
    assert {(row["t"], row["later"]) for row in rows} == {("2024-01-01", "2024-01-03")}


def test_a_data_designer_name_and_ours_together_is_an_error_on_the_alias_line(tmp_path):
    message = error_of(
        tmp_path,
        """
        columns:
          - name: g
            sampler: gaussian
            mean: 0
            std: 1
            stddev: 2
          - name: h
            sampler: gaussian
            mean: 0
            stddev: -1
          - {name: i, sampler: gaussian, mean: 0, stddev: .inf}
        """,
    )
    lines = message.splitlines()
    assert lines[0] == (
        f"{tmp_path}/design.yaml:2: column `g`: `stddev` is Data Designer's name for `std`: give one of them, "
        "not both"
    )
    assert lines[1] == f"{tmp_path}/design.yaml:7: column `h`: gaussian needs std > 0"
    # A key-level error names the alias as written, on its line.
    assert lines[2] == f"{tmp_path}/design.yaml:11: column `i`: `stddev` = inf: use a finite number"
