"""Reward functions: the original's semantics, math equivalence, user code, weighting, and the HTTP reward
against a real local server that injects failures."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hanzo_gym.errors import ConfigError, GymError
from hanzo_gym.rewards import (
    Completion,
    RewardFunction,
    RewardFunctionFailed,
    parse_reward,
    remote,
    score_completions,
)


def completion(text: str, answer: str | None = None, num_tokens: int = 1, prompt: str = "Q?") -> Completion:
    return Completion(prompt=prompt, text=text, answer=answer, num_tokens=num_tokens)


def score(spec: str, text: str, answer: str | None = None, num_tokens: int = 1) -> float:
    return parse_reward(spec)([completion(text, answer, num_tokens)])[0]


# --- the original's rewards ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "answer", "expected"),
    [
        ("  The\tAnswer\n is  ", "the answer is", 1.0),  # whitespace collapsed, case folded
        ("the answer.", "the answer", 0.0),  # punctuation is not normalised away
        ("theanswer", "the answer", 0.0),  # whitespace is collapsed, not removed
        ("", "", 1.0),
        ("anything", None, 0.0),  # no reference answer
    ],
)
def test_exact_match_normalises_whitespace_and_case_only(text, answer, expected):
    assert score("exact_match", text, answer) == expected


@pytest.mark.parametrize(
    ("text", "answer", "expected"),
    [
        ("so \\boxed{1234.0}", "#### 1,234", 1.0),  # the original's example: commas, decimals, boxed
        ("I think 12, no: \\boxed{12} but maybe 13", "12", 1.0),  # the last box wins over later numbers
        ("first 3 then 4", "4", 1.0),  # the last number
        ("first 3 then 4", "3", 0.0),
        ("-0.5", "the answer is -0.50", 1.0),
        ("1.0000001", "1", 1.0),  # within 1e-6
        ("1.00001", "1", 0.0),
        ("no digits here", "7", 0.0),
        ("7", "no digits", 0.0),
        ("7", None, 0.0),
        # The original's box regex has no nested braces, so a fraction falls back to the whole text's last number.
        ("\\boxed{\\frac{1}{2}}", "2", 1.0),
    ],
)
def test_numeric_match_compares_last_numbers(text, answer, expected):
    assert score("numeric_match", text, answer) == expected


@pytest.mark.parametrize(
    ("spec", "text", "expected"),
    [
        ("format:\\d+", "abc 42 def", 1.0),  # unanchored: matches anywhere
        ("format:^\\d+$", "abc 42", 0.0),  # the pattern's own anchors hold
        ("format:^\\d+$", "42", 1.0),
        ("format:<think>.*</think>", "<think>x</think> 4", 1.0),
        ("format:^answer", "x\nanswer", 0.0),  # ^ is the start of the text, not of a line (no multiline flag)
        ("format:", "anything", 1.0),  # the empty pattern matches everywhere
    ],
)
def test_format_searches_the_completion(spec, text, expected):
    assert score(spec, text) == expected


def test_format_keeps_its_spec_as_name():
    assert parse_reward("format:^\\d+$").name == "format:^\\d+$"


@pytest.mark.parametrize(("num_tokens", "expected"), [(0, 0.0), (5, 0.0), (6, -1.0), (50, -1.0)])
def test_length_penalises_only_beyond_n_tokens(num_tokens, expected):
    assert score("length:5", "text is ignored", num_tokens=num_tokens) == expected


@pytest.mark.parametrize("spec", ["exact-match", "Exact_Match", "length", "regex:\\d", "", "math"])
def test_unknown_spec_is_a_config_error_naming_it(spec):
    with pytest.raises(ConfigError, match=re.escape(f'unknown reward function "{spec}"')):
        parse_reward(spec)


@pytest.mark.parametrize(
    "spec",
    [
        "format:(",
        "format:[a-",
        "length:abc",
        "length:-1",
        "length:1.5",
        "length:",
        "http:ftp://example.com/score",
        "http:localhost:8000/score",  # no scheme
        "http:http://",  # no host
        "http://127.0.0.1:port/score",
        "python:",
        "python:just_a_module",
    ],
)
def test_malformed_spec_is_a_config_error_naming_it(spec):
    with pytest.raises(ConfigError) as error:
        parse_reward(spec)
    assert f'"{spec}"' in str(error.value)


# --- math equivalence --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("1/2", "0.5"),
        ("\\frac{1}{2}", "0.5"),
        ("\\frac12", "1/2"),
        ("so the answer is \\boxed{\\frac{1}{2}}", "1/2"),  # nested braces inside the box
        ("\\boxed{\\dfrac{3}{4}}", "0.75"),
        ("-\\frac{1}{2}", "-0.5"),
        ("1,000", "1000"),
        ("$1,234.50$", "1234.5"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("\\sqrt[3]{27}", "3"),
        ("2\\pi", "\\pi + \\pi"),
        ("2x + x", "3x"),
        ("x = 5", "5"),  # an equation's right-hand side
        ("50%", "0.5"),  # a percentage equals its fraction...
        ("50\\%", "50"),  # ...and its number
        ("90^\\circ", "90"),
        ("\\boxed{72 \\text{ apples}}", "72"),
        ("She has 72 apples left.", "Natalia sold 48 + 24 = 72 clips.\n#### 72"),  # GSM8K answer, prose
        ("\\boxed{Paris}", "Paris"),  # same string, not maths
    ],
)
def test_math_equal_accepts_equivalent_answers(text, answer):
    assert score("math_equal", text, answer) == 1.0


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("\\boxed{3}", "4"),
        ("0.3333", "\\frac{1}{3}"),  # a rounded decimal is not the fraction
        ("\\boxed{1, 2}", "2"),  # a tuple is not its last element
        ("\\boxed{9^{9^{9}}}", "9"),  # refused (too large to compute), not mistaken for 9
        ("x", "y"),
        ("1/0", "1"),
        ("", "0"),
        ("__import__('os').getcwd()", "1"),  # never evaluated
        ("5", None),
    ],
)
def test_math_equal_rejects_different_answers(text, answer):
    assert score("math_equal", text, answer) == 0.0


# --- python:module:function ----------------------------------------------------------------------------


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> Callable[[str], str]:
    """Writes a module with a unique name to tmp_path (on sys.path) and returns its name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(source: str) -> str:
        name = f"user_rewards_{os.getpid()}_{len(written)}_{abs(hash(str(tmp_path)))}"
        (tmp_path / f"{name}.py").write_text(source)
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


def test_python_reward_calls_the_function_with_the_batch(user_module):
    module = user_module(
        "def reward(completions):\n"
        "    return [float(len(c.text)) + (c.answer == 'yes') for c in completions]\n"
    )
    func = parse_reward(f"python:{module}:reward")
    assert func.name == f"python:{module}:reward"
    assert func([completion("abc", "yes"), completion("hello", None)]) == [4.0, 5.0]


def test_python_reward_imports_from_the_current_directory(tmp_path, monkeypatch):
    name = f"cwd_rewards_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text("def reward(completions):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    try:
        assert parse_reward(f"python:{name}:reward")([completion("a")]) == [1.0]
    finally:
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("source", "function", "message"),
    [
        ("x = 1\n", "missing", "is not defined"),
        ("reward = 3\n", "reward", "not callable"),
        ("1 / 0\n", "reward", "raised ZeroDivisionError"),
    ],
)
def test_python_reward_that_cannot_be_loaded_is_a_config_error(user_module, source, function, message):
    spec = f"python:{user_module(source)}:{function}"
    with pytest.raises(ConfigError, match=message) as error:
        parse_reward(spec)
    assert spec in str(error.value)


def test_python_reward_from_a_missing_module_is_a_config_error():
    with pytest.raises(ConfigError, match="cannot import module 'no_such_reward_module_xyz'"):
        parse_reward("python:no_such_reward_module_xyz:reward")


@pytest.mark.parametrize(
    ("returned", "message"),
    [("[1.0]", "expected 2 scores"), ("[1.0, float('nan')]", "score 1 is nan"), ("'12'", "expected a list")],
)
def test_python_reward_with_bad_scores_fails_naming_it(user_module, returned, message):
    module = user_module(f"def reward(completions):\n    return {returned}\n")
    spec = f"python:{module}:reward"
    with pytest.raises(GymError, match=message) as error:
        parse_reward(spec)([completion("a"), completion("b")])
    assert spec in str(error.value)


def test_a_reward_that_raises_is_one_error_naming_the_reward_its_error_and_its_line(user_module):
    module = user_module("def reward(completions):\n    raise KeyError(42)\n")
    spec = f"python:{module}:reward"
    with pytest.raises(RewardFunctionFailed) as error:
        score_completions([parse_reward(spec)], None, [completion("a")])
    message = str(error.value)
    assert f"reward function {spec} raised KeyError: 42 at " in message
    assert message.endswith(f"{module}.py:2; fix the reward function and run again")
    assert isinstance(error.value.__cause__, KeyError)


# --- weighting and concurrency -------------------------------------------------------------------------


def test_score_completions_weights_and_reports_raw_scores_by_name():
    funcs = [parse_reward("exact_match"), parse_reward("length:2")]
    batch = [completion("yes", "yes", num_tokens=2), completion("no", "yes", num_tokens=3)]
    totals, by_name = score_completions(funcs, [2.0, 0.5], batch)
    assert by_name == {"exact_match": [1.0, 0.0], "length:2": [0.0, -1.0]}
    assert totals == [2.0, -0.5]


def test_score_completions_weights_default_to_one():
    funcs = [parse_reward("exact_match"), parse_reward("numeric_match")]
    totals, _ = score_completions(funcs, None, [completion("4", "4"), completion("5", "4")])
    assert totals == [2.0, 0.0]


def test_score_completions_keeps_a_repeated_spec_apart():
    funcs = [parse_reward("exact_match"), parse_reward("exact_match")]
    totals, by_name = score_completions(funcs, [1.0, 3.0], [completion("a", "a")])
    assert list(by_name) == ["exact_match", "exact_match#2"]
    assert totals == [4.0]


def test_score_completions_rejects_a_weight_count_mismatch():
    with pytest.raises(GymError, match="2 reward weights for 1 reward functions"):
        score_completions([parse_reward("exact_match")], [1.0, 2.0], [completion("a", "a")])


def test_io_rewards_run_at_the_same_time(user_module):
    # Each function waits at a two-party barrier: run one after the other, the first would time out.
    module = user_module(
        "import threading\n"
        "barrier = threading.Barrier(2, timeout=10)\n"
        "def reward(completions):\n"
        "    barrier.wait()\n"
        "    return [1.0] * len(completions)\n"
    )
    funcs = [parse_reward(f"python:{module}:reward"), parse_reward("exact_match")]
    funcs.append(parse_reward(f"python:{module}:reward"))
    totals, by_name = score_completions(funcs, None, [completion("a", "a")])
    assert totals == [3.0]
    assert list(by_name) == [f"python:{module}:reward", "exact_match", f"python:{module}:reward#2"]


def test_reward_function_is_the_common_base():
    specs = ["exact_match", "numeric_match", "math_equal", "format:x", "length:1", "http://127.0.0.1:1/"]
    assert all(isinstance(parse_reward(s), RewardFunction) for s in specs)


# --- http:<url> against a real local server ------------------------------------------------------------

Reply = tuple[int, dict[str, str], bytes]


def reward_reply(body: dict) -> Reply:
    return 200, {"Content-Type": "application/json"}, json.dumps({"reward": len(body["completion"])}).encode()


class RewardServer:
    """Records each request body and the most requests it held at once; `reply(index, body)` decides each answer
    (index counts from 0 in arrival order) and `delay_s(index)` how long to hold it first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bodies: list[dict] = []
        self.content_types: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.reply: Callable[[int, dict], Reply] = lambda index, body: reward_reply(body)
        self.delay_s: Callable[[int], float] = lambda index: 0.0
        self.url = ""

    @property
    def requests(self) -> int:
        return len(self.bodies)


class _QuietServer(ThreadingHTTPServer):
    request_queue_size = 64  # the default backlog of 5 would make the kernel hold back concurrent connects

    def handle_error(self, request, client_address) -> None:
        pass  # a client that timed out closes its socket; the late reply's broken pipe is expected


def _handler(state: RewardServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                index = len(state.bodies)
                state.bodies.append(body)
                state.content_types.append(self.headers.get("Content-Type", ""))
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                time.sleep(state.delay_s(index))
                status, headers, payload = state.reply(index, body)
            finally:
                with state.lock:
                    state.in_flight -= 1
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args) -> None:
            pass

    return Handler


@pytest.fixture
def server(monkeypatch) -> Iterator[RewardServer]:
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)  # loopback must not go through a proxy
    state = RewardServer()
    httpd = _QuietServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}/score"
    yield state
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """The client's back-off waits, recorded instead of slept."""
    waits: list[float] = []
    monkeypatch.setattr(remote, "_sleep", waits.append)
    return waits


def status_reply(status: int, body: bytes = b"oops", headers: dict[str, str] | None = None) -> Reply:
    return status, headers or {}, body


def test_http_posts_prompt_completion_and_answer(server, sleeps):
    func = parse_reward(f"http:{server.url}")
    batch = [completion("abc", "yes", prompt="P1"), completion("hello", None, prompt="P2")]
    assert func.name == f"http:{server.url}"
    assert func(batch) == [3.0, 5.0]
    assert sorted(server.bodies, key=lambda b: b["prompt"]) == [
        {"prompt": "P1", "completion": "abc", "answer": "yes"},
        {"prompt": "P2", "completion": "hello", "answer": None},
    ]
    assert server.content_types == ["application/json"] * 2
    assert sleeps == []


def test_bare_url_spec_is_an_http_reward(server, sleeps):
    assert parse_reward(server.url)([completion("four")]) == [4.0]


def test_http_ignores_extra_response_fields(server, sleeps):
    server.reply = lambda i, body: (200, {}, b'{"reward": -1.5, "detail": "too long"}')
    assert parse_reward(server.url)([completion("x")]) == [-1.5]


def test_http_retries_503_then_succeeds(server, sleeps):
    server.reply = lambda i, body: status_reply(503) if i < 2 else reward_reply(body)
    assert parse_reward(server.url)([completion("abcd")]) == [4.0]
    assert server.requests == 3
    # Jittered exponential back-off: 0.5 s then 1 s, each scaled by a factor in [0.5, 1].
    assert len(sleeps) == 2
    assert 0.25 <= sleeps[0] <= 0.5 and 0.5 <= sleeps[1] <= 1.0


def test_http_429_waits_as_retry_after_says(server, sleeps):
    server.reply = lambda i, body: (
        status_reply(429, headers={"Retry-After": "7"}) if i == 0 else reward_reply(body)
    )
    assert parse_reward(server.url)([completion("ab")]) == [2.0]
    assert server.requests == 2
    assert sleeps == [7.0]


def test_http_retry_after_is_capped(server, sleeps):
    server.reply = lambda i, body: (
        status_reply(429, headers={"Retry-After": "86400"}) if i == 0 else reward_reply(body)
    )
    parse_reward(server.url)([completion("ab")])
    assert sleeps == [remote.RETRY_AFTER_MAX_S]


def test_http_persistent_500_fails_after_the_retries_naming_the_url(server, sleeps):
    server.reply = lambda i, body: status_reply(500, b"database down")
    with pytest.raises(GymError) as error:
        parse_reward(server.url)([completion("a")])
    message = str(error.value)
    assert server.url in message and f"{remote.MAX_TRIES} tries" in message
    assert "http 500: database down" in message
    assert server.requests == remote.MAX_TRIES
    assert len(sleeps) == remote.MAX_TRIES - 1


def test_http_persistent_500_with_real_short_backoff(server, monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_BASE_S", 0.01)
    server.reply = lambda i, body: status_reply(502)
    with pytest.raises(GymError, match="http 502"):
        parse_reward(server.url)([completion("a")])
    assert server.requests == remote.MAX_TRIES


def test_http_400_fails_at_once(server, sleeps):
    server.reply = lambda i, body: status_reply(400, b"missing field")
    with pytest.raises(GymError, match="http 400: missing field") as error:
        parse_reward(server.url)([completion("a")])
    assert server.url in str(error.value)
    assert server.requests == 1 and sleeps == []


@pytest.mark.parametrize("payload", [b"<html>not json</html>", b'{"score": 1}', b'{"reward": "1"}', b"[1]"])
def test_http_bad_body_fails_at_once(server, sleeps, payload):
    server.reply = lambda i, body: (200, {}, payload)
    with pytest.raises(GymError, match='expected {"reward": number}') as error:
        parse_reward(server.url)([completion("a")])
    assert server.url in str(error.value)
    assert server.requests == 1


def test_http_timeout_is_retried(server, sleeps, monkeypatch):
    monkeypatch.setattr(remote, "REQUEST_TIMEOUT_S", 0.2)
    server.delay_s = lambda i: 1.0 if i == 0 else 0.0
    assert parse_reward(server.url)([completion("abc")]) == [3.0]
    assert server.requests == 2 and len(sleeps) == 1


def test_http_connection_refused_is_retried_then_fails(sleeps):
    with socket.socket() as probe:  # a port nobody listens on once the probe closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    with pytest.raises(GymError, match="connection error") as error:
        parse_reward(url)([completion("a")])
    assert url in str(error.value) and f"{remote.MAX_TRIES} tries" in str(error.value)
    assert len(sleeps) == remote.MAX_TRIES - 1


def test_http_requests_run_concurrently(server, sleeps):
    server.delay_s = lambda i: 0.2
    batch = [completion("x" * n) for n in range(16)]
    assert parse_reward(server.url)(batch) == [float(n) for n in range(16)]  # in the batch's order
    # Sequential requests would never overlap; the pool sends all 16 together.
    assert server.max_in_flight > 8


def test_http_concurrency_is_bounded(server, sleeps, monkeypatch):
    monkeypatch.setattr(remote, "MAX_CONCURRENT_REQUESTS", 3)
    server.delay_s = lambda i: 0.1
    assert parse_reward(server.url)([completion("x" * n) for n in range(9)]) == [float(n) for n in range(9)]
    assert 2 <= server.max_in_flight <= 3


def test_http_failure_in_a_batch_fails_the_batch(server, sleeps):
    server.reply = lambda i, body: status_reply(400) if body["completion"] == "bad" else reward_reply(body)
    with pytest.raises(GymError, match="http 400"):
        parse_reward(server.url)([completion("ok"), completion("bad"), completion("fine")])


def test_http_reward_is_finite(server, sleeps):
    server.reply = lambda i, body: (200, {}, b'{"reward": NaN}')
    with pytest.raises(GymError, match='expected {"reward": number}'):
        parse_reward(server.url)([completion("a")])


# --- module.function: TRL's signature, as Axolotl's configs name rewards ------------------------------------

CHAT_PROMPT = ({"role": "user", "content": "What is 2 plus 2?"},)


def _chat_completion(text: str, **columns) -> Completion:
    return Completion(
        prompt="<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n<|im_start|>assistant\n",
        text=text,
        answer=columns.get("answer"),
        num_tokens=3,
        prompt_messages=CHAT_PROMPT,
        token_ids=(5, 6, 7),
        columns=columns,
    )


def test_trls_own_reward_functions_run_by_their_dotted_path():
    """trl.rewards' functions, unchanged: conversational completions, a `solution` column, completion ids."""
    think = parse_reward("trl.rewards.think_format_reward")
    assert think([_chat_completion("<think>\nsum\n</think>\n4"), _chat_completion("4")]) == [1.0, 0.0]
    import trl.rewards
    from trl.rewards import get_soft_overlong_punishment

    trl.rewards.soft_overlong_for_test = get_soft_overlong_punishment(
        max_completion_len=4, soft_punish_cache=2
    )
    try:
        overlong = parse_reward("trl.rewards.soft_overlong_for_test")
        # 3 completion tokens of at most 4, 2 of them a soft zone: (4 - 2 - 3) / 2 = -0.5
        assert overlong([_chat_completion("x")]) == [-0.5]
    finally:
        del trl.rewards.soft_overlong_for_test


def test_axolotls_docs_reward_module_gets_conversational_completions_and_the_answer_column(user_module):
    module = user_module(
        "import re\n"
        "def accuracy_reward(completions, answer, **kwargs):\n"
        "    out = []\n"
        "    for completion, correct in zip(completions, answer):\n"
        "        numbers = re.findall(r'-?\\d+(?:\\.\\d+)?', completion[0]['content'])\n"
        "        out.append(1.0 if (numbers[-1] if numbers else '') == str(correct) else 0.0)\n"
        "    return out\n"
        "def seen(prompts, completions, completion_ids, **kwargs):\n"
        "    assert prompts[0] == [{'role': 'user', 'content': 'What is 2 plus 2?'}], prompts\n"
        "    assert completion_ids == [[5, 6, 7], [5, 6, 7]] and kwargs['level'] == ['easy', None]\n"
        "    return [float(len(completions))] * len(completions)\n"
    )
    accuracy = parse_reward(f"{module}.accuracy_reward")
    batch = [_chat_completion("It is 4", answer="4", level="easy"), _chat_completion("5", answer="4")]
    assert accuracy(batch) == [1.0, 0.0]
    assert parse_reward(f"{module}.seen")(batch) == [2.0, 2.0]


def test_a_dotted_reward_on_plain_text_prompts_gets_strings(user_module):
    module = user_module(
        "def r(prompts, completions, **kwargs):\n    return [float(p == 'Q?' and c == 'a') for p, c in zip(prompts, completions)]\n"
    )
    assert parse_reward(f"{module}.r")([completion("a"), completion("b")]) == [1.0, 0.0]
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'"):
        parse_reward("no_such_module_xyz.reward")
