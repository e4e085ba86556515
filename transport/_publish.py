"""One request's way from ``Producer.publish`` to its members.

1. Check the whole request (``_items.py``, ``_prepare.py``) and the envelopes a consumer
   would accept, before anything is allocated.
2. Place CUDA tensors whose consumers are all on this host in the device pool.
3. Point items whose payloads are resident in the arena at them (``reuse``).
4. Allocate one arena lease for the rest (waiting up to ``full_timeout`` for releases,
   then ``ArenaFull`` or the inline fallback) and write each payload once; images decode
   straight into their slots, in parallel.
5. Copy what remote pulling ranks own into the transfer window, each with a digest.
6. Deliver (``_delivery.py``).

A publish that fails at any step gives back everything it allocated or referenced.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import msgspec
import numpy as np

from ._arena import ARENA_HEADER, LEASE_HEADER, Arena, Lease
from ._codec import Limits, check_envelopes, encode_batch
from ._control import Member
from ._delivery import Delivery, Staged, raise_if_lost
from ._gpu import ProducerDevice
from ._items import Item
from ._light import heavy, plainly_large
from ._membership import Roster
from ._mooncake import TransferSource
from ._pinning import pin_host, unpin_host
from ._prepare import PreparedItem, envelope, located, payload_digest, prepare
from ._schema import CpuRef, CudaIpcRef, FabricRef, FeatureEnvelope, InlineRef
from ._staging import Holds, stage_for_pullers
from .errors import ArenaFull, BackendUnavailable, PeerGone

__all__ = ["Published", "Publisher"]

Published = tuple[list[FeatureEnvelope], Callable[[], None] | None]
"""A request's envelopes, and what finishes its delivery if a member's queue was full."""

Placed = dict[int, tuple[CudaIpcRef | FabricRef, tuple[int, ...], str]]
"""Items placed in the device pool: their reference, and their shape and dtype there."""


class Publisher:
    """Writes requests' payloads once and hands their envelopes to the delivery."""

    def __init__(
        self,
        *,
        lock: threading.RLock,
        roster: Roster,
        delivery: Delivery,
        arena: Arena,
        device: ProducerDevice,
        transfer: TransferSource | None,
        service: Callable[[], None],
        drain: Callable[[float], None],
        digests: Literal["images", "all", "none"],
        max_image_pixels: int,
        reuse: bool,
        on_full: Literal["wait", "inline"],
        full_timeout: float,
    ) -> None:
        self.lock = lock
        self.roster = roster
        self.delivery = delivery
        self.arena = arena
        self.device = device
        self.transfer = transfer
        self._service = service
        self._drain = drain
        self.digests = digests
        self.max_image_pixels = max_image_pixels
        self.reuse = reuse
        self.on_full = on_full
        self.full_timeout = full_timeout
        self.limits = Limits()
        self.inline_fallbacks = 0
        self._warned_inline = False
        self.arena_pinned: bool | None = None  # None: not tried yet
        self._decode_pool: ThreadPoolExecutor | None = None

    def publish(self, request_id: str, items: Sequence[Item]) -> list[FeatureEnvelope]:
        """Steps 2-6 for a request ``check_request`` accepted (see ``Producer.publish``)."""
        envs, _ = self._publish(request_id, items, now=False)
        return envs

    def publish_now(self, request_id: str, items: Sequence[Item]) -> Published | None:
        """``publish`` if it needs no waiting and no heavy work (a decode, a CUDA copy, more
        than ``NOW_MAX_BYTES`` to copy or hash), for a caller on an event loop; ``None``
        otherwise, with nothing sent and nothing held. If a member's queue was full, the
        envelopes come with what finishes the delivery (run it where blocking is fine)."""
        try:
            return self._publish(request_id, items, now=True)
        except _MustWait:
            return None

    def _publish(self, request_id: str, items: Sequence[Item], *, now: bool) -> Published:
        owners = {r for item in items for r in item.consumers}
        with self.lock:
            # The control thread serves joins and releases as they arrive, off this path;
            # a rank that is not a member yet may have a join waiting to be served.
            members = {s.rank: s for s in self.roster.members.joined()}
            if not owners <= members.keys():
                self._service()
                members = {s.rank: s for s in self.roster.members.joined()}
        missing = sorted(owners - set(members))
        if missing:
            raise PeerGone(
                f"request {request_id!r} names consumer ranks {missing}, which have not joined "
                f"(joined: {sorted(members)})"
            )
        if now and plainly_large(items):
            raise _MustWait
        placed: Placed = {}
        lease: Lease | None = None
        window: Staged | None = None
        holds = Holds()

        def undo() -> None:
            self.device.undo([ref for ref, _, _ in placed.values()])
            self._undo(holds)
            if lease is not None:
                self.arena.release_all(lease.start, lease.generation)
            if window is not None and self.transfer is not None:
                self.transfer.window.release_all(window.lease.start, window.lease.generation)

        try:
            if self.device.pool is not None:  # CUDA tensors go to the pool
                for k, item in enumerate(items):
                    if all(members[r].shared for r in item.consumers):  # all on this host
                        placement = self.device.place(item.data, item.consumers, self._drain)
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
            if now and heavy(prepared):
                raise _MustWait
            envs = self._checked_envelopes(request_id, prepared, placed)
            host = [k for k in range(len(items)) if k not in placed]
            if self.reuse and any(prepared[k].digest is not None for k in host):
                envs = self._reuse(prepared, envs, host, members, holds)
            new = [k for k in host if k not in holds.reused]
            if new:
                holders = {members[r].id for k in new for r in items[k].consumers}
                sizes = [prepared[k].nbytes for k in new]
                if now:
                    lease = self.arena.try_allocate(sizes, holders, tag=request_id)
                    if lease is None:  # releases may be waiting to be served
                        with self.lock:
                            self._service()
                        lease = self.arena.try_allocate(sizes, holders, tag=request_id)
                    if lease is None:
                        raise _MustWait
                else:
                    try:
                        lease = self.arena.allocate(
                            sizes, holders, self.full_timeout, drain=self._drain, tag=request_id
                        )
                    except ArenaFull:
                        if self.on_full != "inline" or placed:
                            raise
                        self._undo(holds)
                        return self._publish_inline(request_id, prepared, envs), None
                for h in holders:
                    holds.add(h, lease.start, lease.generation)
                envs = self._fill(lease, prepared, envs, new)
                self.arena.publish(lease)
                digests = {envs[k].digest or "": n for n, k in enumerate(new) if envs[k].digest}
                if digests:
                    self.arena.index(lease, digests)
            if self.transfer is not None:
                got = stage_for_pullers(
                    self.transfer.window,
                    request_id,
                    prepared,
                    envs,
                    members,
                    holds,
                    slice_of=self.delivery.arena_slice,
                    release=self.arena.release,
                    timeout=None if now else self.full_timeout,
                    drain=self._drain,
                )
                if got is None:
                    raise _MustWait
                envs, window = got
            with self.lock:
                gone = [s for s in members.values() if s.gone and s.rank in owners]
                if gone:
                    raise PeerGone(
                        f"request {request_id!r}: {', '.join(map(str, gone))} went away "
                        "before it was sent"
                    )
                sending = self.delivery.start(envs, holds.by_member, staged=window)
                if not (now and sending.waiting):
                    missed = self.delivery.wait_out(sending)
        except BaseException:
            undo()
            raise
        if now and sending.waiting:

            def finish() -> None:
                with self.lock:
                    try:
                        missed = self.delivery.wait_out(sending)
                    except BaseException:
                        undo()
                        raise
                raise_if_lost(request_id, missed, owners)

            return envs, finish
        raise_if_lost(request_id, missed, owners)
        return envs, None

    def _checked_envelopes(
        self, request_id: str, prepared: list[PreparedItem], placed: Placed
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
        check_envelopes(envs)  # what a consumer's decoder would refuse
        return envs

    def _reuse(
        self,
        prepared: list[PreparedItem],
        envs: list[FeatureEnvelope],
        host: list[int],
        members: dict[int, Member],
        holds: Holds,
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

    def _undo(self, holds: Holds) -> None:
        """Give back the references a failed publish added to resident leases."""
        for holder, start, gen in holds.claimed:
            self.arena.release(start, gen, holder)
        holds.claimed.clear()

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
            self.pin_arena()

        def slot(k: int) -> np.ndarray[Any, Any]:
            off, n = slots[k]
            return np.frombuffer(self.arena.view, dtype=np.uint8, count=n, offset=off)

        def decode(k: int) -> None:
            where = f"item {k} of request {envs[k].request_id!r}"
            located(where, prepared[k].write_into, slot(k))

        # images decode in parallel (Pillow lets go of the GIL), each straight into its slot
        decoding = [k for k in host if prepared[k].image is not None]
        if len(decoding) > 1:
            list(self._decoders().map(decode, decoding))
        else:
            for k in decoding:
                decode(k)
        for k in host:
            if prepared[k].image is None:  # a copy, which raises no MmwireError
                prepared[k].write_into(slot(k))
        for k, (off, n) in slots.items():
            ref = self._ref(lease, off, n)
            digest = envs[k].digest
            if digest is None and self._digest_written(prepared[k]):
                digest = payload_digest(prepared[k], slot(k))
            out[k] = msgspec.structs.replace(envs[k], payload=ref, digest=digest)
        return out

    def _publish_inline(
        self, request_id: str, prepared: list[PreparedItem], envs: list[FeatureEnvelope]
    ) -> list[FeatureEnvelope]:
        if not self._warned_inline:
            warnings.warn(
                "mmwire arena full: sending requests as inline frames", RuntimeWarning, stacklevel=4
            )
            self._warned_inline = True
        inline = [
            msgspec.structs.replace(e, payload=InlineRef(frame=k)) for k, e in enumerate(envs)
        ]
        # Copies: the caller may reuse its arrays as soon as publish returns.
        frames = encode_batch(inline, [p.host_bytes() for p in prepared])
        owners = {r for p in prepared for r in p.item.consumers}
        with self.lock:
            evicted = self.delivery.deliver(inline, {}, frames)
        self.inline_fallbacks += 1
        raise_if_lost(request_id, evicted, owners)
        return inline

    def pin_arena(self) -> None:
        """Register the arena with CUDA once, so CUDA items that travel through the host
        are copied in by DMA at PCIe speed (pageable copies run at about 1 GB/s). A driver
        that refuses leaves the copies pageable, with one warning."""
        if self.arena_pinned is not None:
            return
        try:
            pin_host(self.arena.address, self.arena.size, read_only=False)
            self.arena_pinned = True
        except BackendUnavailable as e:
            self.arena_pinned = False
            warnings.warn(f"mmwire: CUDA items go through pageable memory: {e}", stacklevel=5)

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

    def _decoders(self) -> ThreadPoolExecutor:
        """The threads that decode one request's images in parallel (made at first use)."""
        if self._decode_pool is None:
            workers = min(8, os.cpu_count() or 1)
            self._decode_pool = ThreadPoolExecutor(workers, thread_name_prefix="mmwire-decode")
        return self._decode_pool

    def close(self) -> None:
        """Stop the decode threads and unregister the arena from CUDA."""
        if self._decode_pool is not None:
            self._decode_pool.shutdown(wait=True)
        if self.arena_pinned:
            unpin_host(self.arena.address)


class _MustWait(Exception):
    """``publish_now`` cannot publish without waiting or heavy work (nothing was kept)."""
