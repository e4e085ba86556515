"""The host shared-memory arena: one preallocated memfd per producer, leased per request.

Layout
------
::

    offset 0        4096                                                        size
    +---------------+-----------------+---------------------+-------- ... ------+
    | arena header  | lease A         | free                | lease B           |
    +---------------+-----------------+---------------------+-------- ... ------+

    arena header (4096 B)               lease (starts 4096-aligned)
    0   8s  magic  b"MMWARENA"          0   8s  magic b"MMWLEASE"
    8   u32 layout version (1)          8   u64 generation (0 = free)
    12  u32 producer pid                16  u64 lease length in bytes (header included)
    16  u64 arena size                  24  u32 item count n
    24  16s arena id                    28  u32 reserved
                                        32  n x (u64 offset, u64 length)   layout table
                                        ... payloads, 64-aligned (4096 for >= 1 MiB)

All integers little-endian. Offsets in the layout table and in ``CpuRef`` are absolute
(from the arena start).

States
------
A lease range is *free* (on the free list, header generation 0), *live* (allocated,
header generation g > 0, with a count of pending references per holder: the consumer
members that must release it, once per batch that named it), or *retained* (no holder
left, kept with its generation because its payloads have digests another request may
name again).

Transitions
-----------
* ``allocate``: free -> live. The producer writes the payloads, then the layout table,
  then the generation (``# ORDER`` at the store).
* ``release(holder)``: takes one of ``holder``'s references; when none is left the lease
  is retained if it has digests and the arena retains, else freed: the header generation
  is zeroed and the range goes back on the free list (coalesced).
* ``claim(digest, holders)``: a live or retained lease holding that payload gains a
  reference per holder (retained -> live).
* allocation that finds no free range evicts retained leases, least recently used first
  (retained -> free), before it waits.
* a consumer member's end (death, eviction, replacement): ``release`` for every live lease
  that still waits on that member, never on another member of the same rank.

Invariants
----------
* Live and retained leases never overlap; every range lies inside ``[4096, size)``.
* A digest names at most one slot, of a live or retained lease; eviction forgets it.
* Generations only grow, so a reference whose generation differs from its lease's header
  is stale and is refused (``StaleReference``); an open never returns another lease's bytes.
* The producer is the only writer; consumers get a read-only descriptor of a sealed memfd.

Lifetime
--------
The memfd has no name: nothing appears in ``/dev/shm`` and the kernel frees the memory when
the last process holding the fd or a mapping goes away, so a crash of any party leaks
nothing. ``posix_fallocate`` reserves the pages and the arena is prefaulted at creation, so
no request pays page faults.

Protection
----------
The memfd is sealed against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW``), so no
process holding it can truncate it and make the others' mappings SIGBUS, and against new
writable mappings and ``write()`` (``F_SEAL_FUTURE_WRITE``) once the producer's own mapping
exists. Consumers receive a separate read-only descriptor (:attr:`Arena.readonly_fd`).
"""

from __future__ import annotations

import collections
import fcntl
import mmap
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from .errors import ArenaFull, ClosedResourceError, ConfigurationError

__all__ = ["ARENA_HEADER", "LEASE_HEADER", "Arena", "ArenaStatistics", "Lease"]

ARENA_HEADER = 4096
LEASE_HEADER = 32
PAGE = 4096
_ARENA_FMT = struct.Struct("<8sIIQ16s")
_LEASE_FMT = struct.Struct("<8sQQII")
_SLOT_FMT = struct.Struct("<QQ")
_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux >= 5.1
ARENA_MAGIC = b"MMWARENA"
LEASE_MAGIC = b"MMWLEASE"


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def item_alignment(nbytes: int) -> int:
    """64-byte alignment for small payloads, a page for those of 1 MiB or more."""
    return PAGE if nbytes >= (1 << 20) else 64


def lease_size(item_sizes: list[int]) -> int:
    """Bytes a lease needs for payloads of these sizes, header and layout table included."""
    pos = LEASE_HEADER + _SLOT_FMT.size * len(item_sizes)
    for n in item_sizes:
        pos = _align(pos, item_alignment(n)) + n
    return _align(max(pos, 1), PAGE)


@dataclass(frozen=True)
class ArenaStatistics:
    """A snapshot of one arena's use."""

    size: int
    """Arena size in bytes (header included)."""
    bytes_in_use: int
    """Bytes held by live leases."""
    peak_bytes: int
    """Largest ``bytes_in_use`` seen."""
    leases_outstanding: int
    """Live leases still waiting for at least one consumer's release."""
    leases_total: int
    """Leases allocated since creation."""
    bytes_retained: int = 0
    """Bytes of released leases kept for their digests (reused, or evicted when room is
    needed)."""
    leases_retained: int = 0
    """Released leases kept for their digests."""
    payloads_reused: int = 0
    """Payloads referenced again by digest instead of being copied."""
    bytes_reused: int = 0
    """Payload bytes not copied because they were reused."""
    waiting_for_room: int = 0
    """Publishes waiting now for releases to make room (back-pressure)."""


@dataclass
class Lease:
    """One request's allocation: ``[start, start+length)`` and the item slots inside it.

    ``pending`` counts, per consumer member, the batches naming it that are not yet
    released; ``tag`` names the request in log lines; ``since`` is the
    ``time.monotonic()`` of its allocation or latest reuse; ``digests`` maps the digests
    of its payloads to their slots.
    """

    start: int
    length: int
    generation: int
    slots: list[tuple[int, int]]
    pending: collections.Counter[int]
    tag: str = ""
    since: float = 0.0
    digests: dict[str, int] = field(default_factory=dict)


class Arena:
    """Producer side of the arena: owns the memfd, the writable mapping and the allocator.

    Not thread-safe for writes; the allocator itself is guarded by a lock so releases can
    come from the handover thread. ``retain``: keep released leases that have digests
    until their room is needed.
    """

    def __init__(self, size: int = 1 << 30, *, prefault: bool = True, retain: bool = True) -> None:
        if size < ARENA_HEADER + PAGE:
            raise ConfigurationError(
                f"`arena_size` must be at least {ARENA_HEADER + PAGE} bytes, got {size}"
            )
        size = _align(size, PAGE)
        self.id = secrets.token_hex(16)
        self.size = size
        self.fd = os.memfd_create(
            f"mmwire-arena-{self.id[:8]}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        )
        self.readonly_fd = -1
        try:
            os.ftruncate(self.fd, size)
            os.posix_fallocate(self.fd, 0, size)
            self._map = mmap.mmap(
                self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
            self.write_sealed = _seal(self.fd)
            # What consumers get: the same memory, opened for reading only.
            self.readonly_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            os.close(self.fd)
            raise
        self.view = memoryview(self._map)
        self.address: int = np.frombuffer(self._map, dtype=np.uint8).ctypes.data
        """Where the producer's mapping starts (what ``cudaHostRegister`` is given)."""
        if prefault:
            zero = bytes(1 << 22)
            for off in range(0, size, len(zero)):
                n = min(len(zero), size - off)
                self.view[off : off + n] = zero[:n]
        _ARENA_FMT.pack_into(
            self.view, 0, ARENA_MAGIC, 1, os.getpid(), size, bytes.fromhex(self.id)
        )
        self._lock = threading.Condition()
        self._free: list[tuple[int, int]] = [(ARENA_HEADER, size - ARENA_HEADER)]
        self._live: dict[int, Lease] = {}
        self.retain = retain
        self._retained: collections.OrderedDict[int, Lease] = collections.OrderedDict()
        self._by_digest: dict[str, tuple[int, int]] = {}
        self._retained_bytes = 0
        self._reused = 0
        self._reused_bytes = 0
        self._waiting = 0
        self._generation = 0
        self._in_use = 0
        self._peak = 0
        self._total = 0
        self.closed = False

    # -- allocation -------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """The largest lease this arena can ever hold (its size less the header)."""
        return self.size - ARENA_HEADER

    def try_allocate(self, item_sizes: list[int], holders: set[int], tag: str = "") -> Lease | None:
        """A lease for these payload sizes, or ``None`` if no free range is large enough."""
        need = lease_size(item_sizes)
        with self._lock:
            if self.closed:
                raise ClosedResourceError("the arena was closed")
            while True:
                lease = self._first_fit(need, item_sizes, holders, tag)
                if lease is not None or not self._retained:
                    return lease
                _, oldest = self._retained.popitem(last=False)
                self._retained_bytes -= oldest.length
                self._forget(oldest)
                self._to_free_list(oldest)

    def _first_fit(
        self, need: int, item_sizes: list[int], holders: set[int], tag: str
    ) -> Lease | None:
        for i, (start, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (start + need, length - need)
                self._generation += 1
                lease = Lease(
                    start,
                    need,
                    self._generation,
                    self._layout(start, item_sizes),
                    collections.Counter(holders),
                    tag,
                    time.monotonic(),
                )
                self._live[start] = lease
                self._in_use += need
                self._peak = max(self._peak, self._in_use)
                self._total += 1
                return lease
        return None

    # -- reuse by digest --------------------------------------------------------------

    def index(self, lease: Lease, digests: dict[str, int]) -> None:
        """Record the digests of a published lease's payloads (digest -> slot number); a
        digest already recorded keeps its first slot."""
        with self._lock:
            if self._live.get(lease.start) is not lease:
                return
            for digest, k in digests.items():
                if digest not in self._by_digest:
                    self._by_digest[digest] = (lease.start, k)
                    lease.digests[digest] = k

    def locate(self, digest: str) -> int | None:
        """The start of the live or retained lease holding a payload with this digest."""
        with self._lock:
            where = self._by_digest.get(digest)
            return None if where is None else where[0]

    def claim(self, digest: str, holders: Iterable[int]) -> tuple[Lease, int, int] | None:
        """The lease, offset and length of a resident payload with this digest, after
        giving each holder one more reference to its lease; ``None`` if none is resident."""
        with self._lock:
            where = self._by_digest.get(digest)
            if where is None:
                return None
            start, k = where
            lease = self._live.get(start)
            if lease is None:
                lease = self._retained.pop(start)
                self._retained_bytes -= lease.length
                self._live[start] = lease
                self._in_use += lease.length
                self._peak = max(self._peak, self._in_use)
            lease.pending.update(holders)
            lease.since = time.monotonic()
            off, n = lease.slots[k]
            self._reused += 1
            self._reused_bytes += n
            return lease, off, n

    def allocate(
        self,
        item_sizes: list[int],
        holders: set[int],
        timeout: float,
        drain: Callable[[float], None] | None = None,
        tag: str = "",
    ) -> Lease:
        """Like :meth:`try_allocate`, waiting up to ``timeout`` s for releases; ``ArenaFull`` after.

        A request larger than the whole arena fails at once: no release can make room.
        ``drain`` (a callable taking a timeout) is called while waiting so the caller can
        process release messages that arrive on its own sockets.
        """
        need = lease_size(item_sizes)
        if need > self.capacity:
            raise ArenaFull(
                f"request needs {need} bytes; the arena holds at most {self.capacity} "
                f"(`arena_size` {self.size}); raise `arena_size` or split the request"
            )
        lease = self.try_allocate(item_sizes, holders, tag)
        if lease is not None:
            return lease
        with self._lock:
            self._waiting += 1
        try:
            return self._wait_for_room(item_sizes, holders, timeout, drain, tag, need)
        finally:
            with self._lock:
                self._waiting -= 1

    def _wait_for_room(
        self,
        item_sizes: list[int],
        holders: set[int],
        timeout: float,
        drain: Callable[[float], None] | None,
        tag: str,
        need: int,
    ) -> Lease:
        deadline = time.monotonic() + timeout
        while True:
            lease = self.try_allocate(item_sizes, holders, tag)
            if lease is not None:
                return lease
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                st = self.statistics()
                free = self.size - ARENA_HEADER - st.bytes_in_use
                raise ArenaFull(
                    f"request needs {need} bytes; arena has {free} of {self.size} bytes free "
                    f"({st.leases_outstanding} leases awaiting release) after waiting "
                    f"{timeout:.3g} s; "
                    "raise `arena_size`, release leases sooner, or use on_full='inline'"
                )
            if drain is not None:
                drain(min(remaining, 0.05))
            else:
                with self._lock:
                    self._lock.wait(min(remaining, 0.05))

    def _layout(self, start: int, item_sizes: list[int]) -> list[tuple[int, int]]:
        pos = LEASE_HEADER + _SLOT_FMT.size * len(item_sizes)
        slots = []
        for n in item_sizes:
            pos = _align(pos, item_alignment(n))
            slots.append((start + pos, n))
            pos += n
        return slots

    def publish(self, lease: Lease) -> None:
        """Write the lease's layout table and header once its payloads are in place."""
        for k, (off, n) in enumerate(lease.slots):
            _SLOT_FMT.pack_into(self.view, lease.start + LEASE_HEADER + k * _SLOT_FMT.size, off, n)
        # ORDER: the generation is written last. A consumer validates a reference against it;
        # writing it before the payloads would let an open succeed on half-written bytes.
        _LEASE_FMT.pack_into(
            self.view, lease.start, LEASE_MAGIC, lease.generation, lease.length, len(lease.slots), 0
        )

    # -- release ----------------------------------------------------------------------

    def release(self, start: int, generation: int, holder: int) -> bool:
        """Take one of ``holder``'s references to a lease; the lease is retained or freed
        when none remain.

        Returns whether the release matched a live lease (stale, duplicate or foreign ones
        are ignored and change nothing).
        """
        with self._lock:
            lease = self._live.get(start)
            if lease is None or lease.generation != generation or holder not in lease.pending:
                return False
            lease.pending[holder] -= 1
            if lease.pending[holder] <= 0:
                del lease.pending[holder]
            if not lease.pending:
                self._unheld(lease)
            return True

    def release_holder(self, holder: int) -> int:
        """Release everything ``holder`` still holds (its member ended); returns how many
        leases it held."""
        with self._lock:
            held = [lease for lease in self._live.values() if holder in lease.pending]
            for lease in held:
                del lease.pending[holder]
                if not lease.pending:
                    self._unheld(lease)
            return len(held)

    def release_all(self, start: int, generation: int) -> None:
        """Free a lease whatever its pending set (a publish that failed after allocating)."""
        with self._lock:
            lease = self._live.get(start)
            if lease is not None and lease.generation == generation:
                lease.pending.clear()
                self._free_lease(lease)

    def overdue(self, older_than: float) -> list[Lease]:
        """Live leases allocated more than ``older_than`` seconds ago (a snapshot)."""
        cutoff = time.monotonic() - older_than
        with self._lock:
            return [lease for lease in self._live.values() if lease.since < cutoff]

    def _unheld(self, lease: Lease) -> None:
        """A live lease that no holder references any more: retained or freed."""
        if self.retain and lease.digests and not self.closed:
            del self._live[lease.start]
            self._in_use -= lease.length
            self._retained[lease.start] = lease
            self._retained_bytes += lease.length
            self._lock.notify_all()
        else:
            self._free_lease(lease)

    def _forget(self, lease: Lease) -> None:
        for digest in lease.digests:
            self._by_digest.pop(digest, None)
        lease.digests.clear()

    def _free_lease(self, lease: Lease) -> None:
        del self._live[lease.start]
        self._in_use -= lease.length
        self._forget(lease)
        self._to_free_list(lease)

    def _to_free_list(self, lease: Lease) -> None:
        # ORDER: zero the generation before the range can be reallocated, so a stale
        # reference fails its generation check instead of reading the next request's bytes.
        _LEASE_FMT.pack_into(self.view, lease.start, LEASE_MAGIC, 0, lease.length, 0, 0)
        self._insert_free(lease.start, lease.length)
        self._lock.notify_all()

    def _insert_free(self, start: int, length: int) -> None:
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < start:
            i += 1
        free.insert(i, (start, length))
        if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
            free[i] = (free[i][0], free[i][1] + free[i + 1][1])
            del free[i + 1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
            del free[i]

    def statistics(self) -> ArenaStatistics:
        """A consistent snapshot of the arena's use."""
        with self._lock:
            return ArenaStatistics(
                size=self.size,
                bytes_in_use=self._in_use,
                peak_bytes=self._peak,
                leases_outstanding=len(self._live),
                leases_total=self._total,
                bytes_retained=self._retained_bytes,
                leases_retained=len(self._retained),
                payloads_reused=self._reused,
                bytes_reused=self._reused_bytes,
                waiting_for_room=self._waiting,
            )

    def close(self) -> None:
        """Drop the producer's fd and mapping (idempotent). Consumers keep their own mappings."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self.view.release()
        try:
            self._map.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when that view does
        os.close(self.fd)
        os.close(self.readonly_fd)


def _seal(fd: int) -> bool:
    """Seal the memfd's size, and its future writes where the kernel can; whether it could."""
    fixed = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fixed | _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        return True
    except OSError:  # a kernel before 5.1: the size seals still hold, writes rest on the fd
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fixed | fcntl.F_SEAL_SEAL)
        return False


def read_lease_header(buf: memoryview, start: int) -> tuple[bytes, int, int, int]:
    """``(magic, generation, length, item count)`` of the lease at ``start``."""
    magic, gen, length, n, _ = _LEASE_FMT.unpack_from(buf, start)
    return magic, gen, length, n
