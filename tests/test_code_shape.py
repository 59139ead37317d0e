"""The library's code stays legible: no function takes more than six positional parameters (values that travel
together go in records), and nothing caches a lambda. The Liger, TRL and verl drop-ins keep those libraries'
signatures."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "compiled_grpo"
KEEPS_A_FOREIGN_SIGNATURE = {  # drop-ins called with another library's positional arguments
    ("compat.py", "__init__"),  # Liger's LigerFusedLinearGRPOLoss
    ("compat.py", "forward"),
    ("integrations/trl.py", "apply"),  # TRL's ChunkedLogProbFunction.apply
    ("integrations/verl.py", "linear_cross_entropy"),  # verl's linear_cross_entropy
}
MAX_POSITIONAL = 6


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
