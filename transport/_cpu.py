"""The ``cpu`` backend: a producer that leases arena space per request and N consumer ranks.

Layout
------
Control plane, one zmq ROUTER (producer) and one DEALER per consumer rank::

    consumer -> producer   msgpack Join{rank, shared}        once, after the handover
    producer -> consumer   [header, inline frames...]        one batch per request
    consumer -> producer   msgpack Release{lease, generation} once per lease it consumes

Data plane: the arena (``_arena.py`` has its byte layout), handed over once per consumer
process by ``_handover.py``. A consumer with ``shared=False`` (another host) receives the
same envelopes with ``InlineRef`` payloads whose frames are the arena slices themselves,
sent without copying.

States
------
Per lease: *live, pending = {owner ranks}* -> *free* when the pending set empties. A remote
consumer's part is pending until zmq's send tracker reports its frames sent.

Transitions
-----------
* ``publish``: allocate (waiting for releases up to ``full_timeout``, then ``ArenaFull`` or
  the inline fallback), write each payload once, publish the lease, send the batch to every
  joined rank (owners and non-owners alike: everyone needs the metadata).
* ``Release`` from rank r: r leaves the lease's pending set.
* a consumer's handover connection closes: everything pending on its rank is released.
* the producer's handover connection closes (seen by a consumer): ``PeerGone`` on the next
  ``recv``/``open``.

Invariants
----------
* A rank only opens items whose ``consumers`` name it (``NotAConsumer`` otherwise); it
  never maps pages of other items and never releases leases it does not consume.
* An open checks arena id, lease header, range and generation against the mapping before
  returning a view, so a stale or forged reference never yields someone else's bytes.
* No pickle anywhere; every received message goes through a typed decoder.

Lifetime
--------
A lease lives until every consumer named by its items released it (or died). Views returned
by ``open`` are valid until the batch is released; after that the bytes may be reused. The
arena itself lives until the producer and every consumer have dropped it (memfd).
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import select
import shutil
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, final

import msgspec
import numpy as np
import torch
import zmq
from PIL import Image

from ._arena import (
    ARENA_HEADER,
    LEASE_HEADER,
    LEASE_MAGIC,
    Arena,
    ArenaStatistics,
    read_lease_header,
)
from ._codec import BatchDecoder, Limits, encode_batch
from ._errors import (
    ArenaFull,
    BackendUnavailable,
    ClosedResourceError,
    MalformedEnvelope,
    NotAConsumer,
    OffsetError,
    PeerGone,
    StaleReference,
)
from ._gpu import ConsumerDevice, DevicePoolMode, DevicePoolStatistics, ProducerDevice
from ._handover import HandoverServer, receive_arena
from ._index import GlobalIndex, GlobalTable
from ._pixels import keeps_alpha
from ._schema import (
    DTYPES,
    SCHEMA_VERSION,
    CpuRef,
    CudaIpcRef,
    FabricRef,
    FeatureEnvelope,
    Grid,
    InlineRef,
    Kind,
    Modality,
    PreprocessSpec,
    TensorSpec,
)
from ._select import BackendChoice
from ._views import _TORCH as _TORCH_DTYPES
from ._views import numpy_view, torch_view

__all__ = [
    "ConsumerStatistics",
    "CpuConsumer",
    "CpuProducer",
    "CurveKeys",
    "Item",
    "ProducerStatistics",
    "ReceivedBatch",
]


class _Join(msgspec.Struct, frozen=True, tag=True):
    rank: int
    shared: bool


class _Release(msgspec.Struct, frozen=True, tag=True):
    lease: int
    generation: int


_CTRL_DEC = msgspec.msgpack.Decoder(_Join | _Release)
_CTRL_ENC = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class CurveKeys:
    """A CURVE key pair (z85 bytes), for ``tcp://`` between hosts. See :meth:`generate`."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        """A fresh key pair from libzmq."""
        public, secret = zmq.curve_keypair()
        return cls(public=public, secret=secret)


@dataclass(frozen=True)
class Item:
    """One payload of a request, as the producer hands it to :meth:`CpuProducer.publish`.

    Attributes:
        data: a numpy array, a torch tensor, a PIL image or encoded image bytes. Images
            and bytes become uint8 ``(H, W, C)`` pixels (RGB, RGBA when alpha is kept, L).
            A CUDA tensor goes into the producer's device pool when it has one (else it
            is copied to the host arena once).
        consumers: the rank(s) that own the item and will read its payload.
        kind: ``raw`` (pixels, preprocessing deferred), ``processed`` or ``embedding``.
        grid: the item's patch grid; for raw items it may be left to ``preprocess``.
        preprocess: the spec of a raw item, or a callable ``(width, height) -> spec`` for
            images whose size is only known once decoded.
    """

    data: Any
    consumers: tuple[int, ...]
    kind: Kind = "raw"
    grid: Grid | None = None
    preprocess: PreprocessSpec | Callable[[int, int], PreprocessSpec] | None = None
    modality: Modality = "image"


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
    """Processes refused the arena (credentials or a malformed handover)."""
    device_pool: DevicePoolStatistics | None = None
    """The device pool's use, when the producer has one."""


def _pixels_of_image(im: Image.Image) -> np.ndarray[Any, Any]:
    """uint8 (H, W, C) pixels by the processor's channel rule: RGBA iff alpha, L stays 1-channel."""
    if keeps_alpha(im):
        im = im.convert("RGBA")
    elif im.mode not in ("RGB", "L"):
        im = im.convert("RGB")
    arr = np.asarray(im)
    return arr[:, :, None] if arr.ndim == 2 else arr


def _is_cuda(data: Any) -> bool:
    return isinstance(data, torch.Tensor) and data.is_cuda


def _as_array(data: Any) -> tuple[np.ndarray[Any, Any], str]:
    """A C-contiguous array view of an item's data and its whitelisted dtype name."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return _pixels_of_image(im), "uint8"
    if isinstance(data, Image.Image):
        return _pixels_of_image(data), "uint8"
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise TypeError(f"the cpu backend takes CPU tensors, got one on {data.device}")
        t = data.contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy(), "bfloat16"
        arr = t.numpy()
    elif isinstance(data, np.ndarray):
        arr = data
    else:
        raise TypeError(
            f"cannot publish {type(data).__name__}: give an array, tensor, PIL image or bytes"
        )
    arr = np.ascontiguousarray(arr)
    name = arr.dtype.name
    if name not in DTYPES:
        raise TypeError(f"dtype `{name}` is not in the whitelist {sorted(DTYPES)}")
    return arr, name


def _envelope(
    request_id: str,
    index: int,
    item: Item,
    shape: tuple[int, ...],
    nbytes: int,
    dtype: str,
    payload: CpuRef | InlineRef | CudaIpcRef | FabricRef,
) -> FeatureEnvelope:
    spec = item.preprocess
    if callable(spec):
        spec = spec(shape[1], shape[0])
    grid = item.grid if item.grid is not None else (spec.plan.grid if spec is not None else None)
    if grid is None:
        raise MalformedEnvelope(f"item {index} of request {request_id!r} needs a `grid`")
    return FeatureEnvelope(
        version=SCHEMA_VERSION,
        request_id=request_id,
        index=GlobalIndex(index),
        modality=item.modality,
        kind=item.kind,
        grid=grid,
        tensor=TensorSpec(dtype=dtype, shape=shape, nbytes=nbytes),
        payload=payload,
        consumers=tuple(item.consumers),
        preprocess=spec,
    )


@final
class CpuProducer:
    """The tokenizer/encoder side: owns the arena, the handover socket and the channel.

    Args:
        endpoint: where consumers connect. ``None`` binds ``ipc://`` in a private ``0700``
            directory; ``tcp://HOST:PORT`` binds there (loopback unless told otherwise).
        arena_size: bytes preallocated and prefaulted at start.
        on_full: ``"wait"`` waits up to ``full_timeout`` seconds for releases, then raises
            :class:`ArenaFull`; ``"inline"`` sends the request as inline frames (warns once).
        allowed_uids: uids allowed to receive the arena (default: this process's uid).
        curve: a server key pair; with it a ``tcp://`` endpoint only accepts clients whose
            public key is in ``curve_clients``, and traffic is encrypted.
        device_pool: keep CUDA tensors on the GPU: ``"cuda_ipc"`` (one ``cuMemAlloc`` pool,
            IPC handle), ``"fabric"`` (a VMM pool: FABRIC handle if the driver permits,
            else a POSIX fd over the handover socket), ``"auto"`` (the rule of
            :func:`choose_backend`; ``backend_choice`` says what and why), ``"none"``.
        device / device_pool_size: the pool's GPU and data bytes.
        on_pool_full: ``"cpu"`` sends CUDA items through the host arena when the pool is
            full (warns once); ``"wait"`` reclaims until ``full_timeout``, then ``ArenaFull``.

    Not thread-safe: one thread publishes (``BusyResourceError`` is not checked on the hot path).
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
        prefault: bool = True,
        device_pool: DevicePoolMode = "none",
        device: str | torch.device | None = None,
        device_pool_size: int = 256 << 20,
        on_pool_full: Literal["cpu", "wait"] = "cpu",
    ) -> None:
        self._device = ProducerDevice(
            device_pool,
            None if device is None else torch.device(device),
            device_pool_size,
            spans_hosts=(endpoint or "").startswith("tcp://"),
            on_full=on_pool_full,
            full_timeout=full_timeout,
        )
        self._dir = tempfile.mkdtemp(prefix="mmwire-")
        os.chmod(self._dir, 0o700)
        self.arena = Arena(arena_size, prefault=prefault)
        self.on_full = on_full
        self.full_timeout = full_timeout
        self._gone: list[int] = []
        self._gone_lock = threading.Lock()
        self.handover = HandoverServer(
            os.path.join(self._dir, "handover.sock"),
            self.arena.fd,
            self.arena.id,
            self.arena.size,
            self._on_consumer_gone,
            allowed_uids=allowed_uids,
            pool=self._device.offer,
            pool_fd=self._device.fd,
        )
        self._ctx = zmq.Context()
        self._auth: Any = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            self._start_curve(curve, curve_clients)
        self._sock.bind(endpoint or f"ipc://{self._dir}/channel")
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._routes: dict[int, tuple[bytes, bool]] = {}
        self._trackers: list[tuple[zmq.MessageTracker, int, int, int]] = []
        self._inline_fallbacks = 0
        self._warned_inline = False
        self.closed = False

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
    def handover_path(self) -> str:
        """The Unix socket consumers on this host pass to :class:`CpuConsumer`."""
        return self.handover.path

    def _on_consumer_gone(self, rank: int) -> None:
        self.arena.release_rank(rank)
        with self._gone_lock:
            self._gone.append(rank)

    # -- control messages -------------------------------------------------------------

    def poll(self, timeout: float = 0.0) -> None:
        """Process joins, releases and finished sends; waits up to ``timeout`` s for one."""
        self._check_open()
        with self._gone_lock:
            gone, self._gone = self._gone, []
        for rank in gone:
            self._routes.pop(rank, None)
            self._device.rank_gone(rank)
        still = []
        for tracker, start, gen, rank in self._trackers:
            if tracker.done:
                self.arena.release(start, gen, rank)
            else:
                still.append((tracker, start, gen, rank))
        self._trackers = still
        wait_ms = int(timeout * 1000)
        while self._sock.poll(wait_ms, zmq.POLLIN):  # returns the event mask
            wait_ms = 0
            frames = self._sock.recv_multipart(copy=True)
            if len(frames) != 2:
                continue
            ident, body = frames
            try:
                msg = _CTRL_DEC.decode(body)
            except msgspec.MsgspecError:
                continue  # a malformed control message is dropped, the channel keeps serving
            if isinstance(msg, _Join):
                self._routes[msg.rank] = (ident, msg.shared)
            else:
                sender = next((r for r, (i, _) in self._routes.items() if i == ident), None)
                if sender is not None:
                    self.arena.release(msg.lease, msg.generation, sender)

    def wait_for_consumers(self, ranks: Collection[int], timeout: float = 30.0) -> None:
        """Block until every rank in ``ranks`` has joined; ``TimeoutError`` otherwise."""
        deadline = time.monotonic() + timeout
        while not set(ranks) <= set(self._routes):
            if time.monotonic() > deadline:
                missing = sorted(set(ranks) - set(self._routes))
                raise TimeoutError(f"ranks {missing} did not join within {timeout} s")
            self.poll(0.05)

    # -- publishing -------------------------------------------------------------------

    def publish(self, request_id: str, items: Sequence[Item]) -> list[FeatureEnvelope]:
        """Write one request's payloads once and send its envelopes to every rank.

        Host payloads go into one arena lease (``CpuRef``, or ``InlineRef`` after an inline
        fallback); CUDA tensors into the device pool when there is one and every consumer
        of the item is on this host (``CudaIpcRef``/``FabricRef``), else through the host.
        Raises ``ArenaFull``, ``PeerGone`` when a named consumer is not joined,
        ``TypeError``/``EnvelopeError`` for bad items; a failed publish leaves nothing
        allocated.
        """
        self._check_open()
        self.poll(0)
        owners: set[int] = set()
        for k, item in enumerate(items):
            if not item.consumers:
                raise MalformedEnvelope(f"item {k} of request {request_id!r} names no consumer")
            owners.update(item.consumers)
        missing = sorted(owners - set(self._routes))
        if missing:
            raise PeerGone(
                f"request {request_id!r} names consumer ranks {missing}, which have not joined "
                f"(joined: {sorted(self._routes)})"
            )
        placed: dict[int, tuple[CudaIpcRef | FabricRef, tuple[int, ...], str]] = {}
        try:
            for k, item in enumerate(items):
                if all(self._routes[r][1] for r in item.consumers):  # all on this host
                    placement = self._device.place(item.data, item.consumers, self.poll)
                    if placement is not None:
                        placed[k] = placement
            arrays = {
                k: _as_array(item.data.cpu() if _is_cuda(item.data) else item.data)
                for k, item in enumerate(items)
                if k not in placed
            }
            host_owners = {r for k in arrays for r in items[k].consumers}
            lease = None
            if arrays:
                try:
                    lease = self.arena.allocate(
                        [a.nbytes for a, _ in arrays.values()],
                        host_owners,
                        self.full_timeout,
                        drain=self.poll,
                    )
                except ArenaFull:
                    if self.on_full != "inline" or placed:
                        raise
                    return self._publish_inline(request_id, items, list(arrays.values()))
        except BaseException:
            self._device.undo([ref for ref, _, _ in placed.values()])
            raise
        try:
            slots = iter(lease.slots if lease is not None else ())
            start, generation = (lease.start, lease.generation) if lease is not None else (0, 0)
            envs = []
            for k, item in enumerate(items):
                if k in placed:
                    ref, shape, dtype = placed[k]
                    envs.append(_envelope(request_id, k, item, shape, ref.length, dtype, ref))
                    continue
                arr, dtype = arrays[k]
                off, n = next(slots)
                dst = np.frombuffer(self.arena.view, dtype=np.uint8, count=n, offset=off)
                dst[:] = arr.reshape(-1).view(np.uint8)
                cref = CpuRef(
                    arena_id=self.arena.id,
                    lease=start,
                    offset=off,
                    length=n,
                    generation=generation,
                )
                envs.append(
                    _envelope(request_id, k, item, tuple(arr.shape), arr.nbytes, dtype, cref)
                )
            if lease is not None:
                self.arena.publish(lease)
        except BaseException:
            self._device.undo([ref for ref, _, _ in placed.values()])
            if lease is not None:
                for r in host_owners:
                    self.arena.release(lease.start, lease.generation, r)
            raise
        self._send(envs, None if lease is None else (lease.start, lease.generation))
        return envs

    def _send(self, envs: list[FeatureEnvelope], lease: tuple[int, int] | None) -> None:
        shared_frames = encode_batch(envs)
        for rank, (ident, shared) in list(self._routes.items()):
            owned = [] if shared else [k for k, e in enumerate(envs) if rank in e.consumers]
            if not owned:  # same host, or a remote rank that only needs the metadata
                self._sock.send_multipart([ident, *shared_frames], copy=False)
                continue
            # Another host: the slices of the items it owns go out as frames, zero-copy, and
            # the lease stays pending for this rank until zmq says the frames are sent.
            frame_of = {k: n for n, k in enumerate(owned)}
            remote_envs = [
                msgspec.structs.replace(e, payload=InlineRef(frame=frame_of[k]))
                if k in frame_of
                else e
                for k, e in enumerate(envs)
            ]
            frames = [self._arena_slice(envs[k]) for k in owned]
            tracker = self._sock.send_multipart(
                [ident, *encode_batch(remote_envs, frames)], copy=False, track=True
            )
            if tracker is not None and lease is not None:
                self._trackers.append((tracker, lease[0], lease[1], rank))

    def _arena_slice(self, env: FeatureEnvelope) -> memoryview:
        ref = env.payload
        if not isinstance(ref, CpuRef):
            raise TypeError(f"item {env.index.value} is not in the arena")
        return self.arena.view[ref.offset : ref.offset + ref.length]

    def _publish_inline(
        self, request_id: str, items: Sequence[Item], arrays: list[tuple[np.ndarray[Any, Any], str]]
    ) -> list[FeatureEnvelope]:
        if not self._warned_inline:
            warnings.warn(
                "mmwire arena full: sending requests as inline frames", RuntimeWarning, stacklevel=3
            )
            self._warned_inline = True
        self._inline_fallbacks += 1
        envs = [
            _envelope(request_id, k, item, tuple(arr.shape), arr.nbytes, dtype, InlineRef(frame=k))
            for k, ((arr, dtype), item) in enumerate(zip(arrays, items))
        ]
        frames = encode_batch(envs, [arr.tobytes() for arr, _ in arrays])
        for ident, _ in list(self._routes.values()):
            self._sock.send_multipart([ident, *frames], copy=False)
        return envs

    def statistics(self) -> ProducerStatistics:
        """A snapshot: arena use, joined ranks, inline fallbacks, sends in flight."""
        return ProducerStatistics(
            arena=self.arena.statistics(),
            consumers=tuple(sorted(self._routes)),
            inline_fallbacks=self._inline_fallbacks,
            sends_in_flight=len(self._trackers),
            handovers_refused=self.handover.refused,
            device_pool=self._device.statistics(),
        )

    def reclaim(self) -> int:
        """Check the device pool's acknowledgements now (one batched read); slots freed."""
        self._check_open()
        self.poll(0)
        return 0 if self._device.pool is None else self._device.pool.reclaim()

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedResourceError("this CpuProducer was closed")

    def close(self) -> None:
        """Stop serving and drop the producer's hold on the arena (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.handover.close()
        self._sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        self.arena.close()
        self._device.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> CpuProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            warnings.warn("unclosed CpuProducer", ResourceWarning, stacklevel=1)


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
class CpuConsumer:
    """A scheduler rank's end: receives batches and opens its own items zero-copy.

    Args:
        rank: this consumer's rank (matches ``Item.consumers`` on the producer).
        endpoint: the producer's channel endpoint (``CpuProducer.endpoint``).
        handover: the producer's handover socket path; ``None`` for a consumer on another
            host, which then gets payloads as inline frames through the same API.
        limits: ceilings for decoding untrusted batches.
        curve_server_key / curve: CURVE keys for ``tcp://``.
        device: the GPU on which this rank opens device-pool items (default: the current
            CUDA device, at the first such item; processes without GPU items never touch
            CUDA).
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
    ) -> None:
        self.rank = rank
        self._decoder = BatchDecoder(limits)
        self._mapping: _Mapping | None = None
        self._handover_conn: socket.socket | None = None
        dev = None if device is None else torch.device(device)
        self._device = ConsumerDevice(None, None, dev)
        if handover is not None:
            h = receive_arena(handover, rank)
            self._handover_conn = h.conn
            self._mapping = _Mapping(h.fd, h.arena_id, h.size)
            self._device = ConsumerDevice(h.pool, h.pool_fd, dev)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve_server_key is not None:
            keys = curve or CurveKeys.generate()
            self._sock.curve_serverkey = curve_server_key
            self._sock.curve_publickey = keys.public
            self._sock.curve_secretkey = keys.secret
        self._sock.connect(endpoint)
        self._sock.send(_CTRL_ENC.encode(_Join(rank=rank, shared=self._mapping is not None)))
        self._batches = 0
        self._opened = 0
        self._opened_bytes = 0
        self._held: set[tuple[int, int]] = set()
        self.closed = False

    def producer_alive(self) -> bool:
        """False once the producer's handover connection has closed (it died or closed)."""
        conn = self._handover_conn
        if conn is None:
            return True
        readable, _, _ = select.select([conn], [], [], 0)
        if not readable:
            return True
        try:
            return conn.recv(1, socket.MSG_PEEK) != b""
        except OSError:
            return False

    def recv(self, timeout: float | None = None) -> ReceivedBatch:
        """The next batch; ``TimeoutError`` after ``timeout`` s, ``PeerGone`` if the producer died.

        A malformed batch raises its ``EnvelopeError`` and is dropped; the next call
        receives the next batch.
        """
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._sock.poll(100, zmq.POLLIN):
            if not self.producer_alive():
                raise PeerGone(f"rank {self.rank}: the producer went away")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: no batch within {timeout} s")
        return self.decode(self._sock.recv_multipart(copy=False))

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
        self._held |= leases
        return ReceivedBatch(self, batch.envelopes, batch.frames, leases, device)

    def _open_device(self, env: FeatureEnvelope, waited: set[int]) -> torch.Tensor:
        """A device view of an owned pool item, ordered after the producer's copy."""
        where = f"item {env.index.value} of request {env.request_id!r}"
        if self.rank not in env.consumers:
            raise NotAConsumer(
                f"rank {self.rank} is not a consumer of {where} (consumers {list(env.consumers)})"
            )
        if not self.producer_alive():
            raise PeerGone(f"rank {self.rank}: the producer of {where} went away")
        mapping, ref = self._device.check(env, self.rank)
        if env.index.value not in waited:
            mapping.wait_ready(ref.slot, ref.generation)
            waited.add(env.index.value)
        self._opened += 1
        self._opened_bytes += env.tensor.nbytes
        dtype = _TORCH_DTYPES[env.tensor.dtype]
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

    def _open_bytes(self, env: FeatureEnvelope, frames: tuple[Any, ...]) -> tuple[Any, int]:
        """The buffer and offset of an owned item's payload, after every check."""
        where = f"item {env.index.value} of request {env.request_id!r}"
        if self.rank not in env.consumers:
            raise NotAConsumer(
                f"rank {self.rank} is not a consumer of {where} (consumers {list(env.consumers)})"
            )
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
            raise PeerGone(f"rank {self.rank}: the producer of {where} went away")
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

    def _release(self, leases: set[tuple[int, int]]) -> None:
        for lease, gen in leases:
            if (lease, gen) in self._held:
                self._held.discard((lease, gen))
                if not self.closed:
                    self._sock.send(_CTRL_ENC.encode(_Release(lease=lease, generation=gen)))

    def register_with_cuda(self) -> None:
        """Pin the arena mapping with ``cudaHostRegister`` once, for pinned-speed H2D copies.

        Raises ``BackendUnavailable`` without CUDA or when the driver refuses.
        """
        m = self._mapping
        if m is None or m.registered:
            return
        if not torch.cuda.is_available():
            raise BackendUnavailable("register_with_cuda needs a CUDA device; none is visible")
        # cudaHostRegisterPortable | cudaHostRegisterReadOnly: the mapping is read-only.
        err = torch.cuda.cudart().cudaHostRegister(m.address, m.size, 0x01 | 0x08)  # type: ignore[no-untyped-call]
        if int(err) != 0:
            raise BackendUnavailable(f"cudaHostRegister of the arena failed with error {int(err)}")
        m.registered = True

    def statistics(self) -> ConsumerStatistics:
        """A snapshot of this rank's use."""
        return ConsumerStatistics(
            rank=self.rank,
            arena_mapped=self._mapping is not None,
            batches=self._batches,
            items_opened=self._opened,
            bytes_opened=self._opened_bytes,
            leases_held=len(self._held),
        )

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedResourceError(f"CpuConsumer rank {self.rank} was closed")

    def close(self) -> None:
        """Close the channel and the handover connection (idempotent).

        The arena mapping is dropped when the last view into it is gone.
        """
        if self.closed:
            return
        self.closed = True
        self._sock.close(0)
        self._ctx.term()
        if self._handover_conn is not None:
            self._handover_conn.close()
        if self._mapping is not None and self._mapping.registered:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self._mapping.address)  # type: ignore[no-untyped-call]
        self._mapping = None
        self._device.close()

    def __enter__(self) -> CpuConsumer:
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

    _consumer: CpuConsumer
    envelopes: GlobalTable[FeatureEnvelope]
    _frames: tuple[Any, ...]
    _leases: set[tuple[int, int]]
    _device: list[FeatureEnvelope] = field(default_factory=list)
    released: bool = field(default=False)
    _waited: set[int] = field(default_factory=set)

    @property
    def owned(self) -> tuple[GlobalIndex, ...]:
        """Global positions of the items this rank consumes."""
        rank = self._consumer.rank
        return tuple(g for g, e in self.envelopes.items() if rank in e.consumers)

    def _buffer(self, index: GlobalIndex) -> tuple[FeatureEnvelope, Any, int]:
        if self.released:
            raise ClosedResourceError("this batch was released; its payloads may be reused")
        env = self.envelopes[index]
        buf, off = self._consumer._open_bytes(env, self._frames)
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
            self._consumer._release(self._leases)
            self._consumer._acknowledge(self._device)

    def __enter__(self) -> ReceivedBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
