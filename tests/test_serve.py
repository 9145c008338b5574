"""`gym serve` against the official `openai` client: a tiny random llama with a word-level ChatML tokenizer, a
LoRA adapter trained one step with the Tinker-style client, and a server started on a free local port."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import torch
from tinker_serve import gym_serve_command

from hanzo_gym import tinker
from hanzo_gym.cli import main
from hanzo_gym.engine.sampling import DecodeBatch
from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.renderers import get_renderer
from hanzo_gym.serve import ServedModels, Server
from hanzo_gym.tinker import types
from hanzo_gym.tinker.paths import resolve

# Prompts whose greedy answers from the tiny model are long enough to cut (found by looking, then fixed).
LONG_CHAT = [{"role": "user", "content": "one glad"}]  # base: "hi good hi good be I glad I" then <|im_end|>
LONG_TEXT = "c are"  # base: 10+ tokens without an end


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_dir, word_tokenizer):
    """The reference: Tinker-style sampling clients for the base model and a one-step adapter."""
    service = tinker.ServiceClient(root=tmp_path_factory.mktemp("runs"), dtype=torch.float32)
    training = service.create_lora_training_client(tiny_dir, rank=4, seed=0)
    tokens = word_tokenizer("one two three four five six seven eight nine ten")["input_ids"]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    training.forward_backward([datum], "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=5e-2))
    path = training.save_weights_for_sampler("served").result().path
    return SimpleNamespace(
        root=service.root,
        path=path,
        directory=str(resolve(path, service.root)),
        base=service.create_sampling_client(base_model=tiny_dir),
        tuned=service.create_sampling_client(model_path=path),
        renderer=get_renderer("chat_template", word_tokenizer),
    )


@pytest.fixture(scope="module")
def server(tiny_dir, engine):
    models = ServedModels(ModelHost(tiny_dir, dtype=torch.float32), {"tuned": engine.directory})
    with Server(models, port=0) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def greedy(sampler, tokens: list[int], max_tokens: int, stop=None, n: int = 1, **params):
    params = types.SamplingParams(
        max_tokens=max_tokens, temperature=params.pop("temperature", 0), stop=stop, **params
    )
    return sampler.sample(types.ModelInput.from_ints(tokens), n, params).result().sequences


def text_of(tokenizer, sequence) -> str:
    """What the server should show: the tokens as text, without the stop token that ended them."""
    tokens = sequence.tokens[:-1] if sequence.stop_reason == "stop" else sequence.tokens
    return tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def chat_prompt(engine, messages) -> list[int]:
    return engine.renderer.build_generation_prompt(messages).to_ints()


def raw(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, data.decode()


def post(server, path: str, body) -> tuple[int, object]:
    return raw(server, "POST", path, json.dumps(body).encode())


def stream_texts(stream) -> tuple[dict[int, str], dict[int, str], list]:
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    return texts, finishes, chunks


# -- models and plain completions ----------------------------------------------------------------------------
def test_models_lists_the_base_model_and_its_adapters(client, tiny_dir, engine):
    assert [m.id for m in client.models.list().data] == [tiny_dir, "tuned"]
    card = client.models.retrieve("tuned")
    assert (card.id, card.owned_by) == ("tuned", "hanzo-gym")
    # where the weights came from, by name: no folder of the server's in a reply
    roots = [m.model_extra["root"] for m in client.models.list().data]
    assert roots == [Path(tiny_dir).name, Path(engine.directory).name]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_what_one_request_may_cost_is_bounded_and_stated(tiny_dir, engine):
    """A chat without max_tokens gets at most the default cap (not the whole context); prompts × n × max_tokens
    past the server's limit is a 400 that names the limit; /v1/models states both."""
    models = ServedModels(
        ModelHost(tiny_dir, dtype=torch.float32), default_max_tokens=6, max_request_tokens=40
    )
    with Server(models, port=0) as running:
        client = openai.OpenAI(base_url=running.url, api_key="none", max_retries=0)
        card = client.models.retrieve(tiny_dir)
        assert (card.default_max_tokens, card.max_request_tokens) == (6, 40)
        assert card.max_model_len == models.context_length
        reply = client.chat.completions.create(model=tiny_dir, messages=LONG_CHAT, temperature=0)
        assert reply.usage.completion_tokens <= 6
        with pytest.raises(openai.BadRequestError) as chat_error:
            client.chat.completions.create(model=tiny_dir, messages=LONG_CHAT, n=8)  # 8 × 6 > 40
        assert chat_error.value.body["code"] == "request_too_large"
        assert "at most 40" in chat_error.value.body["message"]
        assert chat_error.value.body["param"] == "n"
        with pytest.raises(openai.BadRequestError) as text_error:
            client.completions.create(model=tiny_dir, prompt=["a b", "c d", "e f"], max_tokens=14)  # 42
        assert "3 prompts × n=1 × max_tokens=14" in text_error.value.body["message"]
        ok = client.completions.create(model=tiny_dir, prompt=["a b", "c d"], max_tokens=20, temperature=0)
        assert len(ok.choices) == 2
    models.batcher.close()


def test_chat_picks_the_adapter_by_model_name_and_matches_the_engine(
    client, tiny_dir, engine, word_tokenizer
):
    prompt = chat_prompt(engine, LONG_CHAT)
    stop = engine.renderer.get_stop_sequences()
    for name, sampler in ((tiny_dir, engine.base), ("tuned", engine.tuned)):
        expected = greedy(sampler, prompt, 12, stop)[0]
        reply = client.chat.completions.create(model=name, messages=LONG_CHAT, max_tokens=12, temperature=0)
        choice = reply.choices[0]
        assert choice.message.content == text_of(word_tokenizer, expected), name
        assert choice.message.role == "assistant"
        assert choice.finish_reason == ("stop" if expected.stop_reason == "stop" else "length")
        assert reply.model == name
        assert reply.usage.prompt_tokens == len(prompt)
        assert reply.usage.completion_tokens == len(expected.tokens)
        assert reply.usage.total_tokens == len(prompt) + len(expected.tokens)
    base = client.chat.completions.create(model=tiny_dir, messages=LONG_CHAT, max_tokens=12, temperature=0)
    tuned = client.chat.completions.create(model="tuned", messages=LONG_CHAT, max_tokens=12, temperature=0)
    assert base.choices[0].message.content == "hi good hi good be I glad I"
    assert tuned.choices[0].message.content != base.choices[0].message.content


def test_completions_match_the_engine_and_max_tokens_ends_with_length(
    client, tiny_dir, engine, word_tokenizer
):
    prompt = word_tokenizer(LONG_TEXT)["input_ids"]
    expected = greedy(engine.base, prompt, 5)[0]
    reply = client.completions.create(model=tiny_dir, prompt=LONG_TEXT, max_tokens=5, temperature=0)
    assert reply.choices[0].text == text_of(word_tokenizer, expected)
    assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", 5)
    # Token-id prompts and several prompts at once; choices come back in prompt order.
    many = client.completions.create(model="tuned", prompt=[prompt, "one glad"], max_tokens=4, temperature=0)
    expected_tuned = [
        greedy(engine.tuned, p, 4)[0] for p in (prompt, word_tokenizer("one glad")["input_ids"])
    ]
    assert [c.text for c in many.choices] == [text_of(word_tokenizer, s) for s in expected_tuned]
    assert [c.index for c in many.choices] == [0, 1]
    assert many.usage.prompt_tokens == len(prompt) + 2


# -- streaming, n, seeds, stop strings ---------------------------------------------------------------------
def test_streamed_deltas_add_up_to_the_non_streamed_text(client, tiny_dir):
    for messages, max_tokens in ((LONG_CHAT, 12), ([{"role": "user", "content": "c are"}], 7)):
        whole = client.chat.completions.create(
            model=tiny_dir, messages=messages, max_tokens=max_tokens, n=2, temperature=0
        )
        stream = client.chat.completions.create(
            model=tiny_dir,
            messages=messages,
            max_tokens=max_tokens,
            n=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        texts, finishes, chunks = stream_texts(stream)
        assert texts == {c.index: c.message.content for c in whole.choices}
        assert finishes == {c.index: c.finish_reason for c in whole.choices}
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # really streamed
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    whole = client.completions.create(model="tuned", prompt=LONG_TEXT, max_tokens=6, temperature=0)
    stream = client.completions.create(
        model="tuned", prompt=LONG_TEXT, max_tokens=6, temperature=0, stream=True
    )
    texts, finishes, _ = stream_texts(stream)
    assert texts == {0: whole.choices[0].text} and finishes == {0: "length"}


def test_n_and_seed_reproduce_the_engines_samples(client, tiny_dir, engine, word_tokenizer):
    prompt = word_tokenizer(LONG_TEXT)["input_ids"]
    expected = greedy(engine.base, prompt, 6, n=3, temperature=1.0, seed=11)
    kwargs = {"model": tiny_dir, "prompt": LONG_TEXT, "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 11}
    first = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [text_of(word_tokenizer, s) for s in expected]
    assert [c.text for c in client.completions.create(**kwargs).choices] == [c.text for c in first.choices]
    assert len({c.text for c in first.choices}) > 1  # three samples, not one repeated
    chat = {"model": "tuned", "messages": LONG_CHAT, "max_tokens": 6, "n": 2, "top_p": 0.9, "seed": 3}
    again = [client.chat.completions.create(**chat) for _ in range(2)]
    assert [c.message.content for c in again[0].choices] == [c.message.content for c in again[1].choices]


def test_stop_strings_end_the_text_before_them_streamed_or_not(client, tiny_dir):
    # Greedy: "hi good hi good be I glad I". "good be" spans two tokens; "good" alone must not leak early.
    for stop, expected in (
        (["good be"], "hi good hi "),
        ("I", "hi good hi good be "),
        (["glad", "be"], "hi good hi good "),
    ):
        whole = client.chat.completions.create(
            model=tiny_dir, messages=LONG_CHAT, max_tokens=12, temperature=0, stop=stop
        )
        assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == (expected, "stop")
        stream = client.chat.completions.create(
            model=tiny_dir, messages=LONG_CHAT, max_tokens=12, temperature=0, stop=stop, stream=True
        )
        texts, finishes, _ = stream_texts(stream)
        assert (texts, finishes) == ({0: expected}, {0: "stop"})
    text = client.completions.create(model=tiny_dir, prompt=LONG_TEXT, max_tokens=9, temperature=0).choices[0]
    assert " six " in text.text
    cut = client.completions.create(model=tiny_dir, prompt=LONG_TEXT, max_tokens=9, temperature=0, stop="six")
    assert cut.choices[0].text == text.text[: text.text.index("six")]
    assert cut.choices[0].finish_reason == "stop"


# -- log-probabilities --------------------------------------------------------------------------------------
def test_chat_logprobs_are_the_samplers_with_top_alternatives(client, engine, word_tokenizer):
    prompt = chat_prompt(engine, LONG_CHAT)
    expected = greedy(engine.tuned, prompt, 12, engine.renderer.get_stop_sequences())[0]
    shown = expected.tokens[:-1] if expected.stop_reason == "stop" else expected.tokens
    for top in (0, 3):
        reply = client.chat.completions.create(
            model="tuned", messages=LONG_CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=top
        )
        content = reply.choices[0].logprobs.content
        assert [c.token for c in content] == [word_tokenizer.decode([t]) for t in shown]
        assert [c.logprob for c in content] == pytest.approx(expected.logprobs[: len(shown)], abs=1e-4)
        for entry in content:
            assert len(entry.top_logprobs) == top
            assert entry.bytes == list(entry.token.encode())
            if top:
                values = [t.logprob for t in entry.top_logprobs]
                assert values == sorted(values, reverse=True)
                # Greedy: the sampled token is the best one.
                assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == pytest.approx(
                    (entry.token, entry.logprob)
                )
    plain = client.chat.completions.create(model="tuned", messages=LONG_CHAT, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_and_their_stream(client, tiny_dir, engine, word_tokenizer):
    prompt = word_tokenizer(LONG_TEXT)["input_ids"]
    expected = greedy(engine.base, prompt, 6)[0]
    reply = client.completions.create(
        model=tiny_dir, prompt=LONG_TEXT, max_tokens=6, temperature=0, logprobs=2
    )
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert logprobs.tokens == [word_tokenizer.decode([t]) for t in expected.tokens]
    assert logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    assert logprobs.text_offset == sorted(set(logprobs.text_offset))
    for token, offset, top in zip(logprobs.tokens, logprobs.text_offset, logprobs.top_logprobs):
        assert choice.text[offset:].lstrip(" ").startswith(token)  # word-level: the joining space comes first
        assert token in top and len(top) == 2  # greedy: the sampled token is one of the top two
        assert max(top.values()) == pytest.approx(top[token])
    stream = client.completions.create(
        model=tiny_dir, prompt=LONG_TEXT, max_tokens=6, temperature=0, logprobs=2, stream=True
    )
    streamed = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == logprobs.tokens
    assert [v for lp in streamed for v in lp.token_logprobs] == pytest.approx(logprobs.token_logprobs)
    assert [o for lp in streamed for o in lp.text_offset] == logprobs.text_offset


# -- concurrency and adapters at runtime -------------------------------------------------------------------
def test_concurrent_requests_are_batched_and_each_answered_correctly(
    client, server, tiny_dir, engine, word_tokenizer, monkeypatch
):
    texts = ["c are", "one glad", "hi there", "two c", "how are", "a b", "one well", "c good"]
    jobs = [(tiny_dir if i % 2 == 0 else "tuned", text) for i, text in enumerate(texts)]
    samplers = {tiny_dir: engine.base, "tuned": engine.tuned}
    expected = [
        text_of(word_tokenizer, greedy(samplers[m], word_tokenizer(t)["input_ids"], 5)[0]) for m, t in jobs
    ]

    admitted = []  # prompts per prefill
    original = DecodeBatch.add
    batcher = server.models.batcher

    def counting(self, prompts):
        if not admitted:  # hold the first prefill until every other request waits in the queue
            deadline = time.monotonic() + 20
            while len(batcher._queue) + len(prompts) < len(jobs) and time.monotonic() < deadline:
                time.sleep(0.005)
        admitted.append(len(prompts))
        return original(self, prompts)

    monkeypatch.setattr(DecodeBatch, "add", counting)
    answers: list[str | None] = [None] * len(jobs)

    def ask(index: int) -> None:
        model, text = jobs[index]
        reply = client.completions.create(model=model, prompt=text, max_tokens=5, temperature=0)
        answers[index] = reply.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert answers == expected
    # Eight requests, two adapters: the first prefill (whatever had arrived), then what waited behind it, one
    # prefill per adapter, joining the running batch of its adapter.
    assert sum(admitted) == len(jobs) and len(admitted) <= 3 and max(admitted) >= 3


@pytest.mark.parametrize("short_model", ["base", "tuned"])
def test_a_short_request_does_not_wait_for_a_long_one(
    client, tiny_dir, engine, word_tokenizer, monkeypatch, short_model
):
    """The long request decodes 200 tokens at >= 5 ms a step; the short one, sent once it runs, decodes beside it
    (the same model, or another adapter through its own), and is answered long before it ends."""
    short_model = tiny_dir if short_model == "base" else short_model
    original = DecodeBatch.step
    steps = []

    def slow(self):
        steps.append(self.rows)
        time.sleep(0.005)
        return original(self)

    monkeypatch.setattr(DecodeBatch, "step", slow)
    long_answer = {}

    def ask_long() -> None:
        reply = client.completions.create(model=tiny_dir, prompt=[11, 12], max_tokens=200, temperature=0)
        long_answer["reply"] = reply

    long_thread = threading.Thread(target=ask_long)
    long_thread.start()
    deadline = time.monotonic() + 20
    while len(steps) < 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    reply = client.completions.create(model=short_model, prompt=LONG_TEXT, max_tokens=4, temperature=0)
    steps_when_answered = len(steps)
    long_thread.join(timeout=120)
    assert steps_when_answered < 40, steps_when_answered  # of the long request's 200
    assert long_answer["reply"].usage.completion_tokens == 200
    sampler = engine.base if short_model == tiny_dir else engine.tuned
    want = text_of(word_tokenizer, greedy(sampler, word_tokenizer(LONG_TEXT)["input_ids"], 4)[0])
    assert reply.choices[0].text == want
    long_alone = greedy(engine.base, [11, 12], 200)[0]
    assert long_answer["reply"].choices[0].text == text_of(word_tokenizer, long_alone)


def test_adapters_load_and_unload_while_serving(client, server, engine, monkeypatch):
    expected = client.chat.completions.create(model="tuned", messages=LONG_CHAT, max_tokens=8, temperature=0)
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "copy", "lora_path": engine.directory})
    assert status == 200 and "copy" in body
    assert "copy" in [m.id for m in client.models.list().data]
    reply = client.chat.completions.create(model="copy", messages=LONG_CHAT, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == expected.choices[0].message.content

    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "copy"})[0] == 200
    assert "copy" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="copy", messages=LONG_CHAT, max_tokens=8)
    assert missing.value.body["code"] == "model_not_found"
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "copy"})[0] == 404

    # The same name again, from the gym:// path under the runs root; the other adapter is untouched.
    monkeypatch.setenv("HANZO_GYM_RUNS", str(engine.root))
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "copy", "lora_path": engine.path})[0] == 200
    again = client.chat.completions.create(model="copy", messages=LONG_CHAT, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == expected.choices[0].message.content
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "copy"})[0] == 200
    still = client.chat.completions.create(model="tuned", messages=LONG_CHAT, max_tokens=8, temperature=0)
    assert still.choices[0].message.content == expected.choices[0].message.content


def _count_and_slow_steps(monkeypatch, seconds: float) -> list[int]:
    """Each decode step of the server's sampler takes at least `seconds`; returns the rows of every step."""
    original = DecodeBatch.step
    steps: list[int] = []

    def slow(self):
        steps.append(self.live_rows)
        time.sleep(seconds)
        return original(self)

    monkeypatch.setattr(DecodeBatch, "step", slow)
    return steps


def test_a_streaming_client_that_leaves_stops_its_sampling(client, tiny_dir, monkeypatch):
    steps = _count_and_slow_steps(monkeypatch, 0.005)  # 200 tokens take a second: time to notice the leaving
    # Greedy from these two tokens runs all 200 tokens without an end.
    stream = client.completions.create(
        model=tiny_dir, prompt=[11, 12], max_tokens=200, temperature=0, stream=True
    )
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the sampler goes idle once the abandoned rows are dropped
        before = len(steps)
        time.sleep(0.1)
        if len(steps) == before:
            break
    assert len(steps) < 100, len(steps)  # stopped long before its 200 tokens
    reply = client.completions.create(model=tiny_dir, prompt=LONG_TEXT, max_tokens=2, temperature=0)
    assert reply.choices[0].finish_reason == "length"


def test_a_client_that_hangs_up_frees_the_sampler(server, client, tiny_dir, monkeypatch):
    steps = _count_and_slow_steps(monkeypatch, 0.01)  # 200 tokens take two seconds: time to hang up part-way
    body = json.dumps({"model": tiny_dir, "prompt": [11, 12], "max_tokens": 200, "temperature": 0}).encode()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(len(body)))
    connection.endheaders(body)
    time.sleep(0.3)
    connection.close()  # hung up before the answer
    reply = client.completions.create(model=tiny_dir, prompt=LONG_TEXT, max_tokens=2, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    time.sleep(0.3)
    assert 0 < len(steps) < 120, len(steps)  # far from the 200 tokens it asked for


# -- bad requests ---------------------------------------------------------------------------------------------
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    (CHAT, b"{not json", 400),
    (CHAT, b"[1, 2]", 400),
    (CHAT, b'"text"', 400),
    (CHAT, b"", 400),
    (CHAT, b"\xff\xfe\x00", 400),
    (CHAT, b"[" * 100_000, 400),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400),
    (CHAT, {"messages": []}, 400),
    (CHAT, {"messages": "hi"}, 400),
    (CHAT, {}, 400),
    (CHAT, {"messages": [{"content": "hi"}]}, 400),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
    ),
    (CHAT, {"messages": ["hi"]}, 400),
    (CHAT, {"model": "nope", "messages": MESSAGES}, 404),
    (CHAT, {"model": 5, "messages": MESSAGES}, 400),
    (CHAT, {"messages": MESSAGES, "max_tokens": 10**9}, 400),
    (CHAT, {"messages": MESSAGES, "max_tokens": 10**40}, 400),
    (CHAT, {"messages": MESSAGES, "max_tokens": -1}, 400),
    (CHAT, {"messages": MESSAGES, "max_tokens": 0}, 400),
    (CHAT, {"messages": MESSAGES, "max_tokens": "5"}, 400),
    (CHAT, {"messages": MESSAGES, "max_tokens": True}, 400),
    (CHAT, {"messages": MESSAGES, "n": -1}, 400),
    (CHAT, {"messages": MESSAGES, "n": 0}, 400),
    (CHAT, {"messages": MESSAGES, "n": 100_000}, 400),
    (CHAT, {"messages": MESSAGES, "n": 2.5}, 400),
    (CHAT, {"messages": MESSAGES, "temperature": -1}, 400),
    (CHAT, {"messages": MESSAGES, "temperature": "hot"}, 400),
    (CHAT, {"messages": MESSAGES, "temperature": 1e308}, 400),
    (CHAT, {"messages": MESSAGES, "top_p": 0}, 400),
    (CHAT, {"messages": MESSAGES, "top_p": 1.5}, 400),
    (CHAT, {"messages": MESSAGES, "seed": 2**70}, 400),
    (CHAT, {"messages": MESSAGES, "stop": 5}, 400),
    (CHAT, {"messages": MESSAGES, "stop": [""]}, 400),
    (CHAT, {"messages": MESSAGES, "stop": ["x"] * 100}, 400),
    (CHAT, {"messages": MESSAGES, "logprobs": "yes"}, 400),
    (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 50}, 400),
    (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, 400),
    (CHAT, {"messages": MESSAGES, "stream": "yes"}, 400),
    (CHAT, {"messages": MESSAGES, "stream_options": {"include_usage": True}}, 400),
    (CHAT, {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    (CHAT, {"messages": MESSAGES, "presence_penalty": 1.0}, 400),
    (CHAT, {"messages": [{"role": "user", "content": "hi " * 300}]}, 400),  # longer than the context
    (TEXT, {}, 400),
    (TEXT, {"prompt": ""}, 400),
    (TEXT, {"prompt": []}, 400),
    (TEXT, {"prompt": [[]]}, 400),
    (TEXT, {"prompt": [-5]}, 400),
    (TEXT, {"prompt": [10**6]}, 400),
    (TEXT, {"prompt": {"text": "hi"}}, 400),
    (TEXT, {"prompt": [1, "a"]}, 400),
    (TEXT, {"prompt": "hi", "logprobs": 100}, 400),
    (TEXT, {"prompt": "hi", "logprobs": True}, 400),
    (TEXT, {"prompt": "hi", "echo": True, "stream": True}, 400),
    (TEXT, {"prompt": "hi", "best_of": 3}, 400),
    (TEXT, {"prompt": ["hi"] * 100}, 400),
    (TEXT, {"prompt": "hi", "max_tokens": 10**6}, 400),
    ("/v1/load_lora_adapter", {"lora_name": "x"}, 400),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/adapter"}, 400),
    ("/v1/load_lora_adapter", {"lora_name": "tuned", "lora_path": "/no/such/adapter"}, 400),
    ("/v1/load_lora_adapter", {"lora_name": 3, "lora_path": "/tmp"}, 400),
    ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, 404),
    ("/v1/unload_lora_adapter", {}, 400),
    ("/v1/embeddings", {"input": "hi"}, 404),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', 400),
    (TEXT, b'{"prompt": "\\udfff"}', 400),
]


@pytest.mark.parametrize(("path", "body", "status"), BAD_REQUESTS, ids=lambda v: str(v)[:40])
def test_a_bad_request_gets_an_openai_error_and_the_server_keeps_serving(server, client, path, body, status):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, answer = raw(server, "POST", path, data)
    assert got == status, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["message"] and answer["error"]["type"] == "invalid_request_error"
    assert raw(server, "GET", "/v1/models")[0] == 200


def test_bad_methods_lengths_and_the_openai_client_errors(server, client, tiny_dir, engine):
    assert raw(server, "GET", CHAT)[0] == 405
    assert raw(server, "DELETE", "/v1/models")[0] == 405
    assert raw(server, "GET", "/nowhere")[0] == 404
    # A Content-Length the body never delivers, and one too big to read at all.
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.putrequest("POST", CHAT)
    connection.putheader("Content-Length", str(10**12))
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413 and "error" in json.loads(response.read())
    connection.close()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.putrequest("POST", CHAT)
    connection.putheader("Content-Length", "50")
    connection.endheaders(b'{"messages": ')
    connection.sock.shutdown(1)  # the client stops sending
    assert connection.getresponse().status == 400
    connection.close()
    with pytest.raises(openai.BadRequestError) as empty:
        client.chat.completions.create(model=tiny_dir, messages=[])
    assert empty.value.status_code == 400 and empty.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    # A streaming client that leaves early costs the server nothing lasting.
    stream = client.chat.completions.create(
        model=tiny_dir,
        messages=[{"role": "user", "content": "c are"}],
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    next(iter(stream))
    stream.close()
    reply = client.chat.completions.create(model="tuned", messages=LONG_CHAT, max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")


# -- the command ----------------------------------------------------------------------------------------------
def test_gym_serve_prints_its_address_and_answers(tiny_dir, engine):
    command = gym_serve_command(tiny_dir)
    process = subprocess.Popen(
        [*command, "--adapter", f"tuned={engine.directory}"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline() == "precision: fp32 (bf16: false)\n"
        line = process.stdout.readline()
        match = re.fullmatch(r"serving (.+) on (http://127\.0\.0\.1:\d+/v1)\n", line)
        assert match, line
        assert match.group(1) == f"{tiny_dir}, tuned"
        cli_client = openai.OpenAI(base_url=match.group(2), api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in cli_client.models.list().data] == [tiny_dir, "tuned"]
        reply = cli_client.chat.completions.create(
            model=tiny_dir, messages=LONG_CHAT, max_tokens=12, temperature=0
        )
        assert reply.choices[0].message.content == "hi good hi good be I glad I"
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_gym_serve_reports_bad_arguments(tiny_dir, capsys):
    assert main(["serve", "--model", tiny_dir, "--adapter", "no-equals-sign"]) == 2
    assert "NAME=PATH" in capsys.readouterr().err
    assert main(["serve", "--model", tiny_dir, "--adapter", "x=/a", "--adapter", " x = /b"]) == 2
    assert "--adapter x is given twice" in capsys.readouterr().err
    assert main(["serve", "--model", tiny_dir, "--adapter", "x=/no/such/adapter", "--port", "0"]) == 2
    assert "cannot load adapter `x`" in capsys.readouterr().err
    assert main(["serve", "--model", tiny_dir, "--renderer", "no-such-renderer", "--port", "0"]) == 2
    assert "unknown renderer" in capsys.readouterr().err


def test_replies_leave_without_waiting_for_the_clients_ack(server):
    """Each reply is written as headers then body; with Nagle's algorithm on, the body of every keep-alive
    reply waited for the client's delayed ACK (40 ms), 23 requests/s. Accepted connections have TCP_NODELAY."""
    import socket

    from hanzo_gym.serve.server import _Handler

    seen: list[int] = []

    class Recording(_Handler):
        def setup(self) -> None:
            super().setup()
            seen.append(self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    handler_class, server.httpd.RequestHandlerClass = server.httpd.RequestHandlerClass, Recording
    try:
        assert raw(server, "GET", "/health")[0] == 200
    finally:
        server.httpd.RequestHandlerClass = handler_class
    assert seen and all(seen), seen
