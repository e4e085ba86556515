"""The consumer of the ``cpu`` backend: a scheduler rank's end of the channel.

Layout
------
The channel and its messages are the producer's (``_producer.py``); the member rules are
``_control.py``'s. A consumer on the producer's host receives the arena once over the
handover socket (``_handover.py``) with a member token and the end of its lane, on which its
batches arrive (``_lane.py``), and joins the channel with it; a consumer on another host
(``handover=None``) joins without one and receives its batches on the channel, with the
payloads of its own items as inline frames, through the same API.

States
------
*joined* -> *closed*, or *cut off*: the producer ended its member (the handover connection
closes, or a notice arrives) or went away; every later ``recv``/``open`` raises
``PeerGone``.

Invariants
----------
* A rank only opens items whose ``consumers`` name it (``NotAConsumer`` otherwise); it
  never maps pages of other items and never releases leases it does not consume.
* An open checks arena id, lease header, range and generation against the mapping before
  returning a view, so a stale or forged reference never yields someone else's bytes.
* ``release`` never blocks and is safe from any thread: a release the channel cannot take
  now (its queue is full, or another thread is using the socket) is kept and sent by the
  next call that uses the socket. Every use of the zmq socket is under one lock; an
  asyncio consumer hands other threads' releases to its event loop instead.
* A lease referenced by several batches (a repeated payload) is held once per batch and
  released once per batch.
* No pickle anywhere; every received message goes through a typed decoder.

Lifetime
--------
Views returned by ``open`` are valid until the batch is released; after that the bytes may
be reused. The arena mapping lives until the consumer and its last view are gone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import mmap
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, final

import numpy as np
import zmq

if TYPE_CHECKING:
    import torch

from ._arena import ARENA_HEADER, LEASE_HEADER, LEASE_MAGIC, read_lease_header
from ._codec import BatchDecoder, Limits
from ._control import ENCODER, NOTICE, CurveKeys, Done, Join, Release
from ._gpu import ConsumerDevice
from ._handover import check_rank, receive_arena
from ._index import GlobalIndex, GlobalTable
from ._lane import LaneReader
from ._mooncake import TRANSFER_OFFER, MooncakeTransfer, PulledItems, Puller, decode_offer
from ._pinning import pin_host, unpin_host
from ._schema import CpuRef, CudaIpcRef, FabricRef, FeatureEnvelope, InlineRef
from ._views import numpy_view, torch_dtype, torch_view
from .errors import (
    BackendUnavailable,
    ClosedResourceError,
    ConfigurationError,
    FrameError,
    HandoverRefused,
    MmwireError,
    NotAConsumer,
    OffsetError,
    PeerGone,
    StaleReference,
    WaitTimeout,
)

__all__ = ["Consumer", "ConsumerStatistics", "ReceivedBatch"]

# How long one wait holds the socket: a release from another thread waits at most this long.
_SLICE_MS = 20

# How long closing waits for the messages still queued for the producer: on a loaded
# 2-core host zmq's I/O thread can wait 200 ms for a core, and a release dropped there
# reports a finished request lost. It costs time only while messages are still queued.
_CLOSE_LINGER_MS = 1000


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


@dataclass(frozen=True)
class ConsumerStatistics:
    """A snapshot of a consumer rank."""

    rank: int
    """This consumer's rank."""
    arena_mapped: bool
    """Whether the producer's arena is mapped in this process."""
    batches: int
    """Batches received."""
    items_opened: int
    """Payloads opened (owned items only)."""
    bytes_opened: int
    """Payload bytes opened."""
    leases_held: int
    """Leases received and not yet released."""


class _Mapping:
    """The consumer's read-only mapping of one arena, shared by all its batches."""

    def __init__(self, fd: int, arena_id: str, size: int) -> None:
        self.arena_id = arena_id
        self.size = size
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        os.close(fd)
        self.view = memoryview(self.map)
        self.address: int = np.frombuffer(self.map, dtype=np.uint8).ctypes.data
        self.registered = False


@final
class Consumer:
    """A scheduler rank's end: receives batches and opens its own items zero-copy.

    Args:
        rank: this consumer's rank (matches ``Item.consumers`` on the producer).
        endpoint: the producer's channel endpoint (``Producer.endpoint``).
        handover: the producer's handover socket path; ``None`` for a consumer on another
            host, which then gets payloads as inline frames through the same API.
        limits: ceilings for decoding untrusted batches.
        curve_server_key / curve: CURVE keys for ``tcp://``.
        device: the GPU on which this rank opens device-pool items (default: the current
            CUDA device, at the first such item; processes without GPU items never touch
            CUDA).
        replace: take the rank over from a live process that holds it (that process's
            leases are released first and it gets ``PeerGone``); without it a second
            process for a live rank is refused (``HandoverRefused``).
        max_backlog: batches this rank queues before the producer waits for it.
    """

    def __init__(
        self,
        rank: int,
        endpoint: str,
        *,
        handover: str | None = None,
        limits: Limits | None = None,
        curve_server_key: bytes | None = None,
        curve: CurveKeys | None = None,
        device: str | torch.device | None = None,
        replace: bool = False,
        max_backlog: int = 1000,
        transfer: MooncakeTransfer | None = None,
        receive_pool_size: int = 1 << 30,
    ) -> None:
        self.rank = check_rank(rank)
        self.closed = True  # until every resource below exists
        self._puller: Puller | None = None
        if transfer is not None:
            if handover is not None:
                raise ConfigurationError(
                    "`transfer` is for consumers on other hosts; this one maps the arena"
                )
            self._puller = Puller(transfer, receive_pool_size)
        self._decoder = BatchDecoder(limits)
        self._mapping: _Mapping | None = None
        self._handover_conn: socket.socket | None = None
        self._cut_off: str | None = None
        dev = None
        if device is not None:
            import torch

            dev = torch.device(device)
        self._device = ConsumerDevice(None, None, dev)
        member = b""
        self._lane: LaneReader | None = None
        self._on_channel = 0  # batches the lane announced on the channel, not yet taken
        self._poll_fd: select.epoll | None = None
        if handover is not None:
            h = receive_arena(handover, rank, replace=replace)
            self._handover_conn = h.conn
            self._mapping = _Mapping(h.fd, h.arena_id, h.size)
            self._device = ConsumerDevice(h.pool, h.pool_fd, dev)
            member = h.member
            if h.lane_fd is not None:
                self._lane = LaneReader(h.lane_fd, min(h.lane_backlog, max_backlog))
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 1 << 20)  # releases are tiny; never block on them
        self._sock.setsockopt(zmq.RCVHWM, max_backlog)
        self._sock.setsockopt(zmq.ROUTING_ID, member or secrets.token_bytes(16))
        if curve_server_key is not None:
            keys = curve or CurveKeys.generate()
            self._sock.curve_serverkey = curve_server_key
            self._sock.curve_publickey = keys.public
            self._sock.curve_secretkey = keys.secret
        self._sock.connect(endpoint)
        self.endpoint = endpoint
        self._unsent: collections.deque[bytes] = collections.deque()
        self._sock_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._flusher: threading.Thread | None = None  # sends what a full lane refused
        self._flusher_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        join = Join(
            rank=rank,
            shared=self._mapping is not None,
            member=member,
            replace=replace,
            pull=self._puller is not None,
            backlog=max_backlog,
        )
        self._sock.send(ENCODER.encode(join))
        self._batches = 0
        self._received = 0  # batches taken (lane or channel): their numbers, for ``Done``
        self._heard = False  # anything at all came from the producer
        self._channel_in: list[tuple[Any, int]] = [(self._sock, zmq.POLLIN)]
        self._opened = 0
        self._opened_bytes = 0
        self._held: collections.Counter[tuple[int, int]] = collections.Counter()
        self.closed = False

    def producer_alive(self) -> bool:
        """False once the producer's handover connection has closed (it died, closed, or
        ended this process's member), or it sent a notice that this member ended."""
        if self._cut_off is not None:
            return False
        if self._lane is not None:  # one peek: the producer closes a member's lane first,
            # before releasing what it held, when it ends the member, closes or dies
            return not self._lane.closed_by_producer()
        conn = self._handover_conn
        if conn is None:
            return True
        try:  # one peek: nothing waiting means alive, EOF means gone
            return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False

    def recv(self, timeout: float | None = None) -> ReceivedBatch:
        """The next batch; ``WaitTimeout`` after ``timeout`` s, ``PeerGone`` if the producer
        died or ended this member, ``HandoverRefused`` if it refused this rank's join.

        A malformed batch raises its ``EnvelopeError`` and is dropped; the next call
        receives the next batch.
        """
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch = self._take(_SLICE_MS)
            if batch is not None:
                return batch
            if not self.producer_alive():
                raise PeerGone(self._gone_reason())
            if deadline is not None and time.monotonic() > deadline:
                raise WaitTimeout(self.waited_in_vain(timeout))

    def try_recv(self) -> ReceivedBatch | None:
        """The next batch if one is waiting, else ``None``; never blocks.

        For a scheduler loop that checks for work between steps. Raises like :meth:`recv`
        (``PeerGone`` once nothing is queued and the producer is gone).
        """
        self._check_open()
        batch = self._take(0)
        if batch is None and not self.producer_alive():
            raise PeerGone(self._gone_reason())
        return batch

    def fileno(self) -> int:
        """A descriptor an engine's own poller (``select``, ``selectors``, ``zmq.Poller``)
        can wait on for this consumer's batches.

        Readable means "call :meth:`try_recv`"; it may stay quiet for batches that were
        already waiting (zmq's ``ZMQ_FD`` is edge-triggered). So call ``try_recv`` until it
        returns ``None`` before each wait, and wait with a timeout. A rank on the
        producer's host gets an epoll descriptor watching both its lane and the channel
        (while a batch its lane announced is on its way through the channel, the lane
        reads ready: that lasts one zmq delivery, for a rare batch with frames of its own).
        """
        self._check_open()
        channel = int(self._sock.getsockopt(zmq.FD))
        if self._lane is None:
            return channel
        if self._poll_fd is None:
            self._poll_fd = select.epoll()
            self._poll_fd.register(self._lane.fileno(), select.EPOLLIN)
            self._poll_fd.register(channel, select.EPOLLIN)
        return self._poll_fd.fileno()

    def _from_lane(self) -> list[Any] | None:
        """The frames of the next batch on the lane, if one waits there (``None`` when the
        lane announced one on the channel: take that first)."""
        lane = self._lane
        if lane is None or self._on_channel:
            return None
        got = lane.take()
        if got is True:
            self._on_channel += 1
            return None
        return None if got is None or got is False else [got]

    def _take(self, wait_ms: int) -> ReceivedBatch | None:
        """One batch waiting within ``wait_ms``, or ``None`` (pings are skipped)."""
        while True:
            with self._sock_lock:
                if self.closed:
                    raise ClosedResourceError(f"Consumer rank {self.rank} was closed")
                self._flush_locked()
                broken: FrameError | None = None
                try:
                    frames = self._from_lane()
                except FrameError as e:  # a malformed packet: one batch, refused below
                    frames, broken = [], e
                if frames is None:
                    # a batch already waiting costs no wait; asking first costs less than the
                    # exception an empty receive raises (about 10 µs), and a rank whose
                    # batches come on its lane finds the channel empty every time
                    if zmq.zmq_poll(self._channel_in, 0):
                        with contextlib.suppress(zmq.Again):
                            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    if frames is None:
                        if not wait_ms or not self._wait(wait_ms):
                            return None
                        continue
                    if len(frames) != 2 or frames[0].bytes not in (TRANSFER_OFFER, NOTICE):
                        self._on_channel = max(0, self._on_channel - 1)
            self._heard = True
            if len(frames) == 2 and frames[0].bytes == TRANSFER_OFFER and self._puller:
                self._puller.offer = decode_offer(frames[1].bytes)
                continue
            if len(frames) == 2 and frames[0].bytes == NOTICE:
                reason = bytes(frames[1].bytes[:1024]).decode("utf-8", "replace")
                if reason == "ping":  # the producer checking that this connection is up
                    continue
                if reason.startswith("refused:"):
                    raise HandoverRefused(f"rank {self.rank}: the producer {reason}")
                self._cut_off = reason
                raise PeerGone(self._gone_reason())
            self._received += 1
            seq = self._received
            try:
                if broken is not None:
                    raise broken
                batch = self.decode(frames)
            except MmwireError as e:  # the producer reports the request lost, and why
                why = f"{type(e).__name__}: {e}"[:160]
                self._unsent.append(ENCODER.encode(Done(seq=seq, refused=why)))
                self._flush()
                raise
            if batch.owned:
                batch._seq = seq
            return batch

    def _wait_fds(self) -> list[int]:
        """The descriptors to wait on for this consumer's next batch: the channel's (zmq's,
        edge-triggered: wait with a timeout), and its lane's while a batch may come there."""
        lane = self._lane_fd()
        channel = int(self._sock.getsockopt(zmq.FD))
        return [channel] if lane is None else [channel, lane]

    def _lane_fd(self) -> int | None:
        """The lane's descriptor while the next batch may come on it: a poller watches it
        beside the channel (not while a batch it announced is awaited on the channel)."""
        lane = self._lane
        if lane is None or self._on_channel or lane.ended or self.closed:
            return None
        return lane.fileno()

    def _wait(self, wait_ms: int) -> bool:
        """Wait up to ``wait_ms`` for the channel, or the lane when it is next."""
        lane = self._lane_fd()
        watched = self._channel_in if lane is None else [*self._channel_in, (lane, zmq.POLLIN)]
        return bool(zmq.zmq_poll(watched, wait_ms))

    def waited_in_vain(self, timeout: float | None) -> str:
        """Why a wait of ``timeout`` s for a batch came back empty, for a ``WaitTimeout``."""
        if self._heard:
            return f"rank {self.rank}: no batch from {self.endpoint} within {timeout} s"
        return (
            f"rank {self.rank}: nothing at all came from {self.endpoint} within {timeout} s: "
            "the producer may never have seen this rank (check the endpoint, and that the "
            "producer named this rank in a request)"
        )

    def _gone_reason(self) -> str:
        if self._cut_off is not None:
            return f"rank {self.rank}: the producer {self._cut_off}"
        return f"rank {self.rank}: the producer went away or ended this member"

    def decode(self, frames: Sequence[Any]) -> ReceivedBatch:
        """Validate a batch's frames (received by :meth:`recv` or by other means).

        Raises the batch's ``EnvelopeError``; this consumer keeps serving afterwards.
        """
        self._check_open()
        batch = self._decoder.decode(frames)
        self._batches += 1
        mine = [e for e in batch.envelopes.values() if self.rank in e.consumers]
        leases = {
            (e.payload.lease, e.payload.generation) for e in mine if isinstance(e.payload, CpuRef)
        }
        device = [e for e in mine if isinstance(e.payload, (CudaIpcRef, FabricRef))]
        with self._state_lock:
            self._held.update(leases)
        pulled = None
        if self._puller is not None and leases:
            try:  # the transfer has completed (or failed): the producer's lease is done
                pulled = self._puller.pull([e for e in mine if isinstance(e.payload, CpuRef)])
            finally:
                self._release(leases)
            leases = set()
        owned = tuple(e.index for e in mine)
        return ReceivedBatch(self, batch.envelopes, batch.frames, leases, device, pulled, owned)

    def _open_device(self, env: FeatureEnvelope, waited: set[int]) -> torch.Tensor:
        """A device view of an owned pool item, ordered after the producer's copy."""
        where = f"item {env.index.value} of request {env.request_id!r}"
        if self.rank not in env.consumers:
            raise NotAConsumer(
                f"rank {self.rank} is not a consumer of {where} (consumers {list(env.consumers)})"
            )
        if not self.producer_alive():
            raise PeerGone(f"{self._gone_reason()} (opening {where})")
        mapping, ref = self._device.check(env, self.rank)
        if env.index.value not in waited:
            mapping.wait_ready(ref.slot, ref.generation)
            waited.add(env.index.value)
        self._opened += 1
        self._opened_bytes += env.tensor.nbytes
        dtype = torch_dtype(env.tensor.dtype)
        return mapping.tensor(ref.offset, ref.length, dtype, env.tensor.shape)

    def _acknowledge(self, envs: list[FeatureEnvelope]) -> None:
        """Stream-ordered acks for this rank's device items, after its reads so far."""
        if not envs or self.closed or self._device.offer is None or not self.producer_alive():
            return
        for env in envs:
            try:
                mapping, ref = self._device.check(env, self.rank)
            except (StaleReference, OffsetError):
                continue  # a reference that never named a real slot has nothing to free
            mapping.acknowledge(ref.slot, self.rank, ref.generation)

    def _open_bytes(
        self, env: FeatureEnvelope, frames: tuple[Any, ...], pulled: PulledItems | None
    ) -> tuple[Any, int]:
        """The buffer and offset of an owned item's payload, after every check."""
        where = f"item {env.index.value} of request {env.request_id!r}"
        if self.rank not in env.consumers:
            raise NotAConsumer(
                f"rank {self.rank} is not a consumer of {where} (consumers {list(env.consumers)})"
            )
        if pulled is not None and env.index.value in pulled.frames:
            return pulled.frames[env.index.value], 0
        ref = env.payload
        if isinstance(ref, InlineRef):
            return frames[ref.frame], 0
        if not isinstance(ref, CpuRef):
            raise BackendUnavailable(
                f"{where} lives in a `{type(ref).__name__}`; the cpu consumer cannot open it"
            )
        m = self._mapping
        if m is None or ref.arena_id != m.arena_id:
            raise StaleReference(
                f"{where} names arena {ref.arena_id!r}, which this process has not mapped"
            )
        if not self.producer_alive():
            raise PeerGone(f"{self._gone_reason()} (opening {where})")
        if ref.lease < ARENA_HEADER or ref.lease + LEASE_HEADER > m.size:
            raise OffsetError(
                f"`payload.lease` {ref.lease} of {where} is outside the arena of {m.size} bytes"
            )
        magic, gen, length, _ = read_lease_header(m.view, ref.lease)
        if magic != LEASE_MAGIC or gen != ref.generation:
            raise StaleReference(
                f"{where}: lease {ref.lease} has generation {gen}, the reference {ref.generation}"
            )
        end = ref.offset + ref.length
        if ref.offset < ref.lease + LEASE_HEADER or end > ref.lease + length or end > m.size:
            raise OffsetError(
                f"`payload` range [{ref.offset}, {end}) of {where} is outside its lease "
                f"[{ref.lease}, {ref.lease + length})"
            )
        return m.view, ref.offset

    def _release(self, leases: set[tuple[int, int]], done: int | None = None) -> None:
        """Give leases back; ``done``: this rank finished batch ``done`` (it owned items of
        it), said by the last release, or by a ``Done`` of its own."""
        window = self._puller is not None
        with self._state_lock:
            owed = [key for key in leases if self._held[key] > 0]
            for n, key in enumerate(owed):
                self._held[key] -= 1
                if not self._held[key]:
                    del self._held[key]
                last = done if done is not None and n == len(owed) - 1 else 0
                release = Release(lease=key[0], generation=key[1], window=window, done=last)
                self._unsent.append(ENCODER.encode(release))
            if done is not None and not owed:
                self._unsent.append(ENCODER.encode(Done(seq=done)))
        self._flush()

    def _flush(self) -> None:
        """Send the releases the channel takes now, from any thread, without blocking.

        Under an event loop, a call from another thread is handed to the loop (the loop
        thread owns the socket); otherwise it sends if no other thread is using the
        socket, and else leaves the releases to that thread's next turn.
        """
        loop = self._loop
        if loop is not None and not _in_loop(loop):
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(self._flush)
            return
        if self._sock_lock.acquire(blocking=False):
            try:
                self._flush_locked()
            finally:
                self._sock_lock.release()

    def _flush_locked(self) -> None:
        lane = self._lane
        while self._unsent and not self.closed:
            try:
                if lane is None:
                    self._sock.send(self._unsent[0], zmq.NOBLOCK)
                elif not lane.send(self._unsent[0]):
                    self._flush_when_lane_takes()
                    return
            except zmq.Again:
                return
            except OSError:  # the producer closed the lane: nobody is left to tell
                self._unsent.clear()
                return
            self._unsent.popleft()

    def _flush_when_lane_takes(self) -> None:
        """Have a helper thread send the releases a full lane refused once it takes them
        again, so a rank that gives back a burst and then stops calling in does not keep
        the leases it released (its next call would send them, but it may not come)."""
        with self._flusher_lock:
            if self._flusher is None:
                self._flusher = threading.Thread(
                    target=self._flush_as_lane_drains,
                    name=f"mmwire-releases-{self.rank}",
                    daemon=True,
                )
                self._flusher.start()

    def _flush_as_lane_drains(self) -> None:
        lane = self._lane
        if lane is None:
            return
        writable = select.poll()
        writable.register(lane.fileno(), select.POLLOUT)
        while True:
            with contextlib.suppress(OSError, ValueError):
                writable.poll(_SLICE_MS)  # until the producer has read some of the lane
            loop = self._loop
            if loop is not None:  # the loop owns the sockets: it sends, this thread waits
                sent = threading.Event()
                with contextlib.suppress(RuntimeError):  # the loop has closed
                    loop.call_soon_threadsafe(self._flush_then_set, sent)
                sent.wait(_SLICE_MS / 1e3)
            elif self._sock_lock.acquire(timeout=_SLICE_MS / 1e3):
                try:  # (a receive holding the lock flushes first thing on its next turn)
                    self._flush_locked()
                finally:
                    self._sock_lock.release()
            with self._flusher_lock:
                if self.closed or not self._unsent or (loop is not None and loop.is_closed()):
                    self._flusher = None
                    return

    def _flush_then_set(self, sent: threading.Event) -> None:
        self._flush()
        sent.set()

    def register_with_cuda(self) -> None:
        """Pin the arena mapping with ``cudaHostRegister`` once, for pinned-speed H2D copies.

        Raises ``BackendUnavailable`` without CUDA or when the driver refuses.
        """
        m = self._mapping
        if m is None or m.registered:
            return
        pin_host(m.address, m.size, read_only=True)
        m.registered = True

    def statistics(self) -> ConsumerStatistics:
        """A snapshot of this rank's use."""
        return ConsumerStatistics(
            rank=self.rank,
            arena_mapped=self._mapping is not None,
            batches=self._batches,
            items_opened=self._opened,
            bytes_opened=self._opened_bytes,
            leases_held=sum(self._held.values()),
        )

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedResourceError(f"Consumer rank {self.rank} was closed")

    def close(self) -> None:
        """Close the channel and the handover connection (idempotent).

        The arena mapping is dropped when the last view into it is gone.
        """
        if self.closed:
            return
        with self._sock_lock:
            self._flush_locked()
            self.closed = True
            # the last releases and ``Done`` get a moment to leave, so a batch finished just
            # before closing is not reported lost; a producer that is gone costs that moment,
            # one never heard from nothing (no batch came, so none is owed)
            self._sock.close(linger=_CLOSE_LINGER_MS if self._heard else 0)
        self._ctx.term()
        if self._lane is not None:
            self._lane.close()
        if self._poll_fd is not None:
            self._poll_fd.close()
        if self._handover_conn is not None:
            self._handover_conn.close()
        if self._mapping is not None and self._mapping.registered:
            unpin_host(self._mapping.address)
        self._mapping = None
        self._device.close()
        if self._puller is not None:
            self._puller.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@final
@dataclass
class ReceivedBatch:
    """One received request: every envelope, and zero-copy access to this rank's own items.

    Views from :meth:`open` are valid until :meth:`release` (or leaving the ``with`` block);
    after that the producer may reuse the bytes. Non-owned items can only be inspected.
    """

    _consumer: Consumer
    envelopes: GlobalTable[FeatureEnvelope]
    _frames: tuple[Any, ...]
    _leases: set[tuple[int, int]]
    _device: list[FeatureEnvelope] = field(default_factory=list)
    _pulled: PulledItems | None = None
    """The owned items read through the transfer engine into the receive pool."""
    _owned: tuple[GlobalIndex, ...] = ()
    """Global positions of this rank's items (taken once, at decode)."""
    released: bool = field(default=False)
    _waited: set[int] = field(default_factory=set)
    _seq: int | None = None
    """Its number on the channel, when it came from there and this rank owns items of it."""

    @property
    def owned(self) -> tuple[GlobalIndex, ...]:
        """Global positions of the items this rank consumes."""
        return self._owned

    def _buffer(self, index: GlobalIndex) -> tuple[FeatureEnvelope, Any, int]:
        if self.released:
            raise ClosedResourceError("this batch was released; its payloads may be reused")
        env = self.envelopes[index]
        buf, off = self._consumer._open_bytes(env, self._frames, self._pulled)
        self._consumer._opened += 1
        self._consumer._opened_bytes += env.tensor.nbytes
        return env, buf, off

    def open(self, index: GlobalIndex) -> np.ndarray[Any, Any]:
        """A read-only numpy view of item ``index``'s payload (no copy; host items only)."""
        if isinstance(self.envelopes[index].payload, (CudaIpcRef, FabricRef)):
            raise BackendUnavailable(
                f"item {index.value} is in a device pool: open it with open_tensor"
            )
        env, buf, off = self._buffer(index)
        return numpy_view(env.tensor, buf, off)

    def open_tensor(self, index: GlobalIndex) -> torch.Tensor:
        """A tensor view of item ``index``'s payload (no copy; do not write into it).

        Host items give a CPU tensor. Device-pool items give a CUDA tensor on this rank's
        device; the current stream is made to wait (on the GPU, not the host) until the
        producer's copy has landed, so read it on that stream.
        """
        env = self.envelopes[index]
        if isinstance(env.payload, (CudaIpcRef, FabricRef)):
            if self.released:
                raise ClosedResourceError("this batch was released; its payloads may be reused")
            return self._consumer._open_device(env, self._waited)
        env, buf, off = self._buffer(index)
        return torch_view(env.tensor, buf, off)

    def release(self) -> None:
        """Tell the producer this rank is done with the batch's payloads (idempotent).

        Device-pool items are acknowledged on the current stream, after the reads queued
        on it so far: enqueue the work that reads them before releasing.
        """
        if not self.released:
            self.released = True
            self._consumer._acknowledge(self._device)
            pulled, puller = self._pulled, self._consumer._puller
            if pulled is not None and puller is not None:
                pulled.frames.clear()
                puller.free(pulled.start, pulled.generation)
            self._consumer._release(self._leases, done=self._seq)

    def __enter__(self) -> ReceivedBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
