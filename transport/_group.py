"""One rank's consumers of several producers (several frontend processes feeding a rank).

Each producer keeps its own arena, leases and channel: the group holds one
:class:`Consumer` per producer, maps each arena once, and hands out their batches in turn.
Leases and releases stay with the consumer that received the batch, so one producer's
crash affects only its own requests: the group reports it once, as ``PeerGone`` naming
that producer, and keeps serving the others. Each producer's batches arrive in the order
it published them.
"""

from __future__ import annotations

import contextlib
import select
import time
from collections.abc import Sequence
from typing import Any, final

from ._address import ProducerAddress
from ._consumer import Consumer, ConsumerStatistics, ReceivedBatch
from .errors import ClosedResourceError, ConfigurationError, PeerGone, WaitTimeout

__all__ = ["ConsumerGroup"]

# How long one wait lasts before the producers' liveness is checked again.
_SLICE_S = 0.02


@final
class ConsumerGroup:
    """One rank's end of N producers; the same receive API as :class:`Consumer`.

    Args:
        rank: this consumer's rank.
        producers: the producers to join (``Producer.address``); at least one.
        **options: passed to each :class:`Consumer` (``limits``, ``device``, ...).
    """

    def __init__(self, rank: int, producers: Sequence[ProducerAddress], **options: Any) -> None:
        if not producers:
            raise ConfigurationError("a ConsumerGroup needs at least one producer")
        self.rank = rank
        self.members: list[Consumer] = []
        try:
            for p in producers:
                self.members.append(Consumer(rank, p.endpoint, handover=p.handover, **options))
        except BaseException:
            for m in self.members:
                m.close()
            raise
        self._live = list(range(len(self.members)))
        self._next = 0
        self.closed = False

    @property
    def producers_live(self) -> int:
        """How many of the group's producers are still serving it."""
        return len(self._live)

    def try_recv(self) -> ReceivedBatch | None:
        """The next waiting batch of any producer (taken in turn), or ``None``.

        Raises ``PeerGone`` once for each producer that goes away (naming it; its batches
        already received stay readable until released), and on every call once none is
        left; an ``EnvelopeError`` for a malformed batch, which is dropped.
        """
        if self.closed:
            raise ClosedResourceError(f"ConsumerGroup rank {self.rank} was closed")
        if not self._live:
            raise PeerGone(f"rank {self.rank}: every producer of the group is gone")
        n = len(self._live)
        for step in range(n):
            k = self._live[(self._next + step) % n]
            try:
                batch = self.members[k].try_recv()
            except PeerGone as e:
                self._live.remove(k)
                raise PeerGone(
                    f"producer {k} ({self.members[k].endpoint}) of rank {self.rank}'s group: "
                    f"{e}; {len(self._live)} producers still serve it"
                ) from e
            if batch is not None:
                self._next = (self._next + step + 1) % n
                return batch
        return None

    def recv(self, timeout: float | None = None) -> ReceivedBatch:
        """The next batch of any producer; ``WaitTimeout`` after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch = self.try_recv()
            if batch is not None:
                return batch
            if deadline is not None and time.monotonic() > deadline:
                raise WaitTimeout(self.waited_in_vain(timeout))
            # zmq's descriptors are edge-triggered: the slice bounds a missed edge's cost
            with contextlib.suppress(OSError, ValueError):
                fds = [fd for k in self._live for fd in self.members[k]._wait_fds()]
                select.select(fds, [], [], _SLICE_S)

    def waited_in_vain(self, timeout: float | None) -> str:
        """Why a wait for a batch came back empty: each producer's own reason."""
        return "; ".join(self.members[k].waited_in_vain(timeout) for k in self._live)

    def statistics(self) -> list[ConsumerStatistics]:
        """Each member's statistics, in the order of ``producers``."""
        return [m.statistics() for m in self.members]

    def close(self) -> None:
        """Close every member (idempotent)."""
        self.closed = True
        for m in self.members:
            m.close()

    def __enter__(self) -> ConsumerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
