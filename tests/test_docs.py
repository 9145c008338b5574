"""The README and docs/ hold true: every link and section anchor resolves, every command the README shows parses
(its config files and scripts exist, its make targets are the Makefile's) and is run by a named test, and no page
speaks of how the project was made rather than of the product."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from hanzo_gym.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# How the project was made, not what it does: work rounds, tickets, sessions and the like.
HISTORY = re.compile(
    r"\b(?:round|ticket|session|sprint|milestone)\s*#?\d+|\bissue\s*#?\d+", re.IGNORECASE
)

# Each command the README shows, and the test that runs it (file::function). A command added to the README without
# a test that runs it fails here.
README_COMMANDS = {
    "make demo": "tests/test_demos.py::test_make_demo_trains_the_sft_demo_then_reports_it",
    "make test": "tests/test_docs.py::test_the_make_targets_the_readme_names_exist",
    "make test-quick": "tests/test_docs.py::test_the_make_targets_the_readme_names_exist",
    "make test-all": "tests/test_docs.py::test_the_make_targets_the_readme_names_exist",
    "gym train examples/smollm2-sft.yaml": "tests/test_demos.py::test_the_sft_demo_trains_and_its_eval_loss_falls",
    "gym report outputs/smollm2-sft": "tests/test_demos.py::test_the_sft_demo_trains_and_its_eval_loss_falls",
    "gym train examples/smollm2-grpo.yaml": "tests/test_demos.py::test_the_grpo_demo_raises_the_reward",
    "gym train examples/smollm2-dpo.yaml": "tests/test_demos.py::test_the_dpo_demo_prefers_the_right_answer",
    "gym train examples/smollm2-qlora.yaml": "tests/test_demos.py::test_the_qlora_demo_trains",
    "python examples/sl_loop.py": "tests/test_tinker_examples.py::test_sl_loop_lowers_the_held_out_nll",
    "gym serve --model .venv/models/SmolLM2-135M-Instruct.Q4_1.gguf --adapter demo=outputs/smollm2-sft": (
        "tests/test_serve_lm_eval.py::test_lm_eval_local_completions_matches_hf_on_the_real_model_and_an_adapter"
    ),
    "tensorboard --logdir outputs/smollm2-sft/runs": "tests/test_trackers.py::test_tensorboard_logs_where_hf_puts_them",
}


def _headings(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces as hyphens."""
    anchors = set()
    in_code = False
    for line in page.read_text().splitlines():
        in_code ^= line.startswith("```")
        if not in_code and line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_anchor_resolves(page):
    broken = []
    prose = re.sub(r"`[^`]*`", "", page.read_text())  # a link's brackets inside code are code
    for target in LINK.findall(prose):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or anchor and file.suffix == ".md" and anchor not in _headings(file):
            broken.append(target)
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_speaks_of_how_the_project_was_made(page):
    assert HISTORY.findall(page.read_text()) == []


def _readme_commands() -> list[str]:
    """The commands in the README's ```bash blocks, comments and continuation lines joined."""
    commands, block = [], None
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            block = [] if block is None and line.strip() == "```bash" else None
            continue
        if block is None:
            continue
        line = line.split(" #", 1)[0].rstrip() if not line.startswith("#") else ""
        if line:
            commands.append(line.strip())
    return [command.removeprefix(".venv/bin/") for command in commands]


def test_every_readme_command_is_run_by_a_named_test():
    shown = _readme_commands()
    assert "make demo" in shown and "gym report outputs/smollm2-sft" in shown  # the reading found the blocks
    untested = [command for command in shown if command not in README_COMMANDS]
    assert untested == [], "add each to README_COMMANDS with the test that runs it"
    for command, test in README_COMMANDS.items():
        file, name = test.split("::")
        assert f"def {name}(" in (ROOT / file).read_text(), (command, test)


def test_every_gym_command_in_the_readme_parses_and_names_files_that_exist():
    parser = build_parser()
    for command in _readme_commands():
        words = shlex.split(command)
        if words[0] == "gym":
            parser.parse_args(words[1:])  # a wrong flag or subcommand exits here
            named = [w for w in words if w.startswith("examples/")]
        elif words[0] == "python":
            named = words[1:2]
        else:
            continue
        assert all((ROOT / path).is_file() for path in named), command


def test_the_make_targets_the_readme_names_exist():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    named = {c.split()[1] for c in _readme_commands() if c.startswith("make ")}
    assert named and named <= targets
