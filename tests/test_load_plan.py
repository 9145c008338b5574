"""The load plan: a run's config translated once into what it loads and how; the base's config.json read once."""

import torch
import yaml
from config_files import write_tiny_run

from hanzo_gym.cli import main
from hanzo_gym.config import load_config, parse_config
from hanzo_gym.engine.distributed import say
from hanzo_gym.model import hub
from hanzo_gym.model.load_plan import AdapterPlan, LoadPlan, Quantization

CPU = torch.device("cpu")


def test_a_training_run_reads_the_base_models_config_json_once(tmp_path, tiny_base, chat_data, monkeypatch):
    reads = []
    read = hub._read_model_config
    monkeypatch.setattr(hub, "_read_model_config", lambda *args: reads.append(args) or read(*args))
    assert main(["train", str(write_tiny_run(tmp_path, tiny_base, chat_data, max_steps=1))]) == 0
    assert len(reads) == 1


def test_a_lora_run_loads_its_base_in_the_compute_dtype(tmp_path, tiny_base, chat_data):
    cfg = load_config(write_tiny_run(tmp_path, tiny_base, chat_data, lora_r=8, peft_use_rslora=True))
    plan = LoadPlan.from_config(cfg, CPU, torch.bfloat16)
    assert (plan.base.dtype, plan.autocast_dtype, plan.device) == (torch.bfloat16, None, CPU)
    assert plan.source.directory == tiny_base.resolve() and plan.source.model_type == "qwen3"
    assert plan.base.quantization == Quantization()
    assert plan.adapter == AdapterPlan(r=8, alpha=8, dropout=0.0, target_modules="all-linear", rslora=True)


def test_full_fine_tuning_keeps_fp32_weights_under_autocast(tmp_path, tiny_base, chat_data):
    keys = yaml.safe_load(write_tiny_run(tmp_path, tiny_base, chat_data).read_text())
    for key in ("adapter", "lora_r", "lora_alpha", "lora_dropout", "lora_target_linear"):
        del keys[key]
    cfg = parse_config(keys)
    plan = LoadPlan.from_config(cfg, CPU, torch.bfloat16)
    assert (plan.base.dtype, plan.autocast_dtype, plan.adapter) == (torch.float32, torch.bfloat16, None)
    assert LoadPlan.from_config(cfg, CPU, torch.float32).autocast_dtype is None


def test_the_plan_translates_the_loader_keys_once(tmp_path, tiny_base, chat_data):
    cfg = load_config(
        write_tiny_run(
            tmp_path,
            tiny_base,
            chat_data,
            adapter="qlora",
            load_in_4bit=True,
            bnb_config_kwargs={"bnb_4bit_quant_type": "fp4"},
            attn_implementation="flash_attention_2",
            activation_offloading=True,
            gradient_checkpointing=True,
        )
    )
    plan = LoadPlan.from_config(cfg, CPU, torch.float32)
    assert plan.base.quantization == Quantization(bits=4, bnb_4bit={"bnb_4bit_quant_type": "fp4"})
    assert plan.base.attention is None  # no flash kernel on a CPU: transformers' default
    assert (plan.activations.offloading, plan.activations.checkpointing) == (False, True)
    assert any("flash_attention_2 runs on CUDA only" in note for note in plan.notes)
    assert any("activation_offloading: on cpu" in note for note in plan.notes)


def test_say_prints_the_lines_that_are_not_empty(capsys):
    say("one", None, "", "two")
    assert capsys.readouterr().out == "one\ntwo\n"
