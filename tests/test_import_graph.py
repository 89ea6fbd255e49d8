"""The package's import graph: no cycle, imports inside functions included; the config schema imports no runtime."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybridflow"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package modules that a module's source imports anywhere (top level, functions, TYPE_CHECKING blocks):
    `import a.b` names a.b; `from a import b` names a.b when that is a module, else a."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
    modules = set(paths)
    return {
        name: imported_modules(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", modules)
        for name, path in paths.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path `[a, b, ..., a]`, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            child = next(stack[-1], None)
            if child is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append(iter(sorted(graph.get(child, ()))))
    return None


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle (imports inside functions count): " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles_and_function_level_imports(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    source = "import os\n\ndef f():\n    from hybridflow.x import y\n    from . import z\n"
    modules = {"hybridflow.x", "hybridflow.x.y", "hybridflow.p.z", "hybridflow.p.m"}
    assert imported_modules(ast.parse(source), "hybridflow.p.m", False, modules) == {"hybridflow.x.y", "hybridflow.p.z"}


def test_the_config_schema_and_checks_import_no_runtime():
    """A config error prints before torch, transformers or Ray load (they take seconds): the CLI's command modules,
    the schema and the checks import them lazily, where a check needs a model's shape or a registry's classes."""
    code = (
        "import sys\n"
        "import hybridflow.trainer.config.schema, hybridflow.trainer.config.validate, hybridflow.trainer.main_ppo\n"
        "import hybridflow.trainer.main_generation, hybridflow.trainer.main_eval, hybridflow.trainer.sft.main\n"
        "print(sorted(m for m in ('torch', 'transformers', 'ray', 'tensordict', 'pyarrow') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
