"""Which backend ``auto`` means for a producer: the rule, as a pure function."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["BackendChoice", "choose_backend"]

Backend = Literal["cpu", "cuda_ipc", "fabric"]


@dataclass(frozen=True)
class BackendChoice:
    """The backend a producer uses for its payloads, and why (for logs and statistics)."""

    backend: Backend
    reason: str


def choose_backend(
    *,
    gpu_tensors: bool,
    consumers_span_hosts: bool,
    fabric_permitted: Callable[[], bool],
) -> BackendChoice:
    """``fabric`` when FABRIC allocations are permitted and consumers span hosts,
    ``cuda_ipc`` on one host when the producer holds GPU tensors, ``cpu`` otherwise.

    ``fabric_permitted`` is only called when it matters (it allocates to find out).
    """
    if not gpu_tensors:
        return BackendChoice("cpu", "the producer's features are host memory")
    if consumers_span_hosts:
        if fabric_permitted():
            return BackendChoice("fabric", "consumers span hosts and FABRIC handles are permitted")
        return BackendChoice(
            "cpu",
            "consumers span hosts but the driver refuses FABRIC allocations (no IMEX "
            "channel): device payloads go through the host arena",
        )
    return BackendChoice("cuda_ipc", "GPU tensors and every consumer on this host")
