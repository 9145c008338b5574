"""Full fine-tuning: a config without `adapter`, as Axolotl reads it, trains every weight. One step
equals plain PyTorch's (transformers' loss, torch's AdamW); the run writes the model where Axolotl does, so
from_pretrained(output_dir) loads it; a checkpoint resumes to the same weights; what cannot go with it fails
at load with the reason."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from config_files import write_tiny_run
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hanzo_gym.cli import main
from hanzo_gym.config import load_config, parse_config
from hanzo_gym.errors import ConfigError
from hanzo_gym.loops.train import build_engine
from hanzo_gym.model.load_plan import LoadPlan
from hanzo_gym.records import AdamParams, Datum

LORA_KEYS = ("adapter", "lora_r", "lora_alpha", "lora_dropout", "lora_target_linear")
TEXTS = ["the cat sat on the mat", "a dog ran far away from home", "one two three four"]


def _full_run(tmp_path, base, data, name="run", **overrides):
    path = write_tiny_run(tmp_path, base, data, name, **overrides)
    written = __import__("yaml").safe_load(path.read_text())
    for key in LORA_KEYS:
        written.pop(key, None)
    path.write_text(__import__("yaml").safe_dump(written))
    return path


def test_one_step_equals_plain_pytorch(tmp_path, tiny_base, chat_data, qwen3_tokenizer):
    cfg = load_config(_full_run(tmp_path, tiny_base, chat_data))
    assert cfg.full_fine_tuning
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32), qwen3_tokenizer)
    reference = copy.deepcopy(engine.model)
    assert engine.trainable_parameter_count == sum(p.numel() for p in reference.parameters())

    tokens = [qwen3_tokenizer.encode(text) for text in TEXTS]
    datums = [Datum.from_tokens(t[:-1], target_tokens=t[1:], weights=[1.0] * (len(t) - 1)) for t in tokens]
    adam = AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)
    out = engine.forward_backward(datums, "cross_entropy")
    engine.optim_step(adam)

    optimizer = torch.optim.AdamW(
        reference.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01
    )
    total = 0.0
    for t in tokens:
        ids = torch.tensor([t])
        logits = reference(input_ids=ids[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:], reduction="sum")
        loss.backward()
        total += float(loss)
    optimizer.step()
    assert out.loss_sum == pytest.approx(total, rel=1e-5)
    # AdamW's first step is lr · g / (|g| + eps): where a gradient is near eps (embedding rows of rare tokens),
    # the two sums' rounding moves that ratio. 1 % of lr bounds it (measured 2.5e-6); a wrong lr, weight decay
    # or a parameter left out moves weights by about lr.
    trained = dict(engine.model.named_parameters())
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(trained[name], parameter, rtol=1e-5, atol=1e-5)
    assert not torch.equal(
        trained["model.embed_tokens.weight"],
        dict(AutoModelForCausalLM.from_pretrained(str(tiny_base)).named_parameters())[
            "model.embed_tokens.weight"
        ],
    )


def test_a_kept_reference_scores_with_the_starting_weights_after_steps(
    tmp_path, tiny_base, chat_data, qwen3_tokenizer
):
    """GRPO's KL penalty in full fine-tuning: Engine.keep_reference keeps the weights as they are, and
    forward(reference=True) scores with them however the trained ones move: exactly the starting model's."""
    cfg = load_config(_full_run(tmp_path, tiny_base, chat_data))
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32), qwen3_tokenizer)
    tokens = [qwen3_tokenizer.encode(text) for text in TEXTS]
    datums = [Datum.from_tokens(t[:-1], target_tokens=t[1:], weights=[1.0] * (len(t) - 1)) for t in tokens]
    starting = engine.forward(datums)
    engine.keep_reference()
    for _ in range(2):
        engine.forward_backward(datums, "cross_entropy")
        engine.optim_step(AdamParams(learning_rate=1e-2))
    trained, reference = engine.forward(datums), engine.forward(datums, reference=True)
    assert all(torch.equal(r, s) for r, s in zip(reference, starting))
    assert not any(torch.equal(t, s) for t, s in zip(trained, starting))
    assert all(torch.equal(t, again) for t, again in zip(trained, engine.forward(datums)))  # swapped back


def test_bf16_is_mixed_precision_over_fp32_weights(tmp_path, tiny_base, chat_data, qwen3_tokenizer, capsys):
    cfg = load_config(_full_run(tmp_path, tiny_base, chat_data, bf16=True))
    tokens = [qwen3_tokenizer.encode(text) for text in TEXTS]
    datums = [Datum.from_tokens(t[:-1], target_tokens=t[1:], weights=[1.0] * (len(t) - 1)) for t in tokens]
    mixed = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.bfloat16), qwen3_tokenizer)
    assert {p.dtype for p in mixed.trainable} == {
        torch.float32
    }  # the weights it trains, and so AdamW's state
    reference = copy.deepcopy(mixed.model)
    out = mixed.forward_backward(datums, "cross_entropy")

    total = 0.0
    for t in tokens:  # the same model under torch's autocast; the output layer in fp32, as the engine runs it
        ids = torch.tensor([t])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = reference.model(input_ids=ids[:, :-1]).last_hidden_state[0]
        logits = hidden.float() @ reference.lm_head.weight.T
        loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
        loss.backward()
        total += float(loss)
    assert out.loss_sum == pytest.approx(total, rel=2e-3)  # bf16 rounding of packed and separate passes
    got = torch.cat([p.grad.flatten() for p in mixed.trainable])
    want = torch.cat([p.grad.flatten() for p in reference.parameters()])
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.999
    fp32 = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32), qwen3_tokenizer)
    assert fp32.forward_backward(datums, "cross_entropy").loss_sum != out.loss_sum  # bf16 matmuls did run

    capsys.readouterr()  # what building the engines above said
    assert (
        main(["train", str(_full_run(tmp_path, tiny_base, chat_data, "bf16", bf16=True, max_steps=2))]) == 0
    )
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("precision: bf16 (") and "full fine-tuning: fp32 weights and AdamW state" in first
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"))
    assert saved.model.embed_tokens.weight.dtype == torch.float32


def test_a_run_writes_the_model_where_axolotl_does_and_resumes(
    tmp_path, tiny_base, chat_data, qwen3_tokenizer
):
    config = _full_run(tmp_path, tiny_base, chat_data, max_steps=3, save_steps=2)
    assert main(["train", str(config)]) == 0
    run = tmp_path / "run"
    assert json.loads((run / "config.json").read_text())["model_type"] == "qwen3"  # the model's own config
    assert "base_model" in json.loads((run / "run_config.json").read_text())
    assert not (run / "adapter_config.json").exists()
    trained = AutoModelForCausalLM.from_pretrained(str(run))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_base))
    assert not torch.equal(trained.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert (run / "checkpoint-2" / "model.safetensors").is_file()
    assert (run / "checkpoint-2" / "optimizer.safetensors").is_file()

    # Killed after its step-2 checkpoint: the run resumes to the same final weights, bit for bit.
    final = load_file(str(run / "model.safetensors"))
    (run / "model.safetensors").unlink()
    rows = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("".join(r + "\n" for r in rows if json.loads(r).get("step", 0) <= 2))
    assert main(["train", str(config)]) == 0
    again = load_file(str(run / "model.safetensors"))
    assert again.keys() == final.keys() and all(torch.equal(again[k], final[k]) for k in final)


BASE = {
    "base_model": "unused",
    "datasets": [{"path": "d.jsonl", "type": "chat_template"}],
    "output_dir": "out",
}


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"load_in_4bit": True}, "a 4- or 8-bit base cannot hold trained weights"),
        ({"load_in_8bit": True}, "a 4- or 8-bit base cannot hold trained weights"),
        (
            {"rl": "grpo", "trl": {"reward_funcs": ["exact_match"], "use_vllm": True}},
            "a fully trained model has none",
        ),
        ({"lora_r": 16, "lora_target_linear": True}, "lora_r, lora_target_linear: no `adapter` means full"),
    ],
)
def test_what_full_fine_tuning_cannot_go_with_fails_at_load(keys, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({**BASE, **keys}, "run.yaml")
    assert parse_config({**BASE, "adapter": None}, "run.yaml").full_fine_tuning
    assert not parse_config(
        {**BASE, "adapter": "lora", "lora_target_linear": True}, "run.yaml"
    ).full_fine_tuning


def test_merge_says_a_full_fine_tune_has_nothing_to_merge(tmp_path, tiny_base, chat_data):
    from hanzo_gym.cli.merge import adapter_directory
    from hanzo_gym.errors import GymError

    cfg = load_config(_full_run(tmp_path, tiny_base, chat_data))
    with pytest.raises(GymError, match="nothing to merge"):
        adapter_directory(cfg, None)


def _pair_file(tmp_path):
    rows = [
        {
            "conversation": [{"role": "user", "content": f"What is {a} plus {b}?"}],
            "chosen": {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
            "rejected": {"role": "assistant", "content": f"It is {a * b + 7}, I think."},
        }
        for a in range(4)
        for b in range(4)
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _full_dpo(tmp_path, tiny_base, chat_data, **overrides):
    dataset = {
        "path": str(_pair_file(tmp_path)),
        "type": "chat_template.default",
        "field_messages": "conversation",
    }
    keys = {"rl": "dpo", "datasets": [dataset], "sequence_len": 128, "micro_batch_size": 2, "max_steps": 3}
    return _full_run(
        tmp_path, tiny_base, chat_data, **{**keys, "save_steps": 2, "learning_rate": 1e-3, **overrides}
    )


def test_full_fine_tuning_dpo_scores_its_reference_before_the_first_step(
    tmp_path, tiny_base, chat_data, capsys
):
    """No adapter to disable: the reference is the starting model, its log-probs computed before the first step
    (TRL's precompute_ref_log_probs) instead of a second copy in memory. The first step's policy is that model,
    so its loss is ln 2; the run learns, and a resume (reference scored again from the base, before the
    checkpoint loads) gives the same final weights."""
    import math

    config = _full_dpo(tmp_path, tiny_base, chat_data)
    assert load_config(config).precompute_ref_log_probs
    assert main(["train", str(config)]) == 0
    assert "reference log-probs of 16 items" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5) and losses[-1] < losses[0]
    final = load_file(str(tmp_path / "run" / "model.safetensors"))
    (tmp_path / "run" / "model.safetensors").unlink()
    kept = [line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (tmp_path / "run" / "metrics.jsonl").write_text(
        "".join(line + "\n" for line in kept if json.loads(line).get("step", 0) <= 2)
    )
    assert main(["train", str(config)]) == 0
    again = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert all(torch.equal(again[k], final[k]) for k in final)


@pytest.mark.slow  # a whole run end to end; CI runs it, `make test` stays under 10 minutes
def test_full_fine_tuning_kto_scores_every_planned_kl_pair_before_the_first_step(
    tmp_path, tiny_base, chat_data, capsys
):
    """KTO's KL term pairs each prompt with another completion of its micro-batch, and the micro-batches change
    each epoch: the reference log-probs of every pair of every planned epoch (and of the held-out batches) are
    scored from the starting model before the first step; a pair missing later would fail the run. The first
    step's policy is that model: rewards and KL are 0, so the loss is 1 − σ(0) = 0.5. A resume gives the same
    final weights."""
    rows = [
        {
            "prompt": f"What is {a} plus {b}?",
            "completion": f"{a + b}." if (a + b) % 2 else f"{a * b + 3}?",
            "label": bool((a + b) % 2),
        }
        for a in range(4)
        for b in range(3)
    ]
    data = tmp_path / "kto.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    keys = {"rl": "kto", "datasets": [{"path": str(data), "type": "llama3.ultra"}], "val_set_size": 2}
    config = _full_dpo(tmp_path, tiny_base, chat_data, **keys, max_steps=8)  # 10 examples, 5 steps an epoch
    assert load_config(config).precompute_ref_log_probs
    assert main(["train", str(config)]) == 0
    assert "reference log-probs of 12 items" in capsys.readouterr().out
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in logged if "loss" in r]
    assert len(losses) == 8 and losses[0] == pytest.approx(0.5, abs=1e-5)
    assert next(r for r in logged if "loss" in r)["kl"] == pytest.approx(0.0, abs=1e-6)
    final = load_file(str(tmp_path / "run" / "model.safetensors"))
    (tmp_path / "run" / "model.safetensors").unlink()
    kept = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "run" / "metrics.jsonl").write_text(
        "".join(line + "\n" for line in kept if json.loads(line).get("step", 0) <= 6)
    )
    assert main(["train", str(config)]) == 0  # from checkpoint-6, in the second epoch
    again = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert all(torch.equal(again[k], final[k]) for k in final)


def test_full_fine_tuning_orpo_needs_no_reference(tmp_path, tiny_base, chat_data):
    config = _full_dpo(tmp_path, tiny_base, chat_data, rl="orpo", max_steps=2)
    assert not load_config(config).precompute_ref_log_probs
    assert main(["train", str(config)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "run")).config.model_type == "qwen3"
