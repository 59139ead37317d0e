"""The library's code stays legible: files of at most 300 lines, classes of at most 130 and functions of at most
60; no function takes more than six positional parameters (values that travel together go in records); nothing
caches a lambda; no circle of imports; and the primitive (logprobs.py) and the graph cache (capture.py) reach no
module of the GRPO loss, directly or through another. The Liger, TRL and verl drop-ins keep those libraries'
signatures."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "compiled_grpo"
KEEPS_A_FOREIGN_SIGNATURE = {  # drop-ins called with another library's positional arguments
    ("compat.py", "__init__"),  # Liger's LigerFusedLinearGRPOLoss
    ("compat.py", "forward"),
    ("integrations/trl/head.py", "apply"),  # TRL's ChunkedLogProbFunction.apply
    ("integrations/verl.py", "linear_cross_entropy"),  # verl's linear_cross_entropy
}
MAX_POSITIONAL = 6
MAX_FILE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 300, 130, 60
# The GRPO loss: its settings, inputs, objective and the schedules that run it (the engine's passes, the
# recomputing and sparse gradient engines and the graph cache are shared with the primitive).
GRPO_LOSS_MODULES = {
    f"compiled_grpo.{m}"
    for m in (
        "batch_objective", "objectives", "config", "loss", "step", "options", "quantile", "sequence_parallel",
        "packing", "inputs", "validation", "compat", "integrations", "schedules.memory", "schedules.speed",
        "schedules.sparse", "schedules.whole_forward", "schedules.choice", "schedules.captured_call",
    )
}  # fmt: skip


def sources():
    return [(path.relative_to(PACKAGE).as_posix(), path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))]


def functions():
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(PACKAGE).as_posix(), node


def positional(node) -> list[str]:
    names = [a.arg for a in node.args.posonlyargs + node.args.args]
    return [n for n in names if n not in ("self", "cls", "ctx")]


@pytest.mark.parametrize("where, node", [pytest.param(w, n, id=f"{w}:{n.name}") for w, n in functions()])
def test_at_most_six_positional_parameters(where, node):
    if (where, node.name) in KEEPS_A_FOREIGN_SIGNATURE:
        return
    names = positional(node)
    assert len(names) <= MAX_POSITIONAL, f"{where}:{node.lineno} {node.name}({', '.join(names)})"


def test_no_cached_lambdas():
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and any(isinstance(a, ast.Lambda) for a in node.args):
                func = ast.unparse(node.func)
                assert "cache" not in func, f"{path.name}:{node.lineno} {func}(lambda ...)"


@pytest.mark.parametrize("where, text", sources(), ids=[w for w, _ in sources()])
def test_files_classes_and_functions_are_short(where, text):
    assert text.count("\n") <= MAX_FILE_LINES, f"{where}: {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        length = node.end_lineno - node.lineno + 1 if hasattr(node, "end_lineno") else 0
        if isinstance(node, ast.ClassDef):
            assert length <= MAX_CLASS_LINES, f"{where}:{node.lineno} class {node.name}: {length} lines"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert length <= MAX_FUNCTION_LINES, f"{where}:{node.lineno} {node.name}: {length} lines"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports anywhere in it (lazy imports too): `from . import x` names the
    module x, `from .x import y` the module x (or x.y where y is a module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(parts + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found |= {f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imported_modules(path, set(paths)) for name, path in paths.items()}


def reached(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module `start` reaches, each with the module that imports it on the way."""
    via, stack = {}, [start]
    while stack:
        here = stack.pop()
        for m in graph[here]:
            if m not in via:
                via[m] = here
                stack.append(m)
    return via


def test_import_graph_resolves_the_package():
    graph = import_graph()
    assert "compiled_grpo.capture" in graph["compiled_grpo.logprobs"]
    assert "compiled_grpo.schedules.recompute" in graph["compiled_grpo.schedules.memory"]


def test_no_circle_of_imports():
    graph = import_graph()
    circles = [name for name in sorted(graph) if name in reached(graph, name)]
    assert not circles, f"modules that import themselves through others: {circles}"


@pytest.mark.parametrize("start", ["compiled_grpo.logprobs", "compiled_grpo.capture"])
def test_the_primitive_and_the_graph_cache_reach_no_grpo_loss_module(start):
    via = reached(import_graph(), start)
    grpo = sorted(set(via) & GRPO_LOSS_MODULES)
    assert not grpo, ", ".join(f"{m} (imported by {via[m]})" for m in grpo)
