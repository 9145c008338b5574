"""Axolotl's loader keys: model_type / tokenizer_type checked against what loads, attn_implementation, tf32."""

from __future__ import annotations

import pytest
import torch
import yaml

from hanzo_gym.cli import main
from hanzo_gym.config import load_config
from hanzo_gym.errors import ModelError
from hanzo_gym.loops.train import build_engine
from hanzo_gym.model import loader_keys
from hanzo_gym.model.load_plan import LoadPlan


def test_the_loader_classes_must_be_what_the_model_loads_as(qwen3_tokenizer):
    from tiny_models import tiny_model

    model = tiny_model("qwen3")
    for fine in (None, "AutoModelForCausalLM", "Qwen3ForCausalLM"):
        loader_keys.check_loader_class("model_type", fine, model, "tiny")
    with pytest.raises(
        ModelError, match="model_type: LlamaForCausalLM, but base_model `tiny` loads as Qwen3"
    ):
        loader_keys.check_loader_class("model_type", "LlamaForCausalLM", model, "tiny")
    name = type(qwen3_tokenizer).__name__.removesuffix("Fast")
    for fine in ("AutoTokenizer", name, name + "Fast"):
        loader_keys.check_loader_class("tokenizer_type", fine, qwen3_tokenizer, "tiny")
    with pytest.raises(ModelError, match="tokenizer_type: LlamaTokenizer, but .* remove tokenizer_type"):
        loader_keys.check_loader_class("tokenizer_type", "LlamaTokenizer", qwen3_tokenizer, "tiny")


def test_a_flash_kernel_falls_back_to_sdpa_where_it_cannot_run(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert loader_keys.attention_kernel(None, cpu) == (None, None)
    assert loader_keys.attention_kernel("eager", cpu) == ("eager", None)
    kernel, note = loader_keys.attention_kernel("flash_attention_2", cpu)
    assert kernel is None and "runs on CUDA only" in note
    monkeypatch.setattr(loader_keys.importlib.util, "find_spec", lambda name: None)
    kernel, note = loader_keys.attention_kernel("flash_attention_2", cuda)
    assert kernel is None and "`flash_attn` package, not installed" in note
    monkeypatch.setattr(loader_keys.importlib.util, "find_spec", lambda name: object())
    assert loader_keys.attention_kernel("flash_attention_2", cuda) == ("flash_attention_2", None)


def test_flex_attention_runs_on_cuda_and_falls_back_where_it_has_no_backward():
    kernel, note = loader_keys.attention_kernel("flex_attention", torch.device("cpu"))
    assert kernel is None and "no backward pass on cpu; using sdpa" in note
    assert loader_keys.attention_kernel("flex_attention", torch.device("cuda")) == ("flex_attention", None)


def test_flex_attn_compile_kwargs_reach_the_compile_transformers_runs(monkeypatch):
    """transformers compiles FlexAttention through its WrappedFlexAttention, once per process; after
    compile_flex_attention_with, what it calls is torch.compile(flex_attention, **the config's arguments)."""
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as integration

    monkeypatch.setattr(
        integration, "WrappedFlexAttention", integration.WrappedFlexAttention
    )  # restored after
    calls = []

    def recording_compile(function, **arguments):
        calls.append((function, arguments))
        return function

    monkeypatch.setattr(loader_keys.torch, "compile", recording_compile)
    loader_keys.compile_flex_attention_with({"dynamic": False, "mode": "max-autotune-no-cudagraphs"})
    compiled = integration.WrappedFlexAttention(True)()
    assert integration.WrappedFlexAttention(False)() is compiled  # one compile, for training and eval alike
    assert calls == [(flex_attention, {"dynamic": False, "mode": "max-autotune-no-cudagraphs"})]


def test_the_multimodal_class_of_a_text_config_names_its_text_model():
    from tiny_models import tiny_model

    loader_keys.check_loader_class("model_type", "Llama4ForConditionalGeneration", tiny_model("llama4"), "m")
    with pytest.raises(ModelError, match="loads as Llama4ForCausalLM"):
        loader_keys.check_loader_class(
            "model_type", "Gemma3ForConditionalGeneration", tiny_model("llama4"), "m"
        )


def test_tf32_sets_cudas_switches_and_says_when_it_cannot(monkeypatch):
    assert loader_keys.apply_tf32(None, torch.device("cpu")) is None
    assert loader_keys.apply_tf32(False, torch.device("cpu")) is None  # off: what a CPU does anyway
    assert "no effect on cpu" in loader_keys.apply_tf32(True, torch.device("cpu"))
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for capability, expected in (((8, 0), True), ((7, 5), False)):
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
            assert loader_keys.apply_tf32("auto", torch.device("cuda")) is None
            assert (
                torch.backends.cuda.matmul.allow_tf32 is expected
                and torch.backends.cudnn.allow_tf32 is expected
            )
        loader_keys.apply_tf32(True, torch.device("cuda"))
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _tiny_config(tmp_path, tiny_base, data_path, **overrides):
    cfg = {
        "base_model": str(tiny_base),
        "datasets": [{"path": str(data_path), "type": "completion"}],
        "output_dir": str(tmp_path / "run"),
        "sequence_len": 32,
        "adapter": "lora",
        "lora_r": 4,
        "lora_target_linear": True,
        "max_steps": 2,
        "bf16": False,
        **overrides,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.jsonl"
    path.write_text("".join(f'{{"text": "count {i} {i + 1} {i + 2}"}}\n' for i in range(8)))
    return path


def test_attn_implementation_reaches_the_model_and_trains(tmp_path, tiny_base, text_file, capsys):
    path = _tiny_config(tmp_path, tiny_base, text_file, attn_implementation="eager", tf32=True)
    cfg = load_config(path)
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32))
    assert engine.model.get_base_model().config._attn_implementation == "eager"
    assert "tf32: True has no effect on cpu" in capsys.readouterr().out
    flash = _tiny_config(tmp_path, tiny_base, text_file, attn_implementation="flash_attention_2")
    assert main(["train", str(flash)]) == 0
    assert (
        "attn_implementation: flash_attention_2 runs on CUDA only; using sdpa (eager where the model has no sdpa) on cpu"
        in capsys.readouterr().out
    )


def test_gym_train_refuses_a_config_written_for_another_model(tmp_path, tiny_base, text_file, capsys):
    path = _tiny_config(tmp_path, tiny_base, text_file, model_type="MistralForCausalLM")
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model_type: MistralForCausalLM, but base_model" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "adapter_model.safetensors").exists()


def test_special_tokens_take_the_tokenizers_own_tokens_and_add_new_ones_as_axolotl_does(
    tmp_path, tiny_base, text_file
):
    from hanzo_gym.data.dataset import load_examples
    from hanzo_gym.model.hub import added_tokens_of, load_tokenizer

    roles = {"eos_token": "<|endoftext|>", "pad_token": "<|fim_pad|>"}
    tokenizer = load_tokenizer(str(tiny_base), special_tokens=roles)
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|endoftext|>", "<|fim_pad|>")
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert added_tokens_of(tokenizer) == ()
    # a role's token the vocabulary lacks, and additional special tokens: added, as Axolotl's load_tokenizer adds
    # them (add_special_tokens with the token as written), and never split
    grown = load_tokenizer(
        str(tiny_base),
        special_tokens={"bos_token": "<|new|>"},
        extra_special_tokens=["<tool>", "<|fim_pad|>"],
    )
    assert grown.bos_token == "<|new|>" and grown.bos_token_id == len(tokenizer)
    assert set(added_tokens_of(grown)) == {"<|new|>", "<tool>"} and len(grown) == len(tokenizer) + 2
    assert grown.encode("a<tool>b", add_special_tokens=False)[1] == grown.convert_tokens_to_ids("<tool>")
    assert "<tool>" in grown.all_special_tokens

    path = _tiny_config(tmp_path, tiny_base, text_file, special_tokens={"eos_token": "<|endoftext|>"})
    cfg = load_config(path)
    examples = load_examples(
        cfg, load_tokenizer(cfg.base_model, special_tokens=cfg.special_token_roles)
    ).train
    assert {example.input_ids[-1] for example in examples} == {
        tokenizer.eos_token_id
    }  # completions end with it
    assert main(["train", str(path)]) == 0
    saved = load_tokenizer(str(tiny_base), tokenizer_config=str(tmp_path / "run"))  # the adapter's tokenizer
    assert saved.eos_token == "<|endoftext|>"


def test_both_kinds_of_checkpointing_give_the_gradients_of_none(
    tmp_path, tiny_base, chat_data, qwen3_tokenizer
):
    from config_files import write_tiny_run

    from hanzo_gym.records import Datum

    tokens = qwen3_tokenizer.encode("one two three four five six seven eight nine ten")
    datum = Datum.from_tokens(tokens[:-1], target_tokens=tokens[1:], weights=[1.0] * (len(tokens) - 1))
    grads = {}
    for kind, keys in {
        "none": {},
        "non-reentrant": {"gradient_checkpointing": True},
        "reentrant": {
            "gradient_checkpointing": True,
            "gradient_checkpointing_kwargs": {"use_reentrant": True},
        },
    }.items():
        config = write_tiny_run(tmp_path, tiny_base, chat_data, name=kind, lora_dropout=0.0, **keys)
        cfg = load_config(config)
        engine = build_engine(
            cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.float32), qwen3_tokenizer
        )
        engine.forward_backward([datum])
        grads[kind] = [p.grad.clone() for p in engine.trainable]
        # lora_B starts at zero, so B matrices take the gradient; a reentrant pass that lost it gives None
        assert all(g.abs().sum() > 0 for g, p in zip(grads[kind], engine.trainable) if p.shape[1] == 4)
    for kind in ("non-reentrant", "reentrant"):
        for got, want in zip(grads[kind], grads["none"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_embeddings_grow_to_a_multiple_of_32_only_where_axolotl_grows_them(qwen3_tokenizer):
    from config_files import parse_minimal
    from tiny_models import tiny_model

    full = parse_minimal(adapter=None, lora_target_linear=None, resize_token_embeddings_to_32x=True)
    length = len(qwen3_tokenizer)
    assert length % 32  # 151669: the case that grows
    model = tiny_model("qwen3", vocab_size=length, tie_word_embeddings=False)
    rows = -(-length // 32) * 32
    note = loader_keys.fit_embeddings(model, length, full)
    assert note == f"embeddings: {length} rows grown to {rows} for the tokenizer's {length} tokens"
    assert (
        model.get_input_embeddings().num_embeddings == rows
        and model.get_output_embeddings().out_features == rows
    )
    assert loader_keys.fit_embeddings(model, length, full) is None  # large enough now: as it is
    lora = parse_minimal(resize_token_embeddings_to_32x=True)
    assert loader_keys.fit_embeddings(tiny_model("qwen3", vocab_size=rows + 64), length, lora) is None
    with pytest.raises(
        ModelError, match=f"grows the {length} embedding rows to {rows}, whose embeddings must train"
    ):
        loader_keys.fit_embeddings(tiny_model("qwen3", vocab_size=length), length, lora)
