"""Axolotl's `model_config` (overrides of the model's config): set before the weights load, a wrong key refused before
anything loads, and `output_router_logits` on a mixture of experts training with the loss the model's own forward
computes (its cross-entropy plus router_aux_loss_coef × its load-balancing loss), gradients included."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_eval_keys import _config, _rows
from tiny_models import tiny_model

from hanzo_gym.cli import main
from hanzo_gym.config import parse_config
from hanzo_gym.engine import Engine
from hanzo_gym.errors import ConfigError
from hanzo_gym.model.lora import attach_lora
from hanzo_gym.records import Datum, ModelInput


def _moe(kind: str):
    # set before the model is built, as model_config sets them: the model reads its coefficient then
    settings = {"output_router_logits": True, "router_aux_loss_coef": 0.5}  # large: a missing term shows
    torch.manual_seed(0)
    return tiny_model(kind, vocab_size=64, **settings)


def _with_lora(model):
    peft = attach_lora(model, r=4, alpha=8, dropout=0.0, target_modules="all-linear", base_model_name="tiny")
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return peft


def _padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    return ids, torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_a_step_has_the_loss_and_gradient_of_the_models_own_forward(kind):
    """The model's forward on a right-padded batch gives the cross-entropy; the router loss is its forward's over the
    tokens a datum feeds the model (each row less its last token, which predicts nothing: a padded batch routes it
    too)."""
    rows = [[3, 9, 14, 2, 7, 30, 5], [11, 4, 8, 21, 6]]
    reference = _with_lora(_moe(kind))
    ours = copy.deepcopy(reference)
    ids, mask = _padded(rows)
    full = reference(input_ids=ids, attention_mask=mask, labels=torch.where(mask.bool(), ids, -100))
    inputs, input_mask = _padded([r[:-1] for r in rows])
    routed = reference(input_ids=inputs, attention_mask=input_mask)
    assert routed.aux_loss is not None and routed.aux_loss > 0
    cross_entropy = full.loss - 0.5 * full.aux_loss
    (cross_entropy + 0.5 * routed.aux_loss).backward()
    # ours: the same rows as datums weighted 1/(trained tokens), packed in one pass
    trained = sum(len(r) - 1 for r in rows)
    datums = [
        Datum(ModelInput.from_ints(r[:-1]), {"target_tokens": r[1:], "weights": [1 / trained] * (len(r) - 1)})
        for r in rows
    ]
    engine = Engine(ours)
    assert engine.routes_experts
    scored = engine.forward_backward(datums, "cross_entropy")
    assert scored.loss_sum == pytest.approx(cross_entropy.item(), abs=1e-5)
    assert scored.metrics["router_aux_loss:sum"] == pytest.approx(0.5 * routed.aux_loss.item(), rel=1e-5)
    grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    for name, p in ours.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads[name], atol=1e-5, rtol=1e-4)


def test_without_the_override_no_router_loss_is_added():
    model = _with_lora(_moe("qwen3_moe"))
    model.config.output_router_logits = False
    engine = Engine(model)
    scored = engine.forward_backward(
        [Datum(ModelInput.from_ints([1, 2, 3]), {"target_tokens": [2, 3, 4], "weights": [1.0] * 3})]
    )
    assert not engine.routes_experts and "router_aux_loss:sum" not in scored.metrics


def test_a_dense_model_asked_for_router_logits_is_refused():
    from hanzo_gym.errors import GymError

    model = tiny_model("llama")
    model.config.output_router_logits = True
    with pytest.raises(
        GymError, match="model_config.output_router_logits: llama has no router load-balancing loss"
    ):
        Engine(model)


def _parse(**keys):
    data = {"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}], "output_dir": "o", **keys}
    return parse_config(data, "run.yaml")


def test_model_config_is_axolotls_name_of_the_overrides():
    cfg = _parse(model_config={"output_router_logits": True})
    assert cfg.model_config_overrides == (("output_router_logits", True),)
    assert _parse(overrides_of_model_config={"rope_theta": 5.0}).model_config_overrides == (
        ("rope_theta", 5.0),
    )
    with pytest.raises(ConfigError, match="disagree"):
        _parse(model_config={"a": 1}, overrides_of_model_config={"a": 2})


def test_gym_train_sets_the_overrides_and_logs_the_router_loss(tmp_path, tiny_moe_base, chat_data, capsys):
    keys = {
        "max_steps": 2,
        "val_set_size": 0,
        "model_config": {"output_router_logits": True, "router_aux_loss_coef": 0.1},
    }
    assert main(["train", str(_config(tmp_path, tiny_moe_base, chat_data, **keys))]) == 0
    rows = [row for row in _rows(tmp_path / "run") if "loss" in row]
    # a balanced router's loss is about 2 × router_aux_loss_coef: 0.1 here, 0.001 without the override
    assert len(rows) == 2 and all(0.05 < row["router_aux_loss"] < 1.0 for row in rows)
    saved = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert saved["overrides_of_model_config"] == {"output_router_logits": True, "router_aux_loss_coef": 0.1}


def test_a_key_the_models_config_lacks_is_refused_before_the_model_loads(
    tmp_path, tiny_base, chat_data, capsys
):
    keys = {"max_steps": 1, "val_set_size": 0, "model_config": {"num_expert": 4}}
    assert main(["train", str(_config(tmp_path, tiny_base, chat_data, **keys))]) == 2
    err = capsys.readouterr().err
    assert "model_config.num_expert: base_model" in err and "has no `num_expert`" in err
