"""Axolotl's `unfrozen_parameters`: full fine-tuning of the parameters its patterns match, read as
Axolotl reads them; the frozen ones keep their values and hold no optimizer state; a resumed run must name the
same ones; with an adapter (where Axolotl would freeze the adapter too) and for row ranges it fails at load."""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_full_fine_tuning import BASE, _full_run
from tiny_models import tiny_model

from hanzo_gym.cli import main
from hanzo_gym.config import load_config, parse_config
from hanzo_gym.errors import ConfigError, ModelError
from hanzo_gym.loops.train import build_engine
from hanzo_gym.model.load_plan import LoadPlan
from hanzo_gym.model.unfreeze import train_only_matching

PATTERNS = ["model.layers.1.*", "^lm_head"]


def test_patterns_match_as_axolotl_reads_them():
    model = tiny_model("llama", num_hidden_layers=3, tie_word_embeddings=False)
    train_only_matching(model, ["model.layers.[12].mlp", "^lm_head.weight$"])
    trained = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    assert trained == ["lm_head.weight"] + [
        f"model.layers.{i}.mlp.{proj}.weight"
        for i in (1, 2)
        for proj in ("down_proj", "gate_proj", "up_proj")
    ]
    # `.` is a literal dot (Axolotl escapes it), so `model.layers.1` cannot match `model_layers_1`, and a
    # pattern is matched from the start of the name: `layers.1` alone matches nothing.
    with pytest.raises(
        ModelError, match=r"unfrozen_parameters: `layers.1` matches no parameter of the model"
    ):
        train_only_matching(model, ["layers.1", "^lm_head"])


def test_a_tied_output_layer_answers_to_both_names():
    model = tiny_model("llama", tie_word_embeddings=True)
    train_only_matching(model, ["^lm_head"])
    assert model.model.embed_tokens.weight.requires_grad  # the one matrix, named lm_head.weight too
    assert not model.model.layers[0].self_attn.q_proj.weight.requires_grad


def test_a_run_trains_only_the_unfrozen_and_resumes_on_the_same(
    tmp_path, tiny_base, chat_data, qwen3_tokenizer, capsys
):
    config = _full_run(
        tmp_path, tiny_base, chat_data, max_steps=2, save_steps=1, unfrozen_parameters=PATTERNS
    )
    cfg = load_config(config)
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32), qwen3_tokenizer)
    names = {id(p): n for n, p in engine.model.named_parameters(remove_duplicate=False)}
    assert sorted({names[id(p)] for p in engine.trainable}) == sorted(
        n for n, _ in engine.model.named_parameters() if n.startswith(("model.layers.1.", "lm_head"))
    )
    assert main(["train", str(config)]) == 0
    trained, base = (
        load_file(str(tmp_path / "run" / "model.safetensors")),
        load_file(str(tiny_base / "model.safetensors")),
    )
    moved = sorted(name for name in base if not torch.equal(trained[name], base[name]))
    assert moved and all(name.startswith(("model.layers.1.", "lm_head")) for name in moved), moved
    optimizer = load_file(str(tmp_path / "run" / "checkpoint-1" / "optimizer.safetensors"))
    state_numel = sum(t.numel() for k, t in optimizer.items() if k.endswith("exp_avg"))
    assert state_numel == sum(p.numel() for p in engine.trainable)  # no state for what is frozen

    # Resumed with other patterns, the checkpoint's optimizer state would belong to other parameters.
    other = _full_run(tmp_path, tiny_base, chat_data, "other", max_steps=3, unfrozen_parameters=["^lm_head"])
    written = yaml.safe_load(other.read_text())
    other.write_text(
        yaml.safe_dump({**written, "output_dir": str(tmp_path / "run"), "resume_from_checkpoint": True})
    )
    assert main(["train", str(other)]) == 2
    assert "settings differ from the checkpoint's (unfrozen_parameters:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"adapter": "lora", "lora_target_linear": True, "unfrozen_parameters": ["^lm_head"]},
            "with `adapter: lora` Axolotl freezes the adapter too",
        ),
        ({"unfrozen_parameters": ["^model.embed_tokens.weight$[:32000]"]}, "training only some rows"),
        ({"unfrozen_parameters": ["model.layers.(1"]}, "`model.layers.(1` is not a valid regular expression"),
    ],
)
def test_what_unfrozen_parameters_cannot_do_fails_at_load(keys, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({**BASE, **keys}, "run.yaml")
    assert parse_config({**BASE, "unfrozen_parameters": None}, "run.yaml").unfrozen_parameters is None
