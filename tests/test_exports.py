"""The public API fits on a screen: each package's ``__all__`` is small and exact, each
public name has one home, and the errors are one namespace both packages share."""

from __future__ import annotations

import importlib

import pytest

NAMESPACES = [
    "mmwire.transport",
    "mmwire.transport.errors",
    "mmwire.transport.wire",
    "mmwire.transport.images",
    "mmwire.materialize",
    "mmwire.kernels",
    "mmwire.kernels.reference",
    "mmwire.bench",
]
SHARED = {"errors"}  # mmwire.materialize re-exports mmwire.transport's errors namespace


@pytest.mark.parametrize("name", NAMESPACES)
def test_all_is_exact(name: str) -> None:
    mod = importlib.import_module(name)
    exported = list(getattr(mod, "__all__", []))
    assert len(exported) == len(set(exported))
    for n in exported:
        assert not n.startswith("_")
        assert hasattr(mod, n), f"{name}.__all__ names missing {n}"


def test_packages_export_what_an_engine_calls() -> None:
    assert len(importlib.import_module("mmwire.transport").__all__) <= 40
    assert len(importlib.import_module("mmwire.materialize").__all__) <= 30


def test_each_name_exported_once() -> None:
    owners: dict[str, list[str]] = {}
    for name in NAMESPACES:
        for n in importlib.import_module(name).__all__:
            if n not in SHARED:
                owners.setdefault(n, []).append(name)
    assert {n: o for n, o in owners.items() if len(o) > 1} == {}


def test_both_packages_share_one_errors_namespace() -> None:
    from mmwire import materialize, transport

    assert materialize.errors is transport.errors
    errors = transport.errors
    for n in errors.__all__:
        cls = getattr(errors, n)
        assert issubclass(cls, errors.MmwireError)
