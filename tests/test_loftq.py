"""LoftQ (Axolotl's `peft.loftq_config`): the start equals PEFT's own `init_lora_weights="loftq"`, which PEFT 0.21
runs on CUDA only and these tests run on the CPU by sending its `.to("cuda")` to the CPU; the adapter trains,
resumes and merges over the rounded base it started from, and the servers refuse it on a shared base."""

from __future__ import annotations

import json
import re

import pytest
import torch
from config_files import refusal_of, write_tiny_run
from peft import LoftQConfig, LoraConfig, PeftModel, get_peft_model
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM

from hanzo_gym.cli import main
from hanzo_gym.errors import ModelError
from hanzo_gym.model.load_plan import LoadPlan
from hanzo_gym.model.loftq import rounded_weight, start_loftq
from hanzo_gym.model.lora import attach_lora

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def peft_on_the_cpu(monkeypatch):
    """PEFT's LoftQ moves its work to "cuda" (or "xpu"); here every such move stays on the CPU, where
    bitsandbytes 0.50 quantizes too, so PEFT's own code is the reference."""
    original = torch.Tensor.to

    def to_cpu(tensor, *args, **kwargs):
        args = tuple("cpu" if str(a).startswith(("cuda", "xpu")) else a for a in args)
        if str(kwargs.get("device", "")).startswith(("cuda", "xpu")):
            kwargs["device"] = "cpu"
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to_cpu)


def _two_copies(seed: int = 3):
    first = tiny_model("qwen3", seed=seed, initializer_range=0.2)
    second = tiny_model("qwen3", seed=seed, initializer_range=0.2)
    return first, second


@pytest.mark.parametrize("bits", [4, 8])
def test_the_start_equals_peft_loftq_init(bits, peft_on_the_cpu):
    ours, theirs = _two_copies()
    ours = attach_lora(ours, r=8, alpha=16, dropout=0.0, target_modules=TARGETS, base_model_name="tiny")
    start_loftq(ours, bits)
    theirs = get_peft_model(
        theirs,
        LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=TARGETS,
            init_lora_weights="loftq",
            loftq_config=LoftQConfig(loftq_bits=bits),
        ),
    )
    expected = theirs.state_dict()
    got = ours.state_dict()
    assert sorted(got) == sorted(expected)
    rounded = 0
    for name, value in expected.items():
        torch.testing.assert_close(got[name].float(), value.float(), rtol=0, atol=0, msg=name)
        rounded += name.endswith("base_layer.weight")
    assert rounded == 7 * 2  # every adapted layer of both blocks keeps the rounded weight
    config = ours.peft_config["default"]
    assert config.init_lora_weights == "loftq" and config.loftq_config["loftq_bits"] == bits


def test_the_start_is_closer_to_the_full_precision_model_than_the_rounded_base():
    """With alpha = r (PEFT's LoftQ leaves the alpha / r scale in, as the module docstring says), Q + B·A is
    nearer W than Q alone, and so are the logits."""
    original, copy = _two_copies()
    tokens = torch.tensor([[5, 17, 42, 8, 63, 30, 11]])
    with torch.no_grad():
        reference = original(tokens).logits
    model = attach_lora(copy, r=8, alpha=8, dropout=0.0, target_modules=TARGETS, base_model_name="tiny")
    start_loftq(model, 4)
    with torch.no_grad():
        started = model(tokens).logits
        with model.disable_adapter():
            rounded_only = model(tokens).logits
    assert (started - reference).norm() < 0.8 * (rounded_only - reference).norm()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    full = original.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(layer.base_layer.weight, rounded_weight(full, 4))
    assert torch.equal(
        rounded_weight(layer.base_layer.weight, 4), layer.base_layer.weight
    )  # rounding is stable


LOFTQ = {"peft": {"loftq_config": {"loftq_bits": 4}}}


def _config(tmp_path, base, data, name="run", **overrides):
    keys = {**LOFTQ, "gradient_accumulation_steps": 1, "max_steps": 4, "save_steps": 2, **overrides}
    return write_tiny_run(tmp_path, base, data, name=name, **keys)


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def test_a_loftq_run_records_it_resumes_exactly_and_merges_as_peft_does(
    tmp_path, tiny_base, chat_data, peft_on_the_cpu
):
    path = _config(tmp_path, tiny_base, chat_data)
    assert main(["train", str(path)]) == 0
    run = tmp_path / "run"
    adapter = json.loads((run / "adapter_config.json").read_text())
    assert adapter["init_lora_weights"] == "loftq" and adapter["loftq_config"]["loftq_bits"] == 4

    resumed = _config(
        tmp_path,
        tiny_base,
        chat_data,
        name="resumed",
        resume_from_checkpoint=str(run / "checkpoint-2"),
    )
    assert main(["train", str(resumed)]) == 0
    assert _losses(tmp_path / "resumed") == {step: _losses(run)[step] for step in (3, 4)}

    # PEFT loads the adapter by re-running LoftQ's rounding of the base (on the CPU here), then its weights;
    # gym merge folds it into the same rounded base.
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_base), str(run))
    assert main(["merge", str(path), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    tokens = torch.tensor([[9707, 11, 1879, 0, 42, 77, 5]])
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, peft(tokens).logits, rtol=1e-4, atol=1e-5)
        plain = AutoModelForCausalLM.from_pretrained(tiny_base)
        plain_merge = PeftModel.from_pretrained(plain, str(run), config=_plain(run)).merge_and_unload()
        assert not torch.allclose(merged(tokens).logits, plain_merge(tokens).logits, atol=1e-4)


def _plain(run) -> LoraConfig:
    """The adapter's config without its LoftQ start: what a loader that ignores it would apply to W."""
    from hanzo_gym.model.loftq import without_loftq_start
    from hanzo_gym.model.lora import read_adapter_config

    return without_loftq_start(read_adapter_config(run))


def test_resuming_without_loftq_is_refused(tmp_path, tiny_base, chat_data, capsys):
    assert main(["train", str(_config(tmp_path, tiny_base, chat_data, max_steps=2))]) == 0
    other = _config(
        tmp_path,
        tiny_base,
        chat_data,
        peft=None,
        name="other",
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"),
    )
    assert main(["train", str(other)]) == 2
    assert "loftq_bits: 4 → None" in capsys.readouterr().err


def test_continuing_a_loftq_adapter_keeps_its_rounded_base(tmp_path, tiny_base, chat_data, capsys):
    from hanzo_gym.config import load_config
    from hanzo_gym.loops.train import build_engine

    assert main(["train", str(_config(tmp_path, tiny_base, chat_data, max_steps=2, save_steps=None))]) == 0
    path = _config(tmp_path, tiny_base, chat_data, name="b", peft=None, lora_model_dir=str(tmp_path / "run"))
    cfg = load_config(path)
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32))
    layer = engine.model.base_model.model.model.layers[1].mlp.down_proj
    full = AutoModelForCausalLM.from_pretrained(tiny_base).model.layers[1].mlp.down_proj.weight
    assert torch.equal(layer.base_layer.weight, rounded_weight(full, 4))
    assert engine.model.peft_config["default"].init_lora_weights == "loftq"  # and its output says so again


def test_a_server_refuses_a_loftq_adapter_on_its_shared_base(tmp_path, tiny_base, chat_data):
    from hanzo_gym.host.model_host import ModelHost

    assert main(["train", str(_config(tmp_path, tiny_base, chat_data, max_steps=1, save_steps=None))]) == 0
    host = ModelHost(str(tiny_base))
    with pytest.raises(ModelError, match="LoftQ adapter.*gym merge"):
        host.load_adapter("loftq", tmp_path / "run")


@pytest.mark.parametrize(
    "overrides, refusal",
    [
        ({"adapter": "qlora", "load_in_4bit": True}, "goes with `adapter: lora`"),
        ({"load_in_8bit": True}, "goes with `adapter: lora`"),
        ({"trl": {"use_vllm": True}, "rl": "grpo"}, "trl.use_vllm"),
        ({"peft": {"loftq_config": {"loftq_bits": 2}}}, "loftq_bits"),
        ({"peft": {"loftq_config": {"loftq_bits": 4, "loftq_iter": 2}}}, "loftq_iter"),
    ],
)
def test_what_loftq_cannot_go_with_is_refused(overrides, refusal):
    assert re.search(refusal, refusal_of(**{**LOFTQ, **overrides}))
