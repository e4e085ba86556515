"""Nothing in the library imports or calls pickle (no pickle on any wire, in any backend)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"pickle", "cPickle", "dill", "cloudpickle", "_pickle", "marshal", "shelve"}
PACKAGES = ["transport", "materialize", "kernels"]


def test_library_never_imports_pickle() -> None:
    offenders = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module.split(".")[0]]
                elif isinstance(node, ast.Attribute) and node.attr in {
                    "send_pyobj",
                    "recv_pyobj",
                    "loads",
                }:
                    names = [node.attr]
                offenders += [
                    f"{path.relative_to(ROOT)}:{node.lineno} {n}"
                    for n in names
                    if n in FORBIDDEN | {"send_pyobj", "recv_pyobj"}
                ]
    assert offenders == []


def test_no_assert_for_checks() -> None:
    """Checks survive ``python -O``: no ``assert`` in library code (style practice 5)."""
    found = [
        f"{p.relative_to(ROOT)}:{n.lineno}"
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.Assert)
    ]
    assert found == []
