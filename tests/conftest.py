"""Shared fixtures: distinct-size pixel arrays, the sample photos, a producer with one rank."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mmwire.transport import Consumer, Producer

sys.path.insert(0, str(Path(__file__).parent))

DATA = Path(__file__).resolve().parent.parent / "bench" / "data"


@pytest.fixture
def rng() -> np.random.Generator:
    seed = np.random.SeedSequence().entropy
    print(f"rng seed {seed}")  # printed so a failure can be replayed
    return np.random.default_rng(seed)


@pytest.fixture
def distinct_images(rng: np.random.Generator) -> list[np.ndarray[Any, Any]]:
    """Three uint8 RGB images of distinct, odd sizes (identical sizes hide index bugs)."""
    return [
        rng.integers(0, 256, size=s, dtype=np.uint8)
        for s in ((37, 53, 3), (61, 29, 3), (45, 45, 3))
    ]


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Producer, Consumer]]:
    """A producer with a 4 MiB arena and rank 0 joined (same process); a test's
    ``@pytest.mark.producer(**options)`` adds producer options."""
    marker = request.node.get_closest_marker("producer")
    p = Producer(arena_size=1 << 22, **(marker.kwargs if marker else {}))
    c = Consumer(0, p.endpoint, handover=p.handover_path)
    p.wait_for_consumers([0], 10)
    yield p, c
    c.close()
    p.close()


def photo_path(name: str) -> Path:
    return DATA / name


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` (the default) on every core, except for ``-m gpu``: the GPU tests share
    one device and time its handovers, so they run in one process."""
    if "gpu" in str(config.getoption("markexpr") or ""):
        return 0
    return None
