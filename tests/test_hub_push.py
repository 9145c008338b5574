"""Pushing runs to the Hugging Face Hub: the real huggingface_hub client against a local stand-in of the Hub's API
(create repo, branch, validate-yaml, preupload, LFS batch and upload, ndjson commit) that records what it is sent."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shlex
import shutil
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import huggingface_hub
import pytest
import yaml
from config_files import write_tiny_run

from hanzo_gym.cli import main
from hanzo_gym.config import parse_config
from hanzo_gym.errors import ConfigError

TOKEN = "hf_fake_token_for_tests"


@dataclass
class Commit:
    repo: str
    revision: str
    summary: str
    files: dict[str, bytes]  # path → the bytes the Hub now holds for it (regular or LFS)


@dataclass
class FakeHub:
    """The Hub's API, as much of it as huggingface_hub's create_repo / create_branch / create_commit use."""

    url: str = ""
    repos: dict[str, dict] = field(default_factory=dict)  # repo id → {"private": …, "branches": […]}
    kinds: dict[str, str] = field(default_factory=dict)  # repo id → model or dataset
    commits: list[Commit] = field(default_factory=list)
    lfs: dict[str, bytes] = field(default_factory=dict)  # sha256 → bytes
    cards_validated: list[str] = field(default_factory=list)
    lfs_uploads: int = 0
    failing_commits: int = 0  # answer this many commits with a server error first

    def files_at(self, repo: str, revision: str = "main") -> dict[str, bytes]:
        state: dict[str, bytes] = {}
        for commit in self.commits:
            if commit.repo == repo and commit.revision == revision:
                state.update(commit.files)
        return state


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                data = b""
                while True:
                    size = int(self.rfile.readline().strip(), 16)
                    if size == 0:
                        self.rfile.readline()
                        return data
                    data += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def _answer(self, status: int, payload: dict | None = None) -> None:
            body = json.dumps(payload or {}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_PUT(self):
            body = self._body()
            match = re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", urlsplit(self.path).path)
            if not match or hashlib.sha256(body).hexdigest() != match[1]:
                return self._answer(400, {"error": "bad upload"})
            hub.lfs[match[1]] = body
            hub.lfs_uploads += 1
            self._answer(200)

        def _file(self, send_body: bool) -> None:
            """A download (`hf_hub_download`: HEAD for the metadata, then GET), and `whoami`."""
            path = unquote(urlsplit(self.path).path)
            if path == "/api/whoami-v2":
                return self._answer(200, {"name": "tester", "type": "user"})
            match = re.fullmatch(r"/datasets/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            files = hub.files_at(match[1], match[2]) if match else {}
            if not match or match[3] not in files:
                self.send_response(404)
                self.send_header(
                    "X-Error-Code", "EntryNotFound" if match and match[1] in hub.repos else "RepoNotFound"
                )
                self.send_header("Content-Length", "0")
                return self.end_headers()
            body = files[match[3]]
            self.send_response(200)
            self.send_header("ETag", f'"{hashlib.sha1(body).hexdigest()}"')
            self.send_header("X-Repo-Commit", hashlib.sha1(str(len(hub.commits)).encode()).hexdigest())
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if send_body:
                self.wfile.write(body)

        def do_GET(self):
            self._file(send_body=True)

        def do_HEAD(self):
            self._file(send_body=False)

        def do_POST(self):
            body = self._body()
            path = unquote(urlsplit(self.path).path)
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                return self._answer(401, {"error": "Invalid credentials in Authorization header"})
            if path == "/api/repos/create":
                request = json.loads(body)
                repo = f"{request.get('organization') or 'tester'}/{request['name']}"
                hub.kinds[repo] = request.get("type", "model")
                if repo in hub.repos:
                    return self._answer(
                        409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo}"}
                    )
                hub.repos[repo] = {"private": request.get("visibility") == "private", "branches": ["main"]}
                return self._answer(200, {"url": f"{hub.url}/{repo}"})
            if path == "/api/validate-yaml":
                hub.cards_validated.append(json.loads(body)["content"])
                return self._answer(200, {"errors": [], "warnings": []})
            match = re.fullmatch(
                r"/api/(?:models|datasets)/([^/]+/[^/]+)/(branch|preupload|commit)/(.+)", path
            )
            if match and match[1] not in hub.repos:
                return self._answer(404, {"error": "Repository not found"})
            if match and match[2] == "branch":
                hub.repos[match[1]]["branches"].append(match[3])
                return self._answer(200)
            if match and match[3] not in hub.repos[match[1]]["branches"]:
                return self._answer(404, {"error": f"Invalid rev id: {match[3]}"})
            if match and match[2] == "preupload":
                files = json.loads(body)["files"]
                modes = [
                    {
                        "path": f["path"],
                        "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                    }
                    for f in files
                ]
                return self._answer(200, {"files": [{**m, "shouldIgnore": False} for m in modes]})
            if match and match[2] == "commit" and hub.failing_commits:
                hub.failing_commits -= 1
                return self._answer(500, {"error": "Internal Error"})
            if match and match[2] == "commit":
                lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                header, files = lines[0]["value"], {}
                for line in lines[1:]:
                    value = line["value"]
                    if line["key"] == "file":
                        files[value["path"]] = base64.b64decode(value["content"])
                    elif line["key"] == "lfsFile":
                        files[value["path"]] = hub.lfs[value["oid"]]
                hub.commits.append(Commit(match[1], match[3], header["summary"], files))
                oid = hashlib.sha1(str(len(hub.commits)).encode()).hexdigest()
                return self._answer(
                    200, {"commitUrl": f"{hub.url}/{match[1]}/commit/{oid}", "commitOid": oid}
                )
            match = re.fullmatch(r"/(?:datasets/)?([^/]+/[^/]+)\.git/info/lfs/objects/batch", path)
            if match:
                objects = []
                for item in json.loads(body)["objects"]:
                    upload = {"href": f"{hub.url}/lfs-upload/{item['oid']}"}
                    stored = item["oid"] in hub.lfs
                    objects.append({**item, **({} if stored else {"actions": {"upload": upload}})})
                return self._answer(200, {"transfer": "basic", "objects": objects})
            self._answer(404, {"error": f"no route {path}"})

    return Handler


def _point_client_at(monkeypatch, url: str) -> None:
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url)
    template = url + "/{repo_id}/resolve/{revision}/{filename}"  # downloads: made from the endpoint at import
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")  # the regular and LFS protocol, which the stand-in speaks
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hub(monkeypatch):
    recorded = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(recorded))
    recorded.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _point_client_at(monkeypatch, recorded.url)
    yield recorded
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def hub_base(tmp_path_factory, tiny_base) -> Path:
    """The tiny Qwen3 in the Hub cache's layout, as a base_model path of a model downloaded from the Hub."""
    snapshot = tmp_path_factory.mktemp("cache") / "models--hanzo-test--tiny-qwen3" / "snapshots" / "5f0c1e2d"
    shutil.copytree(tiny_base, snapshot)
    return snapshot


def _config(tmp_path, base, chat_data, **overrides) -> tuple[Path, Path]:
    """A tiny LoRA run of 4 steps (a key given None is left unset) and its run directory."""
    shape = {"micro_batch_size": 8, "gradient_accumulation_steps": 1, "max_steps": 4}
    path = write_tiny_run(tmp_path, base, chat_data, **{**shape, **overrides})
    return path, tmp_path / "run"


def _front_matter(card: bytes) -> dict:
    text = card.decode()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n", 2)[1])


def _no_local_paths(files: dict[str, bytes], *paths: Path) -> None:
    """No uploaded byte names a local path of the test's (its tmp_path, the base model's and the data's)."""
    for name, content in files.items():
        for path in {*paths, *(p.resolve() for p in paths)}:
            assert str(path).encode() not in content, f"{name} holds the local path {path}"


def test_gym_train_pushes_the_adapter_tokenizer_and_card_once_at_the_end(
    tmp_path, hub_base, chat_data, hub, capsys
):
    path, run = _config(
        tmp_path, hub_base, chat_data, hub_model_id="me/tiny-sft", hub_strategy="end", save_steps=2
    )
    assert main(["train", str(path)]) == 0
    assert "pushed to" in capsys.readouterr().out

    assert hub.repos == {"me/tiny-sft": {"private": True, "branches": ["main"]}}  # Axolotl's: private
    assert [(c.repo, c.revision, c.summary) for c in hub.commits] == [
        ("me/tiny-sft", "main", "End of training")
    ]
    files = hub.commits[0].files
    local_tokenizer = sorted(
        p.name for p in run.iterdir() if p.name.startswith(("tokenizer", "chat_template", "vocab", "merges"))
    )
    assert local_tokenizer  # the run wrote its tokenizer, and the push carries all of it
    assert sorted(files) == sorted(
        ["README.md", "adapter_config.json", "adapter_model.safetensors", *local_tokenizer]
    )
    assert files["adapter_model.safetensors"] == (run / "adapter_model.safetensors").read_bytes()
    assert hub.lfs_uploads == 1  # the weights went the LFS way, the rest as regular files
    for name in local_tokenizer:
        assert files[name] == (run / name).read_bytes()

    card = _front_matter(files["README.md"])
    assert card["base_model"] == "hanzo-test/tiny-qwen3"
    assert card["library_name"] == "peft"
    assert {"hanzo-gym", "lora", "sft"} <= set(card["tags"])
    assert hub.cards_validated == [files["README.md"].decode()]
    body = files["README.md"].decode()
    final_loss = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]["loss"]
    assert f"| loss | {final_loss:.4f} | 4 |" in body
    config_yaml = yaml.safe_load(body.split("```yaml\n", 1)[1].split("```", 1)[0])
    assert config_yaml["lora_r"] == 4 and config_yaml["hub_model_id"] == "me/tiny-sft"
    assert config_yaml["base_model"] == "hanzo-test/tiny-qwen3"
    assert config_yaml["datasets"][0]["path"] == chat_data.name and config_yaml["output_dir"] == "run"

    adapter_config = json.loads(files["adapter_config.json"])
    assert adapter_config["base_model_name_or_path"] == "hanzo-test/tiny-qwen3"
    assert adapter_config["r"] == 4
    _no_local_paths(files, tmp_path, hub_base, chat_data.parent)
    assert (run / "checkpoint-2").is_dir()  # saved, and left alone by hub_strategy: end


@pytest.mark.slow  # three whole runs: the slow tier CI runs
@pytest.mark.parametrize("strategy", ["every_save", "checkpoint", "all_checkpoints"])
def test_the_hub_strategies_push_at_each_save_as_hf_does(tmp_path, hub_base, chat_data, hub, strategy):
    extra = {"hub_revision": "dev", "hub_private_repo": False} if strategy == "all_checkpoints" else {}
    path, run = _config(
        tmp_path, hub_base, chat_data, hub_model_id="tiny", hub_strategy=strategy, save_steps=2, **extra
    )
    assert main(["train", str(path)]) == 0
    revision = extra.get("hub_revision", "main")
    assert hub.repos["tester/tiny"]["private"] is (strategy != "all_checkpoints")
    assert [(c.repo, c.revision, c.summary) for c in hub.commits] == [
        ("tester/tiny", revision, "Training in progress, step 2"),
        ("tester/tiny", revision, "Training in progress, step 4"),
        ("tester/tiny", revision, "End of training"),
    ]
    for commit, step in zip(hub.commits[:2], (2, 4), strict=True):
        folder = run / f"checkpoint-{step}"
        # each save puts the checkpoint's adapter at the top, as HF's push from the checkpoint folder does
        assert (
            commit.files["adapter_model.safetensors"] == (folder / "adapter_model.safetensors").read_bytes()
        )
        assert f"Training in progress: checkpoint at step {step}" in commit.files["README.md"].decode()
        assert "tokenizer.json" in commit.files
        extra_folders = {name.split("/")[0] for name in commit.files if "/" in name}
        if strategy == "every_save":
            assert extra_folders == set()
        else:
            where = "last-checkpoint" if strategy == "checkpoint" else folder.name
            assert extra_folders == {where}
            local = sorted(p.name for p in folder.iterdir())
            assert sorted(name.split("/", 1)[1] for name in commit.files if "/" in name) == local
            assert json.loads(commit.files[f"{where}/trainer_state.json"])["step"] == step
            assert (
                commit.files[f"{where}/optimizer.safetensors"]
                == (folder / "optimizer.safetensors").read_bytes()
            )
        _no_local_paths(commit.files, tmp_path, hub_base, chat_data.parent)
    end = hub.commits[2].files
    assert not any("/" in name for name in end)  # the end push is the final adapter, as HF's push_to_hub
    assert end["adapter_model.safetensors"] == (run / "adapter_model.safetensors").read_bytes()
    state = hub.files_at("tester/tiny", revision)
    folders = {name.split("/")[0] for name in state if "/" in name}
    expected = {
        "every_save": set(),
        "checkpoint": {"last-checkpoint"},
        "all_checkpoints": {"checkpoint-2", "checkpoint-4"},
    }
    assert folders == expected[strategy]
    if strategy == "checkpoint":  # the newest checkpoint's, ready to resume from
        assert json.loads(state["last-checkpoint/trainer_state.json"])["step"] == 4
    assert not {"metrics.jsonl", "checkpoints.jsonl", "run_config.json"} & set(state)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unreachable_hub_leaves_the_trained_run_and_one_line_to_retry(
    tmp_path, hub_base, chat_data, monkeypatch, capsys
):
    _point_client_at(monkeypatch, f"http://127.0.0.1:{_closed_port()}")
    path, run = _config(
        tmp_path, hub_base, chat_data, hub_model_id="me/offline", hub_strategy="checkpoint", save_steps=2
    )
    assert main(["train", str(path)]) == 3
    assert (run / "adapter_model.safetensors").is_file() and (run / "adapter_config.json").is_file()
    assert (run / "checkpoint-2" / "trainer_state.json").is_file()
    assert (run / "checkpoint-4" / "trainer_state.json").is_file()
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    line = errors[0]
    assert "push to the Hub failed" in line and "cannot reach" in line and "ConnectError" in line
    command = line.split("retry with: ", 1)[1]
    assert command == f"gym push {run} me/offline --private"

    # the printed command, once the Hub answers, pushes what the run would have: with hub_strategy checkpoint
    # the newest checkpoint in last-checkpoint/ too
    with pytest.MonkeyPatch.context() as patch:
        recorded = FakeHub()
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(recorded))
        recorded.url = f"http://127.0.0.1:{server.server_address[1]}"
        threading.Thread(target=server.serve_forever, daemon=True).start()
        _point_client_at(patch, recorded.url)
        try:
            assert main(shlex.split(command)[1:]) == 0
        finally:
            server.shutdown()
            server.server_close()
    assert recorded.repos["me/offline"]["private"] is True
    assert len(recorded.commits) == 1
    files = recorded.commits[0].files
    assert files["adapter_model.safetensors"] == (run / "adapter_model.safetensors").read_bytes()
    assert json.loads(files["last-checkpoint/trainer_state.json"])["step"] == 4
    assert not any(name.startswith("checkpoint-") for name in files)


@pytest.mark.slow
def test_a_failed_push_at_a_save_loses_nothing_and_the_end_push_catches_up(
    tmp_path, hub_base, chat_data, hub, capsys
):
    hub.failing_commits = 1
    path, run = _config(
        tmp_path, hub_base, chat_data, hub_model_id="me/flaky", hub_strategy="all_checkpoints", save_steps=2
    )
    assert main(["train", str(path)]) == 0
    assert "also carries what the push at step 2 could not" in capsys.readouterr().out
    assert (run / "checkpoint-2" / "trainer_state.json").is_file()  # the save stood
    assert [c.summary for c in hub.commits] == ["Training in progress, step 4", "End of training"]
    assert {name.split("/")[0] for name in hub.commits[0].files if "/" in name} == {"checkpoint-4"}
    end = hub.commits[1].files
    assert {name.split("/")[0] for name in end if "/" in name} == {"checkpoint-2", "checkpoint-4"}
    local = (run / "checkpoint-2" / "adapter_model.safetensors").read_bytes()
    assert end["checkpoint-2/adapter_model.safetensors"] == local


def test_gym_push_pushes_a_finished_run_and_says_why_it_cannot(
    tmp_path, hub_base, chat_data, hub, capsys, monkeypatch
):
    path, run = _config(tmp_path, hub_base, chat_data, save_steps=2)
    assert main(["train", str(path)]) == 0
    assert not hub.commits  # no hub_model_id: nothing pushed during training
    capsys.readouterr()

    assert main(["push", str(run), "owner/later", "--private"]) == 0
    assert f"pushed {run} to {hub.url}/owner/later" in capsys.readouterr().out
    assert hub.repos["owner/later"]["private"] is True
    files = hub.commits[0].files
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "README.md"} <= set(files)
    assert not any(name.startswith("checkpoint-") or name.endswith(".jsonl") for name in files)
    _no_local_paths(files, tmp_path, hub_base, chat_data.parent)

    assert main(["push", str(run), "owner/later"]) == 0  # again: the repo exists, a second commit
    assert len(hub.repos) == 1 and len(hub.commits) == 2

    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    assert main(["push", str(run), "owner/later"]) == 3
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "HTTP 401" in err and "Invalid credentials" in err
    assert err.endswith(f"retry with: gym push {run} owner/later")

    assert main(["push", str(tmp_path), "owner/later"]) == 2  # not a finished run: a user error, not a push
    assert "holds no final adapter" in capsys.readouterr().err


def test_full_fine_tuning_pushes_the_model_for_transformers(tmp_path, tiny_base, chat_data, hub):
    path, run = _config(
        tmp_path,
        tiny_base,
        chat_data,
        adapter=None,
        lora_r=None,
        lora_alpha=None,
        lora_target_linear=None,
        max_steps=2,
        learning_rate=1e-4,
        hub_model_id="me/full",
    )
    assert main(["train", str(path)]) == 0
    files = hub.commits[-1].files
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(files)
    assert not {"adapter_config.json", "adapter_model.safetensors"} & set(files)
    card = _front_matter(files["README.md"])
    assert card["library_name"] == "transformers" and "base_model" not in card  # a plain local folder
    assert "sft" in card["tags"] and "lora" not in card["tags"]
    assert files["model.safetensors"] == (run / "model.safetensors").read_bytes()
    assert f"`{tiny_base.name}` (a local model) fine-tuned in full" in files["README.md"].decode()
    _no_local_paths(files, tmp_path, tiny_base, chat_data.parent)


BASE = {"base_model": "a/b", "output_dir": "o", "datasets": [{"path": "d.jsonl", "type": "chat_template"}]}


@pytest.mark.parametrize(
    ("keys", "refusal"),
    [
        ({"hub_model_id": "me/x/y"}, "`hub_model_id` = 'me/x/y': not a Hub repo id"),
        ({"hub_model_id": "./out"}, "`hub_model_id` = './out': not a Hub repo id"),
        ({"hub_model_id": "a", "hub_strategy": "sometimes"}, "`hub_strategy` is 'sometimes'; allowed: 'end'"),
        ({"push_to_hub": True}, "push_to_hub: true needs `hub_model_id`"),
        ({"hub_strategy": "end"}, "hub_strategy needs `hub_model_id`"),
        ({"hub_private_repo": False}, "hub_private_repo needs `hub_model_id`"),
        ({"hub_model_id": "a", "hub_strategy": "checkpoint"}, "hub_strategy: checkpoint pushes at each save"),
        ({"hub_model_id": "a", "hub_revision": " dev"}, "`hub_revision` = ' dev': name the branch"),
    ],
)
def test_bad_hub_keys_are_refused_naming_the_key(keys, refusal):
    with pytest.raises(ConfigError) as raised:
        parse_config({**BASE, **keys})
    assert refusal in str(raised.value) and "\n" not in str(raised.value)


def test_the_hub_keys_load_with_axolotl_meanings():
    cfg = parse_config({**BASE, "hub_model_id": "me/x", "hf_use_auth_token": True})
    assert cfg.pushes_to_hub and cfg.hub_private  # Axolotl asks HF for a private repo
    assert not parse_config({**BASE, "hub_model_id": "me/x", "hub_private_repo": False}).hub_private
    assert not parse_config({**BASE, "hub_model_id": "me/x", "push_to_hub": False}).pushes_to_hub
    assert not parse_config({**BASE, "hf_use_auth_token": False}).pushes_to_hub
    assert parse_config(
        {**BASE, "hub_model_id": "x", "save_steps": 5, "hub_strategy": "all_checkpoints"}
    ).hub_strategy
