"""The packages' import graph: no private imports across packages, no cycles, and the
layers transport <- kernels <- materialize <- bench (kernels never imports materialize),
and the producer built from modules of one job each that never import the consumer side."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("transport", "materialize", "kernels", "bench")
# each package and the packages it may import
ALLOWED = {
    "transport": set(),
    "kernels": {"transport"},
    "materialize": {"transport", "kernels"},
    "bench": {"transport", "kernels", "materialize"},
}


def _imports() -> dict[str, set[str]]:
    """``mmwire.pkg.module`` -> the ``mmwire`` modules it imports (function-level ones too)."""
    graph: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).glob("*.py")):
            name = f"mmwire.{pkg}.{path.stem}".removesuffix(".__init__")
            found: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = f"mmwire.{pkg}"
                        target = f"{base}.{node.module}" if node.module else base
                    else:
                        target = node.module or ""
                    found.add(target)
                elif isinstance(node, ast.Import):
                    found.update(a.name for a in node.names)
            graph[name] = {t for t in found if t.startswith("mmwire.")}
    return graph


GRAPH = _imports()


def test_the_graph_sees_every_package() -> None:
    assert {m.split(".")[1] for m in GRAPH} == set(PACKAGES)
    assert "mmwire.kernels._descriptors" in GRAPH["mmwire.kernels"]


def test_no_package_imports_another_packages_private_module() -> None:
    bad = [
        (m, t)
        for m, targets in GRAPH.items()
        for t in targets
        if t.split(".")[1] != m.split(".")[1] and any(p.startswith("_") for p in t.split(".")[2:])
    ]
    assert bad == []


def test_packages_import_only_the_layers_below_them() -> None:
    bad = [
        (m, t)
        for m, targets in GRAPH.items()
        for t in targets
        if t.split(".")[1] != m.split(".")[1] and t.split(".")[1] not in ALLOWED[m.split(".")[1]]
    ]
    assert bad == []


def test_no_module_import_cycles() -> None:
    # a package's __init__ re-exports its modules; the cycles that matter are among modules
    modules = {m: {t for t in ts if t in GRAPH and t.count(".") != 1} for m, ts in GRAPH.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in modules[m]:
            if state.get(t) == 1:
                pytest.fail(" -> ".join([*path[path.index(t) :], t]))
            if t not in state:
                visit(t, [*path, t])
        state[m] = 2

    for m in modules:
        if m not in state:
            visit(m, [m])


def _reached(module: str) -> set[str]:
    """Every module of the packages that ``module`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for t in GRAPH[todo.pop()]:
            if t in GRAPH and t.count(".") != 1 and t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


# the producer's own modules, one job each: what it is built from, what its publish runs
PRODUCER_MODULES = (
    "_producer",
    "_channel",
    "_membership",
    "_control_loop",
    "_publish",
    "_delivery",
    "_items",
    "_prepare",
    "_staging",
    "_light",
)


def test_the_producer_side_never_imports_the_consumer_side() -> None:
    reached = _reached("mmwire.transport._producer")
    assert {f"mmwire.transport.{m}" for m in PRODUCER_MODULES} <= reached | {
        "mmwire.transport._producer"
    }
    assert not reached & {"mmwire.transport._consumer", "mmwire.transport._group"}


@pytest.mark.parametrize("module", PRODUCER_MODULES)
def test_each_producer_module_reads_in_one_sitting(module: str) -> None:
    lines = len((ROOT / "transport" / f"{module}.py").read_text().splitlines())
    assert lines <= 420, f"transport/{module}.py has {lines} lines: split it by job"


@pytest.mark.parametrize("old", ["CpuProducer", "CpuConsumer"])
def test_the_names_before_the_one_producer_are_gone(old: str) -> None:
    import mmwire.transport as transport

    with pytest.raises(AttributeError):
        getattr(transport, old)
