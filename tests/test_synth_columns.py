"""Synth column kinds and validators, with LLM columns answered by a scripted server on localhost."""

from __future__ import annotations

import pytest
from test_synth_llm import FakeLLM, Reply

from hanzo_gym.synth import parse_design, synthesize
from hanzo_gym.synth.extract import ParseFailed, extract_code, extract_json_object


@pytest.fixture
def llm():
    with FakeLLM() as server:
        yield server


def model(server: FakeLLM, **extra) -> dict:
    return {"name": "tiny", "endpoint": server.url, "api_key_env": None, "retry_backoff": 0.01, **extra}


def preview(design: dict, rows: int):
    return synthesize(parse_design({"random_seed": 1, **design}), preview=rows)


def test_expression_keeps_numbers_and_booleans_typed():
    report = preview(
        {
            "columns": [
                {"name": "a", "sampler": "uniform", "low": 1, "high": 9, "integer": True},
                {"name": "double", "expression": "{{ a * 2 }}"},
                {"name": "big", "expression": "{{ a > 4 }}"},
                {"name": "ratio", "expression": "{{ a / 2 }}"},
                {"name": "sentence", "expression": "{{ a }} doubled is {{ double }}"},
                {"name": "as_text", "expression": "{{ a * 2 }}", "dtype": "str"},
                {"name": "as_int", "expression": "{{ a / 2 }}", "dtype": "int"},
                {"name": "as_bool", "expression": "{{ 'true' if a > 4 else 'false' }}", "dtype": "bool"},
            ]
        },
        30,
    )
    for row in report.rows:
        a = row["a"]
        assert row["double"] == 2 * a and type(row["double"]) is int
        assert row["big"] is (a > 4)
        assert row["ratio"] == a / 2 and type(row["ratio"]) is float
        assert row["sentence"] == f"{a} doubled is {2 * a}"
        assert row["as_text"] == str(2 * a)
        assert row["as_int"] == int(a / 2)
        assert row["as_bool"] is (a > 4)


def test_expression_that_cannot_render_fails_its_row_not_the_run():
    report = preview(
        {
            "max_attempts": 4,
            "columns": [
                {"name": "d", "sampler": "category", "values": [{"k": 1}, {"j": 2}]},
                {"name": "k", "expression": "{{ d.k }}"},
            ],
        },
        4,
    )
    assert {r["k"] for r in report.rows} == {1}
    assert report.tally.failed["k"] == report.tally.attempts - report.delivered > 0
    assert "has no attribute 'k'" in report.tally.reasons["column k"]


def test_text_column_renders_prompt_and_system_and_drop_hides_helper_columns(llm):
    report = preview(
        {
            "model": model(llm, temperature=0.7),
            "columns": [
                {"name": "topic", "sampler": "category", "values": ["owls"], "drop": True},
                {
                    "name": "answer",
                    "llm": "text",
                    "prompt": "Write about {{ topic }}.",
                    "system": "Be {{ 'brief' }}.",
                },
            ],
        },
        2,
    )
    assert report.rows == [{"answer": "echo: Write about owls."}] * 2
    assert llm.requests[0].system == "Be brief."
    assert llm.requests[0].body["temperature"] == 0.7


def test_several_named_models_each_get_their_own_requests(llm):
    llm.script = lambda r: Reply(f"{r.body['model']} says hi")
    report = preview(
        {
            "models": {"writer": model(llm, name="big"), "editor": model(llm, name="small")},
            "columns": [
                {"name": "draft", "llm": "text", "prompt": "draft", "model": "writer"},
                {"name": "edit", "llm": "text", "prompt": "edit {{ draft }}", "model": "editor"},
            ],
        },
        3,
    )
    assert report.rows[0] == {"draft": "big says hi", "edit": "small says hi"}
    assert {alias: usage["calls"] for alias, usage in report.tally.usage.items()} == {
        "writer": 3,
        "editor": 3,
    }
    assert report.tally.usage["writer"]["completion_tokens"] == 15


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}


def test_structured_column_sends_response_format_and_extracts_fenced_json(llm):
    llm.script = lambda r: Reply(
        'Sure!\n```json\n{"city": "Oslo", "population": 700000}\n```\nAnything else?'
    )
    report = preview(
        {
            "model": model(llm),
            "columns": [
                {"name": "place info", "llm": "structured", "prompt": "A city.", "json_schema": SCHEMA},
            ],
        },
        1,
    )
    assert report.rows[0]["place info"] == {"city": "Oslo", "population": 700000}
    body = llm.requests[0].body
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "place_info", "schema": SCHEMA, "strict": True},
    }
    assert "inside a ```json fence" in llm.requests[0].user and '"population"' in llm.requests[0].user


def test_structured_reply_that_breaks_the_schema_is_asked_again_then_fails_the_row(llm):
    replies = {0: '{"city": "Oslo"}', 1: '{"city": "Oslo", "population": 5}'}
    llm.script = lambda r: Reply(replies.get(r.index, "no json here"))
    report = preview(
        {
            "model": model(llm),
            "max_attempts": 2,
            "columns": [
                {
                    "name": "info",
                    "llm": "structured",
                    "prompt": "A city.",
                    "json_schema": SCHEMA,
                    "attempts": 2,
                }
            ],
        },
        2,
    )
    assert report.rows == [{"info": {"city": "Oslo", "population": 5}}]
    assert report.tally.failed == {"info": 1}
    assert "reply holds no JSON object" in report.tally.reasons["column info"]
    assert "(after 2 attempts)" in report.tally.reasons["column info"]


def test_structured_falls_back_to_prompted_json_when_the_endpoint_refuses_response_format(llm):
    def script(request):
        if "response_format" in request.body:
            return Reply(status=400)
        return Reply('{"city": "Rome", "population": 3}')

    llm.script = script
    report = preview(
        {
            "model": model(llm, concurrency=1),
            "columns": [{"name": "info", "llm": "structured", "prompt": "A city.", "json_schema": SCHEMA}],
        },
        3,
    )
    assert [r["info"]["city"] for r in report.rows] == ["Rome"] * 3
    assert ["response_format" in r.body for r in llm.requests] == [True, False, False, False]


def test_structured_values_are_reachable_from_later_templates(llm):
    llm.script = lambda r: Reply('{"city": "Oslo", "population": 7}')
    report = preview(
        {
            "model": model(llm),
            "columns": [
                {"name": "info", "llm": "structured", "prompt": "A city.", "json_schema": SCHEMA},
                {"name": "headline", "expression": "{{ info.city }} has {{ info.population }} people"},
                {"name": "people", "expression": "{{ info.population * 2 }}"},
            ],
        },
        1,
    )
    assert report.rows[0]["headline"] == "Oslo has 7 people"
    assert report.rows[0]["people"] == 14


def test_judge_scores_with_rubric_and_writes_reasoning(llm):
    verdicts = iter(['{"score": 9, "reasoning": "x"}', '```json\n{"score": "4.0", "reasoning": null}\n```'])
    llm.script = lambda r: Reply(next(verdicts)) if r.body["messages"][0]["role"] == "system" else Reply("42")
    report = preview(
        {
            "model": model(llm, concurrency=1),
            "columns": [
                {"name": "answer", "llm": "text", "prompt": "What is 6*7?"},
                {
                    "name": "quality",
                    "llm": "judge",
                    "prompt": "Judge the answer to: What is 6*7?",
                    "rubric": {1: "wrong", 5: "right"},
                    "columns": ["answer"],
                },
            ],
        },
        1,
    )
    assert report.rows == [{"answer": "42", "quality": 4, "quality_reasoning": ""}]
    judge_request = llm.requests[1]
    assert judge_request.system == "You are a strict, impartial judge. Score only against the rubric."
    assert "\n\nanswer:\n42" in judge_request.user
    assert "Rubric:\n1: wrong\n5: right\n" in judge_request.user
    assert judge_request.body["response_format"]["json_schema"]["schema"]["properties"]["score"] == {
        "type": "integer",
        "minimum": 1,
        "maximum": 5,
    }
    assert len(llm.requests) == 3  # the out-of-range score 9 was asked again


def test_code_column_extracts_its_language_and_python_validator_drops_bad_syntax(llm):
    replies = [
        "```js\nlet x = 1\n```",
        "```python\ndef f(:\n```",
        "Here:\n```python\ndef f():\n    return 1\n```",
    ]
    llm.script = lambda r: Reply(replies[min(r.index, 2)])
    report = preview(
        {
            "model": model(llm, concurrency=1),
            "max_attempts": 3,
            "columns": [
                {"name": "code", "llm": "code", "language": "python", "prompt": "A function.", "attempts": 1}
            ],
            "validators": [{"column": "code", "kind": "python"}],
        },
        1,
    )
    assert report.rows == [{"code": "def f():\n    return 1"}]
    assert report.tally.failed == {"code": 1}
    assert "fenced as js, not python" in report.tally.reasons["column code"]
    assert report.tally.dropped == {"python on code": 1}
    assert "python syntax error on line 1" in report.tally.reasons["validator python on code"]
    assert "in a single ```python fenced block" in llm.requests[0].user


def test_extraction_rules():
    assert extract_json_object('{"a": 1}') == {"a": 1}
    assert extract_json_object('text ```json\n{"a": 1}\n``` then ```json\n{"a": 2}\n```') == {"a": 2}
    assert extract_json_object('I think {"a": "}{", "b": {"c": 1}} is it') == {"a": "}{", "b": {"c": 1}}
    with pytest.raises(ParseFailed):
        extract_json_object("[1, 2]")
    assert extract_code("x = 1", "python") == "x = 1"
    assert extract_code("```py\nx = 1\n```", "python") == "x = 1"
    assert extract_code("```sql\nselect 1\n```", "sql:postgres") == "select 1"


@pytest.mark.parametrize(
    "validator, passing",
    [
        ({"kind": "regex", "pattern": "^echo: [a-c]$"}, {"a", "b", "c"}),
        ({"kind": "length", "min": 7, "max": 7}, {"a", "b", "c", "d", "e"}),
        ({"kind": "length", "max": 6}, set()),
        ({"kind": "expression", "expression": "word in ['b', 'd']"}, {"b", "d"}),
        ({"kind": "expression", "expression": "{{ answer | length > 7 }}"}, set()),
    ],
)
def test_validators_drop_rows_that_fail(llm, validator, passing):
    report = preview(
        {
            "model": model(llm),
            "max_attempts": 20,
            "columns": [
                {"name": "word", "sampler": "category", "values": ["a", "b", "c", "d", "e"]},
                {"name": "answer", "llm": "text", "prompt": "{{ word }}"},
            ],
            "validators": [{"column": "answer", **validator}],
        },
        5,
    )
    assert {r["word"] for r in report.rows} <= passing
    if passing:
        assert report.delivered == 5
    label = f"{validator['kind']} on answer"
    assert report.tally.dropped[label] == report.tally.attempts - report.delivered


def test_json_schema_validator_parses_string_cells(llm):
    llm.script = lambda r: Reply('{"n": 1}' if "good" in r.user else "{oops")
    report = preview(
        {
            "model": model(llm),
            "max_attempts": 10,
            "columns": [
                {"name": "kind", "sampler": "category", "values": ["good", "bad"]},
                {"name": "answer", "llm": "text", "prompt": "{{ kind }}"},
            ],
            "validators": [
                {
                    "column": "answer",
                    "kind": "json_schema",
                    "json_schema": {"type": "object", "required": ["n"]},
                }
            ],
        },
        3,
    )
    assert [r["kind"] for r in report.rows] == ["good"] * 3
    assert report.tally.reasons["validator json_schema on answer"] == "is not JSON"


def test_retry_regenerates_the_column_and_its_dependents_then_drops_when_spent(llm):
    # Attempt answers: the sampler decides; retries redraw the sampler, which re-asks the LLM and re-renders.
    report = preview(
        {
            "model": model(llm),
            "max_attempts": 1,
            "columns": [
                {"name": "n", "sampler": "uniform", "low": 0, "high": 1000, "integer": True},
                {"name": "answer", "llm": "text", "prompt": "{{ n }}"},
                {"name": "shout", "expression": "{{ answer | upper }}"},
            ],
            "validators": [
                {
                    "column": "n",
                    "kind": "expression",
                    "expression": "n < 0",
                    "on_fail": "retry:3",
                    "name": "never",
                }
            ],
        },
        1,
    )
    assert report.delivered == 0
    assert report.tally.dropped == {"never": 1}
    prompts = [r.user for r in llm.requests]
    assert (
        len(prompts) == 4 and len(set(prompts)) == 4
    )  # first fill plus three regenerations, each a new draw


def test_retry_until_a_row_passes(llm):
    report = preview(
        {
            "model": model(llm),
            "max_attempts": 1,
            "columns": [
                {"name": "n", "sampler": "uniform", "low": 0, "high": 9, "integer": True},
                {"name": "answer", "llm": "text", "prompt": "{{ n }}"},
            ],
            "validators": [
                {"column": "n", "kind": "expression", "expression": "n == 7", "on_fail": "retry:100"}
            ],
        },
        1,
    )
    assert report.rows == [{"n": 7, "answer": "echo: 7"}]
    assert llm.requests[-1].user == "7"
