"""The producer of the ``cpu`` backend: one arena, one handover socket, one zmq channel.

Layout
------
Control plane, one zmq ROUTER (producer) and one DEALER per consumer process::

    consumer -> producer   msgpack Join{rank, shared, member, replace}   once
    producer -> consumer   [header, inline frames...]                     one batch per request
    producer -> consumer   [NOTICE, reason]                               a refusal, an end, a ping
    consumer -> producer   msgpack Release{lease, generation, window}     once per lease
    consumer -> producer   msgpack Done{seq}                              once per owned batch

Data plane: the arena (``_arena.py``), handed over once per consumer process by
``_handover.py``. A remote consumer receives the same envelopes with ``InlineRef`` payloads
whose frames are the arena slices themselves, sent without copying.

States
------
Per lease: *live, pending = {owner members}* -> *free* when the pending set empties. A remote
member's part is pending until zmq's send tracker reports its frames sent.
Per member (``_control.py``): *handed over* -> *joined* -> *ended*.

Transitions
-----------
* ``publish``: check the whole request (``_items.py``), allocate (waiting for releases up to
  ``full_timeout``, then ``ArenaFull`` or the inline fallback), write each payload once,
  publish the lease, send the batch to every joined member.
* a send to a member whose queue is full (``max_backlog`` batches) waits for it, up to
  ``slow_consumer_timeout`` s; then that member is ended (evicted) and logged.
* ``Release`` from a member: it leaves the lease's pending set; anything else is dropped.
* a member ends (its process exits, it is evicted, replaced, never joins, or holds a lease
  past ``lease_timeout``): every lease pending on it is released, its handover connection
  closed.

Invariants
----------
* A publish either reaches every joined member, or raises; it never reports success for a
  batch that a consumer it names is known not to get. A failed publish leaves nothing
  allocated. A batch an owner was sent but never finished (``Done``) before its member
  ended is reported once (``on_lost``/``take_lost``): no request is lost without a word.
* The control thread processes joins, releases, finished sends and timeouts whether or not
  the application calls :meth:`Producer.poll`; every use of the zmq socket is under one
  lock, and nothing blocks while holding it.
* No pickle anywhere; every received message goes through a typed decoder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import threading
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, final

import msgspec
import numpy as np
import torch
import zmq

from ._arena import ARENA_HEADER, LEASE_HEADER, Arena, ArenaStatistics, Lease
from ._codec import Limits, encode_batch
from ._control import NOTICE, CurveKeys, Done, Join, Member, Members, decode_control
from ._errors import (
    ArenaFull,
    BackendUnavailable,
    ClosedResourceError,
    ConfigurationError,
    PeerGone,
    WaitTimeout,
)
from ._gpu import DevicePoolMode, DevicePoolStatistics, ProducerDevice
from ._group import ProducerAddress
from ._handover import HandoverServer, Hello, Offer, Refusal
from ._items import (
    Item,
    PreparedItem,
    check_request,
    envelope,
    located,
    payload_digest,
    prepare,
    validate,
)
from ._mooncake import MooncakeTransfer, TransferSource
from ._pinning import pin_host, unpin_host
from ._pixels import MAX_IMAGE_PIXELS
from ._schema import CpuRef, CudaIpcRef, FabricRef, FeatureEnvelope, InlineRef
from ._select import BackendChoice

__all__ = ["LostRequest", "Producer", "ProducerStatistics"]

_log = logging.getLogger("mmwire.transport")

# The control thread's period. It polls rather than waking on every message: a thread that
# woke per release contended for the GIL with the publishing thread and doubled the time of
# a 64 KiB publish.
_TICK = 0.01


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


@dataclass(frozen=True)
class LostRequest:
    """A request a rank that owned items of it never finished: the rank's member ended (it
    died, was evicted or replaced, or its connection went) before it released the batch.
    Retry it or fail it; mmwire will not deliver it again."""

    request_id: str
    rank: int
    reason: str
    """Why the member ended."""


@final
class Producer:
    """The tokenizer/encoder side: owns the arena, the handover socket and the channel.

    Args:
        endpoint: where consumers connect. ``None`` binds an abstract ``ipc://@...`` socket
            (no file; only members the handover admitted can join it); ``tcp://HOST:PORT``
            binds there and needs ``curve``.
        arena_size: bytes preallocated and prefaulted at start.
        on_full: ``"wait"`` waits up to ``full_timeout`` seconds for releases, then raises
            :class:`ArenaFull`; ``"inline"`` sends the request as inline frames (warns once).
            A request larger than the whole arena raises at once.
        allowed_uids: uids allowed to receive the arena (default: this process's uid).
        curve: a server key pair; with it a ``tcp://`` endpoint only accepts clients whose
            public key is in ``curve_clients``, traffic is encrypted, and a remote rank is
            bound to the key it joined with.
        allow_insecure_tcp: let a ``tcp://`` endpoint run without CURVE (anyone who reaches
            the port can then join as any free rank and read what it is sent). Warns.
        device_pool: keep CUDA tensors on the GPU: ``"cuda_ipc"`` (one ``cuMemAlloc`` pool,
            IPC handle), ``"fabric"`` (a VMM pool: FABRIC handle if the driver permits,
            else a POSIX fd over the handover socket), ``"auto"`` (the rule of
            :func:`choose_backend`; ``backend_choice`` says what and why), ``"none"``.
        device / device_pool_size: the pool's GPU and data bytes.
        on_pool_full: ``"cpu"`` sends CUDA items through the host arena when the pool is
            full (warns once); ``"wait"`` reclaims until ``full_timeout``, then ``ArenaFull``.
        max_backlog: batches queued for one consumer before a publish waits for it.
        slow_consumer_timeout: seconds a publish waits for a consumer whose queue is full
            before that consumer is declared gone (its leases freed, a warning logged).
        lease_timeout: seconds a consumer may hold a lease before it is declared hung and
            gone (``None``: never).
        join_timeout: seconds a process that received the arena has to join the channel.
        digests: which host payloads get a content digest in their envelope
            (``FeatureEnvelope.digest``, BLAKE3 of the bytes as shipped: what an engine's
            prefix cache tells images apart with, and what ``reuse`` finds payloads by):
            ``"images"`` (raw and encoded items), ``"all"`` (also processed and embedding
            tensors), ``"none"``. Only digests computed here select a payload; a caller's
            ``Item(caller_key=...)`` travels beside them.
        transfer: a transfer engine for consumers on other hosts
            (:class:`MooncakeTransfer`): the arena is registered with it once, and a remote
            consumer made with the same option reads the items it owns with one-sided
            reads instead of receiving them as frames through this process.
        on_lost: called with a :class:`LostRequest` for each request a rank owned items of
            and never released before its member ended (on the producer's control thread,
            under its lock: hand it on, do not block or call the producer). Without it,
            :meth:`take_lost` returns them.
        max_image_pixels: the largest image (``W·H``) a request may carry, checked from its
            header before anything is decoded or shipped (default 40 MP; the owner checks
            it again with its own ``Materializer(max_pixels=)``).
        reuse: keep released payloads resident in the arena, and point a request whose
            payload is resident at it instead of copying it again (its lease is then
            referenced by both requests); resident payloads are evicted, least recently
            used first, when room is needed.

    One thread publishes; a control thread of the producer's own serves joins and releases.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        arena_size: int = 1 << 30,
        on_full: Literal["wait", "inline"] = "wait",
        full_timeout: float = 5.0,
        allowed_uids: Collection[int] | None = None,
        curve: CurveKeys | None = None,
        curve_clients: Collection[bytes] = (),
        allow_insecure_tcp: bool = False,
        prefault: bool = True,
        device_pool: DevicePoolMode = "none",
        device: str | torch.device | None = None,
        device_pool_size: int = 256 << 20,
        on_pool_full: Literal["cpu", "wait"] = "cpu",
        max_backlog: int = 1000,
        slow_consumer_timeout: float = 30.0,
        lease_timeout: float | None = 300.0,
        join_timeout: float = 10.0,
        digests: Literal["images", "all", "none"] = "images",
        reuse: bool = True,
        transfer: MooncakeTransfer | None = None,
        on_lost: Callable[[LostRequest], None] | None = None,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
    ) -> None:
        self.closed = True  # until every resource below exists
        self._on_lost = on_lost
        self._lost: list[LostRequest] = []
        self._transfer: TransferSource | None = None
        if digests not in ("images", "all", "none"):
            raise ConfigurationError(f"`digests` must be images, all or none, got {digests!r}")
        self._decode_pool: ThreadPoolExecutor | None = None
        tcp = (endpoint or "").startswith("tcp://")
        if tcp and curve is None:
            if not allow_insecure_tcp:
                raise ConfigurationError(
                    f"endpoint {endpoint!r} is tcp without CURVE: anyone who reaches the port "
                    "could join as a rank; pass `curve=CurveKeys.generate()` (and the clients' "
                    "keys), or `allow_insecure_tcp=True` on a network you trust"
                )
            warnings.warn(
                f"mmwire producer on {endpoint} without CURVE: anyone who reaches it can join",
                RuntimeWarning,
                stacklevel=2,
            )
        for name, value in (
            ("max_backlog", max_backlog),
            ("slow_consumer_timeout", slow_consumer_timeout),
            ("join_timeout", join_timeout),
            ("full_timeout", full_timeout + 1),
            ("lease_timeout", 1 if lease_timeout is None else lease_timeout),
        ):
            if not value > 0:
                raise ConfigurationError(f"`{name}` must be positive, got {value}")
        # abstract Unix sockets: no file to leave behind, gone with this process
        name = secrets.token_hex(8)
        try:
            self._device = ProducerDevice(
                device_pool,
                None if device is None else torch.device(device),
                device_pool_size,
                spans_hosts=tcp,
                on_full=on_pool_full,
                full_timeout=full_timeout,
            )
            self.arena = Arena(arena_size, prefault=prefault, retain=reuse)
            if transfer is not None:
                self._transfer = TransferSource(transfer)
            self.digests = digests
            self.max_image_pixels = max_image_pixels
            self.reuse = reuse
            self.on_full = on_full
            self.full_timeout = full_timeout
            self.slow_consumer_timeout = slow_consumer_timeout
            self.lease_timeout = lease_timeout
            self.join_timeout = join_timeout
            self._limits = Limits()
            self._max_backlog = max_backlog
            self._lock = threading.RLock()
            self._activity = threading.Condition(self._lock)
            self._members = Members(self._member_ended)
            self._remote_ok = tcp
            self._curve = curve is not None
            self._trackers: list[tuple[zmq.MessageTracker, int, int, Member]] = []
            self._inline_fallbacks = 0
            self._warned_inline = False
            self._counts = {"ended": 0, "evicted": 0, "joins": 0, "dropped": 0, "ignored": 0}
            self._noted: set[str] = set()
            self._last_sweep = 0.0
            self._last_ping = 0.0
            fds = [self.arena.readonly_fd]
            if self._device.fd is not None:
                fds.append(self._device.fd)
            self.handover = HandoverServer(
                f"@mmwire-{name}-handover",
                fds,
                self._admit,
                self._handover_closed,
                allowed_uids=allowed_uids,
            )
            self._ctx = zmq.Context()
            self._auth: Any = None
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(
                zmq.ROUTER_MANDATORY, 1
            )  # a full or unknown peer raises, never drops
            self._sock.setsockopt(zmq.SNDHWM, max_backlog)
            self._sock.setsockopt(zmq.RCVHWM, 100_000)
            self._sock.setsockopt(zmq.MAXMSGSIZE, 1 << 12)  # control messages are tiny
            # A peer that vanishes without closing (a remote host's crash) is dropped in 10 s.
            self._sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
            self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10_000)
            if curve is not None:
                self._start_curve(curve, curve_clients)
            address = endpoint or f"ipc://@mmwire-{name}-channel"
            try:
                self._sock.bind(address)
            except zmq.ZMQError as e:
                raise ConfigurationError(f"cannot bind the channel to {address!r}: {e}") from e
            # a remote peer's disconnection makes the control loop check the remote members
            # at once (local members end with their handover connection)
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED) if tcp else None
            self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._zmq_fd = int(self._sock.getsockopt(zmq.FD))
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            self._arena_pinned: bool | None = None  # None: not tried yet
            if device is not None and torch.device(device).type == "cuda":
                self._pin_arena()  # at start, rather than in the first such request
        except BaseException:
            self._abandon()
            raise
        self.closed = False
        self._thread = threading.Thread(target=self._serve, name="mmwire-control", daemon=True)
        self._thread.start()

    def _abandon(self) -> None:
        """Close what a constructor that failed had opened (none of it was shared yet)."""
        handover = getattr(self, "handover", None)
        if handover is not None:
            handover.close()
        for name in ("_monitor", "_sock"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(0)
        if getattr(self, "_auth", None) is not None:
            self._auth.stop()
        ctx = getattr(self, "_ctx", None)
        if ctx is not None:
            ctx.term()
        for name in ("_wake_r", "_wake_w"):
            fd = getattr(self, name, None)
            if fd is not None:
                os.close(fd)
        if self._transfer is not None:
            self._transfer.close()
        arena = getattr(self, "arena", None)
        if arena is not None:
            arena.close()
        device = getattr(self, "_device", None)
        if device is not None:
            device.close()

    def _start_curve(self, keys: CurveKeys, clients: Collection[bytes]) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        allowed = set(clients)

        class _Keys:
            def callback(self, domain: str, key: bytes) -> bool:
                return zmq.utils.z85.encode(key) in allowed or key in allowed

        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=_Keys())
        self._sock.curve_server = True
        self._sock.curve_secretkey = keys.secret
        self._sock.curve_publickey = keys.public

    @property
    def backend_choice(self) -> BackendChoice:
        """Which backend this producer's CUDA items use, and why."""
        return self._device.choice

    @property
    def address(self) -> ProducerAddress:
        """What a consumer on this host passes to join (``ConsumerGroup``, ``AsyncConsumer``)."""
        return ProducerAddress(self.endpoint, self.handover.path)

    @property
    def handover_path(self) -> str:
        """The Unix socket consumers on this host pass to :class:`Consumer`."""
        return self.handover.path

    # -- members ---------------------------------------------------------------------

    def _admit(self, hello: Hello, pid: int) -> Offer | Refusal:
        """The handover thread's question: may process ``pid`` take ``hello.rank``?"""
        with self._lock:
            if self.closed:
                return Refusal(reason="the producer is closing")
            got = self._members.offer(hello.rank, pid, hello.replace)
            if isinstance(got, str):
                return Refusal(reason=got)
            _log.info("mmwire: %s received the arena", got)
            return Offer(
                arena_id=self.arena.id,
                size=self.arena.size,
                member=got.token,
                pool=self._device.offer,
            )

    def _handover_closed(self, token: bytes) -> None:
        with self._lock:
            s = self._members.by_token(token)
            if s is not None:
                self._members.end(s, "its process closed the handover connection")
            self._activity.notify_all()

    def _member_ended(self, s: Member, why: str) -> None:
        """Release what an ended member held (under the lock, from ``Members.end``)."""
        held = self.arena.release_holder(s.id)
        if self._transfer is not None:
            held += self._transfer.window.release_holder(s.id)
        self._trackers = [t for t in self._trackers if t[3] is not s]
        if self._members.of_rank(s.rank) is None:
            self._device.rank_gone(s.rank)
        if s.local:
            self.handover.drop(s.token)
        elif s.ident is not None and not self.closed:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send_multipart(
                    [s.ident, NOTICE, f"ended: {why}".encode()], flags=zmq.NOBLOCK
                )
        self._counts["ended"] += 1
        level = logging.INFO if why.startswith("its process closed") else logging.WARNING
        _log.log(level, "mmwire: %s is gone: %s; %d leases released", s, why, held)
        for request_id in s.outstanding.values():
            self._report_lost(LostRequest(request_id, s.rank, why))
        s.outstanding.clear()

    def _report_lost(self, lost: LostRequest) -> None:
        _log.warning(
            "mmwire: request %r was lost: rank %d never finished it (%s)",
            lost.request_id,
            lost.rank,
            lost.reason,
        )
        if self._on_lost is None:
            self._lost.append(lost)
            return
        try:
            self._on_lost(lost)
        except Exception as e:  # the application's callback must not stop the producer
            self._note("on_lost", f"`on_lost` raised {e!r}")

    def take_lost(self) -> list[LostRequest]:
        """The requests reported lost since the last call (without ``on_lost``): each was
        sent to a rank that owned items of it and ended before releasing it."""
        with self._lock:
            lost, self._lost = self._lost, []
            return lost

    def _evict(self, s: Member, why: str) -> None:
        self._counts["evicted"] += 1
        self._members.end(s, why)

    # -- the control thread -----------------------------------------------------------

    def _serve(self) -> None:
        """Serve the channel while the application does not: every ``_TICK`` s, unless the
        publishing thread holds the lock (it serves the channel itself then)."""
        while not self.closed:
            try:
                select.select([self._wake_r], [], [], _TICK)
            except (OSError, ValueError):
                return
            if not self._lock.acquire(blocking=False):
                continue
            try:
                if self.closed:
                    return
                self._service()
            except Exception as e:  # a bug must not stop releases for everyone
                self._note("service", f"the control thread caught {e!r}")
            finally:
                self._lock.release()

    def _service(self) -> None:
        """Process everything pending: messages, finished sends, timeouts (under the lock)."""
        busy = False
        if self._monitor is not None and self._monitor.poll(0):
            with contextlib.suppress(zmq.ZMQError):
                while self._monitor.recv_multipart(zmq.NOBLOCK):
                    pass
            self._check_remote()
        while int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._on_message(frames)
            busy = True
        if self._trackers:
            still = []
            for t in self._trackers:
                tracker, start, gen, s = t
                if tracker.done:
                    self.arena.release(start, gen, s.id)
                    busy = True
                else:
                    still.append(t)
            self._trackers = still
        now = time.monotonic()
        if now - self._last_sweep > 0.25:
            self._last_sweep = now
            self._members.expire(self.join_timeout)
            if now - self._last_ping > 1.0:
                self._last_ping = now
                self._check_remote()
            if self.lease_timeout is not None:
                self._expire_leases(self.lease_timeout)
        if busy:
            self._activity.notify_all()

    def _on_message(self, frames: list[Any]) -> None:
        if len(frames) != 2:
            self._drop(f"a message of {len(frames)} frames")
            return
        ident, body = frames[0].bytes, frames[1]
        msg = decode_control(body.bytes)
        if msg is None:
            self._drop("a message that is not a control message")
            return
        if isinstance(msg, Join):
            self._on_join(ident, msg, body)
            return
        s = self._members.by_ident(ident)
        if isinstance(msg, Done):
            if s is not None:
                s.outstanding.pop(msg.seq, None)
            return
        if s is None and self._members.ended(ident):
            # its leases went back when it ended; this release was on the way
            self._counts["ignored"] += 1
        elif s is None:
            self._drop("a release from no joined member")
        elif not self._arena_of(msg.window).release(msg.lease, msg.generation, s.id):
            self._counts["ignored"] += 1
            self._note("release", f"{s} released a lease it does not hold (ignored)")

    def _on_join(self, ident: bytes, msg: Join, body: Any) -> None:
        key = None
        if self._curve:
            with contextlib.suppress(Exception):
                key = body.get("User-Id").encode()
        got: Member | str = "it asked to pull payloads, and this producer has no `transfer`"
        if not msg.pull or self._transfer is not None:
            got = self._members.join(ident, msg, key, self._remote_ok, self._connected)
        if isinstance(got, str):
            self._counts["joins"] += 1
            self._note("join", f"refused a join: {got}")
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send_multipart(
                    [ident, NOTICE, f"refused: {got}".encode()], flags=zmq.NOBLOCK
                )
            return
        if got.pulls and self._transfer is not None:  # before any batch: zmq keeps order
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send_multipart([ident, *self._transfer.frames], flags=zmq.NOBLOCK)
        _log.info("mmwire: %s joined the channel", got)
        self._activity.notify_all()

    def _connected(self, s: Member) -> bool:
        """Whether a member's channel connection is still up (a ping it ignores)."""
        if s.ident is None:
            return False
        try:
            self._sock.send_multipart([s.ident, NOTICE, b"ping"], flags=zmq.NOBLOCK)
        except zmq.Again:
            return True  # connected, its queue full
        except zmq.ZMQError:
            return False  # EHOSTUNREACH: no such peer any more
        return True

    def _check_remote(self) -> None:
        """End the remote members whose connection is gone (a process that died, a host
        whose heartbeat lapsed): what they owned and never released is reported lost, and
        a publish naming their rank raises ``PeerGone``. Local members end with their
        handover connection."""
        for s in list(self._members.joined()):
            if not s.local and not self._connected(s):
                self._members.end(s, "its channel connection is gone")

    def _arena_of(self, window: bool) -> Arena:
        """The arena a release names: the transfer window's, or the one local ranks map."""
        return self._transfer.window if window and self._transfer is not None else self.arena

    def _expire_leases(self, timeout: float) -> None:
        overdue = self.arena.overdue(timeout)
        if self._transfer is not None:
            overdue += self._transfer.window.overdue(timeout)
        for lease in overdue:
            for s in [s for s in self._members.all() if s.id in lease.pending]:
                self._evict(
                    s,
                    f"it held the lease of request {lease.tag!r} for more than "
                    f"`lease_timeout` {timeout} s (hung?)",
                )

    def _drop(self, what: str) -> None:
        self._counts["dropped"] += 1
        self._note(what, f"dropped {what} on the channel")

    def _note(self, kind: str, message: str) -> None:
        """Log the first event of each kind; ``statistics()`` counts them all."""
        if kind not in self._noted:
            self._noted.add(kind)
            _log.warning("mmwire: %s (further ones are counted, not logged)", message)

    # -- control messages -------------------------------------------------------------

    def poll(self, timeout: float = 0.0) -> None:
        """Process joins, releases and finished sends now; waits up to ``timeout`` s for one.

        The producer's control thread does this on its own within 10 ms; call it to react
        sooner or to wait for activity.
        """
        self._check_open()
        with self._lock:
            self._service()
        if timeout > 0:
            with contextlib.suppress(OSError, ValueError):
                select.select([self._zmq_fd], [], [], timeout)
            with self._lock:
                self._service()

    def wait_for_consumers(self, ranks: Collection[int], timeout: float = 30.0) -> None:
        """Block until every rank in ``ranks`` has joined; ``WaitTimeout`` otherwise, naming
        the ranks this producer never saw and those handed the arena but not joined."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                missing = sorted(set(ranks) - {s.rank for s in self._members.joined()})
            if not missing:
                return
            if time.monotonic() > deadline:
                with self._lock:
                    handed = sorted(r for r in missing if self._members.of_rank(r) is not None)
                unseen = [r for r in missing if r not in handed]
                raise WaitTimeout(
                    f"producer {self.endpoint}: ranks {missing} did not join within {timeout} s"
                    + (f"; it never saw ranks {unseen} (check their endpoint)" if unseen else "")
                    + (f"; ranks {handed} received the arena, not joined" if handed else "")
                )
            self.poll(0.05)

    # -- publishing -------------------------------------------------------------------

    def publish(self, request_id: str, items: Sequence[Item]) -> list[FeatureEnvelope]:
        """Write one request's payloads once and send its envelopes to every joined rank.

        Host payloads go into one arena lease (``CpuRef``, or ``InlineRef`` after an inline
        fallback); CUDA tensors into the device pool when there is one and every consumer
        of the item is on this host (``CudaIpcRef``/``FabricRef``), else through the host.
        The whole request is checked before anything is allocated, and a publish that
        fails leaves nothing allocated. Raises only ``MmwireError`` subclasses:

        * ``InvalidRequest``: no items, a bad ``request_id``, an item of an unsupported
          type or dtype, a bad consumer list, a ``preprocess`` callable that raised;
        * ``MaterializeError`` (``ImageDecodeError``): a raw item's image that cannot be
          taken (``mmwire.transport.to_pixels``'s contract; a body that fails to decode
          after its header was read frees the lease);
        * ``EnvelopeError``: envelopes the consumers would refuse (a grid, spec or limit);
        * ``ArenaFull``: no room within ``full_timeout`` (at once if it can never fit);
        * ``PeerGone``: a named rank has not joined, or went away before receiving it;
        * ``ClosedResourceError``: the producer was closed.
        """
        self._check_open()
        items = check_request(request_id, items, self._limits.max_items)
        with self._lock:
            self._service()
            owners = {r for item in items for r in item.consumers}
            members = {s.rank: s for s in self._members.joined()}
        missing = sorted(owners - set(members))
        if missing:
            raise PeerGone(
                f"request {request_id!r} names consumer ranks {missing}, which have not joined "
                f"(joined: {sorted(members)})"
            )
        placed: dict[int, tuple[CudaIpcRef | FabricRef, tuple[int, ...], str]] = {}
        lease: Lease | None = None
        window: _Staged | None = None
        holds = _Holds()
        try:
            for k, item in enumerate(items):
                if all(members[r].shared for r in item.consumers):  # all on this host
                    placement = self._device.place(item.data, item.consumers, self.poll)
                    if placement is not None:
                        placed[k] = placement
            prepared = [
                prepare(
                    request_id,
                    k,
                    item,
                    placed[k][1:] if k in placed else None,
                    digests=self.digests,
                    max_pixels=self.max_image_pixels,
                )
                for k, item in enumerate(items)
            ]
            envs = self._checked_envelopes(request_id, prepared, placed)
            host = [k for k in range(len(items)) if k not in placed]
            if self.reuse:
                envs = self._reuse(prepared, envs, host, members, holds)
            new = [k for k in host if k not in holds.reused]
            if new:
                holders = {members[r].id for k in new for r in items[k].consumers}
                try:
                    lease = self.arena.allocate(
                        [prepared[k].nbytes for k in new],
                        holders,
                        self.full_timeout,
                        drain=self.poll,
                        tag=request_id,
                    )
                except ArenaFull:
                    if self.on_full != "inline" or placed:
                        raise
                    self._undo(holds)
                    return self._publish_inline(request_id, prepared, envs)
                for h in holders:
                    holds.add(h, lease.start, lease.generation)
                envs = self._fill(lease, prepared, envs, new)
                self.arena.publish(lease)
                self.arena.index(
                    lease, {envs[k].digest or "": n for n, k in enumerate(new) if envs[k].digest}
                )
            if self._transfer is not None:
                envs, window = self._stage(request_id, prepared, envs, members, holds)
            with self._lock:
                gone = [s for s in members.values() if s.gone and s.rank in owners]
                if gone:
                    raise PeerGone(
                        f"request {request_id!r}: {', '.join(map(str, gone))} went away "
                        "before it was sent"
                    )
                missed = self._deliver(envs, holds.by_member, staged=window)
        except BaseException:
            self._device.undo([ref for ref, _, _ in placed.values()])
            self._undo(holds)
            if lease is not None:
                self.arena.release_all(lease.start, lease.generation)
            if window is not None and self._transfer is not None:
                self._transfer.window.release_all(window.lease.start, window.lease.generation)
            raise
        _raise_if_lost(request_id, missed, owners)
        return envs

    def _stage(
        self,
        request_id: str,
        prepared: list[PreparedItem],
        envs: list[FeatureEnvelope],
        members: dict[int, Member],
        holds: _Holds,
    ) -> tuple[list[FeatureEnvelope], _Staged | None]:
        """Copy the host payloads that remote pulling ranks own into the transfer window (the
        only memory the engine can reach), each with a digest their puller checks; the
        envelopes with those digests, and the window's references. The pullers' references
        to the arena are given back: they read the window, never the arena."""
        pullers = {r: s for r, s in members.items() if s.pulls}
        staged = [
            k
            for k, e in enumerate(envs)
            if isinstance(e.payload, CpuRef) and any(r in pullers for r in e.consumers)
        ]
        if not staged or self._transfer is None:
            return envs, None
        window = self._transfer.window
        holders = {pullers[r].id for k in staged for r in envs[k].consumers if r in pullers}
        lease = window.allocate(
            [envs[k].tensor.nbytes for k in staged],
            holders,
            self.full_timeout,
            drain=self.poll,
            tag=request_id,
        )
        out = list(envs)
        refs: dict[int, CpuRef] = {}
        for k, (off, n) in zip(staged, lease.slots):
            window.view[off : off + n] = self._arena_slice(envs[k])
            if envs[k].digest is None:  # the puller checks every item's bytes against one
                digest = payload_digest(prepared[k], window.view[off : off + n])
                out[k] = msgspec.structs.replace(envs[k], digest=digest)
            refs[k] = CpuRef(
                arena_id=window.id,
                lease=lease.start,
                offset=off,
                length=n,
                generation=lease.generation,
            )
        window.publish(lease)
        for p in pullers.values():
            for start, gen in holds.by_member.pop(p.id, []):
                self.arena.release(start, gen, p.id)
            holds.claimed = [c for c in holds.claimed if c[0] != p.id]
        return out, _Staged(lease, refs)

    def _undo(self, holds: _Holds) -> None:
        """Give back the references a failed publish added to resident leases."""
        for holder, start, gen in holds.claimed:
            self.arena.release(start, gen, holder)
        holds.claimed.clear()

    def _reuse(
        self,
        prepared: list[PreparedItem],
        envs: list[FeatureEnvelope],
        host: list[int],
        members: dict[int, Member],
        holds: _Holds,
    ) -> list[FeatureEnvelope]:
        """Point the items whose payloads are resident in the arena at them: each owner's
        member gains one reference per lease (its consumer releases once per batch)."""
        out = list(envs)
        for k in host:
            digest = prepared[k].digest
            if digest is None:
                continue
            start = self.arena.locate(digest)
            if start is None:
                continue
            holders = {members[r].id for r in prepared[k].item.consumers}
            fresh = {h for h in holders if not holds.holds(h, start)}
            got = self.arena.claim(digest, fresh)
            if got is None:
                continue
            lease, off, n = got
            for h in fresh:
                holds.add(h, lease.start, lease.generation, claimed=True)
            holds.reused.add(k)
            out[k] = msgspec.structs.replace(envs[k], payload=self._ref(lease, off, n))
        return out

    def _checked_envelopes(
        self,
        request_id: str,
        prepared: list[PreparedItem],
        placed: dict[int, tuple[CudaIpcRef | FabricRef, tuple[int, ...], str]],
    ) -> list[FeatureEnvelope]:
        """Envelopes with stand-in arena references, validated as a consumer would."""
        envs = []
        for k, p in enumerate(prepared):
            if k in placed:
                ref: CpuRef | CudaIpcRef | FabricRef = placed[k][0]
                nbytes = placed[k][0].length
            else:
                nbytes = p.nbytes
                at = ARENA_HEADER + LEASE_HEADER
                ref = CpuRef(
                    arena_id=self.arena.id,
                    lease=ARENA_HEADER,
                    offset=at,
                    length=nbytes,
                    generation=1,
                )
            envs.append(envelope(request_id, k, p, nbytes, ref))
        validate(envs)
        return envs

    def _fill(
        self,
        lease: Lease,
        prepared: list[PreparedItem],
        envs: list[FeatureEnvelope],
        host: list[int],
    ) -> list[FeatureEnvelope]:
        """Copy the host payloads into the lease; the envelopes with their real references."""
        out = list(envs)
        slots = dict(zip(host, lease.slots))
        if any(prepared[k].cuda is not None for k in host):
            self._pin_arena()

        def write(k: int) -> None:
            off, n = slots[k]
            dst = np.frombuffer(self.arena.view, dtype=np.uint8, count=n, offset=off)
            located(f"item {k} of request {envs[k].request_id!r}", prepared[k].write_into, dst)

        # images decode in parallel (Pillow lets go of the GIL), each straight into its slot
        decoding = [k for k in host if prepared[k].image is not None]
        if len(decoding) > 1:
            list(self._decoders().map(write, decoding))
        else:
            for k in decoding:
                write(k)
        for k in host:
            if prepared[k].image is None:
                write(k)
        for k, (off, n) in slots.items():
            ref = self._ref(lease, off, n)
            digest = envs[k].digest
            if digest is None and self._digest_written(prepared[k]):
                written = np.frombuffer(self.arena.view, dtype=np.uint8, count=n, offset=off)
                digest = payload_digest(prepared[k], written)
            out[k] = msgspec.structs.replace(envs[k], payload=ref, digest=digest)
        return out

    def _pin_arena(self) -> None:
        """Register the arena with CUDA once, so CUDA items that travel through the host
        are copied in by DMA at PCIe speed (pageable copies run at about 1 GB/s). A driver
        that refuses leaves the copies pageable, with one warning."""
        if self._arena_pinned is not None:
            return
        try:
            pin_host(self.arena.address, self.arena.size, read_only=False)
            self._arena_pinned = True
        except BackendUnavailable as e:
            self._arena_pinned = False
            warnings.warn(f"mmwire: CUDA items go through pageable memory: {e}", stacklevel=4)

    def _digest_written(self, p: PreparedItem) -> bool:
        """Whether an item's digest is taken from its bytes in the arena: a decoded image's
        pixels, a CUDA tensor's elements (``digests="all"``)."""
        if p.image is not None:
            return self.digests != "none"
        return p.cuda is not None and self.digests == "all"

    def _ref(self, lease: Lease, offset: int, length: int) -> CpuRef:
        """The reference to ``length`` bytes at ``offset`` in ``lease``."""
        return CpuRef(
            arena_id=self.arena.id,
            lease=lease.start,
            offset=offset,
            length=length,
            generation=lease.generation,
        )

    def _deliver(
        self,
        envs: list[FeatureEnvelope],
        holds: dict[int, list[tuple[int, int]]],
        frames: list[Any] | None = None,
        staged: _Staged | None = None,
    ) -> list[Member]:
        """Send a batch to every joined member, waiting for full queues; the members that
        did not get it (evicted, or gone while it waited).

        Called under the lock; releases it only while waiting, so the control thread keeps
        serving releases. One thread publishes, so each member gets batches in order.
        """
        shared_frames = encode_batch(envs) if frames is None else frames
        owners = {r for e in envs for r in e.consumers}
        request_id = envs[0].request_id
        waiting: list[tuple[Member, list[Any], bool, str | None]] = []
        targets = list(self._members.joined())
        for s in targets:
            frames, track = self._frames_for(s, envs, shared_frames, staged)
            owned = request_id if s.rank in owners else None
            if not self._try_send(s, frames, track, holds, owned):
                waiting.append((s, frames, track, owned))
        deadline = time.monotonic() + self.slow_consumer_timeout
        pause = 0.0005
        missed = [s for s in targets if s.gone]  # its connection was gone when sent to
        while waiting:
            self._activity.wait(pause)  # releases the lock while it waits
            self._check_open()
            pause = min(pause * 2, 0.02)
            missed += [w[0] for w in waiting if w[0].gone]  # died while we waited
            waiting = [
                w
                for w in waiting
                if not w[0].gone and not self._try_send(w[0], *w[1:3], holds, w[3])
            ]
            if waiting and time.monotonic() > deadline:
                for s, *_ in waiting:
                    self._evict(
                        s,
                        f"its queue stayed full ({self._max_backlog} batches) "
                        f"for `slow_consumer_timeout` {self.slow_consumer_timeout} s",
                    )
                    missed.append(s)
                break
        return missed

    def _frames_for(
        self,
        s: Member,
        envs: list[FeatureEnvelope],
        shared_frames: list[Any],
        staged: _Staged | None = None,
    ) -> tuple[list[Any], bool]:
        if s.pulls:  # its own items point into the transfer window, where it reads them
            refs = {} if staged is None else staged.refs
            mine = {k for k, e in enumerate(envs) if s.rank in e.consumers and k in refs}
            if not mine:
                return shared_frames, False
            pulled = [
                msgspec.structs.replace(e, payload=refs[k]) if k in mine else e
                for k, e in enumerate(envs)
            ]
            return encode_batch(pulled), False
        remote = not s.shared
        owned = [k for k, e in enumerate(envs) if s.rank in e.consumers] if remote else []
        owned = [k for k in owned if isinstance(envs[k].payload, CpuRef)]
        if not owned:  # same host, or a remote rank that only needs the metadata
            return shared_frames, False
        # Another host: the slices of the items it owns go out as frames, zero-copy, and
        # the lease stays pending for this member until zmq says the frames are sent.
        frame_of = {k: n for n, k in enumerate(owned)}
        remote_envs = [
            msgspec.structs.replace(e, payload=InlineRef(frame=frame_of[k])) if k in frame_of else e
            for k, e in enumerate(envs)
        ]
        slices = [self._arena_slice(envs[k]) for k in owned]
        return encode_batch(remote_envs, slices), True

    def _try_send(
        self,
        s: Member,
        frames: list[Any],
        track: bool,
        holds: dict[int, list[tuple[int, int]]],
        owned: str | None,
    ) -> bool:
        """Queue a batch for a member; False if its queue is full (nothing was sent). A
        member whose connection is gone is ended (and the batch not sent). ``owned``: the
        request id, if the member owns items of it (it stays outstanding until ``Done``)."""
        ident = s.ident or b""  # joined members always have one
        try:
            tracker = self._sock.send_multipart(
                [ident, *frames], flags=zmq.NOBLOCK, copy=False, track=track
            )
        except zmq.Again:
            return False
        except zmq.ZMQError as e:  # EHOSTUNREACH: its connection is gone
            self._members.end(s, f"its channel connection is gone ({e})")
            return True
        s.sent += 1
        if owned is not None:
            s.outstanding[s.sent] = owned
        if track and tracker is not None:
            for start, gen in holds.get(s.id, ()):
                self._trackers.append((tracker, start, gen, s))
        return True

    def _arena_slice(self, env: FeatureEnvelope) -> memoryview:
        ref = env.payload
        if not isinstance(ref, CpuRef):
            raise TypeError(f"item {env.index.value} is not in the arena")
        return self.arena.view[ref.offset : ref.offset + ref.length]

    def _publish_inline(
        self, request_id: str, prepared: list[PreparedItem], envs: list[FeatureEnvelope]
    ) -> list[FeatureEnvelope]:
        if not self._warned_inline:
            warnings.warn(
                "mmwire arena full: sending requests as inline frames", RuntimeWarning, stacklevel=3
            )
            self._warned_inline = True
        inline = [
            msgspec.structs.replace(e, payload=InlineRef(frame=k)) for k, e in enumerate(envs)
        ]
        # Copies: the caller may reuse its arrays as soon as publish returns.
        frames = encode_batch(inline, [p.host_bytes() for p in prepared])
        owners = {r for p in prepared for r in p.item.consumers}
        with self._lock:
            evicted = self._deliver(inline, {}, frames)
        self._inline_fallbacks += 1
        _raise_if_lost(request_id, evicted, owners)
        return inline

    def statistics(self) -> ProducerStatistics:
        """A snapshot: arena use, joined ranks, fallbacks, sends in flight, what was refused."""
        with self._lock:
            return ProducerStatistics(
                arena=self.arena.statistics(),
                consumers=tuple(sorted(s.rank for s in self._members.joined())),
                inline_fallbacks=self._inline_fallbacks,
                sends_in_flight=len(self._trackers),
                handovers_refused=self.handover.refused,
                device_pool=self._device.statistics(),
                members_ended=self._counts["ended"],
                evictions=self._counts["evicted"],
                joins_refused=self._counts["joins"],
                messages_dropped=self._counts["dropped"],
                releases_ignored=self._counts["ignored"],
                arena_registered=bool(self._arena_pinned),
                transfer_window=(
                    None if self._transfer is None else self._transfer.window.statistics()
                ),
            )

    def reclaim(self) -> int:
        """Check the device pool's acknowledgements now (one batched read); slots freed."""
        self._check_open()
        self.poll(0)
        return 0 if self._device.pool is None else self._device.pool.reclaim()

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedResourceError("this Producer was closed")

    def close(self) -> None:
        """Stop serving and drop the producer's hold on the arena (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        self.handover.close()
        with self._lock:
            if self._monitor is not None:  # closing the channel ends the monitoring
                self._monitor.close(0)
            self._sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        if self._transfer is not None:
            self._transfer.close()
        if self._arena_pinned:
            unpin_host(self.arena.address)
        self.arena.close()
        self._device.close()
        if self._decode_pool is not None:
            self._decode_pool.shutdown(wait=True)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _decoders(self) -> ThreadPoolExecutor:
        """The threads that decode one request's images in parallel (made at first use)."""
        if self._decode_pool is None:
            workers = min(8, os.cpu_count() or 1)
            self._decode_pool = ThreadPoolExecutor(workers, thread_name_prefix="mmwire-decode")
        return self._decode_pool

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            warnings.warn("unclosed Producer", ResourceWarning, stacklevel=1)


@dataclass
class _Staged:
    """A request's payloads in the transfer window: its lease, and each item's reference."""

    lease: Lease
    refs: dict[int, CpuRef]


class _Holds:
    """The references one publish gives: per member, the leases it must release."""

    def __init__(self) -> None:
        self.by_member: dict[int, list[tuple[int, int]]] = {}
        self.claimed: list[tuple[int, int, int]] = []
        """(member, lease, generation) references added to resident leases (undone if
        the publish fails)."""
        self.reused: set[int] = set()
        """Items pointed at resident payloads."""

    def holds(self, member: int, start: int) -> bool:
        return any(st == start for st, _ in self.by_member.get(member, ()))

    def add(self, member: int, start: int, gen: int, *, claimed: bool = False) -> None:
        self.by_member.setdefault(member, []).append((start, gen))
        if claimed:
            self.claimed.append((member, start, gen))


def _raise_if_lost(request_id: str, missed: list[Member], owners: set[int]) -> None:
    """``PeerGone`` if a member that owns items of the request did not receive it."""
    lost = sorted(s.rank for s in missed if s.rank in owners)
    if lost:
        raise PeerGone(
            f"request {request_id!r} was not delivered to ranks {lost}: they were declared "
            "gone while it waited for them (the other ranks received it)"
        )
