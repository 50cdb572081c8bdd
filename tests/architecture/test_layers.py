"""The architecture holds itself: no import cycles (imports inside functions count), the layer
contract passes, and no function is longer than the limit we set ourselves."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
MAX_FUNCTION_LINES = 80


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Return polo module -> the polo modules it imports anywhere in its source (functions included)."""
    modules = {module_name(path): path for path in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            for target in targets:
                while target and target not in modules:  # `import polo.a.b` imports polo.a.b; an attribute resolves to its module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return the strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for successor in graph[node]:
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_counting_imports_inside_functions():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_function_over_the_limit():
    long = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
                if node.end_lineno - start + 1 > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({node.end_lineno - start + 1} lines)")
    assert long == []


def test_the_layer_contract_holds():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.fail("lint-imports (the import-linter package, a dev extra) is not installed")
    finished = subprocess.run([lint], cwd=SRC.parent, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stdout[-3000:]


# What asking "which device am I on?" looks like in source; only runtime/ and kernels/ may do it.
DEVICE_QUESTIONS = ("torch.cuda", ".device.type", "/proc/cpuinfo", "init_process_group", "torch.autocast(")
DEVICE_LAYERS = ("polo/runtime/", "polo/kernels/")
# polo.core's one collective must put its tensor where the process group's backend wants it.
DEVICE_EXCEPTIONS = ("polo/core/distributed.py",)


def test_only_runtime_and_kernels_ask_which_device_they_run_on():
    askers = []
    for path in SRC.rglob("*.py"):
        relative = path.relative_to(SRC).as_posix()
        if relative.startswith(DEVICE_LAYERS) or relative in DEVICE_EXCEPTIONS:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(question in line for question in DEVICE_QUESTIONS):
                askers.append(f"{relative}:{number}: {line.strip()}")
    assert askers == []
