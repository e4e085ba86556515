"""What a producer reports about itself (``Producer.statistics()``)."""

from __future__ import annotations

from dataclasses import dataclass

from ._arena import ArenaStatistics
from ._gpu import DevicePoolStatistics

__all__ = ["ProducerStatistics"]


@dataclass(frozen=True)
class ProducerStatistics:
    """A snapshot of a producer."""

    arena: ArenaStatistics
    """The arena's use."""
    consumers: tuple[int, ...]
    """Ranks joined on the channel."""
    inline_fallbacks: int
    """Requests sent inline because the arena was full (``on_full='inline'``)."""
    sends_in_flight: int
    """Zero-copy sends to remote consumers not yet done."""
    handovers_refused: int
    """Processes refused the arena (credentials, a malformed or missing hello, a held rank)."""
    device_pool: DevicePoolStatistics | None = None
    """The device pool's use, when the producer has one."""
    members_ended: int = 0
    """Consumer members that ended (exited, evicted, replaced or never joined)."""
    evictions: int = 0
    """Members ended by the producer: a queue full past ``slow_consumer_timeout`` or a
    lease held past ``lease_timeout``."""
    joins_refused: int = 0
    """Join messages refused (no member, a held rank, a foreign key)."""
    messages_dropped: int = 0
    """Channel messages that were not control messages, or came from no joined member."""
    releases_ignored: int = 0
    """Releases that matched no lease this member holds (stale, repeated or forged)."""
    transfer_window: ArenaStatistics | None = None
    """The transfer window's use, when the producer has a ``transfer`` engine."""
    arena_registered: bool = False
    """Whether the arena is registered with CUDA (a CUDA ``device`` or the first CUDA item
    through the host does it), so CUDA items are copied in at PCIe speed."""
