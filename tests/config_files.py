"""Loading a config written into a test's temporary folder, or the one-message error it gives."""

from __future__ import annotations

import pytest

from hanzo_gym.config import load_config
from hanzo_gym.errors import ConfigError


def load_text(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return load_config(path)


def error_of(tmp_path, text) -> str:
    with pytest.raises(ConfigError) as caught:
        load_text(tmp_path, text)
    return str(caught.value)
