"""Where a producer is, as a consumer on its host or another one needs to know it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ProducerAddress"]


@dataclass(frozen=True)
class ProducerAddress:
    """Where a producer is: its channel endpoint and, on this host, its handover socket."""

    endpoint: str
    handover: str | None = None
