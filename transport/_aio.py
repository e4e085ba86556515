"""asyncio ends: an async producer for frontends, async consumers for event-loop ranks.

The consumer is built on ``zmq.asyncio``: its sockets are shadowed on the running loop and
waited on with ``zmq.asyncio.Poller``, so ``await consumer.recv()`` never blocks the loop.
The loop thread owns the sockets; a release from another thread (a batch handed to an
executor) is passed to the loop, because zmq sockets must not be used from two threads.

The producer keeps the sync producer's control thread, which serves joins and releases
whatever the loop is doing. A small request (nothing to decode, at most 1 MiB to copy and
hash, room in the arena) is published on the loop: a hop to a thread and back would cost
more than the publish. The rest run on one worker thread: decoding, hashing and copying a
large image takes milliseconds that would stall every other request on the loop. One
worker, and no loop publish while it has work, keep each rank receiving the requests in the
order they were awaited. Back-pressure (a full arena, a full consumer queue) is awaited on
the worker, never blocked on by the loop.

Cancellation never makes a duplicate: a publish cancelled before the worker takes it is
withdrawn (nothing is sent, ``CancelledError``); one cancelled after the worker took it is
finished, and the coroutine returns its envelopes (or raises its ``MmwireError``) instead of
``CancelledError``, so the caller knows the request was sent and must not send it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, final

import zmq
import zmq.asyncio

from ._address import ProducerAddress
from ._consumer import ReceivedBatch
from ._group import ConsumerGroup
from ._items import Item
from ._producer import Producer, ProducerStatistics
from ._schema import FeatureEnvelope
from .errors import ClosedResourceError, ConfigurationError, WaitTimeout

__all__ = ["AsyncConsumer", "AsyncProducer"]

_T = TypeVar("_T")

# The longest a wait lasts before the producers' liveness is checked again.
_SLICE_MS = 100


@final
class AsyncConsumer:
    """A rank's end on an event loop, of one producer or several.

    Create it inside the running loop. ``await consumer.recv()`` gives the next batch;
    ``async with consumer.recv() as batch:`` releases it on leaving the block.

    Args:
        rank: this consumer's rank.
        producers: a producer's :class:`ProducerAddress` (``Producer.address``), or several.
        **options: passed to each :class:`Consumer`.
    """

    def __init__(
        self, rank: int, producers: ProducerAddress | Sequence[ProducerAddress], **options: Any
    ) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise ConfigurationError(
                "an AsyncConsumer must be created inside a running event loop"
            ) from None
        if isinstance(producers, ProducerAddress):
            producers = [producers]
        self.group = ConsumerGroup(rank, producers, **options)
        self.rank = rank
        self._poller = zmq.asyncio.Poller()
        self._lanes: set[int] = set()  # the lane descriptors the poller watches
        for m in self.group.members:
            m._loop = loop
            self._poller.register(zmq.asyncio.Socket.from_socket(m._sock), zmq.POLLIN)

    def _watch_lanes(self) -> None:
        """Watch each member's lane while its next batch may come there."""
        wanted = {fd for m in self.group.members if (fd := m._lane_fd()) is not None}
        for fd in self._lanes - wanted:
            self._poller.unregister(fd)
        for fd in wanted - self._lanes:
            self._poller.register(fd, zmq.POLLIN)
        self._lanes = wanted

    def try_recv(self) -> ReceivedBatch | None:
        """The next waiting batch, or ``None``; never waits (see ``ConsumerGroup``)."""
        return self.group.try_recv()

    def recv(self, timeout: float | None = None) -> _Receiving:
        """The next batch of any producer: await it, or ``async with`` it.

        Raises like :meth:`ConsumerGroup.try_recv`, and ``WaitTimeout`` after ``timeout``.
        """
        return _Receiving(self._next(timeout))

    async def _next(self, timeout: float | None) -> ReceivedBatch:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch = self.group.try_recv()
            if batch is not None:
                return batch
            wait = _SLICE_MS
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout(self.group.waited_in_vain(timeout))
                wait = min(wait, max(1, int(left * 1000)))
            self._watch_lanes()
            await self._poller.poll(wait)

    def close(self) -> None:
        """Close every member (idempotent)."""
        self.group.close()

    async def __aenter__(self) -> AsyncConsumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


@final
class _Receiving:
    """``await`` it for a batch, or ``async with`` it to release the batch afterwards."""

    def __init__(self, coro: Any) -> None:
        self._coro = coro
        self._batch: ReceivedBatch | None = None

    def __await__(self) -> Generator[Any, None, ReceivedBatch]:
        batch: ReceivedBatch = yield from self._coro.__await__()
        return batch

    async def __aenter__(self) -> ReceivedBatch:
        self._batch = await self._coro
        return self._batch

    async def __aexit__(self, *exc: object) -> None:
        if self._batch is not None:
            self._batch.release()


class _Job:
    """One async publish: whether the worker took it, or the caller withdrew it first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = False
        self.withdrawn = False


@final
class AsyncProducer:
    """A producer for an asyncio frontend: ``await publish(...)`` never blocks the loop.

    Args: those of :class:`Producer`, which it creates and owns (``.producer``).
    """

    def __init__(self, endpoint: str | None = None, **options: Any) -> None:
        self.producer = Producer(endpoint, **options)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="mmwire-publish")
        self._queued = 0  # jobs given to the worker and not yet finished

    @property
    def address(self) -> ProducerAddress:
        """What consumers pass to join this producer."""
        return self.producer.address

    async def publish(self, request_id: str, items: Sequence[Item]) -> list[FeatureEnvelope]:
        """:meth:`Producer.publish`, without blocking the loop; raises what it raises.

        A request that needs no waiting and no heavy work (nothing to decode, at most
        1 MiB to copy and hash, room in the arena) is published on the loop itself, at the
        sync call's cost. Anything else runs on the producer's worker thread, as does every
        request behind one that is still there, so ranks receive requests in the order they
        were awaited.

        Cancelled before the worker takes it: withdrawn, nothing sent (``CancelledError``).
        Cancelled after: it finishes, and this returns its envelopes (the request was sent)
        or raises its error, never ``CancelledError``.
        """
        if self.producer.closed:
            raise ClosedResourceError("this AsyncProducer was closed")
        if not self._queued:  # nothing ahead of it on the worker
            published = self.producer._publish_now(request_id, items)
            if published is not None:
                envs, finish = published
                if finish is not None:  # sent, but a member's queue was full: wait off the loop
                    await self._on_worker(finish, withdrawable=False)
                return envs
        result = await self._on_worker(
            lambda: self.producer.publish(request_id, items), withdrawable=True
        )
        if result is None:  # only a withdrawn job returns None, and it was not awaited
            raise ClosedResourceError(f"request {request_id!r} was withdrawn")
        return result

    async def _on_worker(self, work: Callable[[], _T], *, withdrawable: bool) -> _T | None:
        """``work()`` on the worker thread. Cancelled before the worker takes it: withdrawn
        if ``withdrawable`` (``CancelledError``); else finished, and its result returned."""
        job = _Job()

        def run() -> _T | None:
            with job.lock:
                if job.withdrawn:
                    return None
                job.started = True
            return work()

        self._queued += 1
        done = asyncio.wrap_future(self._worker.submit(run))
        done.add_done_callback(self._left_worker)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            with job.lock:
                if withdrawable and not job.started:
                    job.withdrawn = True
                    raise
            while not done.done():  # taken by the worker: finish it, whatever comes
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(done)
            return done.result()

    def _left_worker(self, _: object) -> None:
        self._queued -= 1

    async def wait_for_consumers(self, ranks: Sequence[int], timeout: float = 30.0) -> None:
        """Until every rank in ``ranks`` has joined; ``WaitTimeout`` otherwise."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.producer.wait_for_consumers, ranks, timeout)

    def statistics(self) -> ProducerStatistics:
        """The producer's statistics."""
        return self.producer.statistics()

    async def aclose(self) -> None:
        """Wait for the publish in progress, then close the producer (idempotent)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._worker.shutdown, True)
        self.producer.close()

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
