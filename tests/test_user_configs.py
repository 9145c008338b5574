"""Configs users keep in their own repositories (tests/user_configs/, verbatim, each file's source in
SOURCES.yaml): each loads with only its model, data and output paths made local, or is refused for exactly the
keys expected.yaml lists, every line of the refusal naming a key the config holds; a config that loads trains
two steps on a tiny model of its family, its length and sizes cut to the tiny model's (max_steps, sequence_len,
lora_r) and the keys naming the user's own model's classes and tokens left out."""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml
from config_corpus import DATASET_LISTS, local_copy, write_rows

from hanzo_gym.cli import main
from hanzo_gym.config import parse_config
from hanzo_gym.config.yaml_source import load_yaml
from hanzo_gym.errors import ConfigError

CONFIGS = Path(__file__).parent / "user_configs"
SOURCES: dict[str, dict] = yaml.safe_load((CONFIGS / "SOURCES.yaml").read_text())
# config file → the keys its refusal names ([] = it loads)
EXPECTED: dict[str, list[str]] = yaml.safe_load((CONFIGS / "expected.yaml").read_text())
NAMES = sorted(
    p.name
    for p in CONFIGS.iterdir()
    if p.suffix in (".yml", ".yaml") and p.stem not in ("SOURCES", "expected")
)
# configs that load but whose run is refused once their tokenizer is read, and the key the refusal names
REFUSED_AT_RUN = {"pharaouk--jobs--llama70.yml": "tokens"}  # new tokens beside an adapter, no lora_modules_to_save
LOADING = [name for name in NAMES if not EXPECTED.get(name) and name not in REFUSED_AT_RUN]
# The share of the corpus that loads may only grow; raise it as features land.
LOADING_AT_LEAST = 137


def _read(name: str, tmp_path: Path, base_model: str = "unused") -> tuple[dict, dict]:
    data, lines = load_yaml((CONFIGS / name).read_text(), name)
    return local_copy(data, tmp_path, base_model), lines


def _key_paths(value, prefix: str = "") -> set[str]:
    """Every key path of the config as a refusal may name it: `lora_r`, `datasets[0].type`, `trl.beta`."""
    paths = set()
    if isinstance(value, dict):
        for key, inner in value.items():
            here = f"{prefix}.{key}" if prefix else str(key)
            paths |= {here, str(key), *_key_paths(inner, here)}
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            paths |= {f"{prefix}[{index}]", *_key_paths(inner, f"{prefix}[{index}]")}
    return paths


def _refused_keys(message: str, data: dict) -> list[str]:
    """The key each refusal line names (the first backticked one, else the first key of the config it names);
    AssertionError for a line that names no key of the config."""
    written = _key_paths(data)
    keys = set()
    for line in message.splitlines():
        quoted = [re.split(r"[: =]", q, maxsplit=1)[0] for q in re.findall(r"`([^`]+)`", line)]
        named = [q for q in quoted if q in written] or [
            word for word in re.findall(r"[a-z_][a-z0-9_.\[\]]*", line.split(": ", 1)[-1]) if word in written
        ]
        assert named, f"a refusal line that names no key of the config: {line}"
        keys.add(named[0])
    return sorted(keys)


def _outcome(name: str, tmp_path: Path) -> list[str]:
    try:
        data, lines = _read(name, tmp_path)
    except ConfigError as refused:  # the YAML itself (a key written twice with two values)
        return _refused_keys(str(refused), yaml.safe_load((CONFIGS / name).read_text()))
    try:
        parse_config(data, name, lines)
    except ConfigError as refused:
        return _refused_keys(str(refused), data)
    return []


def test_every_config_has_its_source_and_its_expectation():
    assert sorted(SOURCES) == NAMES and sorted(EXPECTED) == NAMES
    assert all(
        re.fullmatch(r"[0-9a-f]{40}", source["commit"]) and source["repo"] for source in SOURCES.values()
    )


@pytest.mark.parametrize("name", NAMES)
def test_each_config_loads_or_is_refused_naming_each_key_it_cannot_run(name, tmp_path):
    assert _outcome(name, tmp_path) == sorted(EXPECTED[name])


def test_the_share_of_users_configs_that_loads(capsys):
    blockers = Counter([*(key for keys in EXPECTED.values() for key in keys), *REFUSED_AT_RUN.values()])
    with capsys.disabled():
        print(
            f"\nusers' configs: {len(LOADING)} of {len(NAMES)} load, from {len({s['repo'] for s in SOURCES.values()})}"
        )
        print("blockers (configs):", ", ".join(f"{key} {count}" for key, count in blockers.most_common(12)))
    assert len(LOADING) >= LOADING_AT_LEAST


# -- two steps on a tiny model of the config's family ---------------------------------------------------------

# keys that name the user's own model (its classes, tokens of its vocabulary, a commit of its repository)
OTHER_MODEL_KEYS = ("model_type", "tokenizer_type", "special_tokens", "eot_tokens", "revision_of_model")
TEMPLATES_ANY_MODEL_RENDERS = (None, "tokenizer_default", "chatml", "llama3")
TRAINED_IN_THE_FAST_SUITE = [
    "parlance-labs--ftcourse--hc.yml",
]


# An instruct model's own template, which the tokenizer Llama 3.2's stands in for lacks: Llama 3's turns
LLAMA3_TEMPLATE = (
    "{{- bos_token -}}{%- for m in messages -%}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif -%}"
)


@pytest.fixture(scope="module")
def family_bases(tmp_path_factory, qwen3_tokenizer, llama32_tokenizer, tiny_base) -> dict[str, Path]:
    """A tiny random model of each family the corpus trains, with a real tokenizer of that family (Llama 3.2's
    for Llama, Mistral and Mixtral, with Llama 3's chat template; Qwen3's, with ChatML's tokens, for everything
    else)."""
    from tiny_models import tiny_model

    tokenizer = copy.deepcopy(llama32_tokenizer)  # the session's own stays without a template
    tokenizer.chat_template = LLAMA3_TEMPLATE
    bases = {"qwen": tiny_base}
    for family in ("llama", "mistral", "mixtral"):
        directory = tmp_path_factory.mktemp(f"tiny-{family}")
        model = tiny_model(
            family,
            vocab_size=len(tokenizer),
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
            pad_token_id=None,
        )
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        bases[family] = directory
    return bases


def _family(data: dict) -> str:
    """The family of the config's model, as far as the tiny ones go: ChatML needs Qwen's tokens."""
    templates = {data.get("chat_template")} | {
        ds.get("conversation") for ds in data.get("datasets") or [] if isinstance(ds, dict)
    }
    if "chatml" in templates:
        return "qwen"
    if "llama3" in templates:
        return "llama"
    named = f"{data.get('base_model', '')} {data.get('model_type', '')}".lower()
    return next((family for family in ("mixtral", "mistral", "llama") if family in named), "qwen")


@pytest.mark.parametrize(
    "name",
    [
        *TRAINED_IN_THE_FAST_SUITE,
        *(
            pytest.param(name, marks=pytest.mark.slow)
            for name in [*LOADING, *REFUSED_AT_RUN]
            if name not in TRAINED_IN_THE_FAST_SUITE
        ),
    ],
)
def test_a_loading_config_trains_two_steps(name, tmp_path, family_bases, monkeypatch, capsys):
    """… or, for a config of REFUSED_AT_RUN, is refused before training, naming its key."""
    assert not EXPECTED[name]
    monkeypatch.setenv("WANDB_MODE", "offline")  # the trackers it names log to files, not to a server
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # no Hub: a push fails, the run is kept
    monkeypatch.setenv(
        "MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db"
    )  # MLflow's file store is retired
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # … but a config naming one keeps it
    monkeypatch.chdir(tmp_path)  # relative paths the config keeps (a tracker's folder) land here
    base = family_bases[_family(yaml.safe_load((CONFIGS / name).read_text()))]
    data, lines = _read(name, tmp_path, str(base))
    for key in OTHER_MODEL_KEYS:
        data.pop(key, None)
    if data.get("chat_template") not in TEMPLATES_ANY_MODEL_RENDERS:  # another family's template
        data.pop("chat_template")
    # a short run on a small machine: two steps, rows of at most 256 tokens, a rank the tiny model has room for
    data.update(max_steps=2, sequence_len=min(data.get("sequence_len") or 2048, 256))
    if data.get("lora_r"):
        data["lora_r"] = min(data["lora_r"], 16)
    if (data.get("val_set_size") or 0) >= 1:  # a count of held-out rows, of the few written here
        data["val_set_size"] = min(data["val_set_size"], 2)
    cfg = parse_config(data, name, lines)
    for listed in DATASET_LISTS:
        for ds in getattr(cfg, listed) or []:
            write_rows(ds, cfg.rl)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    code = main(["train", str(path)])
    if name in REFUSED_AT_RUN:
        assert code == 2 and f"error: {REFUSED_AT_RUN[name]} " in capsys.readouterr().err
        return
    assert code == (3 if cfg.hub_model_id else 0)  # 3: the push to the Hub failed, the run is saved
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row][-1] == 2
