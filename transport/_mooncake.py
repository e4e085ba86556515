"""Payloads for consumers on other hosts, pulled through Mooncake's Transfer Engine.

A producer made with ``transfer=MooncakeTransfer(...)`` registers a **transfer window** of its
own with the engine, once, at start: an arena apart from the one local ranks map, which
holds only the payloads of items owned by remote ranks that pull, copied there per request
and freed as soon as those ranks have read them. The local arena is never registered, so
nothing a local rank receives is reachable through the engine. A remote consumer made with
the same option registers one receive pool **once**, joins asking to pull, and is sent a
:class:`TransferOffer` (the engine session to read from, and where the window lies in the
producer's address space). Its batches carry ``CpuRef``s into the window: for each batch the
consumer checks every owned reference against the offer, reads the bytes it owns into its
pool with one batched one-sided read, checks each lease's header came back with the
reference's generation and **each item's bytes against the BLAKE3 digest in its envelope**
(which came over the CURVE-authenticated channel), and releases the leases at once.

Trust boundary: the engine's data plane has no authentication, and the engine (0.3.13)
listens on every interface whatever ``hostname`` it is given. Anyone who reaches its port can
read the window (payloads bound for remote ranks, while they wait to be pulled) and write
into it or into a receive pool; writes before the pull are caught by the digest check
(:class:`IntegrityError`, and the rank keeps serving). So ``transfer=`` on a ``hostname``
other than loopback needs ``MooncakeTransfer(trusted_network=True)``: an explicit statement
that only trusted hosts reach the engine's ports.

Registering memory costs hundreds of milliseconds per GiB, so nothing is registered per
request. The engine's own handshake and metadata service are used as they are
(``P2PHANDSHAKE`` by default: no etcd); the protocol (``tcp``, ``rdma``) and the RDMA
devices are configuration. Reads rather than writes: the owner knows when its receive pool
has room and which items it owns, and the producer's publish never waits on a network.
"""

from __future__ import annotations

import ipaddress
import os
import threading
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from ._arena import ARENA_HEADER, LEASE_HEADER, LEASE_MAGIC, Arena, read_lease_header
from ._digest import digest_of, envelope_alpha
from ._schema import CpuRef, FeatureEnvelope
from .errors import (
    ArenaFull,
    BackendUnavailable,
    ConfigurationError,
    IntegrityError,
    OffsetError,
    PeerGone,
    StaleReference,
)

__all__ = ["MooncakeTransfer", "PulledItems", "Puller", "TransferOffer", "TransferSource"]

TRANSFER_OFFER = b"\x00mmwire-transfer-offer"
"""First frame of the producer -> consumer offer: ``[TRANSFER_OFFER, TransferOffer]``."""

_U63 = msgspec.Meta(ge=0, le=(1 << 63) - 1)


@dataclass(frozen=True)
class MooncakeTransfer:
    """How this process joins Mooncake's Transfer Engine (``pip install "mmwire[mooncake]"``).

    Attributes:
        hostname: this host's address as the other side reaches it.
        protocol: ``"tcp"`` anywhere, ``"rdma"`` where the hosts have RDMA NICs.
        device_name: the RDMA devices to use (``"mlx5_0,mlx5_1"``); ``""`` for tcp or to
            let the engine discover them.
        metadata_server: ``"P2PHANDSHAKE"`` (peers exchange segment metadata directly), or
            the URL of the engine's etcd/HTTP metadata service.
        window_size: bytes of the producer's transfer window: what requests bound for
            remote ranks may hold at once (a full window is ``ArenaFull``).
        trusted_network: required for a ``hostname`` other than loopback: says that only
            trusted hosts reach the engine, whose data plane has no authentication.
    """

    hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_name: str = ""
    metadata_server: str = "P2PHANDSHAKE"
    window_size: int = 256 << 20
    trusted_network: bool = False

    def check(self) -> None:
        """``ConfigurationError`` for settings that cannot work or are not safe to use."""
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigurationError(f"`protocol` must be tcp or rdma, got {self.protocol!r}")
        if self.window_size < ARENA_HEADER + 4096:
            raise ConfigurationError(f"`window_size` {self.window_size} is too small")
        if not self.trusted_network and not _loopback(self.hostname):
            raise ConfigurationError(
                f"the transfer engine on {self.hostname!r} would serve its window to anyone "
                "who reaches the port: its data plane has no authentication. Pass "
                "`MooncakeTransfer(trusted_network=True)` if only trusted hosts reach it"
            )


def _loopback(hostname: str) -> bool:
    if hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(hostname).is_loopback
    except ValueError:
        return False


class TransferOffer(msgspec.Struct, frozen=True, tag=True):
    """producer -> a remote consumer that pulls, once after its join: where to read."""

    session: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    arena_id: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
    base: Annotated[int, _U63]
    size: Annotated[int, msgspec.Meta(ge=ARENA_HEADER + LEASE_HEADER, le=(1 << 63) - 1)]


_OFFER_DECODER = msgspec.msgpack.Decoder(TransferOffer)
_OFFER_ENCODER = msgspec.msgpack.Encoder()


def decode_offer(body: bytes) -> TransferOffer:
    """A producer's offer; ``StaleReference`` for anything else."""
    try:
        return _OFFER_DECODER.decode(body)
    except msgspec.MsgspecError as e:
        raise StaleReference(f"the producer's transfer offer is malformed: {e}") from e


class _Engine:
    """One Transfer Engine of this process, with one registered region."""

    def __init__(self, config: MooncakeTransfer, address: int, size: int) -> None:
        config.check()
        # its own log (glog, to stderr) says INFO lines per start, connection and close: quiet
        # unless the operator asks, with MC_LOG_LEVEL=INFO
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise BackendUnavailable(
                'the mooncake transfer needs `pip install "mmwire[mooncake]"` and the '
                f"system libraries libibverbs1 and libnuma1 ({e})"
            ) from e
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(
            config.hostname, config.metadata_server, config.protocol, config.device_name
        )
        if rc != 0:
            raise BackendUnavailable(
                f"Mooncake's Transfer Engine did not start on {config.hostname} over "
                f"{config.protocol} (error {rc})"
            )
        if self._engine.register_memory(address, size) != 0:
            raise BackendUnavailable(f"Mooncake refused to register {size} bytes")
        self.address = address
        self.session = f"{config.hostname}:{self._engine.get_rpc_port()}"
        self._closed = False

    def read(self, session: str, local: list[int], remote: list[int], lengths: list[int]) -> int:
        """One batched one-sided read; the engine's status (0: all done)."""
        return int(self._engine.batch_transfer_sync_read(session, local, remote, lengths))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.unregister_memory(self.address)


class TransferSource:
    """The producer's side: its transfer window, registered once, and the offer remote
    pullers get."""

    def __init__(self, config: MooncakeTransfer) -> None:
        config.check()
        self.window = Arena(config.window_size, retain=False)
        try:
            self._engine = _Engine(config, self.window.address, self.window.size)
        except BaseException:
            self.window.close()
            raise
        self.offer = TransferOffer(
            session=self._engine.session,
            arena_id=self.window.id,
            base=self.window.address,
            size=self.window.size,
        )
        self.frames = [TRANSFER_OFFER, _OFFER_ENCODER.encode(self.offer)]

    def close(self) -> None:
        self._engine.close()
        self.window.close()


@dataclass
class PulledItems:
    """A batch's owned items, copied into the receive pool: the batch frees it on release."""

    frames: dict[int, memoryview]
    """By global index, the item's bytes in the pool."""
    start: int
    generation: int


class Puller:
    """The remote consumer's side: a receive pool registered once, filled per batch."""

    def __init__(self, config: MooncakeTransfer, pool_size: int) -> None:
        self.pool = Arena(pool_size, retain=False)
        self._engine = _Engine(config, self.pool.address, self.pool.size)
        self.offer: TransferOffer | None = None
        self._lock = threading.Lock()

    def pull(self, envelopes: list[FeatureEnvelope]) -> PulledItems:
        """Read these owned ``CpuRef`` items into the pool; raise before any transfer if one
        does not fit the offered window, after it if a lease changed generation or an item's
        bytes are not those its digest names (``IntegrityError``)."""
        offer = self.offer
        if offer is None:
            raise PeerGone("the producer sent a batch to pull before its transfer offer")
        refs = [_checked(env, offer) for env in envelopes]
        # each item's bytes, then the header of each distinct lease
        leases = sorted({(r.lease, r.generation) for r in refs})
        sizes = [r.length for r in refs] + [LEASE_HEADER] * len(leases)
        with self._lock:
            lease = self.pool.try_allocate(sizes, {0})
        if lease is None:
            raise ArenaFull(
                f"the receive pool ({self.pool.size} bytes) has no room for {sum(sizes)} bytes: "
                "release batches sooner or give a larger `receive_pool_size`"
            )
        try:
            remote = [offer.base + r.offset for r in refs]
            remote += [offer.base + start for start, _ in leases]
            local = [self.pool.address + off for off, _ in lease.slots]
            rc = self._engine.read(offer.session, local, remote, sizes)
            if rc != 0:
                raise PeerGone(
                    f"reading {len(envelopes)} items from {offer.session} failed (error {rc}): "
                    "the producer is gone or refused the addresses"
                )
            for (start, gen), (off, _) in zip(leases, lease.slots[len(envelopes) :]):
                magic, got, _, _ = read_lease_header(self.pool.view, off)
                if magic != LEASE_MAGIC or got != gen:
                    raise StaleReference(
                        f"lease {start} came back with generation {got}, the reference {gen}"
                    )
            for env, (off, n) in zip(envelopes, lease.slots):
                _verify(env, self.pool.view[off : off + n])
        except BaseException:
            self.free(lease.start, lease.generation)
            raise
        frames = {
            e.index.value: self.pool.view[off : off + n]
            for e, (off, n) in zip(envelopes, lease.slots)
        }
        return PulledItems(frames, lease.start, lease.generation)

    def free(self, start: int, generation: int) -> None:
        with self._lock:
            self.pool.release_all(start, generation)

    def close(self) -> None:
        self._engine.close()
        self.pool.close()


def _verify(env: FeatureEnvelope, pulled: memoryview) -> None:
    """``IntegrityError`` unless the pulled bytes are those the envelope's digest names."""
    spec = env.preprocess
    alpha = envelope_alpha(env.kind, spec.alpha if spec is not None else None)
    got = digest_of(env.kind, env.tensor.dtype, env.tensor.shape, alpha, pulled)
    if got != env.digest:
        raise IntegrityError(
            f"item {env.index.value} of request {env.request_id!r}: the bytes pulled from the "
            f"transfer window are not the ones its digest names ({env.digest}); someone "
            "wrote into the window or the receive pool"
        )


def _checked(env: FeatureEnvelope, offer: TransferOffer) -> CpuRef:
    """The item's reference, if the producer could have made it in the arena it offered;
    else a typed error."""
    ref = env.payload
    where = f"item {env.index.value} of request {env.request_id!r}"
    if not isinstance(ref, CpuRef):
        raise BackendUnavailable(f"{where} is not in the producer's arena")
    if ref.arena_id != offer.arena_id:
        raise StaleReference(f"{where} names arena {ref.arena_id!r}, not the offered one")
    if env.digest is None:
        raise IntegrityError(f"{where} has no digest to check its pulled bytes against")
    if ref.length != env.tensor.nbytes:
        raise StaleReference(f"{where}: payload length {ref.length} != {env.tensor.nbytes}")
    if ref.lease < ARENA_HEADER or ref.offset < ref.lease + LEASE_HEADER:
        raise OffsetError(f"{where}: offset {ref.offset} is outside lease {ref.lease}")
    if ref.offset + ref.length > offer.size:
        raise OffsetError(
            f"{where}: bytes {ref.offset}..{ref.offset + ref.length} lie outside the offered "
            f"arena of {offer.size} bytes"
        )
    return ref
