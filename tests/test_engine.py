import pytest
import torch
import torch.nn.functional as F
from tiny_models import VOCAB, tiny_model

from hanzo_gym.engine import Engine
from hanzo_gym.engine.token_logprobs import token_logprobs
from hanzo_gym.errors import GymError
from hanzo_gym.model.lora import attach_lora
from hanzo_gym.records import AdamParams, Datum, ModelInput


def _lora(kind="llama", dropout=0.0):
    model = tiny_model(kind)
    peft_model = attach_lora(
        model, r=4, alpha=8, dropout=dropout, target_modules="all-linear", base_model_name="tiny"
    )
    # B starts at zero; give it values so the adapter changes the output in these tests.
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return peft_model


def _datum(tokens, weights=None):
    weights = weights if weights is not None else [1.0] * (len(tokens) - 1)
    return Datum(ModelInput.from_ints(tokens[:-1]), {"target_tokens": tokens[1:], "weights": weights})


def _reference_logprobs(model, tokens):
    """One sequence through the plain transformers forward, full-vocabulary log_softmax."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)


def test_token_logprobs_match_log_softmax_and_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    upstream = torch.randn(37, dtype=torch.float64)
    upstream[::3] = 0  # positions the backward pass must skip

    chunked, entropy = token_logprobs(hidden, weight, targets, chunk=8)
    reference = (hidden @ weight.T).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(chunked, reference.float(), rtol=1e-6, atol=1e-6)
    log_p = (hidden @ weight.T).log_softmax(-1)
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1).float().detach(), rtol=1e-5, atol=1e-5)

    g_hidden, g_weight = torch.autograd.grad((chunked.double() * upstream).sum(), (hidden, weight))
    r_hidden, r_weight = torch.autograd.grad((reference * upstream).sum(), (hidden, weight))
    torch.testing.assert_close(g_hidden, r_hidden, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_weight, r_weight, rtol=1e-5, atol=1e-6)


def test_chunked_cross_entropy_equals_masked_plain_cross_entropy():
    torch.manual_seed(1)
    hidden = torch.randn(64, 16)
    weight = torch.randn(VOCAB, 16)
    targets = torch.randint(0, VOCAB, (64,))
    labels = targets.clone()
    labels[:20] = -100
    weights = (labels != -100).float() / (labels != -100).sum()
    ours = -(token_logprobs(hidden, weight, targets, chunk=7)[0] * weights).sum()
    plain = F.cross_entropy(hidden @ weight.T, labels, ignore_index=-100)
    torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_packed_forward_equals_one_sequence_at_a_time(kind):
    model = _lora(kind)
    engine = Engine(model, logprob_chunk=5)
    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (9, 4, 17)]
    packed = engine.forward([_datum(s) for s in sequences])
    model.eval()
    for tokens, got in zip(sequences, packed):
        torch.testing.assert_close(got, _reference_logprobs(model, tokens), rtol=1e-4, atol=1e-5)


def test_forward_backward_gradient_equals_separate_passes():
    model = _lora()
    engine = Engine(model)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (8, 12)]
    weights = [[0.0] * 3 + [0.1] * (len(s) - 4) for s in seqs]

    out = engine.forward_backward([_datum(s, w) for s, w in zip(seqs, weights)])
    packed_grads = [p.grad.clone() for p in engine.trainable]
    engine.optimizer.zero_grad()

    total = 0.0
    for s, w in zip(seqs, weights):
        logits = model(input_ids=torch.tensor([s[:-1]])).logits[0].float()
        lp = logits.log_softmax(-1).gather(1, torch.tensor(s[1:])[:, None]).squeeze(1)
        loss = -(lp * torch.tensor(w)).sum()
        loss.backward()
        total += loss.item()
    assert out.loss_sum == pytest.approx(total, rel=1e-5)
    for got, want in zip(packed_grads, [p.grad for p in engine.trainable]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_only_lora_parameters_get_gradients_and_move():
    model = _lora()
    frozen_before = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine = Engine(model)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    seq = list(range(3, 20))
    first = engine.forward_backward([_datum(seq)]).loss_sum
    engine.optim_step(AdamParams(learning_rate=1e-2))
    for _ in range(5):
        engine.forward_backward([_datum(seq)])
        engine.optim_step(AdamParams(learning_rate=1e-2))
    assert engine.forward_backward([_datum(seq)]).loss_sum < first
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen_before[n]), n


def test_optim_step_matches_torch_adamw_with_clipping():
    model = _lora()
    reference = [p.detach().clone().requires_grad_() for p in Engine(model).trainable]
    engine = Engine(model)
    seq = list(range(5, 30))
    engine.forward_backward([_datum(seq)])
    for ref, p in zip(reference, engine.trainable):
        ref.grad = p.grad.clone()
    params = AdamParams(
        learning_rate=1e-3, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.01
    )
    stats = engine.optim_step(params)

    norm = torch.nn.utils.clip_grad_norm_(reference, 0.01)
    torch.optim.AdamW(reference, lr=1e-3, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.1).step()
    assert stats["grad_norm"] == pytest.approx(norm.item(), rel=1e-5)
    for ref, p in zip(reference, engine.trainable):
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-5, atol=1e-7)
        assert p.grad is None


def test_bad_datums_are_named():
    engine = Engine(_lora())
    with pytest.raises(GymError, match="needs loss_fn_inputs\\[`weights`\\]"):
        engine.forward_backward([Datum(ModelInput.from_ints([1, 2]), {"target_tokens": [2, 3]})])
    with pytest.raises(GymError, match="unknown loss_fn"):
        engine.forward_backward([_datum([1, 2, 3])], loss_fn="nope")
    with pytest.raises(
        GymError, match="datum 0: loss_fn_inputs\\[`weights`\\] has shape \\(1,\\), but model_input has 2"
    ):
        engine.forward_backward(
            [Datum(ModelInput.from_ints([1, 2]), {"target_tokens": [2, 3], "weights": [1.0]})]
        )


def test_passes_split_by_token_budget_and_accumulate_the_same_gradient():
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (8, 12, 5, 30)]
    datums = [_datum(s, [0.05] * (len(s) - 1)) for s in seqs]
    results = []
    for budget in (1000, 16):
        engine = Engine(_lora(), max_tokens_per_pass=budget)
        assert [len(group) for group in engine._passes(datums)] == ([4] if budget == 1000 else [1, 2, 1])
        out = engine.forward_backward(datums)
        results.append((out.loss_sum, out.logprobs, [p.grad.clone() for p in engine.trainable]))
    (loss_a, lp_a, grads_a), (loss_b, lp_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    for a, b in zip(lp_a, lp_b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_reference_forward_disables_the_adapter():
    model = _lora()
    engine = Engine(model)
    tokens = list(range(3, 20))
    datum = _datum(tokens)
    with model.disable_adapter():
        base = _reference_logprobs(model, tokens)
    torch.testing.assert_close(engine.forward([datum], reference=True)[0], base, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(engine.forward([datum])[0], base, atol=1e-4)
    # and the adapter is active again afterwards
    torch.testing.assert_close(
        engine.forward([datum])[0], _reference_logprobs(model, tokens), rtol=1e-4, atol=1e-5
    )


def test_architectures_that_ignore_packing_get_one_datum_per_pass():
    from transformers import AutoModelForCausalLM, OPTConfig

    torch.manual_seed(0)
    opt = AutoModelForCausalLM.from_config(
        OPTConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=32,
            max_position_embeddings=64,
        )
    )
    with pytest.warns(UserWarning, match="one datum per pass"):
        engine = Engine(
            attach_lora(opt, r=4, alpha=8, dropout=0.0, target_modules="all-linear", base_model_name="opt")
        )
    assert not engine.packs_datums
    seqs = [list(range(3, 12)), list(range(20, 26))]
    assert [len(g) for g in engine._passes([_datum(s) for s in seqs])] == [1, 1]
    opt.eval()  # OPT has dropout: compare in eval mode, as engine.forward scores
    references = [_reference_logprobs(opt, tokens) for tokens in seqs]
    for want, got in zip(references, engine.forward([_datum(s) for s in seqs])):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert Engine(_lora("qwen3")).packs_datums and Engine(_lora("llama")).packs_datums


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_datums_sharing_a_prompt_score_and_train_as_if_alone(kind):
    g = torch.Generator().manual_seed(9)
    prompt_a = torch.randint(3, VOCAB, (20,), generator=g).tolist()
    prompt_b = torch.randint(3, VOCAB, (18,), generator=g).tolist()
    tails = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 1, 7, 4)]
    seqs = [
        prompt_a + tails[0],
        prompt_a + tails[1],
        prompt_a + tails[2],
        prompt_b + tails[3],
        prompt_b + tails[4],
    ]
    weights = [[0.0] * (len(s) - 1 - 3) + [0.2] * 3 for s in seqs]
    datums = [_datum(s, w) for s, w in zip(seqs, weights)]

    shared = Engine(_lora(kind), max_tokens_per_pass=10_000)
    from hanzo_gym.engine.prefix_sharing import shared_layout

    layout = shared_layout([d.model_input.to_ints() for d in datums], torch.device("cpu"))
    assert layout is not None and len(layout.tokens) == 20 + 5 + 9 + 1 + 18 + 7 + 4 - 5  # each prompt once
    out = shared.forward_backward(datums)
    shared_grads = [p.grad.clone() for p in shared.trainable]

    alone = Engine(_lora(kind), max_tokens_per_pass=1)  # one datum per pass: nothing shared
    reference = alone.forward_backward(datums)
    assert out.loss_sum == pytest.approx(reference.loss_sum, rel=1e-5)
    for a, b in zip(out.logprobs, reference.logprobs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(shared_grads, [p.grad for p in alone.trainable]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("shared_prompt", [True, False])
def test_scored_from_skips_the_prompts_logits_and_changes_no_loss_or_gradient(shared_prompt, monkeypatch):
    """Per datum, positions before `scored_from` come back as 0 and the output layer never sees them; what a
    loss reads after them, and the gradients, are those of scoring everything (custom losses and RL ones)."""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, VOCAB, (20,), generator=g).tolist()
    other = torch.randint(3, VOCAB, (20,), generator=g).tolist()
    tails = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (6, 4, 5)]
    seqs = [prompt + tails[0], (prompt if shared_prompt else other) + tails[1], other + tails[2]]
    starts = [19, 19, 0]  # the last datum is scored whole (ORPO's chosen)
    advantages = [[0.0] * start + [0.5] * (len(s) - 1 - start) for s, start in zip(seqs, starts)]
    datums = [
        Datum(
            ModelInput.from_ints(s[:-1]),
            {"target_tokens": s[1:], "logprobs": [-1.0] * (len(s) - 1), "advantages": a},
        )
        for s, a in zip(seqs, advantages)
    ]

    def completion_loss(logprobs):
        return sum(lp[start:].sum() for lp, start in zip(logprobs, starts)), {}

    import hanzo_gym.engine.engine as engine_module

    head_rows = []  # the positions the output layer computes logits for, per pass
    original = engine_module.token_logprobs
    monkeypatch.setattr(
        engine_module,
        "token_logprobs",
        lambda hidden, *rest: head_rows.append(len(hidden)) or original(hidden, *rest),
    )
    engine = Engine(_lora(), max_tokens_per_pass=10_000)
    results = {}
    for scored_from in (None, starts):
        head_rows.clear()
        run = {"forward": engine.forward(datums, scored_from=scored_from)}
        engine.forward_backward_custom(datums, completion_loss, scored_from=scored_from)
        run["custom grads"] = [p.grad.clone() for p in engine.trainable]
        engine.optimizer.zero_grad(set_to_none=True)
        run["rl"] = engine.forward_backward(datums, "importance_sampling", scored_from=scored_from)
        run["rl grads"] = [p.grad.clone() for p in engine.trainable]
        engine.optimizer.zero_grad(set_to_none=True)
        run["head rows"] = list(head_rows)
        results[scored_from is not None] = run
    every, skipping = results[False], results[True]
    assert every["head rows"] == [sum(len(s) - 1 for s in seqs)] * 3
    assert skipping["head rows"] == [sum(len(s) - 1 - start for s, start in zip(seqs, starts))] * 3
    for a, b, start in zip(every["forward"], skipping["forward"], starts):
        torch.testing.assert_close(b[start:], a[start:], rtol=1e-5, atol=1e-6)
        assert not b[:start].any()
    assert skipping["rl"].loss_sum == pytest.approx(every["rl"].loss_sum, rel=1e-5)
    for name in ("custom grads", "rl grads"):
        for a, b in zip(every[name], skipping[name]):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
