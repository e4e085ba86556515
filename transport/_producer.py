"""The producer: one arena, one handover socket, one zmq channel.

The producer is built from one module per job:

* ``_channel.py``: the ROUTER socket, CURVE, the disconnect monitor;
* ``_membership.py``: members, their leases, ends and lost requests (``_control.py`` has
  the messages and the member table's rules);
* ``_control_loop.py``: the thread that serves the channel;
* ``_publish.py``: a request's checks, placement, arena writes and staging;
* ``_delivery.py``: sending a batch to every member.

Per lease: *live, pending = {owner members}* -> *free* when the pending set empties (a
remote member's part stays pending until zmq reports its frames sent). Per member
(``_control.py``): *handed over* -> *joined* -> *ended*.

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

import secrets
import threading
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Literal, final

if TYPE_CHECKING:
    import torch

from ._address import ProducerAddress
from ._arena import Arena
from ._channel import Channel, check_security
from ._control import CurveKeys
from ._control_loop import ControlLoop
from ._delivery import Delivery
from ._gpu import DevicePoolMode, ProducerDevice
from ._handover import HandoverServer, Hello, Offer, Refusal
from ._items import Item, check_request
from ._membership import LostRequest, Roster
from ._mooncake import MooncakeTransfer, TransferSource
from ._pixels import MAX_IMAGE_PIXELS
from ._producer_statistics import ProducerStatistics
from ._publish import Published, Publisher
from ._schema import FeatureEnvelope
from ._select import BackendChoice
from .errors import ClosedResourceError, ConfigurationError, WaitTimeout

__all__ = ["LostRequest", "Producer", "ProducerStatistics"]


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
        if digests not in ("images", "all", "none"):
            raise ConfigurationError(f"`digests` must be images, all or none, got {digests!r}")
        tcp = (endpoint or "").startswith("tcp://")
        check_security(endpoint or "", curve, allow_insecure_tcp)
        for name, value in (
            ("max_backlog", max_backlog),
            ("slow_consumer_timeout", slow_consumer_timeout),
            ("join_timeout", join_timeout),
            ("full_timeout", full_timeout + 1),
            ("lease_timeout", 1 if lease_timeout is None else lease_timeout),
        ):
            if not value > 0:
                raise ConfigurationError(f"`{name}` must be positive, got {value}")
        self._lock = threading.RLock()
        self._activity = threading.Condition(self._lock)
        # abstract Unix sockets: no file to leave behind, gone with this process
        name = secrets.token_hex(8)
        opened: list[Callable[[], None]] = []  # closed in reverse if the constructor fails
        on_device = None
        if device is not None:
            import torch

            on_device = torch.device(device)
        try:
            self._device = ProducerDevice(
                device_pool,
                on_device,
                device_pool_size,
                spans_hosts=tcp,
                on_full=on_pool_full,
                full_timeout=full_timeout,
            )
            opened.append(self._device.close)
            self.arena = Arena(arena_size, prefault=prefault, retain=reuse)
            opened.append(self.arena.close)
            self._transfer = None if transfer is None else TransferSource(transfer)
            if self._transfer is not None:
                opened.append(self._transfer.close)
            self._channel = Channel(
                endpoint or f"ipc://@mmwire-{name}-channel",
                curve=curve,
                curve_clients=curve_clients,
                max_backlog=max_backlog,
            )
            opened.append(self._channel.close)
            self._roster = Roster(
                activity=self._activity,
                channel=self._channel,
                arena=self.arena,
                device=self._device,
                transfer=self._transfer,
                drop_local=lambda token: self.handover.drop(token),
                on_lost=on_lost,
                remote_ok=tcp,
                max_backlog=max_backlog,
            )
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
            opened.append(self.handover.close)
            self._delivery = Delivery(
                roster=self._roster,
                arena=self.arena,
                activity=self._activity,
                max_backlog=max_backlog,
                slow_consumer_timeout=slow_consumer_timeout,
                check_open=self._check_open,
            )
            self._publisher = Publisher(
                lock=self._lock,
                roster=self._roster,
                delivery=self._delivery,
                arena=self.arena,
                device=self._device,
                transfer=self._transfer,
                service=self._service,
                drain=self.poll,
                digests=digests,
                max_image_pixels=max_image_pixels,
                reuse=reuse,
                on_full=on_full,
                full_timeout=full_timeout,
            )
            opened.append(self._publisher.close)
            if on_device is not None and on_device.type == "cuda":
                self._publisher.pin_arena()  # at start, rather than in the first such request
        except BaseException:
            for close in reversed(opened):
                close()
            raise
        self.endpoint: str = self._channel.endpoint
        self._loop = ControlLoop(
            lock=self._lock,
            activity=self._activity,
            channel=self._channel,
            roster=self._roster,
            delivery=self._delivery,
            join_timeout=join_timeout,
            lease_timeout=lease_timeout,
        )
        self.closed = False

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

    def _admit(self, hello: Hello, pid: int) -> tuple[Offer, list[int]] | Refusal:
        with self._lock:
            return self._roster.admit(hello, pid)

    def _handover_closed(self, token: bytes) -> None:
        with self._lock:
            if not self.closed:  # first what it sent before closing: its last releases
                self._loop.service()
            self._roster.handover_closed(token)
            if not self.closed:
                self._loop.wake()  # it ends when its grace runs out

    def _service(self) -> None:
        self._loop.service()

    def take_lost(self) -> list[LostRequest]:
        """The requests reported lost since the last call (without ``on_lost``): each was
        sent to a rank that owned items of it and ended before releasing it."""
        with self._lock:
            return self._roster.take_lost()

    def poll(self, timeout: float = 0.0) -> None:
        """Process joins, releases and finished sends now; waits up to ``timeout`` s for one.

        The producer's control thread does this on its own; call it to react at once or
        to wait for activity.
        """
        self._check_open()
        with self._lock:
            self._loop.service()
        if timeout > 0:
            self._loop.wait(timeout)
            with self._lock:
                self._loop.service()

    def wait_for_consumers(self, ranks: Collection[int], timeout: float = 30.0) -> None:
        """Block until every rank in ``ranks`` has joined; ``WaitTimeout`` otherwise, naming
        the ranks this producer never saw and those handed the arena but not joined."""
        deadline = time.monotonic() + timeout
        members = self._roster.members
        while True:
            with self._lock:
                missing = sorted(set(ranks) - {s.rank for s in members.joined()})
            if not missing:
                return
            if time.monotonic() > deadline:
                with self._lock:
                    handed = sorted(r for r in missing if members.of_rank(r) is not None)
                unseen = [r for r in missing if r not in handed]
                raise WaitTimeout(
                    f"producer {self.endpoint}: ranks {missing} did not join within {timeout} s"
                    + (f"; it never saw ranks {unseen} (check their endpoint)" if unseen else "")
                    + (f"; ranks {handed} received the arena, not joined" if handed else "")
                )
            self.poll(0.05)

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
          taken (``mmwire.transport.images.to_pixels``'s contract; a body that fails to decode
          after its header was read frees the lease);
        * ``EnvelopeError``: envelopes the consumers would refuse (a grid, spec or limit);
        * ``ArenaFull``: no room within ``full_timeout`` (at once if it can never fit);
        * ``PeerGone``: a named rank has not joined, or went away before receiving it;
        * ``ClosedResourceError``: the producer was closed.
        """
        self._check_open()
        items = check_request(request_id, items, self._publisher.limits.max_items)
        return self._publisher.publish(request_id, items)

    def _publish_now(self, request_id: str, items: Sequence[Item]) -> Published | None:
        """``publish`` on the caller's thread if it needs no waiting and no heavy work;
        ``None`` (nothing sent) otherwise. For ``AsyncProducer``, on its event loop."""
        self._check_open()
        items = check_request(request_id, items, self._publisher.limits.max_items)
        return self._publisher.publish_now(request_id, items)

    def statistics(self) -> ProducerStatistics:
        """A snapshot: arena use, joined ranks, fallbacks, sends in flight, what was refused."""
        with self._lock:
            counts = self._roster.counts
            return ProducerStatistics(
                arena=self.arena.statistics(),
                consumers=tuple(sorted(s.rank for s in self._roster.members.joined())),
                inline_fallbacks=self._publisher.inline_fallbacks,
                sends_in_flight=self._delivery.in_flight(),
                handovers_refused=self.handover.refused,
                device_pool=self._device.statistics(),
                members_ended=counts["ended"],
                evictions=counts["evicted"],
                joins_refused=counts["joins"],
                messages_dropped=counts["dropped"],
                releases_ignored=counts["ignored"],
                arena_registered=bool(self._publisher.arena_pinned),
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
            self._roster.close()
        self._loop.stop()
        self.handover.close()
        with self._lock:
            self._channel.close()
        if self._transfer is not None:
            self._transfer.close()
        self._publisher.close()
        self.arena.close()
        self._device.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            warnings.warn("unclosed Producer", ResourceWarning, stacklevel=1)
