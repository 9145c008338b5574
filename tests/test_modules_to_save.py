"""Axolotl's `lora_modules_to_save`: whole modules (the embeddings and the output layer) trained
beside the LoRA adapter, as PEFT's modules_to_save; the engine's fused log-probability path trains the output
copy, a reference pass scores with the base's, the adapter saves, resumes and merges as PEFT's own does."""

from __future__ import annotations

import json

import pytest
import torch
from config_files import write_tiny_run
from conftest import save_tiny_qwen3
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hanzo_gym.cli import main
from hanzo_gym.config import load_config
from hanzo_gym.config.feature import feature_notes
from hanzo_gym.errors import ConfigError, ModelError
from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.loops.train import build_engine
from hanzo_gym.model.load_plan import LoadPlan
from hanzo_gym.model.lora import read_adapter_config
from hanzo_gym.records import Datum

SAVED = ["embed_tokens", "lm_head"]


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def base(request, tmp_path_factory, qwen3_tokenizer):
    """A tiny Qwen3 whose input and output embeddings are one matrix (as SmolLM2's and Llama 3.2 1B's), or two."""
    directory = tmp_path_factory.mktemp("tied" if request.param else "untied")
    return save_tiny_qwen3(
        directory, qwen3_tokenizer, tie_word_embeddings=request.param, initializer_range=0.2
    )


TEXTS = ["the cat sat on the mat", "a dog ran far away from home"]


def _datums(tokenizer) -> list[Datum]:
    return [
        Datum.from_tokens(t[:-1], target_tokens=t[1:], weights=[1.0] * (len(t) - 1))
        for t in map(tokenizer.encode, TEXTS)
    ]


def test_the_trained_copies_get_the_gradient_plain_peft_gives(base, tmp_path, chat_data, qwen3_tokenizer):
    """One forward_backward through the engine (fused, chunked log-probabilities) against transformers' loss
    on the same PEFT model: equal loss, and equal gradients of the trained embedding/output copies."""
    cfg = load_config(write_tiny_run(tmp_path, base, chat_data, lora_modules_to_save=SAVED))
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32), qwen3_tokenizer)
    copies = {n: p for n, p in engine.model.named_parameters() if "modules_to_save" in n}
    assert copies and all(p.requires_grad for p in copies.values())
    tied = engine.model.get_base_model().config.tie_word_embeddings
    assert len(copies) == (1 if tied else 2)  # a tied pair stays one matrix

    datums = _datums(qwen3_tokenizer)
    engine.forward_backward(datums, "cross_entropy")
    ours = {n: p.grad.clone() for n, p in copies.items()}
    loss = engine.forward_loss(datums).loss_sum
    engine.model.zero_grad(set_to_none=True)
    total = 0.0
    for text in TEXTS:
        tokens = torch.tensor([qwen3_tokenizer.encode(text)])
        logits = engine.model(input_ids=tokens[:, :-1]).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0], tokens[0, 1:], reduction="sum")
        nll.backward()
        total += float(nll)
    assert loss == pytest.approx(total, rel=1e-5)
    # The output layer's gradient is summed over chunks of 64 positions (Qwen3's vocabulary) in fp32, the
    # reference's in one matmul: measured 9e-6 apart at most, 3 of 4.9M entries beyond 1e-6
    for name, parameter in copies.items():
        torch.testing.assert_close(ours[name], parameter.grad, rtol=1e-4, atol=2e-5)


def test_a_run_trains_the_copies_saves_resumes_and_merges(base, tmp_path, chat_data, qwen3_tokenizer):
    config = write_tiny_run(tmp_path, base, chat_data, lora_modules_to_save=SAVED, max_steps=3, save_steps=2)
    assert main(["train", str(config)]) == 0
    run = tmp_path / "run"
    saved = read_adapter_config(run)
    assert "embed_tokens" in saved.modules_to_save  # PEFT writes a tied pair its own way
    weights = load_file(str(run / "adapter_model.safetensors"))
    head_key = next(k for k in weights if k.endswith("lm_head.weight"))
    original = AutoModelForCausalLM.from_pretrained(str(base))
    assert not torch.equal(weights[head_key], original.lm_head.weight.detach())  # the copy trained

    # PEFT's own loader gives the trained head, with the base's layers untouched; the merged model equals it.
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(run))
    tokens = torch.tensor([qwen3_tokenizer.encode("the cat sat on the mat")])
    with torch.no_grad():
        want = loaded(input_ids=tokens).logits
    assert main(["merge", str(config), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=tokens).logits, want, rtol=1e-4, atol=1e-4)
    tied = original.config.tie_word_embeddings
    assert (
        json.loads((tmp_path / "merged" / "config.json").read_text()).get("tie_word_embeddings", True) == tied
    )
    if tied:
        assert torch.equal(merged.lm_head.weight, merged.model.embed_tokens.weight)

    # Killed after its step-2 checkpoint, the run resumes to the same final adapter.
    final = load_file(str(run / "adapter_model.safetensors"))
    for entry in ("adapter_model.safetensors", "adapter_config.json"):
        (run / entry).unlink()
    rows = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("".join(r + "\n" for r in rows if json.loads(r).get("step", 0) <= 2))
    assert main(["train", str(config)]) == 0
    again = load_file(str(run / "adapter_model.safetensors"))
    assert again.keys() == final.keys() and all(torch.equal(again[k], final[k]) for k in final)


def test_the_reference_pass_scores_with_the_bases_layers(tmp_path, tiny_base, chat_data, qwen3_tokenizer):
    cfg = load_config(write_tiny_run(tmp_path, tiny_base, chat_data, lora_modules_to_save=SAVED))
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32), qwen3_tokenizer)
    datums = _datums(qwen3_tokenizer)
    before = engine.forward(datums, reference=True)
    with torch.no_grad():
        for name, parameter in engine.model.named_parameters():
            if "modules_to_save" in name:
                parameter.add_(torch.randn_like(parameter) * 0.5)
    moved = engine.forward(datums)
    after = engine.forward(datums, reference=True)
    for a, b, m in zip(before, after, moved, strict=True):
        torch.testing.assert_close(a, b)
        assert not torch.allclose(a, m)


def test_a_bf16_run_keeps_the_copies_in_fp32(tmp_path, tiny_base, chat_data, qwen3_tokenizer):
    cfg = load_config(write_tiny_run(tmp_path, tiny_base, chat_data, lora_modules_to_save=SAVED, bf16=True))
    engine = build_engine(
        cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.bfloat16), qwen3_tokenizer
    )
    copies = [p for n, p in engine.model.named_parameters() if "modules_to_save" in n]
    assert copies and all(p.dtype == torch.float32 for p in copies)
    out = engine.forward_backward(_datums(qwen3_tokenizer), "cross_entropy")
    assert torch.isfinite(torch.tensor(out.loss_sum)) and all(torch.isfinite(p.grad).all() for p in copies)
    engine.optim_step(engine_adam())


def engine_adam():
    from hanzo_gym.records import AdamParams

    return AdamParams(learning_rate=1e-3)


def test_what_cannot_use_the_copies_says_so(tmp_path, tiny_base, chat_data):
    grpo = {"rl": "grpo", "trl": {"reward_funcs": ["exact_match"]}, "lora_modules_to_save": SAVED}
    with pytest.raises(ConfigError, match="sampler folds only the LoRA deltas"):
        load_config(write_tiny_run(tmp_path, tiny_base, chat_data, name="grpo", **grpo))
    with pytest.raises(ModelError, match="has no module of that name"):
        cfg = load_config(write_tiny_run(tmp_path, tiny_base, chat_data, lora_modules_to_save=["wte"]))
        build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32))
    config = write_tiny_run(
        tmp_path, tiny_base, chat_data, name="served", lora_modules_to_save=SAVED, max_steps=1
    )
    assert main(["train", str(config)]) == 0
    with pytest.raises(ModelError, match="gym merge"):
        ModelHost(str(tiny_base), dtype=torch.float32).load_adapter("trained", tmp_path / "served")


def test_a_bf16_base_runs_the_models_own_forward_and_lora_model_dir_continues(
    tmp_path, tiny_base, chat_data, qwen3_tokenizer
):
    """The copies' dtype hooks: the model's own forward (not only the fused path) runs over a bf16 base; and a
    later run continues from such an adapter with lora_model_dir, its copies included."""
    cfg = load_config(write_tiny_run(tmp_path, tiny_base, chat_data, lora_modules_to_save=SAVED, bf16=True))
    engine = build_engine(
        cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.bfloat16), qwen3_tokenizer
    )
    tokens = torch.tensor([qwen3_tokenizer.encode(TEXTS[0])])
    with torch.no_grad():
        assert torch.isfinite(engine.model(input_ids=tokens).logits).all()

    first = write_tiny_run(
        tmp_path, tiny_base, chat_data, name="first", lora_modules_to_save=SAVED, max_steps=1
    )
    assert main(["train", str(first)]) == 0
    second = load_config(
        write_tiny_run(tmp_path, tiny_base, chat_data, name="second", lora_model_dir=str(tmp_path / "first"))
    )
    continued = build_engine(
        second, LoadPlan.from_config(second, torch.device("cpu"), torch.float32), qwen3_tokenizer
    )
    saved = load_file(str(tmp_path / "first" / "adapter_model.safetensors"))
    start = continued.weights()
    assert start.keys() == saved.keys() and all(torch.equal(start[k], saved[k]) for k in saved)
    grpo = {"rl": "grpo", "trl": {"reward_funcs": ["exact_match"]}, "lora_model_dir": str(tmp_path / "first")}
    with pytest.raises(ModelError, match="GRPO sampler folds only LoRA deltas"):
        cfg = load_config(write_tiny_run(tmp_path, tiny_base, chat_data, name="g", **grpo))
        build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32))


def test_module_names_match_as_peft_matches_them(tmp_path, tiny_base, chat_data, qwen3_tokenizer):
    cfg = load_config(
        write_tiny_run(tmp_path, tiny_base, chat_data, lora_modules_to_save=["model.embed_tokens"])
    )
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32), qwen3_tokenizer)
    assert any("embed_tokens.modules_to_save" in n for n, _ in engine.model.named_parameters())


def test_a_saved_module_also_named_a_lora_target_is_trained_whole_as_peft_builds_it(
    tmp_path, tiny_base, chat_data, qwen3_tokenizer
):
    """Configs list embed_tokens and lm_head in both keys; PEFT then wraps them whole and gives them no LoRA."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "v_proj", *SAVED]
    cfg = load_config(
        write_tiny_run(
            tmp_path,
            tiny_base,
            chat_data,
            lora_target_linear=False,
            lora_target_modules=targets,
            lora_modules_to_save=SAVED,
        )
    )
    assert cfg.lora_target_modules == ["q_proj", "v_proj"]
    (note,) = [line for line in feature_notes(cfg) if "also in lora_modules_to_save" in line]
    assert note.startswith("lora_target_modules: embed_tokens, lm_head also in lora_modules_to_save")
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32), qwen3_tokenizer)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_base),
        LoraConfig(r=cfg.lora_r, target_modules=targets, modules_to_save=SAVED),
    )
    trained = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trained == {n for n, p in peft_model.named_parameters() if p.requires_grad}
