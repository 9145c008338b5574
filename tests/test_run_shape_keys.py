"""Axolotl's `lora_model_dir`, `trust_remote_code`, `pad_to_sequence_len`, `eval_sample_packing`,
`group_by_length` and `strict`: each does what Axolotl does, or fails at load with the reason."""

from __future__ import annotations

import json
import random

import pytest
import torch
from config_files import parse_minimal, refusal_of, write_tiny_run
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.trainer_pt_utils import get_length_grouped_indices

from hanzo_gym.cli import main
from hanzo_gym.config import load_config
from hanzo_gym.config.feature import feature_notes
from hanzo_gym.data.batching import epoch_order, length_grouped_order, micro_batches
from hanzo_gym.data.dataset import load_examples
from hanzo_gym.engine import Engine
from hanzo_gym.errors import ModelError
from hanzo_gym.loops import sft
from hanzo_gym.loops.train import build_engine
from hanzo_gym.model import hub
from hanzo_gym.model.load_plan import BaseModelPlan, LoadPlan
from hanzo_gym.model.lora import adapter_weights, read_adapter
from hanzo_gym.records import IGNORE_INDEX


def _config(tmp_path, tiny_base, chat_data, name="run", **overrides):
    return write_tiny_run(tmp_path, tiny_base, chat_data, name, **overrides)


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir, key="loss"):
    return {row["step"]: row[key] for row in _rows(run_dir) if key in row}


_parse, _refusal = parse_minimal, refusal_of


# -- config: the keys load, with their rules --------------------------------------------------------------


def test_the_keys_load_with_their_values(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    cfg = _parse(
        lora_model_dir=str(adapter),
        trust_remote_code=True,
        pad_to_sequence_len=True,
        sample_packing=True,
        eval_sample_packing=False,
        strict=True,
    )
    assert (cfg.lora_model_dir, cfg.trust_remote_code, cfg.pad_to_sequence_len) == (str(adapter), True, True)
    assert (cfg.eval_sample_packing, cfg.strict) == (False, True)
    assert _parse(group_by_length=True).group_by_length is True
    defaults = _parse()
    assert (defaults.lora_model_dir, defaults.trust_remote_code, defaults.pad_to_sequence_len) == (
        None,
        False,
        False,
    )
    assert (defaults.eval_sample_packing, defaults.group_by_length, defaults.strict) == (None, False, False)


def test_strict_takes_only_a_boolean_and_reads_unknown_keys_the_same_either_way():
    assert _parse(strict=False).strict is False
    assert "`strict`" in _refusal(strict="yes")
    for strict in (False, True):
        assert "did you mean `learning_rate`?" in _refusal(strict=strict, learning_rat=1e-4)
        assert (
            "`frobnicate` is no key of Axolotl 0.19's"
            in feature_notes(_parse(strict=strict, frobnicate=1))[0]
        )


def test_lora_model_dir_must_be_an_adapter_directory(tmp_path):
    assert "is not a directory" in _refusal(lora_model_dir=str(tmp_path / "missing"))
    assert "has no adapter_config.json" in _refusal(lora_model_dir=str(tmp_path))


@pytest.mark.parametrize("method", ["dpo", "ipo", "kto"])
def test_lora_model_dir_with_a_reference_method_is_refused_with_the_reason(tmp_path, method):
    (tmp_path / "adapter_config.json").write_text("{}")
    kind = "llama3.ultra" if method == "kto" else "chat_template.default"
    message = _refusal(
        lora_model_dir=str(tmp_path),
        rl=method,
        datasets=[{"path": "d.jsonl", "type": kind}],
        micro_batch_size=2,
    )
    assert f"lora_model_dir with rl: {method} is not supported yet" in message and "reference" in message
    # ORPO and SimPO have no reference model: the starting adapter is simply where training starts
    orpo = _parse(lora_model_dir=str(tmp_path), rl="orpo", datasets=[{"path": "d.jsonl", "type": kind}])
    assert orpo.lora_model_dir == str(tmp_path)


def test_lora_model_dir_with_grpo_needs_no_kl_reference(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    grpo = {"rl": "grpo", "trl": {"reward_funcs": ["exact_match"]}}
    assert _parse(lora_model_dir=str(tmp_path), **grpo).rl == "grpo"
    beta = {**grpo, "trl": {**grpo["trl"], "beta": 0.04}}
    assert "trl.beta > 0 is not supported yet" in _refusal(lora_model_dir=str(tmp_path), **beta)


def test_batching_keys_that_cannot_act_load_saying_so_or_are_refused():
    # what Axolotl ignores loads, turned off, with the line that says so
    pairs = _parse(
        pad_to_sequence_len=True, rl="orpo", datasets=[{"path": "d.jsonl", "type": "chat_template.default"}]
    )
    assert pairs.pad_to_sequence_len is False
    assert (
        "pad_to_sequence_len: changes nothing here: it pads SFT batches, and rl: orpo"
        in feature_notes(pairs)[0]
    )
    packed = _parse(group_by_length=True, sample_packing=True)
    assert (packed.group_by_length, packed.sample_packing) == (False, True)
    assert "group_by_length: changes nothing here: with sample_packing the packer" in feature_notes(packed)[0]
    assert "only together with sample_packing: true" in _refusal(eval_sample_packing=True)
    # false asks for Axolotl's default, with or without the other keys
    assert _parse(eval_sample_packing=False, pad_to_sequence_len=False, group_by_length=False).rl is None


# -- group_by_length: HF's length-grouped order -------------------------------------------------------------


@pytest.mark.parametrize(("n", "batch_size"), [(37, 8), (500, 4), (5, 8), (1000, 2)])
def test_length_grouped_order_is_hfs_rule(monkeypatch, n, batch_size):
    lengths = [random.Random(i * 31 + n).randint(3, 300) for i in range(n)]
    ours = length_grouped_order(lengths, batch_size, seed=3, epoch=1)
    # transformers' own function, handed the same permutation
    monkeypatch.setattr(torch, "randperm", lambda size, generator=None: torch.tensor(epoch_order(size, 3, 1)))
    assert ours == get_length_grouped_indices(lengths, batch_size)
    assert sorted(ours) == list(range(n)) and lengths[ours[0]] == max(lengths)
    assert ours == length_grouped_order(lengths, batch_size, seed=3, epoch=1)  # the same order every time
    if n >= 8 * batch_size:  # several mega-batches: each epoch its own order
        assert ours != length_grouped_order(lengths, batch_size, seed=3, epoch=2)


def test_group_by_length_orders_the_training_windows(tmp_path, tiny_base, chat_data):
    cfg = load_config(_config(tmp_path, tiny_base, chat_data, group_by_length=True))
    train = load_examples(cfg, hub.load_tokenizer(cfg.base_model)).train
    lengths = [len(example) for example in train]
    windows = sft._windows(cfg, train, 0)
    grouped = micro_batches(lengths, length_grouped_order(lengths, 8, cfg.seed, 0), 4)
    assert [b for window in windows for b in window] == grouped
    plain = cfg.model_copy(update={"group_by_length": False})
    assert [b for window in sft._windows(plain, train, 0) for b in window] != grouped
    # one mega-batch is one window here (40 examples // (4 · 8) = 1): each window runs longest first
    for window in windows[1:]:
        flat = [lengths[i] for batch in window for i in batch]
        assert flat == sorted(flat, reverse=True)


def test_group_by_length_resumes_exactly(tmp_path, tiny_base, chat_data):
    # HF's batch of 2: mega-batches of min(40 // 8, 50) · 2 = 10 examples, each window 2 of them
    keys = {"group_by_length": True, "micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 8}
    assert main(["train", str(_config(tmp_path, tiny_base, chat_data, save_steps=4, **keys))]) == 0
    straight = _losses(tmp_path / "run")
    resumed = _config(
        tmp_path,
        tiny_base,
        chat_data,
        name="resumed",
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"),
        **keys,
    )
    assert main(["train", str(resumed)]) == 0
    again = _losses(tmp_path / "resumed")
    assert sorted(again) == [5, 6, 7, 8]
    for step in again:
        assert again[step] == pytest.approx(straight[step], rel=1e-6, abs=1e-7), step
    plain = _config(tmp_path, tiny_base, chat_data, name="plain", **{**keys, "group_by_length": False})
    assert main(["train", str(plain)]) == 0
    assert _losses(tmp_path / "plain")[1] != pytest.approx(straight[1], rel=1e-4)  # another order


# -- pad_to_sequence_len and eval_sample_packing -------------------------------------------------------------


def _spy(monkeypatch, method):
    calls = []
    real = getattr(Engine, method)

    def spy(self, datums, *args, **kwargs):
        calls.append([(len(d), any(d.loss_fn_inputs["weights"].data)) for d in datums])
        return real(self, datums, *args, **kwargs)

    monkeypatch.setattr(Engine, method, spy)
    return calls


@pytest.mark.parametrize("packing", [False, True])
def test_pad_to_sequence_len_pads_every_row_and_changes_no_number(
    tmp_path, tiny_base, chat_data, monkeypatch, packing
):
    keys = {"max_steps": 3, "val_set_size": 0.2, "sample_packing": packing}
    assert main(["train", str(_config(tmp_path, tiny_base, chat_data, name="plain", **keys))]) == 0
    trained = _spy(monkeypatch, "forward_backward")
    scored = _spy(monkeypatch, "forward")
    padded = _config(tmp_path, tiny_base, chat_data, name="padded", pad_to_sequence_len=True, **keys)
    assert main(["train", str(padded)]) == 0
    for call in trained + scored:
        assert not call[-1][1], "a row ends with its padding"
        row = 0
        for length, real in call:
            row += length
            if not real:  # a row's padding closes it at sequence_len tokens
                assert row == 64
                row = 0
        assert row == 0
    assert any(not real for call in trained for _, real in call)
    for key in ("loss", "eval/loss"):
        plain, pad = _losses(tmp_path / "plain", key), _losses(tmp_path / "padded", key)
        assert plain.keys() == pad.keys()
        for step in plain:
            assert pad[step] == pytest.approx(plain[step], rel=1e-5), (key, step)


@pytest.mark.slow  # a whole run end to end; CI runs it, `make test` stays under 10 minutes
def test_eval_sample_packing_packs_the_eval_set_and_the_eval_loss_stays(
    tmp_path, tiny_base, chat_data, monkeypatch
):
    keys = {"max_steps": 2, "val_set_size": 0.5, "sample_packing": True, "micro_batch_size": 2}
    sizes = {}
    for name, value in (("packed", None), ("unpacked", False)):  # unset: as sample_packing (Axolotl)
        scored = _spy(monkeypatch, "forward")
        extra = {} if value is None else {"eval_sample_packing": value}
        assert main(["train", str(_config(tmp_path, tiny_base, chat_data, name=name, **keys, **extra))]) == 0
        sizes[name] = [len(call) for call in scored]
        monkeypatch.undo()
    assert max(sizes["unpacked"]) == 2 and max(sizes["packed"]) > 2  # micro-batches of 2 rows
    assert len(sizes["packed"]) < len(sizes["unpacked"])
    packed, unpacked = _losses(tmp_path / "packed", "eval/loss"), _losses(tmp_path / "unpacked", "eval/loss")
    assert packed.keys() == unpacked.keys() == {0, 2}
    for step in packed:
        assert packed[step] == pytest.approx(unpacked[step], rel=1e-5)


# -- lora_model_dir ---------------------------------------------------------------------------------------


def _saved_adapter_loss(base_dir, adapter_dir, examples) -> float:
    """Mean NLL per trained token of `examples` under the saved adapter, by plain transformers + peft."""
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(adapter_dir)).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            ids = torch.tensor([example.input_ids])
            logprobs = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
            targets = torch.tensor(example.labels[1:])
            trained = targets != IGNORE_INDEX
            nll -= logprobs[trained].gather(1, targets[trained, None]).sum().item()
            count += int(trained.sum())
    return nll / count


def test_lora_model_dir_continues_from_the_saved_adapter(tmp_path, tiny_base, chat_data, capsys):
    first = _config(tmp_path, tiny_base, chat_data, name="first", max_steps=2)
    assert main(["train", str(first)]) == 0
    saved_dir = tmp_path / "first"
    # one window of every example, so the first step's loss is the whole set's mean NLL
    keys = {"max_steps": 1, "micro_batch_size": 40, "gradient_accumulation_steps": 1}
    second = _config(
        tmp_path, tiny_base, chat_data, name="second", lora_model_dir=str(saved_dir), lora_r=2, **keys
    )
    cfg = load_config(second)
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32))
    _, saved = read_adapter(saved_dir)
    start = adapter_weights(engine.model)
    assert start.keys() == saved.keys()
    assert all(torch.equal(start[key], saved[key]) for key in saved)
    assert (
        engine.adapter_config.r == 4
    )  # the directory's rank, as in Axolotl (PEFT reads adapter_config.json)
    assert all(p.requires_grad for p in engine.trainable) and engine.trainable

    capsys.readouterr()
    assert main(["train", str(second)]) == 0
    printed = capsys.readouterr().out
    assert "lora_r 2 (the adapter's: 4)" in printed
    examples = load_examples(cfg, hub.load_tokenizer(cfg.base_model)).train
    first_loss = _losses(tmp_path / "second")[1]
    assert first_loss == pytest.approx(_saved_adapter_loss(tiny_base, saved_dir, examples), rel=1e-5)
    fresh = _config(tmp_path, tiny_base, chat_data, name="fresh", **keys)
    assert main(["train", str(fresh)]) == 0
    assert _losses(tmp_path / "fresh")[1] != pytest.approx(first_loss, rel=1e-3)  # a fresh adapter differs
    written = json.loads((tmp_path / "second" / "adapter_config.json").read_text())
    assert (written["r"], written["base_model_name_or_path"]) == (4, str(tiny_base))


def test_lora_model_dir_with_what_vllm_refuses_fails_clearly(tmp_path, tiny_base, chat_data):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True, "r": 2}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    cfg = load_config(_config(tmp_path, tiny_base, chat_data, lora_model_dir=str(adapter)))
    with pytest.raises(ModelError, match="use_dora"):
        build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32))


# -- trust_remote_code --------------------------------------------------------------------------------------

CUSTOM_CODE = """
from transformers import Qwen3Config, Qwen3ForCausalLM


class TinyCustomConfig(Qwen3Config):
    model_type = "tiny_custom"


class TinyCustomForCausalLM(Qwen3ForCausalLM):
    config_class = TinyCustomConfig
"""


@pytest.fixture
def custom_code_model(tmp_path, tiny_base, monkeypatch):
    """A model folder whose causal LM class lives in its own Python file (config.json's auto_map)."""
    import shutil

    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    directory = tmp_path / "custom"
    shutil.copytree(tiny_base, directory)
    (directory / "modeling_tiny_custom.py").write_text(CUSTOM_CODE)
    config = json.loads((directory / "config.json").read_text())
    config.update(
        model_type="tiny_custom",
        architectures=["TinyCustomForCausalLM"],
        auto_map={
            "AutoConfig": "modeling_tiny_custom.TinyCustomConfig",
            "AutoModelForCausalLM": "modeling_tiny_custom.TinyCustomForCausalLM",
        },
    )
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_trust_remote_code_loads_the_repositorys_own_model_class(custom_code_model):
    with pytest.raises(ModelError, match="set `trust_remote_code: true`"):
        hub.load_causal_lm(BaseModelPlan.of(str(custom_code_model), torch.float32))
    model = hub.load_causal_lm(
        BaseModelPlan.of(str(custom_code_model), torch.float32, trust_remote_code=True)
    )
    assert type(model).__name__ == "TinyCustomForCausalLM"


def test_trust_remote_code_trains_and_reaches_from_pretrained(
    tmp_path, custom_code_model, chat_data, monkeypatch
):
    seen = []
    for loader in (AutoModelForCausalLM, AutoTokenizer):
        real = loader.from_pretrained.__func__

        def recording(cls, *args, _real=real, **kwargs):
            seen.append((cls.__name__, kwargs.get("trust_remote_code")))
            return _real(cls, *args, **kwargs)

        monkeypatch.setattr(loader, "from_pretrained", classmethod(recording))
    path = _config(
        tmp_path,
        custom_code_model,
        chat_data,
        trust_remote_code=True,
        max_steps=1,
        lora_target_linear=False,
        lora_target_modules=["q_proj", "v_proj"],
    )
    assert main(["train", str(path)]) == 0
    assert ("AutoModelForCausalLM", True) in seen and ("AutoTokenizer", True) in seen
    assert list(_losses(tmp_path / "run")) == [1]
