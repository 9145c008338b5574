"""Pushing a run to the Hugging Face Hub (`hub_model_id`, `gym push`), with HF Trainer's `hub_strategy`.

What a push uploads, in one commit through huggingface_hub's `create_commit`: the adapter (adapter_config.json,
adapter_model.safetensors) or, in full fine-tuning, the model (config.json, generation_config.json,
model.safetensors), the tokenizer files, and a model card `README.md` (loops/model_card.py). Never the run's records (metrics.jsonl, checkpoints.jsonl, …), a staging
folder, or a checkpoint folder other than the strategy's. A local absolute path in what is uploaded (the base
model's folder, dataset files, output_dir) is replaced by what stands for it on the Hub (loops/hub_paths.py):
nothing of the user's file system reaches the Hub.

When (HF's `HubStrategy`): `end` pushes once, after the final adapter is written; `every_save` (HF's default) also
at each checkpoint, the checkpoint's adapter at the repo's top; `checkpoint` also the checkpoint folder itself into
`last-checkpoint/` (to resume from); `all_checkpoints` each checkpoint folder under its own name. HF pushes at a
save in the background; here the push runs in place, after the checkpoint is complete on disk, and a failed one
loses nothing local: training goes on, and the end push then also pushes the checkpoints the strategy puts on the
Hub. A failed end push raises `HubPushError`, one line with the reason and the `gym push` command that retries.
Only the main process pushes.
"""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hanzo_gym.config import Config
from hanzo_gym.config.hub_keys import is_repo_id
from hanzo_gym.engine.distributed import is_main, say
from hanzo_gym.errors import GymError, HubPushError
from hanzo_gym.loops.hub_paths import Scrub
from hanzo_gym.loops.model_card import RunView, model_card
from hanzo_gym.loops.run_dir import ADAPTER_MARKER, CHECKPOINT_PREFIX, MODEL_MARKER, TRAINER_STATE
from hanzo_gym.loops.trackers import Tracker, Trackers

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*-of-*.safetensors",
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "tekken.json",
)
LAST_CHECKPOINT = "last-checkpoint"  # HF's folder for hub_strategy: checkpoint


@dataclass(frozen=True)
class HubTarget:
    """Where a run goes: the repo, whether a repo created for it is private, its branch, and HF's hub_strategy."""

    repo_id: str
    private: bool | None = None
    revision: str | None = None
    strategy: str = "every_save"

    @classmethod
    def from_config(cls, cfg: Config) -> HubTarget | None:
        if not cfg.pushes_to_hub:
            return None
        return cls(cfg.hub_model_id, cfg.hub_private, cfg.hub_revision, cfg.hub_strategy or "every_save")

    def retry_command(self, run_dir: Path) -> str:
        words = ["gym", "push", str(run_dir.absolute()), self.repo_id]
        if self.private:
            words.append("--private")
        if self.revision:
            words += ["--revision", self.revision]
        return shlex.join(words)


def _top_files(directory: Path, patterns: Iterable[str]) -> list[Path]:
    found: dict[str, Path] = {}
    for pattern in patterns:
        for path in sorted(directory.glob(pattern)):
            if path.is_file():
                found.setdefault(path.name, path)
    return list(found.values())


def _folder_files(directory: Path) -> list[Path]:
    return sorted(
        path
        for path in directory.rglob("*")
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(directory).parts)
    )


def complete_checkpoints(run_dir: Path) -> list[Path]:
    folders = [
        path
        for path in run_dir.glob(f"{CHECKPOINT_PREFIX}*")
        if path.name.removeprefix(CHECKPOINT_PREFIX).isdigit() and (path / TRAINER_STATE).is_file()
    ]
    return sorted(folders, key=lambda p: int(p.name.removeprefix(CHECKPOINT_PREFIX)))


def is_full_model(directory: Path) -> bool:
    return (directory / MODEL_MARKER).is_file() and not (directory / ADAPTER_MARKER).is_file()


class Upload:
    """The files of one commit: (path in the repo, what to upload), in order, each path once."""

    def __init__(self, scrub: Scrub):
        self.scrub = scrub
        self.files: dict[str, Path | bytes] = {}

    def add(self, path_in_repo: str, content: Path | bytes) -> None:
        self.files.setdefault(
            path_in_repo, self.scrub.file(content) if isinstance(content, Path) else content
        )

    def model(self, directory: Path, tokenizer_dir: Path) -> bool:
        """The adapter or full model in `directory` and the tokenizer in `tokenizer_dir`; whether it is a full model."""
        full = is_full_model(directory)
        for path in _top_files(directory, MODEL_FILES if full else ADAPTER_FILES):
            self.add(path.name, path)
        for path in _top_files(tokenizer_dir, TOKENIZER_FILES):
            self.add(path.name, path)
        return full

    def folder(self, directory: Path, path_in_repo: str) -> None:
        for path in _folder_files(directory):
            self.add(f"{path_in_repo}/{path.relative_to(directory).as_posix()}", path)

    def checkpoints(self, run_dir: Path, strategy: str, only: Path | None = None) -> None:
        """The checkpoint folders `strategy` puts on the Hub: the newest (or `only`) as last-checkpoint/, or
        each under its name."""
        folders = [only] if only is not None else complete_checkpoints(run_dir)
        if strategy == "checkpoint" and folders:
            self.folder(folders[-1], LAST_CHECKPOINT)
        elif strategy == "all_checkpoints":
            for folder in folders:
                self.folder(folder, folder.name)

    def operations(self) -> list:
        from huggingface_hub import CommitOperationAdd

        return [
            CommitOperationAdd(
                path_in_repo=name, path_or_fileobj=str(content) if isinstance(content, Path) else content
            )
            for name, content in self.files.items()
        ]


class HubClient:
    """One repo on the Hub: created on the first commit (`exist_ok`: a repo that exists keeps its visibility),
    its branch too when the target names one."""

    def __init__(self, target: HubTarget):
        self.target = target
        self.url: str | None = None
        self.repo_id: str | None = None
        self._api = None

    def commit(self, upload: Upload, message: str) -> str:
        from huggingface_hub import HfApi

        if self._api is None:
            self._api = HfApi()  # reads HF_ENDPOINT and the token (HF_TOKEN or `hf auth login`) now
        if self.repo_id is None:
            repo = self._api.create_repo(self.target.repo_id, private=self.target.private, exist_ok=True)
            if self.target.revision and self.target.revision != "main":
                self._api.create_branch(repo.repo_id, branch=self.target.revision, exist_ok=True)
            self.url, self.repo_id = str(repo), repo.repo_id
        info = self._api.create_commit(
            self.repo_id,
            operations=upload.operations(),
            commit_message=message,
            revision=self.target.revision,
        )
        return info.oid


def short_reason(exc: BaseException) -> str:
    """Why a push failed, in a few words: the HTTP status and the Hub's message, or the connection error."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    response = getattr(exc, "response", None) if isinstance(exc, HfHubHTTPError) else None
    if response is not None:
        text = f"HTTP {response.status_code} {response.reason_phrase}".rstrip()
        if exc.server_message:
            text += f": {exc.server_message}"
        if response.status_code in (401, 403):
            text += " (log in with `hf auth login` or set HF_TOKEN to a token that may write there)"
    elif isinstance(exc, OfflineModeIsEnabled):
        text = "HF_HUB_OFFLINE is set"
    elif isinstance(exc, OSError) or type(exc).__module__.startswith("httpx"):
        text = f"cannot reach {constants.ENDPOINT}: {type(exc).__name__}: {exc}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."


class HubPusher(Tracker):
    """hub_model_id during `gym train`: a push at each checkpoint (as a tracker, after the checkpoint is
    complete) unless hub_strategy is `end`, and `push_end` once the final adapter or model is written."""

    name = "hub"

    def __init__(self, target: HubTarget, run_dir: Path, write_tokenizer: Callable[[Path], None]):
        self.target, self.run_dir, self.write_tokenizer = target, run_dir, write_tokenizer
        self.client = HubClient(target)
        self.missed: list[tuple[int, str]] = []  # (step, reason) of the pushes at saves that failed

    def checkpoint(self, path: Path, step: int, epoch: float) -> None:
        if self.target.strategy == "end":
            return
        try:
            view = RunView.read(self.run_dir)
            scrub = Scrub(view.config, self.run_dir)
            upload = Upload(scrub)
            with tempfile.TemporaryDirectory() as tokenizer_dir:
                self.write_tokenizer(Path(tokenizer_dir))
                full = upload.model(path, Path(tokenizer_dir))
                card = model_card(
                    view, scrub, self.target.repo_id, full, progress=f"checkpoint at step {step}"
                )
                upload.add("README.md", card.encode())
                upload.checkpoints(self.run_dir, self.target.strategy, only=path)
                self.client.commit(upload, f"Training in progress, step {step}")
        except Exception as exc:  # noqa: BLE001 - the checkpoint is on disk; the end push catches up
            self.missed.append((step, short_reason(exc)))

    def push_end(self, model_dir: Path) -> None:
        """The final push (raises HubPushError); after a failed push at a save it also pushes the checkpoint
        folders the strategy puts on the Hub."""
        strategy = self.target.strategy if self.missed else "end"
        try:
            commit = push_files(self.client, self.run_dir, model_dir, strategy, "End of training")
        except Exception as exc:  # whatever went wrong, the run is saved: say so in one line
            raise HubPushError(_failure(short_reason(exc), self.run_dir, self.target)) from exc
        caught_up = (
            f" (it also carries what the push at step {self.missed[0][0]} could not)" if self.missed else ""
        )
        say(f"pushed to {self.client.url} (commit {commit[:8]}){caught_up}")


def push_files(client: HubClient, run_dir: Path, model_dir: Path, strategy: str, message: str) -> str:
    """One commit: the final adapter or model and tokenizer of `model_dir`, the model card, and the checkpoint
    folders of `strategy`. Returns the commit's id."""
    view = RunView.read(run_dir)
    scrub = Scrub(view.config, run_dir, model_dir)
    upload = Upload(scrub)
    full = upload.model(model_dir, model_dir)
    upload.add("README.md", model_card(view, scrub, client.target.repo_id, full).encode())
    upload.checkpoints(run_dir, strategy)
    return client.commit(upload, message)


def _failure(reason: str, run_dir: Path, target: HubTarget) -> str:
    return (
        f"push to the Hub failed ({reason}); the run is saved in {run_dir}; retry with: "
        f"{target.retry_command(run_dir)}"
    )


def start_hub_push(cfg: Config, run_dir: Path, tokenizer: Any, trackers: Trackers) -> HubPusher | None:
    """With hub_model_id, on the main process: the pusher, added to the run's trackers so that it pushes at
    each checkpoint; `push_end` is for the caller to run once the final files are written."""
    target = HubTarget.from_config(cfg)
    if target is None or not is_main():
        return None
    pusher = HubPusher(target, run_dir, lambda directory: tokenizer.save_pretrained(str(directory)))
    trackers.trackers.append(pusher)
    visibility = "private" if target.private else "public"
    branch = f", branch {target.revision}" if target.revision else ""
    say(f"hub: pushing to {target.repo_id} ({visibility} if created{branch}), hub_strategy {target.strategy}")
    return pusher


def push_run_dir(
    run_dir: str | Path, repo_id: str, private: bool | None = None, revision: str | None = None
) -> str:
    """`gym push`: a finished run directory's final adapter or model, tokenizer and model card, and the
    checkpoint folders its hub_strategy puts on the Hub, in one commit. Returns the repo's URL."""
    run_dir = Path(run_dir)
    if not is_repo_id(repo_id):
        raise GymError(f"`{repo_id}` is not a Hub repo id: write `owner/name` or `name`")
    if not ((run_dir / ADAPTER_MARKER).is_file() or (run_dir / MODEL_MARKER).is_file()):
        raise GymError(
            f"{run_dir} holds no final adapter ({ADAPTER_MARKER}) or model ({MODEL_MARKER}): give the output_dir "
            "of a finished run"
        )
    strategy = RunView.read(run_dir).config.get("hub_strategy") or "end"
    target = HubTarget(repo_id, private, revision, strategy)
    client = HubClient(target)
    try:
        push_files(client, run_dir, run_dir, strategy, "End of training")
    except Exception as exc:  # one line, whatever the cause
        raise HubPushError(_failure(short_reason(exc), run_dir, target)) from exc
    return client.url or repo_id
