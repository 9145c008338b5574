"""QLoRA: a LoRA adapter trained on a 4-bit NF4 base, and LoRA on an 8-bit (LLM.int8()) base (`load_in_8bit`),
both through bitsandbytes, whose CPU kernels run these tiny models. bitsandbytes quantizes in blocks of 64, so
the tiny model is 64 wide."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from bitsandbytes.nn import Linear4bit
from conftest import save_tiny_word_model
from peft import PeftModel
from transformers import AutoModelForCausalLM

from hanzo_gym.cli import main
from hanzo_gym.config import parse_config
from hanzo_gym.engine.sampling import sample_groups
from hanzo_gym.loops.train import build_engine
from hanzo_gym.model.load_plan import BaseModelPlan, LoadPlan, Quantization
from hanzo_gym.records import Datum, ModelInput, SamplingParams

WIDE = {"hidden_size": 64, "intermediate_size": 128}


@pytest.fixture(scope="module")
def wide_base(tmp_path_factory, word_tokenizer):
    return save_tiny_word_model(tmp_path_factory.mktemp("tiny-wide"), word_tokenizer, **WIDE)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "train.jsonl"
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight"]
    with open(path, "w") as handle:
        for word in words:
            messages = [
                {"role": "user", "content": f"how are you {word}"},
                {"role": "assistant", "content": f"I am well {word} thanks"},
            ]
            handle.write(json.dumps({"messages": messages}) + "\n")
    return path


def qlora_config(base, data, output_dir, **overrides) -> dict:
    return {
        "base_model": str(base),
        "datasets": [{"path": str(data), "type": "chat_template"}],
        "output_dir": str(output_dir),
        "adapter": "qlora",
        "load_in_4bit": True,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_target_linear": True,
        "micro_batch_size": 4,
        "num_epochs": 4,
        "learning_rate": 5e-3,
        "logging_steps": 1,
        "sequence_len": 64,
        **overrides,
    }


def _trains_and_merges(tmp_path, config: dict, base) -> tuple:
    """Train `config` (8 steps), check the loss falls, merge the adapter into the full-precision base, and
    check that the merged model is the base with the adapter; the run folder and the merged folder."""
    run, path = Path(config["output_dir"]), tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0
    metrics = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    losses = [row["loss"] for row in metrics if "loss" in row]
    assert len(losses) == 8 and losses[-1] < losses[0] * 0.7
    # The adapter is an ordinary PEFT adapter: it loads on the full-precision base.
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(run))
    merged_dir = tmp_path / "merged"
    assert main(["merge", str(path), "--out", str(merged_dir)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    tokens = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, tuned(tokens).logits, rtol=1e-4, atol=1e-4)
    return path, run, merged_dir


def test_qlora_trains_on_a_4bit_base_and_merges_into_the_full_precision_model(tmp_path, wide_base, chats):
    _, run, merged_dir = _trains_and_merges(
        tmp_path, qlora_config(wide_base, chats, tmp_path / "run"), wide_base
    )
    assert json.loads((run / "adapter_config.json").read_text())["r"] == 8
    assert "quantization_config" not in json.loads((merged_dir / "config.json").read_text())


def test_a_4bit_model_samples_what_it_scores(tmp_path, wide_base, chats, word_tokenizer):
    cfg = parse_config(qlora_config(wide_base, chats, tmp_path / "unused"))
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32), word_tokenizer)
    linear_bases = [m.base_layer for m in engine.model.modules() if hasattr(m, "base_layer")]
    assert linear_bases and all(isinstance(b, Linear4bit) for b in linear_bases)
    with torch.no_grad():
        for name, parameter in engine.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)  # an adapter that changes what the model says
    prompt = [1, 8, 9, 12]
    [[greedy]] = sample_groups(
        engine.model, word_tokenizer, [prompt], 1, SamplingParams(max_tokens=6, temperature=0)
    )
    tokens = list(prompt)
    engine.model.eval()
    with torch.no_grad():
        for _ in range(len(greedy.tokens)):
            tokens.append(int(engine.model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    assert greedy.tokens == tokens[len(prompt) :]
    [group] = sample_groups(engine.model, word_tokenizer, [prompt], 3, SamplingParams(max_tokens=5, seed=0))
    for sequence in group:
        full = prompt + sequence.tokens
        [recomputed] = engine.forward([Datum(ModelInput.from_ints(full[:-1]), {"target_tokens": full[1:]})])
        torch.testing.assert_close(
            recomputed[-len(sequence.tokens) :], torch.tensor(sequence.logprobs), rtol=1e-3, atol=1e-3
        )


def test_qlora_gradients_equal_those_of_the_dequantized_model(tmp_path, wide_base, chats, word_tokenizer):
    """The reference: the same network in fp32 with each 4-bit weight replaced by its dequantized value, and
    the same adapter. Scores and LoRA gradients must agree (they would not if the 4-bit layers dropped the
    gradient flowing through them)."""
    import bitsandbytes.functional as bnb_functional

    from hanzo_gym.engine import Engine
    from hanzo_gym.model.hub import load_causal_lm
    from hanzo_gym.model.lora import attach_lora

    cfg = parse_config(qlora_config(wide_base, chats, tmp_path / "unused", lora_r=4))
    quantized = build_engine(
        cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32), word_tokenizer
    )
    reference_model = AutoModelForCausalLM.from_pretrained(wide_base)
    for name, module in load_causal_lm(
        BaseModelPlan.of(str(wide_base), torch.float32, quantization=Quantization(bits=4))
    ).named_modules():
        if isinstance(module, Linear4bit):
            dequantized = bnb_functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
            reference_model.get_submodule(name).weight.data.copy_(dequantized)
    reference = Engine(
        attach_lora(
            reference_model,
            r=4,
            alpha=cfg.lora_alpha,
            dropout=0.0,
            target_modules="all-linear",
            base_model_name=str(wide_base),
        )
    )
    for mine, theirs in _gradients_beside(quantized, reference):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)


def _gradients_beside(quantized, reference) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Give both engines the same random adapter, run one cross-entropy pass on each, check that the losses
    agree (rel 1e-5) and return the (quantized, reference) gradient of every LoRA tensor."""
    with torch.no_grad():
        theirs = dict(reference.model.named_parameters())
        for name, parameter in quantized.model.named_parameters():
            if "lora_" in name:
                if "lora_B" in name:
                    parameter.normal_(0, 0.2)
                theirs[name].copy_(parameter)
    data = [
        Datum(
            ModelInput.from_ints([1, 8, 9, 12, 13, 14]),
            {"target_tokens": [8, 9, 12, 13, 14, 2], "weights": [1.0] * 6},
        ),
        Datum(ModelInput.from_ints([20, 21, 22]), {"target_tokens": [21, 22, 2], "weights": [1.0] * 3}),
    ]
    got = quantized.forward_backward(data, "cross_entropy")
    want = reference.forward_backward(data, "cross_entropy")
    assert got.loss_sum == pytest.approx(want.loss_sum, rel=1e-5)
    gradients = {n: p.grad for n, p in reference.model.named_parameters() if p.grad is not None}
    pairs = [(p.grad, gradients[n]) for n, p in quantized.model.named_parameters() if p.grad is not None]
    assert len(pairs) == len(gradients) == 2 * 7 * 2  # A and B of 7 projections in each of 2 layers
    return pairs


def test_trainjob_with_method_qlora_writes_a_full_precision_merged_model(
    tmp_path, wide_base, chats, monkeypatch
):
    from hanzo_gym.cli.trainjob import VARIABLES

    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "chats.jsonl").write_text(chats.read_text())
    output = tmp_path / "output"
    env = {
        "METHOD": "qlora",
        "TASK": "chat",
        "MODEL_DIR": str(wide_base),
        "DATASET_DIR": str(dataset),
        "OUTPUT_DIR": str(output),
        "EPOCHS": "1",
        "BATCH_SIZE": "4",
        "GRAD_ACCUM": "1",
        "MAX_SEQ_LEN": "64",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["trainjob"]) == 0
    resolved = json.loads((output / "run" / "run_config.json").read_text())
    assert (resolved["adapter"], resolved["load_in_4bit"]) == ("qlora", True)
    assert "quantization_config" not in json.loads((output / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(output)
    tuned = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(wide_base), str(output / "adapter")
    )
    tokens = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, tuned(tokens).logits, rtol=1e-4, atol=1e-4)


def _lora_8bit_config(base, data, output_dir, **overrides) -> dict:
    config = qlora_config(base, data, output_dir, adapter="lora", load_in_4bit=False, load_in_8bit=True)
    return {**config, **overrides}


def _dequantized_8bit_reference(base: str, lora_r: int, alpha: float):
    """The same network in fp32 with each 8-bit weight replaced by its dequantized value (int8 row × its
    scale / 127), and a fresh adapter of the same shape."""
    from bitsandbytes.nn import Linear8bitLt

    from hanzo_gym.engine import Engine
    from hanzo_gym.model.hub import load_causal_lm
    from hanzo_gym.model.lora import attach_lora

    reference_model = AutoModelForCausalLM.from_pretrained(base)
    layers = 0
    for name, module in load_causal_lm(
        BaseModelPlan.of(base, torch.float32, quantization=Quantization(bits=8))
    ).named_modules():
        if isinstance(module, Linear8bitLt):
            weight = module.weight
            dequantized = weight.data.float() * weight.SCB.float()[:, None] / 127
            reference_model.get_submodule(name).weight.data.copy_(dequantized)
            layers += 1
    assert layers == 2 * 7
    return Engine(
        attach_lora(
            reference_model,
            r=lora_r,
            alpha=alpha,
            dropout=0.0,
            target_modules="all-linear",
            base_model_name=base,
        )
    )


def test_8bit_lora_gradients_follow_the_dequantized_model(tmp_path, wide_base, chats, word_tokenizer):
    """On a CPU bitsandbytes' int8 layers compute with the dequantized weights (on a GPU LLM.int8() also rounds
    the activations to int8, which this test does not see), so scores and LoRA gradients agree with the
    dequantized fp32 model to float rounding (measured: 2.7e-6 of each gradient's largest entry); a base whose
    layers dropped the gradient flowing through them would be off by about the gradient itself."""
    from bitsandbytes.nn import Linear8bitLt

    cfg = parse_config(_lora_8bit_config(wide_base, chats, tmp_path / "unused", lora_r=4))
    quantized = build_engine(
        cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32), word_tokenizer
    )
    bases = [m.base_layer for m in quantized.model.modules() if hasattr(m, "base_layer")]
    assert bases and all(isinstance(b, Linear8bitLt) for b in bases)
    reference = _dequantized_8bit_reference(str(wide_base), 4, cfg.lora_alpha)
    worst = max(
        float((mine - theirs).abs().max() / theirs.abs().max())
        for mine, theirs in _gradients_beside(quantized, reference)
    )
    assert worst < 1e-4


def test_8bit_lora_trains_resumes_the_same_kind_and_merges_into_the_full_precision_model(
    tmp_path, wide_base, chats, word_tokenizer, capsys
):
    config = _lora_8bit_config(wide_base, chats, tmp_path / "run", save_steps=4)
    path, run, _ = _trains_and_merges(tmp_path, config, wide_base)
    # a checkpoint of the 8-bit run does not resume as a full-precision one
    plain = _lora_8bit_config(
        wide_base, chats, run, load_in_8bit=False, resume_from_checkpoint=str(run / "checkpoint-4")
    )
    path.write_text(yaml.safe_dump(plain))
    capsys.readouterr()
    assert main(["train", str(path)]) != 0
    assert "load_in_8bit" in capsys.readouterr().err


def test_an_8bit_model_samples_what_it_scores(tmp_path, wide_base, chats, word_tokenizer):
    cfg = parse_config(_lora_8bit_config(wide_base, chats, tmp_path / "unused"))
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32), word_tokenizer)
    with torch.no_grad():
        for name, parameter in engine.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
    prompt = [1, 8, 9, 12]
    [group] = sample_groups(engine.model, word_tokenizer, [prompt], 3, SamplingParams(max_tokens=5, seed=0))
    for sequence in group:
        full = prompt + sequence.tokens
        [recomputed] = engine.forward([Datum(ModelInput.from_ints(full[:-1]), {"target_tokens": full[1:]})])
        # LLM.int8() keeps the input columns with an outlier (> 6) anywhere in the batch in 16 bits, so a
        # token's score depends a little on which tokens share its pass (one at a time when sampling, the
        # whole sequence when scoring): measured up to 0.02 nats here. An adapter the sampler left out would
        # be off by whole nats (lora_B ~ N(0, 0.3)).
        torch.testing.assert_close(
            recomputed[-len(sequence.tokens) :], torch.tensor(sequence.logprobs), rtol=0, atol=0.05
        )


def test_bnb_config_kwargs_set_the_4bit_layers_quantization(tmp_path, wide_base, chats):
    from hanzo_gym.config import load_config

    def first_4bit_layer(**kwargs):
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(qlora_config(wide_base, chats, tmp_path / "run", **kwargs)))
        cfg = load_config(path)
        engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32))
        return next(m for m in engine.model.modules() if isinstance(m, Linear4bit)).weight.quant_state

    qlora = first_4bit_layer()
    assert (qlora.quant_type, qlora.nested) == ("nf4", True)
    same = first_4bit_layer(bnb_config_kwargs={"bnb_4bit_use_double_quant": True})  # Axolotl's Gemma 4 config
    assert (same.quant_type, same.nested) == ("nf4", True)
    other = first_4bit_layer(
        bnb_config_kwargs={"bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": False}
    )
    assert (other.quant_type, other.nested) == ("fp4", False)
    # `adapter: lora` on load_in_4bit: what Axolotl before 0.13 loaded, transformers' load_in_4bit defaults
    older = first_4bit_layer(adapter="lora")
    assert (older.quant_type, older.nested) == ("fp4", False)
    defaults = transformers.BitsAndBytesConfig(load_in_4bit=True)
    assert (defaults.bnb_4bit_quant_type, defaults.bnb_4bit_use_double_quant) == ("fp4", False)
    with pytest.raises(
        Exception, match="bnb_config_kwargs sets how a 4-bit base is quantized; it needs load_in_4bit"
    ):
        parse_config({**qlora_config(wide_base, chats, tmp_path / "run"), "adapter": "lora", "load_in_4bit": False,
                      "bnb_config_kwargs": {}}, "run.yaml")  # fmt: skip
