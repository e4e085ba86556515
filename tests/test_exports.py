"""Each public name is exported by exactly one public namespace; no private name leaks."""

from __future__ import annotations

import importlib

import pytest

NAMESPACES = ["mmwire.transport", "mmwire.materialize", "mmwire.kernels", "mmwire.bench"]


@pytest.mark.parametrize("name", NAMESPACES)
def test_all_is_exact(name: str) -> None:
    mod = importlib.import_module(name)
    exported = list(getattr(mod, "__all__", []))
    assert len(exported) == len(set(exported))
    for n in exported:
        assert not n.startswith("_")
        assert hasattr(mod, n), f"{name}.__all__ names missing {n}"


def test_each_name_exported_once() -> None:
    owners: dict[str, list[str]] = {}
    for name in NAMESPACES:
        for n in importlib.import_module(name).__all__:
            owners.setdefault(n, []).append(name)
    assert {n: o for n, o in owners.items() if len(o) > 1} == {}
