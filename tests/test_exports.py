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
    "mmwire.transport.videos",
    "mmwire.materialize",
    "mmwire.materialize.video",
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


def test_a_numpy_producer_and_rank_never_import_torch() -> None:
    # a frontend and a CPU rank moving arrays and encoded bytes: importing torch would cost
    # them seconds at start and hundreds of MB
    code = """
import sys
import numpy as np
from mmwire.transport import Consumer, GlobalIndex, Grid, Item, Producer
with Producer(arena_size=1 << 22) as p, Consumer(0, p.endpoint, handover=p.handover_path) as c:
    p.wait_for_consumers([0], 30)
    data = np.arange(12, dtype=np.float32)
    p.publish("a", [Item(data, consumers=(0,), kind="embedding", grid=Grid((1, 1)))])
    with c.recv(30) as batch:
        assert (batch.open(GlobalIndex(0)) == data).all()
print("torch" in sys.modules)
"""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"
