import pytest
import torch
from peft.tuners.lora import LoraLayer
from tiny_models import tiny_model

from hanzo_gym.engine import Engine
from hanzo_gym.engine.sampling import sample_groups
from hanzo_gym.model.lora import attach_lora
from hanzo_gym.records import Datum, ModelInput, SamplingParams


@pytest.fixture(params=["llama", "qwen3"])
def policy(request, word_tokenizer):
    model = tiny_model(
        request.param, vocab_size=len(word_tokenizer), eos_token_id=word_tokenizer.eos_token_id
    )
    peft_model = attach_lora(
        model, r=4, alpha=8, dropout=0.0, target_modules="all-linear", base_model_name="t"
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return peft_model


PROMPTS = [[5, 9, 11], [7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24]]


def _greedy_without_cache(model, prompt, max_tokens, eos):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            nxt = int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax())
            tokens.append(nxt)
            if nxt == eos:
                break
    return tokens[len(prompt) :]


def test_greedy_sampling_equals_full_forward_greedy(policy, word_tokenizer):
    groups = sample_groups(policy, word_tokenizer, PROMPTS, 2, SamplingParams(max_tokens=12, temperature=0))
    policy.eval()
    for prompt, group in zip(PROMPTS, groups):
        expected = _greedy_without_cache(policy, prompt, 12, word_tokenizer.eos_token_id)
        assert [s.tokens for s in group] == [expected, expected]
        assert group[0].stop_reason == ("stop" if expected[-1] == word_tokenizer.eos_token_id else "length")


def test_sampled_logprobs_equal_recomputed_logprobs(policy, word_tokenizer):
    groups = sample_groups(policy, word_tokenizer, PROMPTS, 3, SamplingParams(max_tokens=10, seed=1))
    engine = Engine(policy)
    datums, expected = [], []
    for prompt, group in zip(PROMPTS, groups):
        for sequence in group:
            full = prompt + sequence.tokens
            datums.append(Datum(ModelInput.from_ints(full[:-1]), {"target_tokens": full[1:]}))
            expected.append(sequence.logprobs)
    for datum, logprobs, want in zip(datums, engine.forward(datums), expected):
        torch.testing.assert_close(logprobs[-len(want) :], torch.tensor(want), rtol=1e-4, atol=1e-4)


def test_seeded_sampling_is_reproducible(policy, word_tokenizer):
    params = SamplingParams(max_tokens=8, seed=123, temperature=1.0)
    first = sample_groups(policy, word_tokenizer, PROMPTS, 4, params)
    again = sample_groups(policy, word_tokenizer, PROMPTS, 4, params)
    other = sample_groups(policy, word_tokenizer, PROMPTS, 4, SamplingParams(max_tokens=8, seed=7))
    tokens = lambda groups: [[s.tokens for s in g] for g in groups]
    assert tokens(first) == tokens(again)
    assert tokens(first) != tokens(other)
    assert len({tuple(s.tokens) for s in first[0]}) > 1  # samples of one group differ


def test_first_token_frequencies_follow_temperature_and_top_k(policy, word_tokenizer):
    prompt = [5, 9, 11]
    policy.eval()
    with torch.no_grad():
        logits = policy(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    top = torch.topk(logits, 4)
    expected = dict(zip(top.indices.tolist(), (top.values / 0.7).softmax(-1).tolist()))
    params = SamplingParams(max_tokens=1, temperature=0.7, top_k=4, seed=0)
    [group] = sample_groups(policy, word_tokenizer, [prompt], 4000, params)
    counts = torch.bincount(torch.tensor([s.tokens[0] for s in group]), minlength=len(logits))
    assert set(counts.nonzero().flatten().tolist()) <= set(expected)
    for token, probability in expected.items():
        assert counts[token].item() / 4000 == pytest.approx(probability, abs=0.03)
    # the sampled logprobs are the raw model's, not the tempered distribution's
    raw = logits.log_softmax(-1)
    assert group[0].logprobs[0] == pytest.approx(raw[group[0].tokens[0]].item(), abs=1e-4)


def test_top_p_keeps_the_nucleus(policy, word_tokenizer):
    prompt = [7, 8, 9]
    policy.eval()
    with torch.no_grad():
        probs = policy(input_ids=torch.tensor([prompt])).logits[0, -1].float().softmax(-1)
    ranked = torch.argsort(probs, descending=True)
    covered = probs[ranked].cumsum(0)
    nucleus = set(ranked[: int((covered < 0.5).sum()) + 1].tolist())
    [group] = sample_groups(
        policy, word_tokenizer, [prompt], 500, SamplingParams(max_tokens=1, top_p=0.5, seed=3)
    )
    assert {s.tokens[0] for s in group} <= nucleus


def test_stops_by_token_id_and_by_string_include_the_stop(policy, word_tokenizer):
    [[greedy]] = sample_groups(
        policy, word_tokenizer, [PROMPTS[1]], 1, SamplingParams(max_tokens=10, temperature=0)
    )
    assert greedy.stop_reason == "length" and len(greedy.tokens) == 10
    target = greedy.tokens[4]
    cut = greedy.tokens.index(target) + 1
    [[by_id]] = sample_groups(
        policy, word_tokenizer, [PROMPTS[1]], 1, SamplingParams(max_tokens=10, temperature=0, stop=[target])
    )
    assert by_id.tokens == greedy.tokens[:cut] and by_id.stop_reason == "stop"
    word = word_tokenizer.decode([target])
    [[by_string]] = sample_groups(
        policy, word_tokenizer, [PROMPTS[1]], 1, SamplingParams(max_tokens=10, temperature=0, stop=word)
    )
    assert by_string.tokens == greedy.tokens[:cut] and by_string.stop_reason == "stop"


def test_sampling_leaves_the_base_weights_bit_exact_and_the_adapter_on(policy, word_tokenizer):
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    switches = [m.disable_adapters for m in policy.modules() if isinstance(m, LoraLayer)]
    sample_groups(policy, word_tokenizer, PROMPTS, 2, SamplingParams(max_tokens=4, seed=0))
    after = dict(policy.named_parameters())
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert torch.equal(value, after[name]), name
    assert [m.disable_adapters for m in policy.modules() if isinstance(m, LoraLayer)] == switches
    assert switches and not any(switches)  # every LoRA layer is on again


def test_models_with_scaled_logits_sample_from_their_own_head(word_tokenizer):
    """Granite divides its logits by `logits_scaling`: the sampler must go through the model's own head."""
    from transformers import AutoModelForCausalLM, GraniteConfig

    torch.manual_seed(0)
    config = GraniteConfig(
        vocab_size=len(word_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=word_tokenizer.eos_token_id,
        logits_scaling=4.0,
        initializer_range=0.2,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt = PROMPTS[1]
    [[greedy]] = sample_groups(
        model, word_tokenizer, [prompt], 1, SamplingParams(max_tokens=6, temperature=0)
    )
    assert greedy.tokens == _greedy_without_cache(model, prompt, 6, word_tokenizer.eos_token_id)
    full = prompt + greedy.tokens
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([full[:-1]])).logits[0].log_softmax(-1)
    want = logits.gather(1, torch.tensor(full[1:])[:, None]).squeeze(1)[-len(greedy.tokens) :]
    torch.testing.assert_close(torch.tensor(greedy.logprobs), want, rtol=1e-4, atol=1e-4)


def test_cancelled_prompts_stop_decoding_and_leave_the_others_untouched(policy, word_tokenizer):
    params = SamplingParams(max_tokens=10, temperature=0)
    alone = sample_groups(policy, word_tokenizer, PROMPTS, 2, params)
    asked = []

    def cancel_prompt_zero_from_step_three() -> list[int]:
        asked.append(1)
        return [0] if len(asked) > 3 else []

    groups = sample_groups(
        policy, word_tokenizer, PROMPTS, 2, params, cancelled_prompts=cancel_prompt_zero_from_step_three
    )
    assert [len(s.tokens) for s in groups[0]] == [min(3, len(s.tokens)) for s in alone[0]]
    for got, want in zip(groups[1:], alone[1:]):  # same tokens; the scores up to the batch's float rounding
        assert [s.tokens for s in got] == [s.tokens for s in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-5
            )
