"""`rl: dpo | ipo | orpo | simpo` from YAML: the data formats, the loop's numbers against TRL's loss functions
on the same log-probabilities, the reference pass against the plain base model, and `gym train` end to end."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml

from hanzo_gym.cli import main
from hanzo_gym.config import parse_config
from hanzo_gym.data.preference import load_preferences, pair_from_row
from hanzo_gym.data.sources import Row
from hanzo_gym.data.strategies import StrategyContext
from hanzo_gym.errors import ConfigError, DataError

QUESTIONS = [(a, b) for a in range(6) for b in range(4)]


def _pair_rows() -> list[dict]:
    """Conversational pairs: the chosen answer is right and polite, the rejected one wrong."""
    rows = []
    for a, b in QUESTIONS:
        rows.append(
            {
                "conversation": [{"role": "user", "content": f"What is {a} plus {b}?"}],
                "chosen": {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
                "rejected": {"role": "assistant", "content": f"It is {a * b + 7}, I think."},
            }
        )
    return rows


@pytest.fixture(scope="module")
def pair_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _pair_rows()))
    return path


def _config(tmp_path, tiny_base, pair_file, **overrides) -> tuple:
    cfg = {
        "base_model": str(tiny_base),
        "rl": "dpo",
        "datasets": [
            {
                "path": str(pair_file),
                "type": "chat_template.default",
                "field_messages": "conversation",
                "field_chosen": "chosen",
                "field_rejected": "rejected",
            }
        ],
        "val_set_size": 0.25,
        "output_dir": str(tmp_path / "run"),
        "sequence_len": 128,
        "adapter": "lora",
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_target_linear": True,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "num_epochs": 2,
        "learning_rate": 5e-3,
        "logging_steps": 1,
        "save_steps": 4,
        "seed": 3,
        "bf16": False,
    }
    cfg.update(overrides)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# -- dataset formats --------------------------------------------------------------------------------------------


def _dataset(tmp_path, rows, **ds) -> tuple:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = parse_config(
        {
            "base_model": "unused",
            "rl": "dpo",
            "datasets": [{"path": str(path), **ds}],
            "output_dir": str(tmp_path / "run"),
            "adapter": "lora",
            "lora_target_linear": True,
            "sequence_len": 64,
        }
    )
    return cfg, [Row(row, str(path), number) for number, row in enumerate(rows, start=1)]


def _decoded(tokenizer, pair) -> tuple[str, str, str]:
    return tuple(tokenizer.decode(ids) for ids in (pair.prompt, pair.chosen, pair.rejected))


def test_chatml_intel_writes_axolotls_text_template(tmp_path, qwen3_tokenizer):
    row = {"system": "Be brief.", "question": "2+2?", "chosen": "4", "rejected": "5"}
    cfg, rows = _dataset(tmp_path, [row], type="chatml.intel")
    pair = pair_from_row(rows[0], cfg.datasets[0], StrategyContext(tokenizer=qwen3_tokenizer))
    assert _decoded(qwen3_tokenizer, pair) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n",
        "4<|im_end|>",  # the eos is <|im_end|> already: TRL appends none
        "5<|im_end|>",
    )


def test_llama3_ultra_takes_the_answers_from_message_lists_and_adds_bos_and_eos(tmp_path, llama32_tokenizer):
    row = {
        "prompt": "Name a colour.",
        "chosen": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
        "rejected": [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Seven."},
        ],
    }
    cfg, rows = _dataset(tmp_path, [row], type="llama3.ultra")
    prompt, chosen, rejected = _decoded(
        llama32_tokenizer,
        pair_from_row(rows[0], cfg.datasets[0], StrategyContext(tokenizer=llama32_tokenizer)),
    )
    assert prompt == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nName a colour.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # TRL appends the tokenizer's eos (<|end_of_text|>) to a completion that lacks it
    assert (chosen, rejected) == ("Blue.<|eot_id|><|end_of_text|>", "Seven.<|eot_id|><|end_of_text|>")


def test_chat_template_default_maps_roles_and_renders_with_the_template(tmp_path, qwen3_tokenizer):
    row = {
        "conversation": [{"from": "human", "value": "Hi?"}],
        "chosen": {"from": "gpt", "value": "Hello."},
        "rejected": "Go away.",
    }
    cfg, rows = _dataset(
        tmp_path,
        [row],
        type="chat_template.default",
        field_messages="conversation",
        message_property_mappings={"role": "from", "content": "value"},
        roles={"user": ["human"], "assistant": ["gpt"]},
    )
    pair = pair_from_row(rows[0], cfg.datasets[0], StrategyContext(tokenizer=qwen3_tokenizer))
    messages = [{"role": "user", "content": "Hi?"}]
    prompt_ids = qwen3_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    with_chosen = qwen3_tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": "Hello."}], return_dict=True
    )
    prompt_ids, with_chosen = list(prompt_ids["input_ids"]), list(with_chosen["input_ids"])
    assert pair.prompt + pair.chosen == with_chosen  # HF's own rendering of the conversation
    assert with_chosen[: len(pair.prompt)] == pair.prompt and len(pair.prompt) <= len(prompt_ids)
    assert qwen3_tokenizer.decode(pair.rejected).endswith("Go away.<|im_end|>\n")


def test_passthrough_conversations_with_an_implicit_prompt_split_at_the_last_shared_message(
    tmp_path, qwen3_tokenizer
):
    turns = [{"role": "user", "content": "Colour?"}]
    row = {
        "chosen": [*turns, {"role": "assistant", "content": "Blue."}],
        "rejected": [*turns, {"role": "assistant", "content": "Seven."}],
    }
    cfg, rows = _dataset(tmp_path, [row], type="passthrough")
    prompt, chosen, rejected = _decoded(
        qwen3_tokenizer, pair_from_row(rows[0], cfg.datasets[0], StrategyContext(tokenizer=qwen3_tokenizer))
    )
    assert prompt.endswith("<|im_start|>user\nColour?<|im_end|>\n<|im_start|>assistant\n")
    assert chosen.endswith("Blue.<|im_end|>\n") and rejected.endswith("Seven.<|im_end|>\n")


def test_a_bad_row_names_the_file_the_row_and_the_field(tmp_path, qwen3_tokenizer):
    rows = [{"question": "q", "chosen": "a", "rejected": "b"}, {"question": "q", "chosen": "a"}]
    cfg, _ = _dataset(tmp_path, rows, type="chatml.intel")
    with pytest.raises(DataError, match=r"rows\.jsonl row 2: field `rejected` is missing or not a string"):
        load_preferences(cfg, qwen3_tokenizer)
    bad_role = [{"conversation": [{"role": "robot", "content": "x"}], "chosen": "a", "rejected": "b"}]
    cfg, _ = _dataset(tmp_path, bad_role, type="chat_template.default", field_messages="conversation")
    with pytest.raises(DataError, match=r"row 1: `conversation` message 0 has role 'robot'"):
        load_preferences(cfg, qwen3_tokenizer)


def test_over_long_pairs_are_dropped_or_truncated_as_axolotl_does(tmp_path, qwen3_tokenizer):
    long_answer = " ".join(["word"] * 100)
    rows = [
        {"question": "Short?", "chosen": "Yes.", "rejected": "No."},
        {"question": "Long?", "chosen": long_answer, "rejected": "No."},
    ]
    cfg, _ = _dataset(tmp_path, rows, type="chatml.intel")
    loaded = load_preferences(cfg, qwen3_tokenizer)
    assert len(loaded.train) == 1 and loaded.stats[-1].too_long == 1 and loaded.stats[-1].dropped == 0
    truncating = cfg.model_copy(update={"excess_length_strategy": "truncate"})
    loaded = load_preferences(truncating, qwen3_tokenizer)
    assert len(loaded.train) == 2 and loaded.stats[-1].truncated == 1
    assert max(len(p.prompt) + len(p.chosen) for p in loaded.train) == cfg.sequence_len
    with pytest.raises(DataError, match="row 2: prompt \\+ completion is"):
        load_preferences(cfg.model_copy(update={"excess_length_strategy": "raise"}), qwen3_tokenizer)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"sample_packing": True}, "does not pack samples"),
        ({"datasets": [{"path": "x.jsonl", "type": "chat_template"}]}, "rl: dpo reads datasets of type"),
        ({"rl": None}, "holds preference data; it needs `rl: dpo`"),
        ({"rl": "ipo", "dpo_label_smoothing": 0.1}, "applies to rl: dpo"),
        ({"rl_beta": 0.1, "dpo_beta": 0.2}, "disagree"),
        ({"dpo_loss_type": ["sigmoid", "ipo"]}, "one of sigmoid or ipo"),
        (
            {"rl": "kto", "micro_batch_size": 2, "datasets": [{"path": "x", "type": "chatml.default"}]},
            "rl: kto reads datasets of type",
        ),
        ({"rl": "kto", "micro_batch_size": 1, "datasets": [{"path": "x", "type": "chatml.argilla"}]}, "≥ 2"),
        ({"rl": "orpo", "dpo_use_weighting": True}, "applies to rl: dpo or ipo, not rl: orpo"),
        ({"rl": "simpo", "dpo_use_weighting": True}, "applies to rl: dpo or ipo, not rl: simpo"),
        (
            {
                "rl": "kto",
                "micro_batch_size": 2,
                "datasets": [{"path": "x", "type": "chatml.argilla"}],
                "dpo_use_weighting": True,
            },
            "applies to rl: dpo or ipo, not rl: kto",
        ),
        (
            {"rl": None, "datasets": [{"path": "x", "type": "alpaca"}], "dpo_use_weighting": True},
            "needs `rl: dpo`",
        ),
        ({"dpo_use_weighting": True, "rpo_alpha": 0.5}, "TRL 1.16's DPOTrainer fails on that combination"),
        ({"dpo_use_weighting": True, "dpo_loss_type": ["sigmoid", "sft"]}, "with the chosen NLL"),
    ],
)
def test_preference_config_mistakes_are_refused_with_a_sentence(tmp_path, extra, message):
    data = {
        "base_model": "unused",
        "rl": "dpo",
        "datasets": [{"path": "x.jsonl", "type": "chatml.intel"}],
        "output_dir": str(tmp_path),
        "adapter": "lora",
        "lora_target_linear": True,
        **extra,
    }
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(data)


@pytest.mark.parametrize("method", ["dpo", "ipo"])
def test_dpo_use_weighting_loads_for_dpo_and_ipo(tmp_path, method):
    data = {
        "base_model": "unused",
        "rl": method,
        "datasets": [{"path": "x.jsonl", "type": "chatml.intel"}],
        "output_dir": str(tmp_path),
        "adapter": "lora",
        "lora_target_linear": True,
        "dpo_use_weighting": True,
    }
    assert parse_config(data).dpo_use_weighting is True


# -- gym train end to end ---------------------------------------------------------------------------------------


# DPO end to end in the developer's suite; the other methods (same loop, other loss: each is checked against TRL
# above or in test_preference_losses.py) end to end in CI's
@pytest.mark.parametrize(
    "method", ["dpo", *(pytest.param(m, marks=pytest.mark.slow) for m in ("ipo", "orpo", "simpo", "dpo+wpo"))]
)
def test_gym_train_preference_methods_learn(tmp_path, tiny_base, pair_file, capsys, method):
    rl, _, weighting = method.partition("+")
    path, _ = _config(tmp_path, tiny_base, pair_file, rl=rl, dpo_use_weighting=weighting == "wpo")
    assert main(["train", str(path)]) == 0
    rows = _rows(tmp_path / "run")
    train_rows = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/loss" in r]
    # 24 pairs → 18 train → 9 micro-batches of 2 → 5 steps of 2 per epoch, 2 epochs
    assert [r["step"] for r in train_rows] == list(range(1, 11))
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
        assert key in train_rows[0] and f"eval/{key}" in evals[0]
    for key in ("logps/chosen", "logps/rejected", "grad_norm", "lr", "tokens_per_s", "pairs_per_s"):
        assert key in train_rows[0]
    assert evals[-1]["eval/rewards/margins"] > evals[0]["eval/rewards/margins"]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()
    assert "step 10/10" in capsys.readouterr().out


# -- parity with TRL's DPOTrainer on the same model --------------------------------------------------------------

trl = pytest.importorskip("trl")


def _trl_rows() -> list[dict]:
    """TRL's conversational preference rows (explicit prompt)."""
    return [
        {
            "prompt": [{"role": "user", "content": f"What is {a} plus {b}? Answer in one short sentence."}],
            "chosen": [{"role": "assistant", "content": f"{a} plus {b} is {a + b}."}],
            "rejected": [{"role": "assistant", "content": f"It is {a * b + 7}, I would say."}],
        }
        for a, b in QUESTIONS[:4]
    ]


def _trl_trainer(trainer_class, args, rows: list[dict], tokenizer):
    """A TRL trainer over a tiny Qwen3 (wide initialisation, so that an adapter moves its logits) with a fresh
    LoRA adapter that TRL attaches itself: its reference is then the adapter disabled, as ours."""
    import os

    from datasets import Dataset
    from peft import LoraConfig
    from tiny_models import tiny_model

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    model = tiny_model(
        "qwen3",
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
        bos_token_id=None,
        initializer_range=0.2,
    )
    return trainer_class(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )


def _random_lora_b(model, seed: int) -> None:
    """Random B matrices: the policy then differs from the reference."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)


def _preference_config(tmp_path, path, **settings):
    return parse_config(
        {
            "base_model": "unused",
            "rl": "dpo",
            "datasets": [{"path": str(path), "type": "passthrough"}],
            "output_dir": str(tmp_path),
            "adapter": "lora",
            "lora_target_linear": True,
            **settings,
        }
    )


def _trl_dpo_trainer(qwen3_tokenizer, tmp_path_factory, **options):
    args = trl.DPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")),
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        **options,
    )
    trainer = _trl_trainer(trl.DPOTrainer, args, _trl_rows(), qwen3_tokenizer)
    _random_lora_b(trainer.model, 0)
    return trainer


@pytest.fixture(scope="module")
def trl_dpo(qwen3_tokenizer, tmp_path_factory):
    return _trl_dpo_trainer(qwen3_tokenizer, tmp_path_factory)


@pytest.fixture(scope="module")
def trl_wpo(qwen3_tokenizer, tmp_path_factory):
    """TRL's DPOTrainer with `use_weighting=True` (WPO): its fused LM head then also returns log Σ_v π(v)²."""
    return _trl_dpo_trainer(qwen3_tokenizer, tmp_path_factory, use_weighting=True)


def _our_pairs(qwen3_tokenizer, tmp_path):
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _trl_rows()))
    ds = _preference_config(tmp_path, path).datasets[0]
    ctx = StrategyContext(tokenizer=qwen3_tokenizer)
    rows = [Row(data, str(path), number) for number, data in enumerate(_trl_rows(), start=1)]
    return [pair_from_row(row, ds, ctx) for row in rows]


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize(
    "settings",
    [
        {"rl": "dpo", "rl_beta": 0.1},
        {"rl": "dpo", "rl_beta": 0.3, "rpo_alpha": 0.5},
        {"rl": "ipo", "rl_beta": 0.2},
        {"rl": "dpo", "rl_beta": 0.1, "dpo_use_weighting": True},
        {"rl": "ipo", "rl_beta": 0.2, "dpo_use_weighting": True},
    ],
    ids=["sigmoid", "rpo", "ipo", "wpo-sigmoid", "wpo-ipo"],
)
def test_loss_and_gradient_equal_trl_dpo_trainer(request, qwen3_tokenizer, tmp_path, settings):
    from hanzo_gym.engine import Engine
    from hanzo_gym.loops.preference import PairMethod, evaluate

    weighting = settings.get("dpo_use_weighting", False)
    trl_dpo = request.getfixturevalue("trl_wpo" if weighting else "trl_dpo")
    assert trl_dpo.use_weighting is weighting
    pairs = _our_pairs(qwen3_tokenizer, tmp_path)
    dataset = trl_dpo.train_dataset
    for pair, tokenized in zip(pairs, dataset):  # TRL's own tokenization of the same rows
        assert (pair.prompt, pair.chosen, pair.rejected) == (
            tokenized["prompt_ids"],
            tokenized["chosen_ids"],
            tokenized["rejected_ids"],
        )

    trl_dpo.beta = settings["rl_beta"]
    trl_dpo.args.beta = settings["rl_beta"]
    if settings["rl"] == "ipo":
        trl_dpo.loss_types, trl_dpo.loss_weights = ["ipo"], [1.0]
    elif "rpo_alpha" in settings:
        trl_dpo.loss_types, trl_dpo.loss_weights = ["sigmoid", "sft"], [1.0, settings["rpo_alpha"]]
    else:
        trl_dpo.loss_types, trl_dpo.loss_weights = ["sigmoid"], [1.0]
    model = trl_dpo.model
    model.train()
    trl_dpo._metrics["train"].clear()
    batch = trl_dpo.data_collator([dataset[i] for i in range(len(dataset))])
    trl_loss = trl_dpo.compute_loss(model, batch)
    trl_loss.backward()
    trl_grads = _grads(model)
    trl_metrics = {key: values[-1] for key, values in trl_dpo._metrics["train"].items()}

    cfg = _preference_config(tmp_path, tmp_path / "trl.jsonl", **settings)
    engine = Engine(model, qwen3_tokenizer)
    method = PairMethod(cfg, engine, pairs)
    batch = list(range(len(pairs)))
    prepared = method.prepare(batch)
    captured = {}

    unweighted = PairMethod(cfg.model_copy(update={"dpo_use_weighting": False}), engine, pairs)

    def loss_fn(logprobs, **extras):
        scored = method.loss(batch, logprobs, prepared, **extras)
        captured.update(scored.metrics)
        captured["unweighted"] = unweighted.loss(
            batch, [lp.detach() for lp in logprobs], prepared
        ).loss.item()
        return scored.loss, {}

    # as the training loop calls it: no logits over the prompts
    our_loss, _ = engine.forward_backward_custom(
        method.datums(batch), loss_fn, method.outputs, scored_from=method.scored_from(batch)
    )
    our_grads = _grads(model)

    print(f"loss ours {our_loss:.8g} TRL {trl_loss.item():.8g} unweighted {captured['unweighted']:.8g}")
    assert our_loss == pytest.approx(trl_loss.item(), rel=1e-5)
    if weighting:  # the weights are in: the loss is not the plain one
        assert abs(our_loss - captured["unweighted"]) > 1e-3 * abs(captured["unweighted"])
    else:
        assert our_loss == pytest.approx(captured["unweighted"], rel=1e-6)
    # the evaluation path (no gradient, its own scoring of the same outputs) gives the same loss
    assert evaluate(method, len(pairs))["eval/loss"] == pytest.approx(our_loss, rel=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert captured[key] == pytest.approx(trl_metrics[key], rel=1e-4, abs=1e-6), key
    assert captured["rewards/accuracies"] == trl_metrics["rewards/accuracies"]
    assert trl_grads.keys() == our_grads.keys() and len(our_grads) > 0
    for name, grad in trl_grads.items():
        # float32 summation order differs (packed vs padded rows): allow 1e-4 of the tensor's largest entry
        scale = grad.abs().max().item()
        torch.testing.assert_close(
            our_grads[name], grad, rtol=1e-4, atol=1e-4 * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("rl", ["orpo", "simpo"])
def test_orpo_and_simpo_score_what_their_losses_read(trl_dpo, qwen3_tokenizer, tmp_path, rl):
    """Their losses from the loop's scoring (no logits before `scored_from`) equal those from scoring every
    position: ORPO's chosen NLL runs over the prompt too, so its chosen sequences are scored whole."""
    from hanzo_gym.engine import Engine
    from hanzo_gym.loops.preference import PairMethod, evaluate

    pairs = _our_pairs(qwen3_tokenizer, tmp_path)
    model = trl_dpo.model
    _random_lora_b(model, 3)
    method = PairMethod(_preference_config(tmp_path, "x", rl=rl), Engine(model, qwen3_tokenizer), pairs)
    batch = list(range(len(pairs)))
    every, _ = method.engine.forward_with(method.datums(batch), ())
    expected = method.loss(batch, every, method.prepare(batch)).loss.item()
    assert evaluate(method, len(pairs))["eval/loss"] == pytest.approx(expected, rel=1e-6)


def test_reference_pass_equals_the_plain_base_model(trl_dpo, qwen3_tokenizer, tmp_path):
    """The adapter-disabled pass scores each completion as the base model alone does (no LoRA in the graph)."""
    from hanzo_gym.engine import Engine
    from hanzo_gym.loops.preference import PairMethod

    pairs = _our_pairs(qwen3_tokenizer, tmp_path)
    model = trl_dpo.model
    cfg = _preference_config(tmp_path, "x")
    reference = PairMethod(cfg, Engine(model, qwen3_tokenizer), pairs).prepare(range(len(pairs)))
    base = model.get_base_model()
    with model.disable_adapter(), torch.no_grad():
        for index, pair in enumerate(pairs):
            for side, completion in enumerate((pair.chosen, pair.rejected)):
                tokens = torch.tensor([pair.prompt + completion])
                logits = base(input_ids=tokens).logits[0, :-1].float()
                logprobs = logits.log_softmax(-1).gather(1, tokens[0, 1:, None])[:, 0]
                expected = logprobs[len(pair.prompt) - 1 :].sum()
                assert reference[side, index].item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-5)


@pytest.mark.slow  # a whole run end to end; CI runs it, `make test` stays under 10 minutes
def test_resume_gives_the_metrics_of_an_uninterrupted_run(tmp_path, tiny_base, pair_file):
    path, _ = _config(tmp_path, tiny_base, pair_file, max_steps=6, save_steps=4, val_set_size=0)
    assert main(["train", str(path)]) == 0
    straight = {row["step"]: row for row in _rows(tmp_path / "run")}
    resumed_path, _ = _config(
        tmp_path,
        tiny_base,
        pair_file,
        max_steps=6,
        save_steps=4,
        val_set_size=0,
        output_dir=str(tmp_path / "resumed"),
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"),
    )
    assert main(["train", str(resumed_path)]) == 0
    again = {row["step"]: row for row in _rows(tmp_path / "resumed")}
    assert sorted(again) == [5, 6]
    for step, row in again.items():
        for key in ("loss", "rewards/margins", "rewards/chosen", "logps/rejected", "grad_norm"):
            assert row[key] == pytest.approx(straight[step][key], rel=1e-6, abs=1e-7), (step, key)


# -- KTO ----------------------------------------------------------------------------------------------------------


def _kto_rows() -> list[dict]:
    """TRL's unpaired conversational rows: each question with a right (desirable) or a wrong answer."""
    rows = []
    for k, (a, b) in enumerate(QUESTIONS[:4]):
        good = k % 2 == 0
        answer = f"{a} plus {b} is {a + b}." if good else f"It is {a * b + 7}, I would say."
        rows.append(
            {
                "prompt": [
                    {"role": "user", "content": f"What is {a} plus {b}? Answer in one short sentence."}
                ],
                "completion": [{"role": "assistant", "content": answer}],
                "label": good,
            }
        )
    return rows


def test_kto_strategies_read_axolotls_fields_and_the_label(tmp_path, qwen3_tokenizer):
    from hanzo_gym.data.preference import kto_from_row

    path = tmp_path / "kto.jsonl"
    rows = [
        {"instruction": "2+2?", "completion": "4", "label": True},
        {"instruction": "2+2?", "completion": "5"},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = parse_config(
        {
            "base_model": "unused",
            "rl": "kto",
            "micro_batch_size": 2,
            "datasets": [{"path": str(path), "type": "chatml.argilla"}],
            "output_dir": str(tmp_path),
            "adapter": "lora",
            "lora_target_linear": True,
        }
    )
    ctx = StrategyContext(tokenizer=qwen3_tokenizer)
    example = kto_from_row(Row(rows[0], str(path), 1), cfg.datasets[0], ctx)
    assert (
        qwen3_tokenizer.decode(example.prompt) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert qwen3_tokenizer.decode(example.completion) == "4<|im_end|>" and example.desirable
    with pytest.raises(DataError, match=r"kto\.jsonl row 2: field `label` is missing"):
        load_preferences(cfg, qwen3_tokenizer)


@pytest.fixture(scope="module")
def trl_kto(qwen3_tokenizer, tmp_path_factory):
    args = trl.KTOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl-kto")),
        per_device_train_batch_size=4,
        beta=0.3,
        desirable_weight=0.7,
        undesirable_weight=1.3,
        report_to=[],
        use_cpu=True,
    )
    return _trl_trainer(trl.KTOTrainer, args, _kto_rows(), qwen3_tokenizer)


def test_kto_loss_kl_term_and_gradient_equal_trl_kto_trainer(trl_kto, qwen3_tokenizer, tmp_path):
    from hanzo_gym.data.preference import kto_from_row
    from hanzo_gym.engine import Engine
    from hanzo_gym.loops.preference import KtoMethod

    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _kto_rows()))
    cfg = _preference_config(
        tmp_path,
        path,
        rl="kto",
        rl_beta=0.3,
        kto_desirable_weight=0.7,
        kto_undesirable_weight=1.3,
        micro_batch_size=4,
    )
    ctx = StrategyContext(tokenizer=qwen3_tokenizer)
    examples = [
        kto_from_row(Row(r, str(path), n), cfg.datasets[0], ctx) for n, r in enumerate(_kto_rows(), 1)
    ]
    dataset = trl_kto.train_dataset
    for example, tokenized in zip(examples, dataset):
        assert (example.prompt, example.completion) == (tokenized["prompt_ids"], tokenized["completion_ids"])

    model = trl_kto.model
    method = KtoMethod(cfg, Engine(model, qwen3_tokenizer), examples)
    order = list(range(len(examples)))
    # An adapter under which the mismatched sequences gain probability: KTO's KL term is clamped at 0, and a
    # zero term would test nothing
    for seed in range(50):
        _random_lora_b(model, seed)
        _, policy_kl, reference_kl = method.prepare(order)
        if (policy_kl - reference_kl).mean() > 0.1:
            break
    model.train()
    trl_kto._metrics["train"].clear()
    batch = trl_kto.data_collator([dataset[i] for i in range(len(dataset))])
    trl_loss = trl_kto.compute_loss(model, batch)
    trl_loss.backward()
    trl_grads = _grads(model)
    trl_metrics = {key: values[-1] for key, values in trl_kto._metrics["train"].items()}

    prepared = method.prepare(order)
    captured = {}

    def loss_fn(logprobs):
        scored = method.loss(order, logprobs, prepared)
        captured.update(scored.metrics)
        return scored.loss, {}

    our_loss, _ = method.engine.forward_backward_custom(
        method.datums(order), loss_fn, scored_from=method.scored_from(order)
    )
    our_grads = _grads(model)
    assert our_loss == pytest.approx(trl_loss.item(), rel=1e-5)
    assert captured["kl"] == pytest.approx(trl_metrics["kl"], rel=1e-4, abs=1e-6)
    assert captured["kl"] > 0.1
    for name, grad in trl_grads.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(
            our_grads[name], grad, rtol=1e-4, atol=1e-4 * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.slow
def test_gym_train_kto_learns(tmp_path, tiny_base):
    path = tmp_path / "kto.jsonl"
    rows = []
    for a, b in QUESTIONS:
        question = [{"role": "user", "content": f"What is {a} plus {b}?"}]
        rows.append(
            {"prompt": question, "completion": [{"role": "assistant", "content": f"{a + b}."}], "label": True}
        )
        wrong = [{"role": "assistant", "content": f"It is {a * b + 7}, I think."}]
        rows.append({"prompt": question, "completion": wrong, "label": False})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config, _ = _config(
        tmp_path,
        tiny_base,
        path,
        rl="kto",
        datasets=[{"path": str(path), "type": "passthrough"}],
        micro_batch_size=4,
    )
    assert main(["train", str(config)]) == 0
    rows = _rows(tmp_path / "run")
    train_rows, evals = [r for r in rows if "loss" in r], [r for r in rows if "eval/loss" in r]
    for key in ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "examples_per_s"):
        assert any(key in row for row in train_rows), key
    assert all("rewards/accuracies" not in row for row in train_rows)  # TRL's KTO logs none: no pairs
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    assert evals[-1]["eval/rewards/margins"] > evals[0]["eval/rewards/margins"]


def test_pairs_and_kto_sets_that_cannot_teach_are_said_with_counts():
    from hanzo_gym.data.preference import KtoExample, PreferencePair, unteachable_notes

    pairs = [
        PreferencePair([1, 2], [3], [4]),
        PreferencePair([1], [5, 6], [5, 6]),
        PreferencePair([2], [7], [7]),
    ]
    said = (
        "2 of 3 training pairs have the same chosen and rejected completion: their preference term is the same "
        "whatever the weights, so they teach nothing (check field_chosen / field_rejected)"
    )
    assert unteachable_notes(pairs, "dpo") == [said]
    assert "only ORPO's NLL of the chosen completion trains on them" in unteachable_notes(pairs, "orpo")[0]
    assert unteachable_notes(pairs[:1], "dpo") == []
    kto = [KtoExample([1], [2], True), KtoExample([1], [3], True)]
    said = (
        "all 2 KTO training examples are desirable, none undesirable: KTO weighs one kind against the other, "
        "so check the label field (`label`, true for desirable)"
    )
    assert unteachable_notes(kto, "kto") == [said]
    assert unteachable_notes([*kto, KtoExample([1], [4], False)], "kto") == []
