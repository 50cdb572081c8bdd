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
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            for target in targets:
                while (
                    target and target not in modules
                ):  # `import polo.a.b` imports polo.a.b; an attribute resolves to its module
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
                    long.append(
                        f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({node.end_lineno - start + 1} lines)"
                    )
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
DEVICE_EXCEPTIONS: tuple[str, ...] = ()


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


def polo_sources_outside(layers: tuple[str, ...]):
    """Yield (relative path, parsed module) for every source file of polo outside `layers`."""
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC).as_posix()
        if not relative.startswith(layers):
            yield relative, ast.parse(path.read_text())


def cpu_kernel_imports(tree: ast.AST) -> list[int]:
    """Return the line numbers of imports of `polo.kernels.cpu` (or its modules) in a module."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        if any(name == "polo.kernels.cpu" or name.startswith("polo.kernels.cpu.") for name in names):
            lines.append(node.lineno)
    return lines


def test_only_the_kernels_facade_imports_the_cpu_kernels():
    importers = [
        f"{relative}:{line}"
        for relative, tree in polo_sources_outside(("polo/kernels/",))
        for line in cpu_kernel_imports(tree)
    ]
    assert importers == [], "import kernels through polo.kernels, which picks them per device"


def test_the_cpu_kernel_import_check_finds_one():
    assert cpu_kernel_imports(
        ast.parse("from polo.kernels.cpu.attention import x\nimport polo.kernels.cpu.linear\n")
    ) == [1, 2]
    assert cpu_kernel_imports(
        ast.parse("from polo.kernels import cpu\nfrom polo.kernels import use_fast_attention\n")
    ) == [1]


def precision_string_parameters(tree: ast.AST) -> list[str]:
    """Return `function(precision: str)` parameters in a module: a precision travels as a Compute."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            for argument in arguments:
                annotation = ast.unparse(argument.annotation) if argument.annotation is not None else ""
                if argument.arg == "precision" and annotation in ("str", "'str'", '"str"'):
                    found.append(f"{node.lineno} {node.name}")
    return found


def test_no_function_takes_a_precision_string():
    found = [
        f"{relative}:{where}"
        for relative, tree in polo_sources_outside(())
        for where in precision_string_parameters(tree)
    ]
    assert found == [], "pass the run's polo.runtime.device.Compute instead of a precision name"


def device_strings(tree: ast.AST) -> list[int]:
    """Return the lines of the string constants "cpu" and "cuda" (or "cuda:N") in a module."""
    return sorted(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and (node.value in ("cpu", "cuda") or node.value.startswith("cuda:"))
    )


def test_no_device_named_outside_runtime_and_kernels():
    found = [
        f"{relative}:{line}" for relative, tree in polo_sources_outside(DEVICE_LAYERS) for line in device_strings(tree)
    ]
    assert found == [], "allocate on the run's Compute.device (or an input tensor's device), never a named one"


def test_the_device_checks_find_what_they_look_for():
    assert precision_string_parameters(ast.parse("def f(x, *, precision: str = 'fp32'): pass")) == ["1 f"]
    assert precision_string_parameters(ast.parse("def f(x, *, compute=None): pass")) == []
    assert device_strings(ast.parse("a = torch.zeros(3, device='cpu')\nb = 'cuda:1'\nc = 'cpus'")) == [1, 2]


def test_a_future_warning_fails_the_test_that_raised_it():
    """pyproject's pytest filters make a FutureWarning an error, so a deprecated call in polo fails `make test`."""
    import warnings

    import pytest

    with pytest.raises(FutureWarning, match="going away"):
        warnings.warn("this argument is going away", FutureWarning, stacklevel=1)


# A training loop logs a metrics row per step and turns stop signals into a clean stop: one module does both for
# every trainer (polo.runtime.lifecycle), and the pipeline stops between its stages.
LIFECYCLE = "polo/runtime/lifecycle.py"
LOOP_PARTS = {
    "MetricsLogger": (LIFECYCLE,),
    "StopRequest": (LIFECYCLE, "polo/pipeline/run.py"),
    "RunStopped": (LIFECYCLE, "polo/pipeline/run.py", "polo/runtime/interrupt.py"),
}


def loop_part_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """Return (line, name) of every call that builds a training loop's part (`LOOP_PARTS`) in a module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            function = node.func
            name = function.id if isinstance(function, ast.Name) else getattr(function, "attr", "")
            if name in LOOP_PARTS:
                found.append((node.lineno, name))
    return found


def test_only_the_lifecycle_runs_a_training_loop():
    """A second loop would open its own metrics logger and stop handling: only the lifecycle builds them."""
    found = [
        f"{relative}:{line} {name}("
        for relative, tree in polo_sources_outside(())
        for line, name in loop_part_calls(tree)
        if relative not in LOOP_PARTS[name]
    ]
    assert found == [], "a trainer is a step plugged into polo.runtime.lifecycle.run_lifecycle, not a loop of its own"


def test_the_loop_check_finds_a_second_loop():
    source = "logger = metrics.MetricsLogger(out, 3)\nwith StopRequest() as stop:\n    raise RunStopped(2, 1, None)\n"
    assert loop_part_calls(ast.parse(source)) == [(1, "MetricsLogger"), (2, "StopRequest"), (3, "RunStopped")]
