"""Preference losses against TRL 1.16's own code, on the same batch.

Where TRL computes a loss inside a trainer method that also runs the model, the test builds the trainer with
`object.__new__` and the attributes the method reads, and hands it a stand-in model that returns the per-token
log-probabilities of the batch (zero off the completion, as TRL's fused LM head does for `-100` labels). So TRL's
real reduction, loss and metric code runs on our numbers. Where TRL 1.16 keeps them:
- DPO (sigmoid, ipo, sft = RPO's NLL, use_weighting): `trl.trainer.dpo_trainer.DPOTrainer._compute_loss`.
- SimPO: CPO moved to `trl.experimental.cpo.CPOTrainer` (`cpo_loss`, `get_batch_loss_metrics`).
- ORPO: moved to `trl.experimental.orpo.ORPOTrainer` (`odds_ratio_loss`, `get_batch_loss_metrics`).
- KTO: still stable, `trl.trainer.kto_trainer.KTOTrainer._compute_loss`.
TRL 1.16's DPO `sigmoid` ignores `label_smoothing`; its cDPO formula survives in `aot`, which sorts the batch's
log-ratios, so on a batch of one pair it is exactly cDPO: label smoothing is checked pair by pair against it.
"""

from __future__ import annotations

import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from tiny_models import VOCAB, tiny_model

from hanzo_gym.engine import Engine
from hanzo_gym.engine import preference_losses as pl
from hanzo_gym.records import Datum, ModelInput

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
trl_kto = pytest.importorskip("trl.trainer.kto_trainer")
trl_cpo = pytest.importorskip("trl.experimental.cpo")
trl_orpo = pytest.importorskip("trl.experimental.orpo")

RTOL = 1e-5
PAIR_METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"]
PAIR_METRICS += ["logps/chosen", "logps/rejected"]


def _relative_difference(ours: float, theirs: float) -> float:
    # Values that are zero in both (an accuracy of 0, a margin of exactly 0) count as equal.
    return abs(ours - theirs) / max(abs(theirs), 1e-12) if ours != theirs else 0.0


def _assert_close_to_trl(ours: float, theirs: float, what: str) -> None:
    difference = _relative_difference(float(ours), float(theirs))
    print(f"max-rel {what}: {difference:.3e}")  # `pytest -s` shows the measured parity
    assert difference <= RTOL, f"{what}: ours {ours} vs TRL {theirs} (relative {difference:.2e})"


# -- batches --------------------------------------------------------------------------------------------------


def _random_sequences(
    generator: torch.Generator, count: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` right-padded rows: completion_mask [count, width] (a prompt of 2–4 tokens, then 2+ completion
    tokens, then padding) and per-token log-probs [count, width-1] aligned to TRL's shifted labels, zero off the
    completion."""
    completion_mask = torch.zeros(count, width, dtype=torch.long)
    for row in range(count):
        prompt = int(torch.randint(2, 5, (1,), generator=generator))
        end = int(torch.randint(prompt + 2, width + 1, (1,), generator=generator))
        completion_mask[row, prompt:end] = 1
    per_token_logps = -3 * torch.rand(count, width - 1, generator=generator) * completion_mask[:, 1:]
    return completion_mask, per_token_logps


class _ScoredModel:
    """Stands in for a model patched with TRL's fused LM head: each call returns the per-token fields registered
    for the `input_ids` it receives."""

    training = True

    def __init__(self) -> None:
        self.outputs: list[tuple[torch.Tensor, SimpleNamespace]] = []

    def register(self, input_ids, log_probs, log_sum_sq_probs=None) -> None:
        zeros = torch.zeros_like(log_probs)
        fields = SimpleNamespace(
            log_probs=log_probs,
            entropy=zeros,
            mean_logits=zeros,
            is_top1=zeros.bool(),
            log_sum_sq_probs=log_sum_sq_probs if log_sum_sq_probs is not None else zeros,
        )
        self.outputs.append((input_ids, fields))

    def __call__(self, input_ids, labels=None, fused_lm_head=False, **kwargs):
        assert fused_lm_head
        return next(fields for ids, fields in self.outputs if torch.equal(ids, input_ids))


def _accelerator() -> SimpleNamespace:
    return SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t)


# -- DPO ------------------------------------------------------------------------------------------------------


def _trl_dpo(batch: dict, *, beta, loss_types, loss_weights=None, label_smoothing=0.0, use_weighting=False):
    """TRL's DPOTrainer._compute_loss on one [chosen; rejected] batch with precomputed reference log-probs."""
    model = _ScoredModel()
    model.register(batch["input_ids"], batch["per_token_logps"], batch.get("log_sum_sq_probs"))
    trainer = object.__new__(trl_dpo.DPOTrainer)
    trainer.model = model
    trainer.accelerator = _accelerator()
    trainer.aux_loss_enabled = False
    trainer.ld_alpha = None
    trainer.precompute_ref_logps = True
    trainer.f_divergence_type = "reverse_kl"
    trainer.loss_types = loss_types
    trainer.loss_weights = loss_weights or [1.0] * len(loss_types)
    trainer.beta = beta
    trainer.label_smoothing = label_smoothing
    trainer.use_weighting = use_weighting
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._total_train_tokens = 0
    trainer._tp_size = 1
    inputs = {
        "input_ids": batch["input_ids"],
        "attention_mask": torch.ones_like(batch["input_ids"]),
        "completion_mask": batch["completion_mask"],
        "ref_chosen_logps": batch["ref_chosen_logps"],
        "ref_rejected_logps": batch["ref_rejected_logps"],
    }
    loss = trainer._compute_loss(model, inputs, return_outputs=False)
    return loss, {key: values[-1] for key, values in trainer._metrics["train"].items()}


def _pair_batch(per_token_logps, completion_mask, ref_chosen, ref_rejected, log_sum_sq_probs=None) -> dict:
    """A TRL-layout batch (chosen rows, then rejected rows) and our per-sequence inputs from the same numbers."""
    pairs = completion_mask.shape[0] // 2
    sums = per_token_logps.sum(1)
    lengths = completion_mask.sum(1)
    batch = {
        "input_ids": torch.randint(
            3, VOCAB, completion_mask.shape, generator=torch.Generator().manual_seed(7)
        ),
        "completion_mask": completion_mask,
        "per_token_logps": per_token_logps,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
        "ours": {
            "policy_chosen_logps_B": sums[:pairs],
            "policy_rejected_logps_B": sums[pairs:],
            "ref_chosen_logps_B": ref_chosen,
            "ref_rejected_logps_B": ref_rejected,
            "chosen_lengths_B": lengths[:pairs],
            "rejected_lengths_B": lengths[pairs:],
        },
    }
    if log_sum_sq_probs is not None:
        batch["log_sum_sq_probs"] = log_sum_sq_probs
        aligned = ((per_token_logps - log_sum_sq_probs) * completion_mask[:, 1:]).sum(1)
        batch["ours"]["chosen_wpo_logps_B"] = aligned[:pairs]
        batch["ours"]["rejected_wpo_logps_B"] = aligned[pairs:]
    return batch


def _random_pair_batch(seed: int, pairs: int = 6, width: int = 14, weighting: bool = False) -> dict:
    generator = torch.Generator().manual_seed(seed)
    completion_mask, per_token_logps = _random_sequences(generator, 2 * pairs, width)
    sums = per_token_logps.sum(1)
    # The reference near the policy, as after a few steps: log-ratios of both signs, rewards of mixed order.
    ref = sums + torch.randn(2 * pairs, generator=generator)
    # log Σ_v π(v)² is at most 0 and near the log-prob of a peaked token: keep the WPO weights in (0, 1].
    log_sum_sq = (
        per_token_logps - torch.rand(per_token_logps.shape, generator=generator) if weighting else None
    )
    return _pair_batch(per_token_logps, completion_mask, ref[:pairs], ref[pairs:], log_sum_sq)


def _compare_dpo(batch, ours: pl.PreferenceLoss, theirs, what: str) -> None:
    trl_loss, trl_metrics = theirs
    _assert_close_to_trl(ours.loss.item(), trl_loss.item(), f"{what} loss")
    for key in PAIR_METRICS:
        _assert_close_to_trl(ours.metrics[key], trl_metrics[key], f"{what} {key}")


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_sigmoid_equals_trl(seed, beta):
    batch = _random_pair_batch(seed)
    ours = pl.dpo_loss(**batch["ours"], beta=beta)
    _compare_dpo(batch, ours, _trl_dpo(batch, beta=beta, loss_types=["sigmoid"]), "dpo sigmoid")


def test_dpo_sigmoid_gradient_equals_trl():
    batch = _random_pair_batch(3)
    leaf = batch["per_token_logps"].clone().requires_grad_()
    batch["per_token_logps"] = leaf
    trl_loss, _ = _trl_dpo(batch, beta=0.2, loss_types=["sigmoid"])
    (trl_grad,) = torch.autograd.grad(trl_loss, leaf)
    sums = leaf.sum(1)
    pairs = sums.shape[0] // 2
    inputs = {**batch["ours"], "policy_chosen_logps_B": sums[:pairs], "policy_rejected_logps_B": sums[pairs:]}
    (our_grad,) = torch.autograd.grad(pl.dpo_loss(**inputs, beta=0.2).loss, leaf)
    assert trl_grad.abs().max() > 0
    torch.testing.assert_close(our_grad, trl_grad, rtol=RTOL, atol=1e-8)


@pytest.mark.parametrize("label_smoothing", [0.1, 0.3])
def test_dpo_label_smoothing_is_cdpo_as_trl_computes_it_for_one_pair(label_smoothing):
    batch = _random_pair_batch(4, pairs=5)
    ours = pl.dpo_loss(**batch["ours"], beta=0.1, label_smoothing=label_smoothing)
    pairs = batch["completion_mask"].shape[0] // 2
    trl_losses = []
    for pair in range(pairs):
        rows = torch.tensor([pair, pairs + pair])
        single = _pair_batch(
            batch["per_token_logps"][rows],
            batch["completion_mask"][rows],
            batch["ref_chosen_logps"][pair : pair + 1],
            batch["ref_rejected_logps"][pair : pair + 1],
        )
        loss, _ = _trl_dpo(single, beta=0.1, loss_types=["aot"], label_smoothing=label_smoothing)
        trl_losses.append(loss)
    _assert_close_to_trl(ours.loss.item(), torch.stack(trl_losses).mean().item(), "cdpo loss")
    # and it really is smoothed: not the plain sigmoid loss
    assert abs(ours.loss.item() - pl.dpo_loss(**batch["ours"], beta=0.1).loss.item()) > 1e-3


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_ipo_equals_trl(beta):
    batch = _random_pair_batch(5)
    ours = pl.dpo_loss(**batch["ours"], beta=beta, loss_type="ipo")
    _compare_dpo(batch, ours, _trl_dpo(batch, beta=beta, loss_types=["ipo"]), "ipo")


@pytest.mark.parametrize("rpo_alpha", [0.5, 1.0])
def test_rpo_equals_trl_sigmoid_plus_weighted_sft(rpo_alpha):
    batch = _random_pair_batch(6)
    ours = pl.dpo_loss(**batch["ours"], beta=0.1, rpo_alpha=rpo_alpha)
    theirs = _trl_dpo(batch, beta=0.1, loss_types=["sigmoid", "sft"], loss_weights=[1.0, rpo_alpha])
    _compare_dpo(batch, ours, theirs, "rpo")
    assert ours.loss.item() > pl.dpo_loss(**batch["ours"], beta=0.1).loss.item()  # the NLL term is in


def test_wpo_weighting_equals_trl_use_weighting():
    batch = _random_pair_batch(7, weighting=True)
    ours = pl.dpo_loss(**batch["ours"], beta=0.1)
    _compare_dpo(batch, ours, _trl_dpo(batch, beta=0.1, loss_types=["sigmoid"], use_weighting=True), "wpo")
    unweighted = {k: v for k, v in batch["ours"].items() if "wpo" not in k}
    assert abs(ours.loss.item() - pl.dpo_loss(**unweighted, beta=0.1).loss.item()) > 1e-3


def test_trl_cannot_weight_rpo_yet():
    # TRL 1.16 multiplies the expanded (stride-0) sft loss in place: RPO with WPO weighting raises there, so our
    # weighted NLL term (TRL's evident intent: mean of w·NLL) has no TRL number to match. When this starts
    # failing, TRL runs the combination: compare `dpo_loss(..., rpo_alpha=α)` with WPO inputs against it.
    batch = _random_pair_batch(7, weighting=True)
    with pytest.raises(RuntimeError, match="memory location"):
        _trl_dpo(batch, beta=0.1, loss_types=["sigmoid", "sft"], loss_weights=[1.0, 1.0], use_weighting=True)


def test_dpo_refuses_what_it_cannot_compute():
    batch = _random_pair_batch(8)
    without_lengths = {k: v for k, v in batch["ours"].items() if "lengths" not in k}
    with pytest.raises(ValueError, match="lengths"):
        pl.dpo_loss(**without_lengths, loss_type="ipo")
    with pytest.raises(ValueError, match="loss_type"):
        pl.dpo_loss(**batch["ours"], loss_type="hinge")


# -- DPO on log-probs a tiny model scored through our engine ---------------------------------------------------


def _engine_scored_pairs(pairs: int = 4):
    """Chosen and rejected completions of shared prompts, scored by the engine under a policy and a reference
    (two tiny models with different weights); per-token log-probs laid out as TRL's padded batch."""
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (3 + p % 3,), generator=generator) for p in range(pairs)]
    completions = [torch.randint(3, VOCAB, (2 + (i * 5) % 7,), generator=generator) for i in range(2 * pairs)]
    sequences = [torch.cat([prompts[i % pairs], completions[i]]).tolist() for i in range(2 * pairs)]
    prompt_lengths = [len(prompts[i % pairs]) for i in range(2 * pairs)]
    datums = [Datum(ModelInput.from_ints(s[:-1]), {"target_tokens": s[1:]}) for s in sequences]
    policy_model, reference_model = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    policy, reference = Engine(policy_model).forward(datums), Engine(reference_model).forward(datums)

    width = max(len(s) for s in sequences)
    completion_mask = torch.zeros(2 * pairs, width, dtype=torch.long)
    policy_per_token = torch.zeros(2 * pairs, width - 1)
    log_sum_sq = torch.zeros(2 * pairs, width - 1)
    ref_sums = torch.zeros(2 * pairs)
    for row, (sequence, prompt_length) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        completion_mask[row, prompt_length : len(sequence)] = 1
        targets = slice(prompt_length - 1, len(sequence) - 1)  # the target of position t is token t+1
        policy_per_token[row, targets] = policy[row][targets]
        ref_sums[row] = reference[row][targets].sum()
        with torch.no_grad():
            logits = policy_model(input_ids=torch.tensor([sequence[:-1]])).logits[0]
        log_sum_sq[row, targets] = pl.log_sum_squared_probs(logits)[targets]
    batch = _pair_batch(policy_per_token, completion_mask, ref_sums[:pairs], ref_sums[pairs:], log_sum_sq)
    batch["input_ids"] = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    return batch


def test_dpo_family_on_engine_scored_tiny_model_equals_trl():
    batch = _engine_scored_pairs()
    assert batch["ours"]["policy_chosen_logps_B"].abs().min() > 0  # real scores, not padding
    cases = [
        ("tiny sigmoid", {}, {"loss_types": ["sigmoid"]}),
        ("tiny ipo", {"loss_type": "ipo"}, {"loss_types": ["ipo"]}),
        ("tiny rpo", {"rpo_alpha": 0.5}, {"loss_types": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}),
    ]
    unweighted = {k: v for k, v in batch["ours"].items() if "wpo" not in k}
    for what, our_options, trl_options in cases:
        ours = pl.dpo_loss(**unweighted, beta=0.1, **our_options)
        _compare_dpo(batch, ours, _trl_dpo(batch, beta=0.1, **trl_options), what)
    ours = pl.dpo_loss(**batch["ours"], beta=0.1)
    _compare_dpo(
        batch, ours, _trl_dpo(batch, beta=0.1, loss_types=["sigmoid"], use_weighting=True), "tiny wpo"
    )


def test_log_sum_sq_probs_of_the_chunked_path_equal_trls_fused_lm_head():
    """The engine's chunked scoring gives TRL's `log_sum_sq_probs` (its fused LM head's chunked kernel, here on
    the CPU), with the log-probs and entropy unchanged and no gradient through the WPO term."""
    from trl.kernels import ChunkedLogProbFunction

    from hanzo_gym.engine.token_logprobs import token_logprobs, token_logprobs_with_log_sum_sq

    generator = torch.Generator().manual_seed(12)
    hidden = torch.randn(37, 16, generator=generator, requires_grad=True)
    weight = (3 * torch.randn(50, 16, generator=generator)).requires_grad_()
    targets = torch.randint(0, 50, (37,), generator=generator)
    logprobs, entropy, log_sum_sq = token_logprobs_with_log_sum_sq(hidden, weight, targets, chunk=8)
    outputs = ("entropy", "log_sum_sq_probs")
    trl_logprobs, _, trl_log_sum_sq, _, _ = ChunkedLogProbFunction.apply(
        hidden, weight, None, targets, 1.0, 16, None, 1.0, outputs
    )
    # peaked rows (logits of size ~50) put log Σ π² near 0: compare absolutely, each within fp32 of float64
    exact = torch.logsumexp(2 * (hidden.double() @ weight.double().T).log_softmax(-1), dim=-1)
    for values in (log_sum_sq, trl_log_sum_sq, pl.log_sum_squared_probs(hidden @ weight.T)):
        torch.testing.assert_close(values.double(), exact.detach(), rtol=0, atol=2e-6)
    torch.testing.assert_close(log_sum_sq, trl_log_sum_sq, rtol=0, atol=2e-6)
    torch.testing.assert_close(logprobs, trl_logprobs, rtol=RTOL, atol=1e-6)
    plain_logprobs, plain_entropy = token_logprobs(hidden, weight, targets, chunk=8)
    assert torch.equal(logprobs, plain_logprobs) and torch.equal(entropy, plain_entropy)
    # no gradient, and log Σ π² within [−log V, 0]
    assert not log_sum_sq.requires_grad
    assert log_sum_sq.max() <= 0 and log_sum_sq.min() >= -torch.log(torch.tensor(50.0))


def test_engine_scores_log_sum_sq_probs_per_datum():
    engine_model = tiny_model("llama", seed=0)
    sequences = [[5, 9, 4, 17, 3], [8, 2, 11]]
    datums = [Datum(ModelInput.from_ints(s[:-1]), {"target_tokens": s[1:]}) for s in sequences]
    logprobs, extras = Engine(engine_model).forward_with(datums, ["log_sum_sq_probs"])
    assert [t.tolist() for t in logprobs] == [t.tolist() for t in Engine(engine_model).forward(datums)]
    for sequence, values in zip(sequences, extras["log_sum_sq_probs"], strict=True):
        with torch.no_grad():
            logits = engine_model(input_ids=torch.tensor([sequence[:-1]])).logits[0]
        torch.testing.assert_close(values, pl.log_sum_squared_probs(logits), rtol=RTOL, atol=1e-5)


# -- SimPO (CPO) and ORPO -------------------------------------------------------------------------------------


def _reference_free_batch(seed: int, pairs: int = 6) -> dict:
    generator = torch.Generator().manual_seed(seed)
    completion_mask, per_token_logps = _random_sequences(generator, 2 * pairs, 14)
    sums, lengths = per_token_logps.sum(1), completion_mask.sum(1)
    return {
        "policy_chosen_logps_B": sums[:pairs],
        "policy_rejected_logps_B": sums[pairs:],
        "chosen_lengths_B": lengths[:pairs],
        "rejected_lengths_B": lengths[pairs:],
    }


def _with_forward(trainer, batch: dict, chosen_nll: torch.Tensor):
    """Give a CPO/ORPO trainer a `concatenated_forward` that returns our batch: TRL averages the log-probs over the
    completion (`average_log_prob=True`) before its loss."""
    chosen_average = batch["policy_chosen_logps_B"] / batch["chosen_lengths_B"]
    rejected_average = batch["policy_rejected_logps_B"] / batch["rejected_lengths_B"]
    logits = torch.zeros(len(chosen_average), 2, 3)  # logged only
    trainer.concatenated_forward = lambda model, inputs: (
        chosen_average,
        rejected_average,
        logits,
        logits,
        chosen_nll,
    )
    trainer.accelerator = _accelerator()
    trainer.aux_loss_enabled = False
    return trainer


@pytest.mark.parametrize(
    ("beta", "gamma", "label_smoothing", "cpo_alpha"), [(2.0, 0.5, 0.0, 0.0), (0.1, 1.0, 0.1, 1.0)]
)
def test_simpo_equals_trl_cpo_simpo(beta, gamma, label_smoothing, cpo_alpha):
    batch = _reference_free_batch(9)
    nll = pl.mean_token_nll(batch["policy_chosen_logps_B"], batch["chosen_lengths_B"])
    trainer = _with_forward(object.__new__(trl_cpo.CPOTrainer), batch, nll)
    trainer.beta, trainer.simpo_gamma, trainer.label_smoothing = beta, gamma, label_smoothing
    trainer.loss_type, trainer.cpo_alpha, trainer.alpha = "simpo", cpo_alpha, 0.0
    trl_loss, trl_metrics = trainer.get_batch_loss_metrics(None, {})
    ours = pl.simpo_loss(
        **batch,
        beta=beta,
        simpo_gamma=gamma,
        label_smoothing=label_smoothing,
        cpo_alpha=cpo_alpha,
        chosen_nll=nll,
    )
    _assert_close_to_trl(ours.loss.item(), trl_loss.item(), "simpo loss")
    for key in PAIR_METRICS:
        _assert_close_to_trl(ours.metrics[key], trl_metrics[key], f"simpo {key}")


@pytest.mark.parametrize("orpo_alpha", [0.1, 0.5])
def test_orpo_equals_trl(orpo_alpha):
    batch = _reference_free_batch(10)
    nll = pl.mean_token_nll(batch["policy_chosen_logps_B"], batch["chosen_lengths_B"])
    trainer = _with_forward(object.__new__(trl_orpo.ORPOTrainer), batch, nll)
    trainer.beta = orpo_alpha
    trl_loss, trl_metrics = trainer.get_batch_loss_metrics(None, {})
    ours = pl.orpo_loss(**batch, chosen_nll=nll, orpo_alpha=orpo_alpha)
    _assert_close_to_trl(ours.loss.item(), trl_loss.item(), "orpo loss")
    for key in [*PAIR_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen"]:
        _assert_close_to_trl(ours.metrics[key], trl_metrics[key], f"orpo {key}")


def test_orpo_log1mexp_equals_trl_near_zero_and_far():
    x = -torch.logspace(-6, 2, 200, dtype=torch.float64)
    torch.testing.assert_close(pl._log1mexp(x), trl_orpo.orpo_trainer.log1mexp(x), rtol=1e-12, atol=0)


# -- KTO ------------------------------------------------------------------------------------------------------


def _trl_kto(inputs: dict, completion_mask, per_token, kl_ids, kl_mask, kl_per_token, **options):
    model = _ScoredModel()
    model.register(inputs["input_ids"], per_token)
    model.register(kl_ids, kl_per_token)
    trainer = object.__new__(trl_kto.KTOTrainer)
    trainer.model = model
    trainer.accelerator = _accelerator()
    trainer.calculate_KL = True
    trainer.loss_type = "kto"
    trainer.precompute_ref_logps = True
    trainer.aux_loss_enabled = False
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._total_train_tokens = 0
    trainer._tp_size = 1
    for key, value in options.items():
        setattr(trainer, key, value)
    batch = {
        **inputs,
        "attention_mask": torch.ones_like(inputs["input_ids"]),
        "completion_mask": completion_mask,
        "KL_input_ids": kl_ids,
        "KL_attention_mask": torch.ones_like(kl_ids),
        "KL_completion_mask": kl_mask,
    }
    loss = trainer._compute_loss(model, batch, return_outputs=False)
    return loss, {key: values[-1] for key, values in trainer._metrics["train"].items()}


@pytest.mark.parametrize(
    ("desirable_weight", "undesirable_weight", "kl_shift"),
    [(1.0, 1.0, 0.5), (1.33, 0.75, 0.5), (1.0, 1.0, -5.0)],
)
def test_kto_equals_trl(desirable_weight, undesirable_weight, kl_shift):
    # kl_shift < 0 drives the KL estimate negative, where both clamp it to 0.
    generator = torch.Generator().manual_seed(12)
    examples, width = 8, 14
    completion_mask, per_token = _random_sequences(generator, examples, width)
    kl_mask, kl_per_token = _random_sequences(generator, examples, width + 2)
    desirable = torch.tensor([True, True, False, True, False, False, True, False])
    ref = per_token.sum(1) + torch.randn(examples, generator=generator)
    ref_kl = kl_per_token.sum(1) - kl_shift + 0.3 * torch.randn(examples, generator=generator)
    ids = torch.randint(3, VOCAB, (examples, width), generator=generator)
    kl_ids = torch.randint(3, VOCAB, (examples, width + 2), generator=generator)
    inputs = {"input_ids": ids, "label": desirable, "ref_logps": ref, "ref_KL_logps": ref_kl}
    options = {"beta": 0.1, "desirable_weight": desirable_weight, "undesirable_weight": undesirable_weight}
    trl_loss, trl_metrics = _trl_kto(
        inputs, completion_mask, per_token, kl_ids, kl_mask, kl_per_token, **options
    )
    ours = pl.kto_loss(per_token.sum(1), ref, desirable, kl_per_token.sum(1), ref_kl, **options)
    _assert_close_to_trl(ours.loss.item(), trl_loss.item(), "kto loss")
    expected = [k for k in PAIR_METRICS if k != "rewards/accuracies"] + ["kl"]
    for key in expected:
        _assert_close_to_trl(ours.metrics[key], trl_metrics[key], f"kto {key}")
    assert (ours.metrics["kl"] == 0) == (kl_shift < 0)
