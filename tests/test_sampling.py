import pytest
import torch
from peft.tuners.lora import LoraLayer
from tiny_models import tiny_model
from transformers.cache_utils import DynamicLayer

from hanzo_gym.engine import Engine
from hanzo_gym.engine.decoding import GrowingLayer, decoding
from hanzo_gym.engine.sampling import DecodeBatch, Prompt, sample_groups
from hanzo_gym.errors import GymError
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


def test_eos_ends_a_sample_unless_stop_is_an_empty_list(policy, word_tokenizer):
    """Tinker's rule: `stop=None` keeps the tokenizer's EOS as a stop, a stop list adds to it, `stop=[]`
    samples to max_tokens."""
    import copy

    [[greedy]] = sample_groups(
        policy, word_tokenizer, [PROMPTS[1]], 1, SamplingParams(max_tokens=10, temperature=0)
    )
    assert greedy.stop_reason == "length"
    eos = greedy.tokens[4]
    cut = greedy.tokens.index(eos) + 1
    tokenizer = copy.deepcopy(word_tokenizer)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    assert tokenizer.eos_token_id == eos

    def greedy_with(stop):
        params = SamplingParams(max_tokens=10, temperature=0, stop=stop)
        [[sample]] = sample_groups(policy, tokenizer, [PROMPTS[1]], 1, params)
        return sample.tokens, sample.stop_reason

    assert greedy_with(None) == (greedy.tokens[:cut], "stop")
    assert greedy_with([PROMPTS[0][0]]) == (greedy.tokens[:cut], "stop")
    assert greedy_with([]) == (greedy.tokens, "length")


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


def _decode_alone(policy, tokenizer, prompt: Prompt) -> list:
    [group] = sample_groups(policy, tokenizer, [prompt.tokens], prompt.num_samples, prompt.params)
    return group


def _assert_same_samples(got, want):
    """Same tokens and stop reasons; the scores equal up to the float rounding of another batch shape."""
    assert [(s.tokens, s.stop_reason) for s in got] == [(s.tokens, s.stop_reason) for s in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-5)


def test_rows_that_join_a_running_batch_decode_as_they_would_alone(policy, word_tokenizer):
    greedy = SamplingParams(max_tokens=12, temperature=0)
    first = Prompt(PROMPTS[0], 2, greedy)
    # Joining later, with a longer prompt (the running cache is padded), its own limit and its own stop token.
    second = Prompt(PROMPTS[1], 1, SamplingParams(max_tokens=5, temperature=0))
    stop_at = _decode_alone(policy, word_tokenizer, Prompt(PROMPTS[2], 1, greedy))[0].tokens[3]
    third = Prompt(PROMPTS[2], 3, SamplingParams(max_tokens=9, temperature=0, stop=[stop_at]))
    with decoding(policy):
        batch = DecodeBatch(policy, word_tokenizer)
        [first_job] = batch.add([first])
        finished = []
        for _ in range(3):
            finished += batch.step()
        second_job, third_job = batch.add([second, third])
        assert batch.rows == 6
        while batch.live_rows:
            finished += batch.step()
    assert set(finished) == {first_job, second_job, third_job}
    for job in (first_job, second_job, third_job):
        _assert_same_samples(job.sequences, _decode_alone(policy, word_tokenizer, job.prompt))
    assert third_job.sequences[0].stop_reason == "stop" and len(third_job.sequences[0].tokens) <= 4
    assert [len(s.tokens) for s in second_job.sequences] == [5]


def test_a_greedy_row_beside_sampled_rows_stays_greedy(policy, word_tokenizer):
    greedy = Prompt(PROMPTS[1], 1, SamplingParams(max_tokens=8, temperature=0))
    sampled = Prompt(PROMPTS[0], 4, SamplingParams(max_tokens=8, temperature=1.0, top_k=5, top_p=0.9))
    with decoding(policy):
        batch = DecodeBatch(policy, word_tokenizer, seed=0)
        greedy_job, sampled_job = batch.add([greedy, sampled])
        while batch.live_rows:
            batch.step()
    _assert_same_samples(greedy_job.sequences, _decode_alone(policy, word_tokenizer, greedy))
    assert len({tuple(s.tokens) for s in sampled_job.sequences}) > 1


def test_finished_rows_leave_and_take_the_padding_only_they_needed(policy, word_tokenizer):
    long_prompt = Prompt([5, 9, 11, 7] * 10, 1, SamplingParams(max_tokens=2, temperature=0))
    short = [Prompt(PROMPTS[0], 1, SamplingParams(max_tokens=10, temperature=0)) for _ in range(2)]
    with decoding(policy):
        batch = DecodeBatch(policy, word_tokenizer)
        jobs = batch.add([long_prompt, *short])
        widths = []
        while batch.live_rows:
            batch.step()
            widths.append(batch._mask.shape[1] if batch.live_rows else 0)
    # The 40-token prompt left after 2 tokens: the two short rows go on in a cache sized for themselves.
    assert widths[1] < len(long_prompt.tokens) and widths[-2] <= len(PROMPTS[0]) + 10
    for job in jobs:
        _assert_same_samples(job.sequences, _decode_alone(policy, word_tokenizer, job.prompt))


def test_dropped_rows_stop_decoding_and_leave_the_others_untouched(policy, word_tokenizer):
    params = SamplingParams(max_tokens=10, temperature=0)
    alone = sample_groups(policy, word_tokenizer, PROMPTS, 2, params)
    with decoding(policy):
        batch = DecodeBatch(policy, word_tokenizer)
        jobs = batch.add([Prompt(p, 2, params) for p in PROMPTS])
        for _ in range(3):
            batch.step()
        batch.drop(jobs[0])
        while batch.live_rows:
            batch.step()
    assert not jobs[0].done and all(job.done for job in jobs[1:])
    for got, want in zip(jobs[1:], alone[1:]):
        _assert_same_samples(got.sequences, want)


def test_a_prompt_that_cannot_be_decoded_is_refused_before_the_batch_changes(policy, word_tokenizer):
    with decoding(policy):
        batch = DecodeBatch(policy, word_tokenizer)
        batch.add([Prompt(PROMPTS[0], 1, SamplingParams(max_tokens=3))])
        context = policy.config.max_position_embeddings
        with pytest.raises(GymError, match="fills the model's context"):
            batch.add([Prompt(PROMPTS[1], 1, SamplingParams()), Prompt([5] * context, 1, SamplingParams())])
        with pytest.raises(GymError, match="temperature must be >= 0"):
            batch.add([Prompt(PROMPTS[1], 1, SamplingParams(temperature=-1))])
        assert batch.rows == 1


def test_the_growing_cache_layer_appends_in_place_and_reads_like_a_plain_one():
    plain, growing = DynamicLayer(), GrowingLayer()
    torch.manual_seed(0)
    buffers = set()
    for length in (5, 1, 1, 1, 1, 1, 1, 1, 1, 3):
        keys, values = torch.randn(2, 3, length, 4), torch.randn(2, 3, length, 4)
        want = plain.update(keys, values)
        got = growing.update(keys, values)
        assert all(torch.equal(w, g) for w, g in zip(want, got))
        buffers.add(growing._keys.data_ptr())
    assert len(buffers) <= 3  # grown twice at most over 16 positions, never copied per step
    growing.batch_select_indices(torch.tensor([1, 1, 0]))  # what merges and repeats do
    plain.batch_select_indices(torch.tensor([1, 1, 0]))
    growing.values = growing.values[..., 2:, :]  # assigning one side leaves the other as it was
    assert torch.equal(growing.keys, plain.keys) and torch.equal(growing.values, plain.values[..., 2:, :])
