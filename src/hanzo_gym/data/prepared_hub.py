"""Axolotl's `push_dataset_to_hub`: the tokenized datasets of a run shared through a private Hub dataset repo, so
that another machine (or a run without `dataset_prepared_path`) reads them instead of tokenizing again.

An entry goes to `<repo>/<key>/` (prepared.json and inputs.json, data/prepared.py's files), where the key is the
hash of what the tokenized result depends on with each data file known by its content alone: the same data
tokenized on two machines has one key wherever its files lie. Nothing of the local file system is pushed: inputs.json
lists the files' hashes, and a dataset path of the statistics that is absolute keeps its file name only. The repo
is created private, as Axolotl pushes it (an existing one keeps its visibility); a repo id without an owner is the
pushing user's. A run that does not find its entry on the Hub (no network, no such repo) tokenizes, as Axolotl's
does; one whose push fails says so in one line and trains on: the tokenized data is in memory and, with
`dataset_prepared_path`, on disk.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import HfHubHTTPError

from hanzo_gym.data.sources import HUB_UNAVAILABLE

DATA_FILE, INPUTS_FILE = "prepared.json", "inputs.json"


def portable_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """`inputs` with its data files known by their content hashes, in order, not by where they lie: a dataset
    `path` that is a local file or folder is written `local` (a hub dataset id stays)."""
    config = dict(inputs["config"])
    for listed in ("datasets", "test_datasets"):
        if config.get(listed):
            config[listed] = [
                {**ds, "path": "local"}
                if isinstance(ds.get("path"), str) and Path(ds["path"]).expanduser().exists()
                else ds
                for ds in config[listed]
            ]
    return {**inputs, "config": config, "data_files": list(inputs["data_files"].values())}


def hub_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(portable_inputs(inputs), sort_keys=True).encode()).hexdigest()[:20]


def pull_entry(repo: str, key: str) -> Path | None:
    """The local copy of the entry's prepared.json, downloaded; None when the Hub does not have it or cannot be
    reached. Asking who the token is first tells an unreachable Hub at once, where a download would retry for
    half a minute, and names the owner of a repo id that has none."""
    try:
        owner = HfApi().whoami()["name"]
        full = repo if "/" in repo else f"{owner}/{repo}"
        return Path(hf_hub_download(full, f"{key}/{DATA_FILE}", repo_type="dataset"))
    except (*HUB_UNAVAILABLE, HfHubHTTPError, OSError):
        return None


def push_entry(repo: str, key: str, document: dict[str, Any], inputs: dict[str, Any]) -> str:
    """Upload the entry (a prepared.json `document`) in one commit; the line that says where, or why not."""
    stats = [
        {**stat, "path": Path(stat["path"]).name if Path(stat["path"]).is_absolute() else stat["path"]}
        for stat in document.get("stats", [])
    ]
    api = HfApi()
    try:
        full = api.create_repo(repo, repo_type="dataset", private=True, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as staging:
            folder = Path(staging)
            (folder / DATA_FILE).write_text(json.dumps({**document, "stats": stats}, separators=(",", ":")))
            (folder / INPUTS_FILE).write_text(
                json.dumps(portable_inputs(inputs), indent=2, sort_keys=True) + "\n"
            )
            api.upload_folder(
                repo_id=full,
                repo_type="dataset",
                folder_path=folder,
                path_in_repo=key,
                commit_message=f"prepared datasets {key}",
            )
    except (*HUB_UNAVAILABLE, HfHubHTTPError, OSError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"push_dataset_to_hub: could not push the prepared datasets to `{repo}` ({reason}); training goes on"
    return f"push_dataset_to_hub: pushed the prepared datasets to hub dataset `{full}`, folder {key}"
