"""`echo` on /v1/completions: the prompt's own log-probabilities, checked against plain transformers.

A tiny random Qwen3 with the real Qwen3 tokenizer (byte-level BPE, so text offsets are real character offsets)
and a random LoRA adapter on it, served over HTTP on a free port.
"""

from __future__ import annotations

import http.client
import json

import openai
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from hanzo_gym.engine.token_logprobs import prompt_logprobs
from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.renderers import get_renderer
from hanzo_gym.serve import ServedModels, Server
from hanzo_gym.serve.api import complete
from hanzo_gym.serve.protocol import parse_completion

TEXT_PROMPT = "The café in Zürich serves breakfast until"  # multi-byte characters: offsets count characters
TOKEN_PROMPT = [785, 6722, 315, 9625, 374, 12095, 13, 576]
TOP = 3


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, wide_qwen3_dir) -> str:
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(wide_qwen3_dir)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    directory = tmp_path_factory.mktemp("echo-adapter")
    get_peft_model(model, config).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def references(wide_qwen3_dir, adapter_dir) -> dict:
    """Plain transformers (and peft) models: what the server's numbers must match, by served model name."""
    base = AutoModelForCausalLM.from_pretrained(wide_qwen3_dir, dtype=torch.float32).eval()
    tuned = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(wide_qwen3_dir), adapter_dir
    ).eval()
    return {wide_qwen3_dir: base, "tuned": tuned}


@pytest.fixture(scope="module")
def served(wide_qwen3_dir, adapter_dir):
    models = ServedModels(ModelHost(wide_qwen3_dir, dtype=torch.float32), {"tuned": adapter_dir})
    with Server(models, port=0) as server:
        yield server


def post(server, body: dict) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        connection.request(
            "POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def reference_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """[T-1, vocab]: log-softmax of each position's logits in fp32, the plain full-logits way."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def pieces(tokenizer, tokens: list[int]) -> list[str]:
    return [tokenizer.decode([t], clean_up_tokenization_spaces=False) for t in tokens]


# -- the prompt's own scores ---------------------------------------------------------------------------------
@pytest.mark.parametrize("adapter", [False, True], ids=["base", "adapter"])
def test_echo_scores_each_prompt_token_like_transformers(
    served, references, wide_qwen3_dir, qwen3_tokenizer, adapter
):
    name = "tuned" if adapter else wide_qwen3_dir
    text_tokens = qwen3_tokenizer(TEXT_PROMPT)["input_ids"]
    status, reply = post(
        served,
        {
            "model": name,
            "prompt": [TEXT_PROMPT, TOKEN_PROMPT],
            "echo": True,
            "logprobs": TOP,
            "max_tokens": 0,
        },
    )
    assert status == 200, reply
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert reply["usage"] == {
        "prompt_tokens": len(text_tokens) + len(TOKEN_PROMPT),
        "completion_tokens": 0,
        "total_tokens": len(text_tokens) + len(TOKEN_PROMPT),
    }
    texts = [TEXT_PROMPT, qwen3_tokenizer.decode(TOKEN_PROMPT)]
    for choice, tokens, text in zip(reply["choices"], [text_tokens, TOKEN_PROMPT], texts):
        assert (choice["text"], choice["finish_reason"]) == (text, "length")
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == pieces(qwen3_tokenizer, tokens)
        assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(tokens)
        # Nothing predicts the first token.
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        expected = reference_logprobs(references[name], tokens)
        picked = expected.gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)
        assert logprobs["token_logprobs"][1:] == pytest.approx(picked.tolist(), abs=1e-4)
        for position, top in enumerate(logprobs["top_logprobs"][1:]):
            values, ids = expected[position].topk(TOP)
            wanted = dict(zip(pieces(qwen3_tokenizer, ids.tolist()), values.tolist()))
            wanted.setdefault(logprobs["tokens"][position + 1], picked[position].item())
            assert top == pytest.approx(wanted, abs=1e-4)  # the top 3 and the prompt's own token


def test_the_adapter_changes_the_prompt_scores(served, wide_qwen3_dir):
    body = {"prompt": TOKEN_PROMPT, "echo": True, "logprobs": 0, "max_tokens": 0}
    _, base = post(served, {**body, "model": wide_qwen3_dir})
    _, tuned = post(served, {**body, "model": "tuned"})
    base_values = base["choices"][0]["logprobs"]["token_logprobs"][1:]
    tuned_values = tuned["choices"][0]["logprobs"]["token_logprobs"][1:]
    assert max(abs(a - b) for a, b in zip(base_values, tuned_values)) > 1e-2
    # logprobs 0: no alternatives, only each token's own logprob.
    top = base["choices"][0]["logprobs"]["top_logprobs"]
    assert top[0] is None and all(len(t) == 1 for t in top[1:])


def test_text_offsets_index_the_echoed_text(served, wide_qwen3_dir, qwen3_tokenizer):
    _, reply = post(
        served, {"model": wide_qwen3_dir, "prompt": TEXT_PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}
    )
    logprobs = reply["choices"][0]["logprobs"]
    offsets, tokens = logprobs["text_offset"], logprobs["tokens"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    text = reply["choices"][0]["text"]
    assert any(ord(c) > 127 for c in text)  # the case where bytes and characters differ
    for token, offset in zip(tokens, offsets):
        if "\ufffd" not in token:  # a token holding half a character has no text of its own
            assert text.startswith(token, offset), (token, offset)


# -- echo followed by a completion ---------------------------------------------------------------------------
def test_echo_puts_the_prompt_before_the_completion(served, wide_qwen3_dir, qwen3_tokenizer):
    body = {"model": wide_qwen3_dir, "prompt": TEXT_PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 2}
    _, plain = post(served, body)
    _, echoed = post(served, {**body, "echo": True})
    _, scored = post(served, {**body, "echo": True, "max_tokens": 0})
    completion, choice = plain["choices"][0], echoed["choices"][0]
    prompt_length = len(qwen3_tokenizer(TEXT_PROMPT)["input_ids"])
    assert choice["text"] == TEXT_PROMPT + completion["text"]
    assert choice["finish_reason"] == completion["finish_reason"] == "length"
    assert echoed["usage"] == plain["usage"]
    logprobs = choice["logprobs"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert len(logprobs[key]) == prompt_length + 3
        assert logprobs[key][:prompt_length] == scored["choices"][0]["logprobs"][key], key
    assert logprobs["tokens"][prompt_length:] == completion["logprobs"]["tokens"]
    assert logprobs["token_logprobs"][prompt_length:] == completion["logprobs"]["token_logprobs"]
    assert logprobs["text_offset"][prompt_length:] == [
        len(TEXT_PROMPT) + offset for offset in completion["logprobs"]["text_offset"]
    ]
    # Without logprobs, the text alone.
    _, text_only = post(served, {**body, "echo": True, "logprobs": None})
    assert text_only["choices"][0]["text"] == choice["text"]
    assert text_only["choices"][0]["logprobs"] is None


def test_the_openai_client_reads_an_echo_with_n_choices(served):
    client = openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=60)
    reply = client.completions.create(
        model="tuned", prompt=TOKEN_PROMPT, echo=True, logprobs=1, max_tokens=0, n=2
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].text == reply.choices[1].text
    assert reply.choices[0].logprobs.token_logprobs[0] is None
    assert len(reply.choices[0].logprobs.tokens) == len(TOKEN_PROMPT)


def test_echo_keeps_the_stop_token_that_ended_the_completion(tiny_dir, word_tokenizer):
    """lm-eval asks for one token and drops the last position: when that token is eos, it must be there, or
    the answer's last token would be dropped instead."""
    reference = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    chat = [{"role": "user", "content": "one glad"}]  # its greedy answer ends within a few tokens
    tokens = get_renderer("chat_template", word_tokenizer).build_generation_prompt(chat).to_ints()
    for _ in range(30):  # greedy, until the model's next token is eos
        with torch.no_grad():
            following = int(reference(input_ids=torch.tensor([tokens])).logits[0, -1].argmax())
        if following == word_tokenizer.eos_token_id:
            break
        tokens.append(following)
    assert following == word_tokenizer.eos_token_id, "no prompt found whose next token is eos"
    models = ServedModels(ModelHost(tiny_dir, dtype=torch.float32))
    try:
        body = {"prompt": tokens, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
        choice = complete(models, parse_completion(body))["choices"][0]
    finally:
        models.batcher.close()
    assert choice["finish_reason"] == "stop"
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(tokens) + 1
    assert logprobs["tokens"][-1] == word_tokenizer.eos_token
    assert choice["text"] == word_tokenizer.decode(tokens)  # the stop token is scored, not shown
    assert logprobs["text_offset"][-1] == len(choice["text"])
    expected = reference_logprobs(reference, [*tokens, word_tokenizer.eos_token_id])[-1]
    assert logprobs["token_logprobs"][-1] == pytest.approx(
        expected[word_tokenizer.eos_token_id].item(), abs=1e-4
    )


# -- bad requests ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"prompt": "hi", "echo": "yes"}, "echo", "boolean"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "echo"),
        ({"prompt": "hi", "echo": True, "max_tokens": -1}, "max_tokens", ">= 0"),
        ({"prompt": "hi", "echo": True, "stream": True}, "echo", "stream"),
        ({"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs", "between 0 and 20"),
    ],
    ids=["echo-not-boolean", "max-tokens-0-without-echo", "negative-max-tokens", "stream", "too-many-tops"],
)
def test_bad_echo_requests_get_a_400_naming_the_parameter(served, body, param, says):
    status, reply = post(served, body)
    assert status == 400
    assert reply["error"]["param"] == param and says in reply["error"]["message"], reply
    assert reply["error"]["type"] == "invalid_request_error"


# -- the engine function alone ------------------------------------------------------------------------------
def test_prompt_logprobs_in_chunks_match_the_full_logits(references, wide_qwen3_dir):
    model = references[wide_qwen3_dir]
    expected = reference_logprobs(model, TOKEN_PROMPT)
    for chunk in (2, 3, 1024):  # chunks that do and do not divide the 7 scored positions
        scores = prompt_logprobs(model, TOKEN_PROMPT, top_k=4, chunk=chunk)
        picked = expected.gather(1, torch.tensor(TOKEN_PROMPT[1:])[:, None]).squeeze(1)
        torch.testing.assert_close(scores.logprobs_N, picked, atol=1e-5, rtol=0)
        values, ids = expected.topk(4, dim=-1)
        torch.testing.assert_close(scores.top_logprobs_NK, values, atol=1e-5, rtol=0)
        assert torch.equal(scores.top_ids_NK, ids)
    single = prompt_logprobs(model, TOKEN_PROMPT[:1], top_k=2)
    assert single.logprobs_N.shape == (0,) and single.top_ids_NK.shape == (0, 2)
