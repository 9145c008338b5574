import json
import re
from pathlib import Path

import httpx2
import huggingface_hub
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import load_dataset

from hanzo_gym.config.splits import Split
from hanzo_gym.data import sources
from hanzo_gym.data.sources import Row, read_rows
from hanzo_gym.errors import DataError

REPO_ID = "owner/chat-data"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def numbered(count: int, tag: str) -> list[dict]:
    return [{"id": f"{tag}{index}"} for index in range(count)]


def ids(rows: list[Row]) -> list[str]:
    return [row.data["id"] for row in rows]


@pytest.mark.parametrize(
    "spec, n, expected",
    [
        ("train", 10, (0, 10)),
        ("validation[:3]", 10, (0, 3)),
        ("train[:20%]", 10, (0, 2)),
        ("train[:1000]", 10, (0, 10)),
        ("train[10%:]", 10, (1, 10)),
        ("train[100:200]", 150, (100, 150)),
        ("train[25%:75%]", 7, (1, 5)),
        ("train[33%:]", 100, (33, 100)),
        ("train[8:3]", 10, (8, 8)),
        ("train[2.3%:]", 50000, (1150, 50000)),
    ],
)
def test_split_bounds(spec, n, expected):
    assert Split.parse(spec).bounds(n) == expected


def test_split_keeps_percent_as_float_and_index_as_int():
    assert Split.parse(" train[20%:5] ") == Split("train", 20.0, 5)
    assert isinstance(Split.parse("train[20%:5]").lo, float)
    assert isinstance(Split.parse("train[20%:5]").hi, int)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("train[1]", "bad split `train[1]`: expected name or name[lo:hi]"),
        ("train[:5", "bad split `train[:5`: expected name or name[lo:hi]"),
        ("train[::2]", "bad split `train[::2]`: expected name or name[lo:hi]"),
        ("train[a:b]", "bad split `train[a:b]`: `a` is not a row index"),
        ("train[-1:]", "bad split `train[-1:]`: `-1` is not a row index"),
        ("train[+1:]", "bad split `train[+1:]`: `+1` is not a row index"),
        ("train[x%:]", "bad split `train[x%:]`: `x%` is not a percent"),
    ],
)
def test_bad_split_is_rejected(spec, message):
    with pytest.raises(DataError, match="^" + re.escape(message)):
        Split.parse(spec)


def test_single_file_ignores_split_name_but_applies_slice(tmp_path):
    file = write_jsonl(tmp_path / "validation.jsonl", numbered(4, "v"))
    assert ids(read_rows(str(file), "train[1:3]")) == ["v1", "v2"]


def test_directory_picks_files_of_the_split(tmp_path):
    write_jsonl(tmp_path / "train-00000-of-00002.jsonl", numbered(2, "a"))
    write_jsonl(tmp_path / "train-00001-of-00002.jsonl", numbered(2, "b"))
    write_jsonl(tmp_path / "validation.jsonl", numbered(3, "v"))
    (tmp_path / "train-notes.txt").write_text("not data")
    assert ids(read_rows(str(tmp_path))) == ["a0", "a1", "b0", "b1"]
    assert ids(read_rows(str(tmp_path), "validation[1:]")) == ["v1", "v2"]


def test_directory_falls_back_to_files_naming_no_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", numbered(2, "t"))
    write_jsonl(tmp_path / "extra.jsonl", numbered(2, "x"))
    assert ids(read_rows(str(tmp_path), "holdout")) == ["x0", "x1"]


def test_split_names_match_regardless_of_case(tmp_path):
    write_jsonl(tmp_path / "Train.jsonl", numbered(1, "t"))
    write_jsonl(tmp_path / "Test.jsonl", numbered(1, "e"))
    assert ids(read_rows(str(tmp_path), "train")) == ["t0"]


@pytest.mark.parametrize(
    ("names", "chosen"),
    [
        # split words inside other words name no split: constraints ⊃ train, latest/contest ⊃ test, …
        (["constraints.jsonl", "data.jsonl"], ["constraints.jsonl", "data.jsonl"]),
        (["contest_a.jsonl", "developer_notes.jsonl", "latest.jsonl"], "all"),
        (["device1/rows.jsonl", "trainer_logs.jsonl"], "all"),
        # whole words, in file or folder names, next to separators or digits, any case
        (["constraints.jsonl", "test.jsonl", "train.jsonl"], ["train.jsonl"]),
        (
            ["data/test-00000-of-00001.parquet", "data/train-00000-of-00002.parquet"],
            ["data/train-00000-of-00002.parquet"],
        ),
        (["test0.jsonl", "train0.jsonl"], ["train0.jsonl"]),
        (["My_Test_Set.jsonl", "My_Train_Set.jsonl"], ["My_Train_Set.jsonl"]),
        (["test/part.jsonl", "train/part.jsonl", "valid/part.jsonl"], ["train/part.jsonl"]),
        (["a.jsonl", "dev.jsonl", "sub/test.jsonl"], ["a.jsonl"]),
    ],
)
def test_split_names_match_whole_words_only(names, chosen):
    chosen = names if chosen == "all" else chosen
    picked, skipped = sources.split_selection(names, "train", "here")
    assert picked == chosen
    assert skipped == [n for n in names if n not in chosen]


def test_split_names_of_several_words_match_in_a_row():
    names = [
        "data/test_sft-00000-of-00001.parquet",
        "data/train_sft-00000-of-00001.parquet",
        "sft_train.jsonl",
    ]
    assert sources.split_selection(names, "train_sft", "here") == ([names[1]], [names[0], names[2]])
    assert sources.split_selection(names, "TEST_SFT", "here")[0] == [names[0]]
    assert sources.split_selection(names, "train", "here")[0] == names[1:]


def test_directory_reports_chosen_and_skipped_files(tmp_path, capsys):
    write_jsonl(tmp_path / "A.JSONL", numbered(1, "a"))
    write_jsonl(tmp_path / "constraints.jsonl", numbered(1, "c"))
    write_jsonl(tmp_path / "test.jsonl", numbered(1, "t"))
    assert ids(read_rows(str(tmp_path))) == ["a0", "c0"]  # before: constraints.jsonl alone, A.JSONL dropped
    out = capsys.readouterr().out
    assert f"{tmp_path}: split `train` reads 2 file(s): A.JSONL, constraints.jsonl" in out
    assert "skipped 1 named for another split: test.jsonl" in out
    write_jsonl(tmp_path / "train.jsonl", numbered(1, "r"))
    assert ids(read_rows(str(tmp_path))) == ["r0"]
    out = capsys.readouterr().out
    assert "reads 1 file(s): train.jsonl; skipped 3 not named for split `train`: A.JSONL, " in out


def test_directory_without_files_for_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", numbered(2, "t"))
    with pytest.raises(DataError) as raised:
        read_rows(str(tmp_path), "test")
    expected = f"no data files for split `test` in {tmp_path}: files seen: train.jsonl."
    assert str(raised.value).startswith(expected)


def test_data_files_keep_their_order_and_skip_split_filter(tmp_path):
    write_jsonl(tmp_path / "first.jsonl", numbered(2, "f"))
    (tmp_path / "second.json").write_text(json.dumps(numbered(2, "s")))
    rows = read_rows(str(tmp_path), "test[1:3]", data_files=["second.json", "first.jsonl"])
    assert ids(rows) == ["s1", "f0"]
    assert [(row.file, row.line) for row in rows] == [
        (str(tmp_path / "second.json"), 2),
        (str(tmp_path / "first.jsonl"), 1),
    ]


def test_missing_data_files_entry_is_named(tmp_path):
    write_jsonl(tmp_path / "first.jsonl", numbered(1, "f"))
    with pytest.raises(DataError, match=r"^data_files entry `gone\.jsonl` not found"):
        read_rows(str(tmp_path), data_files=["first.jsonl", "gone.jsonl"])


def test_jsonl_rows_keep_physical_line_numbers(tmp_path):
    file = tmp_path / "train.jsonl"
    file.write_text('\n{"id": "a"}\n   \n\t\n{"id": "b"}\r\n')
    assert [(row.file, row.line, row.data) for row in read_rows(str(file))] == [
        (str(file), 2, {"id": "a"}),
        (str(file), 5, {"id": "b"}),
    ]


def test_parquet_nested_columns_become_lists_and_dicts(tmp_path):
    messages = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], []]
    file = tmp_path / "train.parquet"
    pq.write_table(pa.table({"messages": messages, "tags": [["a"], None]}), file)
    rows = read_rows(str(file))
    assert [(row.line, row.data) for row in rows] == [
        (1, {"messages": messages[0], "tags": ["a"]}),
        (2, {"messages": [], "tags": None}),
    ]
    assert pa.types.is_struct(pq.read_schema(file).field("messages").type.value_type)


def test_invalid_json_line_names_file_and_line(tmp_path):
    file = tmp_path / "train.jsonl"
    file.write_text('{"id": 1}\n\n{"id": 2,}\n')
    with pytest.raises(DataError) as raised:
        read_rows(str(file))
    assert str(raised.value).startswith(f"{file} line 3: invalid JSON (Expecting property name")


def test_jsonl_row_must_be_an_object(tmp_path):
    file = tmp_path / "train.jsonl"
    file.write_text('{"id": 1}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"train\.jsonl line 2: expected a JSON object, found a JSON array$"):
        read_rows(str(file))


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"id": 1}', "expected a JSON array of objects, found a JSON object"),
        ('[{"id": 1}, "x"]', "row 2: expected a JSON object, found a JSON string"),
        ('[{"id": 1}]\n[{"id": 2}]\n', "line 2 column 1: invalid JSON (Extra data)"),
        ('{"id": 1}\n{"id": 2\n', "line 2: invalid JSON"),
    ],
)
def test_json_file_must_be_an_array_of_objects(tmp_path, content, message):
    file = tmp_path / "train.json"
    file.write_text(content)
    with pytest.raises(DataError) as raised:
        read_rows(str(file))
    assert str(raised.value).startswith(f"{file}") and message in str(raised.value)


def test_a_json_file_of_one_object_per_line_reads_as_hfs_json_loader_reads_it(tmp_path):
    file = tmp_path / "train.json"
    file.write_text('{"id": 1}\n\n{"id": 2}\n')
    rows = read_rows(str(file))
    assert [(row.data, row.line) for row in rows] == [({"id": 1}, 1), ({"id": 2}, 3)]
    assert [row["id"] for row in load_dataset("json", data_files=str(file), split="train")] == [1, 2]


def test_unsupported_file_type(tmp_path):
    file = tmp_path / "train.csv"
    file.write_text("id\n1\n")
    with pytest.raises(DataError, match=r"train\.csv: unsupported file type `\.csv`"):
        read_rows(str(file))


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache; huggingface_hub reads its constants at import, so patch them as well as the env."""
    cache = tmp_path / "hf_home" / "hub"
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def offline(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def cache_snapshot(cache: Path, files: dict[str, list[dict]]) -> Path:
    """Lay out a dataset snapshot the way hf_hub_download leaves it (minus the blob symlinks)."""
    repo_dir = cache / f"datasets--{REPO_ID.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / COMMIT
    for name, rows in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(snapshot / name, rows)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_hub_dataset_offline_and_not_cached(hub_cache, offline):
    with pytest.raises(DataError) as raised:
        read_rows(REPO_ID)
    assert str(raised.value) == (
        f"`{REPO_ID}` is neither a local file/directory nor a reachable or cached Hugging Face Hub dataset: "
        f"HF_HUB_OFFLINE=1 is set and the hub cache ({hub_cache}) does not have it. Fix the path, or unset "
        "HF_HUB_OFFLINE and run once with network access to download it"
    )


def test_hub_unreachable_and_not_cached(hub_cache, monkeypatch):
    def refuse(*args, **kwargs):
        raise httpx2.ConnectError("[Errno 111] Connection refused")

    monkeypatch.setattr(sources, "list_repo_files", refuse)
    with pytest.raises(DataError) as raised:
        read_rows(REPO_ID)
    message = str(raised.value)
    assert message.startswith(f"`{REPO_ID}` is neither a local file/directory nor a reachable or cached")
    assert "the hub could not be reached (ConnectError: [Errno 111] Connection refused)" in message
    assert "check the network connection" in message


def test_path_that_is_neither_local_nor_a_repo_id(tmp_path):
    missing = str(tmp_path / "no" / "such.jsonl")
    with pytest.raises(DataError, match=r"no such file or folder \(and no folder .*no\); fix the path"):
        read_rows(missing)
    with pytest.raises(DataError, match=r"is neither a local file/directory .*not a valid hub dataset id"):
        read_rows("not an id")


def test_a_mistyped_local_path_fails_at_once_with_the_near_name_and_no_hub_call(tmp_path, monkeypatch):
    (tmp_path / "addition.jsonl").write_text('{"a": 1}\n')

    def no_hub(*args, **kwargs):
        raise AssertionError("a path that names a local file asked the Hub")

    monkeypatch.setattr(sources, "list_repo_files", no_hub)
    monkeypatch.chdir(tmp_path)
    for written, hint in (
        ("addtion.jsonl", "did you mean `addition.jsonl`?"),
        (str(tmp_path / "addtion.jsonl"), f"did you mean `{tmp_path / 'addition.jsonl'}`?"),
        ("./elsewhere", "fix the path"),
    ):
        with pytest.raises(DataError) as raised:
            read_rows(written)
        assert str(raised.value) == f"`{written}`: no such file or folder; {hint}"


def test_cached_hub_dataset_is_read_offline(hub_cache, offline):
    cache_snapshot(
        hub_cache,
        {
            "data/train-00000-of-00001.jsonl": numbered(3, "t"),
            "data/validation-00000-of-00001.jsonl": numbered(2, "v"),
            "README.md": [],
        },
    )
    rows = read_rows(REPO_ID, "train[1:]")
    assert ids(rows) == ["t1", "t2"]
    assert (rows[0].file, rows[0].line) == (f"{REPO_ID}/data/train-00000-of-00001.jsonl", 2)
    assert ids(read_rows(REPO_ID, "validation")) == ["v0", "v1"]


def test_cached_hub_dataset_missing_a_listed_shard(hub_cache, offline, monkeypatch):
    cache_snapshot(hub_cache, {"data/train-00000-of-00002.jsonl": numbered(1, "t")})
    listed = ["data/train-00000-of-00002.jsonl", "data/train-00001-of-00002.jsonl"]
    tree = [huggingface_hub.hf_api.RepoFile(path=name, size=1, oid="x") for name in listed]
    monkeypatch.setattr(sources, "get_cached_repo_tree", lambda *args, **kwargs: tree)
    with pytest.raises(DataError, match=r"is incomplete: data/train-00001-of-00002\.jsonl not downloaded"):
        read_rows(REPO_ID)


CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
---
# a dataset card
"""


def test_name_picks_a_configuration_of_a_dataset_folder_by_its_card(tmp_path):
    for folder, split, count in (("main", "train", 3), ("main", "test", 2), ("socratic", "train", 4)):
        (tmp_path / folder).mkdir(exist_ok=True)
        write_jsonl(tmp_path / folder / f"{split}-00000-of-00001.jsonl", numbered(count, f"{folder}-{split}"))
    (tmp_path / "README.md").write_text(CARD)
    rows = read_rows(str(tmp_path), name="main")
    assert ids(rows) == [f"main-train{i}" for i in range(3)]
    assert len(read_rows(str(tmp_path), split="test", name="main")) == 2
    assert len(read_rows(str(tmp_path), name="socratic")) == 4
    with pytest.raises(DataError, match="has no configuration `other`; its configurations: main, socratic"):
        read_rows(str(tmp_path), name="other")
    with pytest.raises(DataError, match="configuration `socratic`, has no split `test`; its splits: train"):
        read_rows(str(tmp_path), split="test", name="socratic")
    with pytest.raises(DataError, match="give `name` .* or `data_files`, not both"):
        read_rows(str(tmp_path), name="main", data_files=["main/train-00000-of-00001.jsonl"])
    with pytest.raises(DataError, match="is a single file"):
        read_rows(str(tmp_path / "main" / "test-00000-of-00001.jsonl"), name="main")


def test_name_picks_a_configuration_of_a_cached_hub_dataset(hub_cache, offline):
    snapshot = cache_snapshot(
        hub_cache,
        {
            "main/train-00000-of-00001.jsonl": numbered(3, "m"),
            "socratic/train-00000-of-00001.jsonl": numbered(1, "s"),
        },
    )
    (snapshot / "README.md").write_text(CARD)
    assert ids(read_rows(REPO_ID, name="main")) == ["m0", "m1", "m2"]
    assert [r.file for r in read_rows(REPO_ID, name="socratic")] == [
        f"{REPO_ID}/socratic/train-00000-of-00001.jsonl"
    ]


def test_a_file_format_builder_as_path_reads_its_data_files(tmp_path, monkeypatch):
    """`path: json` with `data_files`, as `datasets.load_dataset("json", data_files=…)` reads them."""
    monkeypatch.chdir(tmp_path)
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text('{"text": "one"}\n{"text": "two"}\n')
    second.write_text('{"text": "three"}\n')
    rows = read_rows("json", data_files=[str(first), "b.jsonl"])
    assert [row.data["text"] for row in rows] == ["one", "two", "three"]
    with pytest.raises(
        DataError, match="path: json names a file format: give the files to read in `data_files`"
    ):
        read_rows("json")
    with pytest.raises(DataError, match="text files are not read yet"):
        read_rows("text", data_files=[str(first)])
    with pytest.raises(DataError, match="data_files entry `missing.jsonl` \\(path: json\\) is not a file"):
        read_rows("json", data_files=["missing.jsonl"])
