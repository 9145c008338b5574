"""The layering rules of the package, held by tests (see docs/architecture.md).

Bottom to top: records, errors, files, launch and clock → renderers, rewards → config (it checks reward specs and template
names at load) → data, synth (they read configs); none of these loads torch → model (loading, LoRA) → engine → host (model host, sample batcher), rollout (vLLM) → loops → front ends (cli, serve, tinker, cookbook). An
import only points down or sideways within a layer; module-level imports form no cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import hanzo_gym

PACKAGE = Path(hanzo_gym.__file__).parent
LAYERS = [
    {"records", "errors", "files", "launch", "clock"},
    {"renderers", "rewards"},
    {"config"},
    {"data", "synth"},
    {"model"},
    {"engine"},
    {"host", "rollout"},
    {"loops"},
    {"cli", "serve", "tinker", "cookbook"},
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
TORCH_FREE = ["records", "errors", "files", "launch", "clock", "config", "data", "renderers", "rewards", "synth"]


def _modules(part: str) -> list[str]:
    """Every module of a top-level part of the package, by dotted name."""
    root = PACKAGE / part
    if not root.is_dir():
        return [f"hanzo_gym.{part}"]
    names = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
        if relative.name != "__main__":
            names.append(".".join(parts))
    return names


def _loaded_after_import(modules: list[str], script: str = "") -> set[str]:
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + script
        + "print('\\n'.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_every_part_of_the_package_has_a_layer():
    parts = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert parts - {"__init__"} == set(RANK)


@pytest.mark.parametrize("part", TORCH_FREE)
def test_the_lower_layers_load_no_torch(part):
    loaded = _loaded_after_import(_modules(part))
    assert "torch" not in loaded, f"importing hanzo_gym.{part} loads torch"


def test_validating_a_config_loads_neither_torch_nor_transformers(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "base_model: some/model\nadapter: lora\nchat_template: chatml\noutput_dir: out\n"
        "datasets:\n  - path: data.jsonl\n    type: chat_template\n    split: train[:90%]\n"
        "lora_target_linear: true\nrl: grpo\ntrl:\n  reward_funcs: [numeric_match, 'format:\\d+']\n"
    )
    loaded = _loaded_after_import(["hanzo_gym.config"], f"hanzo_gym.config.load_config({str(config)!r})\n")
    assert not {"torch", "transformers"} & loaded


def test_gym_synth_loads_no_torch():
    loaded = _loaded_after_import(["hanzo_gym.synth.console", "hanzo_gym.synth.run", "hanzo_gym.cli"])
    assert "torch" not in loaded


def test_the_engine_loads_no_loop_host_or_front_end():
    loaded = _loaded_after_import(_modules("engine"))
    above = {f"hanzo_gym.{part}" for part in RANK if RANK[part] > RANK["engine"]}
    assert not {m for m in loaded if ".".join(m.split(".")[:2]) in above}


def _imports(path: Path, module_level_only: bool) -> list[tuple[str, int]]:
    """The hanzo_gym modules `path` imports (with line numbers). Module level includes TYPE_CHECKING blocks;
    otherwise imports inside functions count too. `from pkg import name` names pkg itself (its __init__
    runs and is read) and pkg.name when that is a module."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    if module_level_only:  # descend into top-level if/try blocks (TYPE_CHECKING, optional imports)
        stack, nodes = list(nodes), []
        while stack:
            node = stack.pop()
            nodes.append(node)
            if isinstance(node, (ast.If, ast.Try)):
                stack.extend(node.body + node.orelse + getattr(node, "finalbody", []))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.startswith("hanzo_gym")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hanzo_gym"):
            found.append((node.module, node.lineno))
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                if _path_of(candidate) is not None:
                    found.append((candidate, node.lineno))
    return found


def _path_of(module: str) -> Path | None:
    base = PACKAGE.parent.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _name_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def test_imports_point_down_the_layers():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _name_of(path)
        if name == "hanzo_gym":
            continue
        source = name.split(".")[1]
        for target, line in _imports(path, module_level_only=False):
            parts = target.split(".")
            if len(parts) < 2 or parts[1] not in RANK:
                continue  # `from hanzo_gym import __version__`
            if RANK[parts[1]] > RANK[source]:
                wrong.append(f"{path.relative_to(PACKAGE)}:{line} ({source}) imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles_at_module_level():
    graph = {
        _name_of(path): {target for target, _ in _imports(path, module_level_only=True)} - {_name_of(path)}
        for path in PACKAGE.rglob("*.py")
        if path.name != "__main__.py"
    }  # (a package's __init__ importing its own submodules is no cycle)
    cycles = []
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycles.append(" → ".join([*trail[trail.index(target) :], target]))
            elif target not in state:
                visit(target, [*trail, target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)
