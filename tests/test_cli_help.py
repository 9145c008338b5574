"""Every subcommand's --help says what it does and names a reference that exists (a file, and a section heading
in it where it names one)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from hanzo_gym.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _headings(page: Path) -> set[str]:
    return {line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")}

COMMANDS = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_commands_help_says_what_it_does_and_where_to_read_more(name):
    command = COMMANDS[name]
    assert command.description and len(command.description) > 30
    reference = re.fullmatch(r"Reference: (\S+)(?:, section (.+))?", command.epilog)
    assert reference, command.epilog
    assert (ROOT / reference[1]).is_file()
    if reference[2]:
        assert reference[2] in _headings(ROOT / reference[1])
    assert all(
        action.help for action in command._actions if action.dest != "help"
    )  # every argument explained
