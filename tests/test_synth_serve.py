"""`gym synth` end to end against `gym serve` on the real SmolLM2-135M-Instruct: a served model on a free local
port, a small design through the command line, and the rows, columns and summary it delivers."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from hanzo_gym.cli import main
from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.serve import ServedModels, Server


@pytest.mark.real_model
def test_synth_against_gym_serve_on_the_real_model(real, tmp_path, capsys):
    models = ServedModels(ModelHost(str(real.gguf), dtype=torch.float32), name="smol")
    with Server(models, port=0) as server:
        output = tmp_path / "rows.jsonl"
        design = {
            "model": {
                "name": "smol",
                "endpoint": server.url,
                "api_key_env": None,
                "temperature": 0,
                "max_tokens": 16,
                "concurrency": 3,
            },
            "random_seed": 0,
            "rows": 3,
            "max_attempts": 6,
            "output": str(output),
            "columns": [
                {"name": "animal", "sampler": "category", "values": ["cat", "dog", "horse"]},
                {"name": "fact", "llm": "text", "prompt": "Tell me one short fact about a {{ animal }}."},
            ],
            "validators": [{"column": "fact", "kind": "length", "min": 5}],
        }
        path = tmp_path / "design.yaml"
        path.write_text(yaml.safe_dump(design, sort_keys=False))
        assert main(["synth", str(path)]) == 0
    summary = capsys.readouterr().out
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert list(row) == ["animal", "fact"]
        assert row["animal"] in ("cat", "dog", "horse")
        assert isinstance(row["fact"], str) and len(row["fact"]) >= 5
    assert f"synth: 3/3 rows delivered to {output}" in summary
    assert f"model default (smol @ {server.url}): " in summary
    calls = int(summary.split(f"{server.url}): ")[1].split(" calls")[0])
    assert calls >= 3 and ", 0 failed; tokens " in summary
    completion = int(summary.split(" prompt + ")[1].split(" completion")[0])
    assert 3 <= completion <= 16 * calls  # max_tokens reached the server
