"""Synth runs end to end: rows delivered, shortfall report, fatal vs per-row errors, reproducibility, resume,
parquet schema, seed datasets and the `gym synth` command line."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from test_synth_llm import FakeLLM, Reply

from hanzo_gym.cli import main
from hanzo_gym.errors import ConfigError
from hanzo_gym.synth import parse_design, synthesize
from hanzo_gym.synth.llm import EndpointRefused
from hanzo_gym.synth.writer import checkpoint_dir

EXAMPLE = Path(__file__).parent.parent / "examples" / "synth-addition.yaml"


@pytest.fixture
def llm():
    with FakeLLM() as server:
        yield server


def write_design(tmp_path, server: FakeLLM | None, output: str | None = "out.jsonl", **overrides) -> str:
    design = {
        "random_seed": 11,
        "rows": 12,
        "columns": [
            {"name": "a", "sampler": "uniform", "low": 0, "high": 99, "integer": True},
            {"name": "b", "sampler": "uniform", "low": 0, "high": 99, "integer": True},
            {"name": "question", "expression": "What is {{ a }} + {{ b }}?"},
        ],
    }
    if server is not None:
        design["model"] = {"name": "tiny", "endpoint": server.url, "api_key_env": None, "retry_backoff": 0.01}
        design["columns"].append({"name": "answer", "llm": "text", "prompt": "{{ question }}"})
    if output is not None:
        design["output"] = str(tmp_path / output)
    design.update(overrides)
    path = tmp_path / "design.yaml"
    path.write_text(yaml.safe_dump(design, sort_keys=False))
    return str(path)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _flaky(request) -> bool:
    """A fixed, prompt-dependent half of the prompts get a bad answer."""
    return zlib.crc32(request.user.encode()) % 2 == 0


def test_rows_means_rows_delivered_despite_drops(tmp_path, llm):
    llm.script = lambda r: Reply("bad" if _flaky(r) else "good")
    path = write_design(
        tmp_path, llm, validators=[{"column": "answer", "kind": "regex", "pattern": "^good$"}]
    )
    report = synthesize(path)
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert len(rows) == report.delivered == 12
    assert all(r["answer"] == "good" for r in rows)
    assert report.tally.attempts == 12 + report.tally.dropped["regex on answer"]
    assert report.tally.dropped["regex on answer"] > 0
    assert report.shortfall is None


def test_shortfall_reports_causes_per_validator_and_column(tmp_path, llm):
    llm.script = lambda r: (
        Reply(status=500) if "What is 1" in r.user else Reply("bad" if _flaky(r) else "good")
    )
    path = write_design(
        tmp_path,
        llm,
        rows=40,
        max_attempts=30,
        validators=[{"column": "answer", "kind": "regex", "pattern": "^good$"}],
    )
    report = synthesize(path)
    assert report.tally.attempts == 30 and report.delivered < 30
    dropped, failed = report.tally.dropped["regex on answer"], report.tally.failed["answer"]
    assert dropped > 0 and failed > 0 and report.delivered + dropped + failed == 30
    assert report.shortfall.startswith(f"delivered {report.delivered} of 40 rows: max_attempts (30) spent")
    assert (
        f"dropped by validator `regex on answer` ×{dropped} (last: does not match /^good$/)"
        in report.shortfall
    )
    assert f"failed in column `answer` ×{failed} (last: model `default`: " in report.shortfall
    assert "http 500" in report.shortfall and "gave up after 4 attempts" in report.shortfall
    usage = report.tally.usage["default"]
    assert usage["failed_calls"] == 4 * failed


def test_refused_key_stops_the_run_and_keeps_finished_rows(tmp_path, llm):
    llm.script = lambda r: Reply(status=401) if r.index >= 5 else Reply("fine")
    path = write_design(
        tmp_path,
        llm,
        model={"name": "tiny", "endpoint": llm.url, "concurrency": 1, "api_key_env": "SYNTH_TEST_KEY"},
    )
    with pytest.raises(EndpointRefused, match="refused the API key"):
        synthesize(path, environ={"SYNTH_TEST_KEY": "k"})
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 5
    assert len(llm.requests) == 6  # stopped at the first 401, no retries


def test_same_seed_same_file_whatever_the_concurrency_and_reply_timing(tmp_path, llm):
    # Replies arrive out of order (delays vary per prompt); rows must still be settled in attempt order.
    llm.script = lambda r: Reply(
        "bad" if _flaky(r) else f"ok {r.user}", delay=(zlib.crc32(r.user.encode()) % 5) / 200
    )
    validators = [{"column": "answer", "kind": "regex", "pattern": "^ok"}]
    outputs = []
    for concurrency in (1, 6):
        model = {"name": "tiny", "endpoint": llm.url, "api_key_env": None, "concurrency": concurrency}
        path = write_design(tmp_path, llm, output=f"c{concurrency}.jsonl", model=model, validators=validators)
        synthesize(path)
        outputs.append((tmp_path / f"c{concurrency}.jsonl").read_text())
    assert outputs[0] == outputs[1]
    assert len(outputs[0].splitlines()) == 12


class Crash(Exception):
    pass


def _crash_after(rows: int):
    def progress(delivered, requested, tally):
        if delivered >= rows:
            raise Crash()

    return progress


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_resume_continues_after_the_last_complete_row(tmp_path, llm, suffix):
    llm.script = lambda r: Reply("bad" if _flaky(r) else f"ok {r.user}")
    validators = [{"column": "answer", "kind": "regex", "pattern": "^ok"}]
    reference = write_design(tmp_path, llm, output=f"whole.{suffix}", validators=validators)
    synthesize(reference)

    path = write_design(tmp_path, llm, output=f"part.{suffix}", validators=validators)
    with pytest.raises(Crash):
        synthesize(path, progress=_crash_after(5))
    state_dir = checkpoint_dir(tmp_path / f"part.{suffix}")
    rows_file = state_dir / "rows.jsonl" if suffix == "parquet" else tmp_path / f"part.{suffix}"
    # A hard crash can leave half a line after the last checkpoint; resume must cut it off.
    with rows_file.open("a") as handle:
        handle.write('{"a": 1, "b"')
    calls_before = len(llm.requests)
    report = synthesize(path)
    assert report.resumed_rows == 5 and report.delivered == 12

    if suffix == "jsonl":
        assert (tmp_path / "part.jsonl").read_text() == (tmp_path / "whole.jsonl").read_text()
    else:
        assert pq.read_table(tmp_path / "part.parquet").equals(pq.read_table(tmp_path / "whole.parquet"))
    # The resumed run asked nothing for rows the first part had already written.
    written = read_jsonl(rows_file)[:5]
    assert not {f"What is {r['a']} + {r['b']}?" for r in written} & {
        r.user for r in llm.requests[calls_before:]
    }
    # A finished run run again is a no-op that reports the same rows.
    again = synthesize(path)
    assert again.delivered == 12 and again.tally.attempts == report.tally.attempts


def test_resume_refuses_a_changed_design_or_a_foreign_output(tmp_path):
    path = write_design(tmp_path, None, rows=3)
    synthesize(path)
    changed = write_design(tmp_path, None, rows=3, random_seed=12)
    with pytest.raises(ConfigError, match="written by a different design"):
        synthesize(changed)
    more_rows = write_design(tmp_path, None, rows=6)
    assert synthesize(more_rows).delivered == 6  # `rows` may grow on resume
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"x": 1}\n')
    with pytest.raises(ConfigError, match="exists but has no synth checkpoint"):
        synthesize(write_design(tmp_path, None, output="foreign.jsonl"))


def test_parquet_schema_covers_every_key_and_mixed_types(tmp_path):
    seed = tmp_path / "seed.jsonl"
    seed_rows = [{"topic": f"t{i}"} for i in range(600)]
    seed_rows[550]["late_key"] = "only here"
    seed.write_text("".join(json.dumps(r) + "\n" for r in seed_rows))
    path = write_design(
        tmp_path,
        None,
        output="out.parquet",
        rows=600,
        seed={"path": str(seed)},
        columns=[
            {"name": "n", "sampler": "uniform", "low": 0, "high": 10, "integer": True},
            {"name": "half", "expression": "{{ n / 2 if n % 2 else n // 2 }}"},
            {"name": "mixed", "expression": "{{ n if n > 5 else 'small' }}"},
            {"name": "nested", "sampler": "category", "values": [{"k": [1, 2]}]},
            {"name": "flag", "sampler": "bernoulli", "p": 0.5, "drop": True},
            {"name": "yes", "expression": "{{ flag == 1 }}"},
        ],
    )
    synthesize(path)
    table = pq.read_table(tmp_path / "out.parquet")
    types = {f.name: str(f.type) for f in table.schema}
    assert types == {
        "topic": "string",
        "late_key": "string",
        "n": "int64",
        "half": "double",
        "mixed": "string",
        "nested": "string",
        "yes": "bool",
    }
    rows = table.to_pylist()
    assert len(rows) == 600 and rows[550]["late_key"] == "only here" and rows[0]["late_key"] is None
    assert json.loads(rows[0]["nested"]) == {"k": [1, 2]}
    assert {r["mixed"] for r in rows} <= {"small", "6", "7", "8", "9", "10"}
    assert not list(tmp_path.glob(".out.parquet.*.tmp"))


def test_seed_rows_are_assigned_in_order_or_shuffled_per_pass(tmp_path):
    seed = tmp_path / "seed.jsonl"
    seed.write_text("".join(json.dumps({"s": i}) + "\n" for i in range(4)))
    columns = [{"name": "echo", "expression": "{{ s * 10 }}"}]
    ordered = synthesize(
        write_design(tmp_path, None, seed={"path": str(seed)}, columns=columns), preview=8
    ).rows
    assert [r["s"] for r in ordered] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [r["echo"] for r in ordered[:4]] == [0, 10, 20, 30]
    shuffled = synthesize(
        write_design(tmp_path, None, seed={"path": str(seed), "sampling": "shuffle"}, columns=columns),
        preview=8,
    ).rows
    values = [r["s"] for r in shuffled]
    assert sorted(values[:4]) == sorted(values[4:]) == [0, 1, 2, 3]
    assert values != [0, 1, 2, 3, 0, 1, 2, 3]


def test_cli_run_prints_summary_and_exits_2_on_shortfall(tmp_path, llm, capsys):
    llm.script = lambda r: Reply("bad" if _flaky(r) else "good")
    path = write_design(
        tmp_path, llm, validators=[{"column": "answer", "kind": "regex", "pattern": "^good$"}]
    )
    assert main(["synth", path]) == 0
    out = capsys.readouterr().out
    assert f"synth: 12/12 rows delivered to {tmp_path / 'out.jsonl'}" in out
    assert "dropped by validator: regex on answer" in out
    assert "model default (tiny @ " in out and "tokens " in out

    short = write_design(
        tmp_path,
        llm,
        output="short.jsonl",
        max_attempts=3,
        validators=[{"column": "answer", "kind": "regex", "pattern": "^never$"}],
    )
    assert main(["synth", short]) == 2
    captured = capsys.readouterr()
    assert "synth: 0/12 rows delivered" in captured.out
    assert "error: delivered 0 of 12 rows: max_attempts (3) spent" in captured.err


def test_cli_preview_prints_rows_and_writes_nothing(tmp_path, llm, capsys):
    path = write_design(tmp_path, llm)
    assert main(["synth", path, "--preview", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count('"answer": "echo: What is') == 2
    assert "synth: 2/2 rows delivered" in captured.err
    assert not (tmp_path / "out.jsonl").exists()


def test_cli_reports_design_errors_with_exit_2(tmp_path, capsys):
    path = tmp_path / "design.yaml"
    path.write_text("columns:\n  - {name: a, sampler: nope}\n")
    assert main(["synth", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {path}:2: column `a`: unknown sampler `nope`")


def test_example_design_writes_chat_rows_for_gym_train(llm):
    def script(request):
        numbers = [int(word.rstrip("?")) for word in request.user.split() if word.rstrip("?").isdigit()]
        # Every third reply is wrong, so the example's retry validator has work to do.
        return Reply(f"That makes {sum(numbers) if request.index % 3 else 99}.")

    llm.script = script
    data = yaml.safe_load(EXAMPLE.read_text())
    data["model"]["endpoint"] = llm.url
    report = synthesize(parse_design(data), preview=4)
    assert report.delivered == 4
    for row in report.rows:
        assert set(row) == {"messages", "answer"}
        system, user, assistant = row["messages"]
        assert [system["role"], user["role"], assistant["role"]] == ["system", "user", "assistant"]
        assert assistant["content"] == f"That makes {row['answer']}."
        assert isinstance(row["answer"], str)
    assert len(llm.requests) > 4  # wrong sums were asked again


def test_a_model_answering_400_to_every_call_stops_the_run_instead_of_spending_max_attempts(tmp_path, llm):
    llm.script = lambda r: Reply(status=400)
    path = write_design(tmp_path, llm, max_attempts=200, rows=50)
    with pytest.raises(EndpointRefused, match="first 5 calls all failed with http 400"):
        synthesize(path)
    assert len(llm.requests) < 10  # not 200 row attempts' worth
    assert read_jsonl(tmp_path / "out.jsonl") == []


def test_non_json_values_become_json_in_preview_and_file_alike(tmp_path, capsys):
    text = f"""
random_seed: 3
rows: 2
output: {tmp_path / "out.jsonl"}
columns:
  - {{name: day, sampler: category, values: [2024-01-01, 2]}}
  - {{name: span, expression: "{{{{ range(3) }}}}"}}
  - {{name: pairs, expression: "{{{{ {{'a': 1}}.items() }}}}"}}
  - {{name: pair, expression: "{{{{ (1, day) }}}}"}}
  - {{name: upper, expression: "{{{{ ['x', 'y'] | map('upper') }}}}"}}
"""
    path = tmp_path / "design.yaml"
    path.write_text(text)
    assert main(["synth", str(path), "--preview", "2"]) == 0
    shown = capsys.readouterr().out
    rows = json.loads("[" + shown.replace("}\n{", "},\n{") + "]")
    assert main(["synth", str(path)]) == 0
    written = read_jsonl(tmp_path / "out.jsonl")
    assert rows == written and len(rows) == 2
    for row in rows:
        assert row["day"] in ("2024-01-01", 2)
        assert row["span"] == [0, 1, 2]
        assert row["pairs"] == [["a", 1]]
        assert row["pair"] == [1, row["day"]]
        assert row["upper"] == ["X", "Y"]


def test_a_value_with_no_json_form_fails_its_column_with_the_cause(tmp_path):
    design = parse_design(
        {
            "random_seed": 0,
            "max_attempts": 4,
            "columns": [
                {"name": "word", "sampler": "category", "values": ["nan", "ns"]},
                {"name": "number", "expression": "{{ word | float if word == 'nan' else 1 }}"},
                {"name": "thing", "expression": "{{ namespace(a=1) if word == 'ns' else 1 }}"},
            ],
        }
    )
    report = synthesize(design, preview=1)
    assert report.delivered == 0
    assert set(report.tally.failed) == {"number", "thing"} and report.tally.attempts == 4
    assert "not JSON" in report.tally.reasons["column number"]
    assert "nan is not a finite number" in report.tally.reasons["column number"]
    assert "(a Namespace) has no JSON form" in report.tally.reasons["column thing"]


def test_retries_count_against_max_attempts(tmp_path):
    never = {
        "column": "n",
        "kind": "expression",
        "expression": "n < 0",
        "on_fail": "retry:3",
        "name": "never",
    }
    design = {
        "random_seed": 0,
        "rows": 5,
        "max_attempts": 8,
        "columns": [{"name": "n", "sampler": "uniform", "low": 0, "high": 9, "integer": True}],
        "validators": [never],
    }
    report = synthesize(parse_design(design), preview=5)
    # Each attempt costs 1 + 3 retries: two attempts spend the budget of 8.
    assert (report.tally.attempts, report.tally.retries) == (2, 6)
    assert report.shortfall.startswith(
        "delivered 0 of 5 rows: max_attempts (8) spent after 2 row attempts + 6"
    )


def test_retry_count_is_capped_at_load(tmp_path):
    path = tmp_path / "design.yaml"
    path.write_text(
        "columns:\n  - {name: n, sampler: uniform, low: 0, high: 9}\n"
        "validators:\n  - column: n\n    kind: length\n    max: 1\n    on_fail: retry:99999999999\n"
    )
    with pytest.raises(ConfigError) as caught:
        synthesize(str(path), preview=1)
    assert str(caught.value).startswith(f"{path}:7: validators[0]: `on_fail` = 'retry:99999999999'")
    assert "at most retry:100" in str(caught.value)


def test_sampler_only_retries_yield_to_the_event_loop():
    import asyncio

    from hanzo_gym.synth.plan import make_plan
    from hanzo_gym.synth.run import RowMaker

    never = {"column": "n", "kind": "expression", "expression": "n < 0", "on_fail": "retry:100"}
    design = {"columns": [{"name": "n", "sampler": "uniform", "low": 0, "high": 9}], "validators": [never]}
    maker = RowMaker(make_plan(parse_design(design), {}), 0, {})

    async def go():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        outcome = await maker.make(0)
        task.cancel()
        return outcome, ticks

    outcome, ticks = asyncio.run(go())
    assert outcome.dropped_by is not None and outcome.retries == 100
    assert ticks >= 100  # the other task ran between retries
