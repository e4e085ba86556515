"""Device pools of the GPU backends: one allocation per producer, exported once.

Layout
------
::

    [ready: u32 x slots][ack: u32 x slots x max_ranks]  control, padded to 2 MiB
    [data ...]                                          item bytes, 256-byte aligned

States
------
A slot is *free*, or *in use* by one item with a generation and a consumer set (the
owner ranks named in its envelope, never the world size).

Transitions
-----------
* producer stream: copy the item into its bytes, then ``ready[slot] = gen``
  (``cuStreamWriteValue32``, which fences the copy before the write);
* consumer stream: ``cuStreamWaitValue32(ready[slot] >= gen)``, its reads, then
  ``ack[slot][rank] = gen`` once those reads are done (stream order);
* producer host, when it needs room (or on ``reclaim()``): one device-to-host copy of the
  whole ack table, then every slot whose consumers all acked ``gen`` (or died) is freed.

Invariants
----------
No host synchronisation on either hot path (the recycler's one small copy waits only for
itself, on a private stream). A slot's bytes are rewritten only after every consumer in
its set acknowledged. One export per pool, one import per consumer process. A reference's
bounds are checked on the host; its generation only by the GPU wait (``>=``, cyclic): a
stale one passes at once (the slot cannot be reused before this rank acknowledges it),
a forged future one would stall this rank's stream, so references must come from the
producer's channel (joined with a handover token, or CURVE).

Lifetime
--------
The producer frees the pool at ``close()``; importers unmap theirs at their ``close()``.
A dead consumer's slots are freed when its handover connection closes.
"""

from __future__ import annotations

import os
import uuid
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np

if TYPE_CHECKING:
    import torch

from ._cuda import call, context_for, driver, tensor_at
from .errors import BackendUnavailable, OffsetError

__all__ = ["DevicePool", "PoolFull", "PoolMapping", "PoolOffer", "fabric_permitted"]

CONTROL_ALIGN = 2 << 20
DATA_ALIGN = 256
PoolKind = Literal["cuda_ipc", "fabric", "posix_fd"]


class PoolFull(Exception):
    """No room in the device pool for an item even after reclaiming (internal signal)."""


class PoolOffer(msgspec.Struct, frozen=True, kw_only=True):
    """What a consumer needs to import a pool; travels once, in the handover."""

    pool_id: str
    kind: PoolKind
    size: int
    slots: int
    max_ranks: int
    data_offset: int
    handle: bytes | None = None
    """The 64-byte IPC or FABRIC handle; ``None`` for ``posix_fd`` (the fd rides SCM_RIGHTS)."""


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def _vmm_prop(index: int, handle_type: Any) -> Any:
    drv = driver()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = index
    prop.requestedHandleTypes = handle_type
    return prop


def _granularity(prop: Any) -> int:
    drv = driver()
    flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(call("cuMemGetAllocationGranularity", prop, flag))


def _map(handle: Any, size: int, index: int, granularity: int) -> int:
    """Reserve a VA range, map ``handle`` there and make it read/write for device ``index``."""
    drv = driver()
    va = int(call("cuMemAddressReserve", size, granularity, 0, 0))
    call("cuMemMap", va, size, 0, handle, 0)
    access = drv.CUmemAccessDesc()
    access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = index
    access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    call("cuMemSetAccess", va, size, [access], 1)
    return va


_FABRIC: dict[int, bool] = {}


def fabric_permitted(device: torch.device) -> bool:
    """Whether this process may allocate memory with FABRIC handles on ``device``.

    Probed by allocating (the device attribute can say yes while the driver refuses
    without an IMEX channel); cached per device.
    """
    index = context_for(device)
    if index not in _FABRIC:
        drv = driver()
        fabric = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
        try:
            prop = _vmm_prop(index, fabric)
            handle = call("cuMemCreate", _granularity(prop), prop, 0)
            call("cuMemRelease", handle)
            _FABRIC[index] = True
        except BackendUnavailable:
            _FABRIC[index] = False
    return _FABRIC[index]


@dataclass
class _Entry:
    offset: int
    length: int
    generation: int
    consumers: frozenset[int]
    dead: set[int] = field(default_factory=set)


_LOCAL: weakref.WeakValueDictionary[str, DevicePool] = weakref.WeakValueDictionary()


class DevicePool:
    """The producer's pool on one device.

    Args:
        device: the CUDA device holding the pool.
        size: data bytes (the control table comes on top).
        kind: ``"cuda_ipc"`` (``cuMemAlloc`` + a legacy IPC handle) or ``"fabric"`` (a VMM
            allocation with a FABRIC handle when the driver permits one, else a POSIX fd).
        slots: items in flight at most; max_ranks: consumer ranks 0 .. max_ranks-1.
    """

    def __init__(
        self,
        device: torch.device,
        size: int,
        *,
        kind: Literal["cuda_ipc", "fabric"] = "cuda_ipc",
        slots: int = 1024,
        max_ranks: int = 64,
    ) -> None:
        import torch

        drv = driver()
        self.index = context_for(device)
        self.device = torch.device("cuda", self.index)
        self.slots, self.max_ranks = slots, max_ranks
        control = _round_up(4 * slots * (1 + max_ranks), CONTROL_ALIGN)
        self.data_offset = control
        total = control + _round_up(size, CONTROL_ALIGN)
        self._fd: int | None = None
        self._vmm: tuple[Any, int] | None = None
        handle: bytes | None = None
        if kind == "cuda_ipc":
            self.kind: PoolKind = "cuda_ipc"
            self.base = int(call("cuMemAlloc", total))
            handle = bytes(call("cuIpcGetMemHandle", self.base).reserved)
        else:
            types = drv.CUmemAllocationHandleType
            fabric = fabric_permitted(self.device)
            self.kind = "fabric" if fabric else "posix_fd"
            htype = (
                types.CU_MEM_HANDLE_TYPE_FABRIC
                if fabric
                else types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            )
            prop = _vmm_prop(self.index, htype)
            gran = _granularity(prop)
            total = _round_up(total, gran)
            alloc = call("cuMemCreate", total, prop, 0)
            self.base = _map(alloc, total, self.index, gran)
            self._vmm = (alloc, gran)
            exported = call("cuMemExportToShareableHandle", alloc, htype, 0)
            if fabric:
                handle = bytes(exported.data)
            else:
                self._fd = int(exported)
        self.size = total
        self.reason = (
            "cuda_ipc requested"
            if kind == "cuda_ipc"
            else "FABRIC handles permitted"
            if self.kind == "fabric"
            else "FABRIC allocation refused by the driver: POSIX fd handles on this host"
        )
        call("cuMemsetD32", self.base, 0, control // 4)  # all slots free: ready = ack = 0
        call("cuCtxSynchronize")  # once, at creation
        self.id = uuid.uuid4().hex
        self.offer = PoolOffer(
            pool_id=self.id,
            kind=self.kind,
            size=self.size,
            slots=slots,
            max_ranks=max_ranks,
            data_offset=self.data_offset,
            handle=handle,
        )
        self._free: list[tuple[int, int]] = [(0, self.size - self.data_offset)]
        self._free_slots = list(range(slots - 1, -1, -1))
        self._used: dict[int, _Entry] = {}
        self._generation = 0
        self._acks = torch.empty(slots * max_ranks, dtype=torch.int32, pin_memory=True)
        self._stream = call("cuStreamCreate", 1)  # CU_STREAM_NON_BLOCKING, for the recycler
        self.reclaims = 0
        self.closed = False
        _LOCAL[self.id] = self

    @property
    def fd(self) -> int | None:
        """The POSIX fd to hand over (``posix_fd`` pools only)."""
        return self._fd

    @property
    def bytes_in_use(self) -> int:
        """Data bytes held by items not yet acknowledged by all their consumers."""
        return sum(_round_up(e.length, DATA_ALIGN) for e in self._used.values())

    @property
    def items_in_use(self) -> int:
        """Slots held by items not yet acknowledged by all their consumers."""
        return len(self._used)

    def ready_address(self, slot: int) -> int:
        return self.base + 4 * slot

    def _alloc(self, n: int) -> int | None:
        need = _round_up(max(n, 1), DATA_ALIGN)
        for k, (start, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[k]
                else:
                    self._free[k] = (start + need, length - need)
                return start
        return None

    def _release(self, slot: int) -> None:
        e = self._used.pop(slot)
        self._free_slots.append(slot)
        self._free.append((e.offset, _round_up(max(e.length, 1), DATA_ALIGN)))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged

    def place(self, tensor: torch.Tensor, consumers: frozenset[int]) -> tuple[int, int, int]:
        """Copy ``tensor`` into the pool on the current stream: ``(slot, offset, generation)``.

        Raises ``PoolFull`` when there is no room even after one reclaim.
        """
        import torch

        if any(not 0 <= r < self.max_ranks for r in consumers):
            raise ValueError(f"consumer ranks must be in 0..{self.max_ranks - 1}")
        src = tensor.contiguous()
        n = src.numel() * src.element_size()
        offset = self._alloc(n) if self._free_slots else None
        if offset is None:
            self.reclaim()
            offset = self._alloc(n) if self._free_slots else None
            if offset is None:
                raise PoolFull(f"device pool full: {n} bytes wanted, {self.bytes_in_use} in use")
        slot = self._free_slots.pop()
        self._generation = self._generation % 0xFFFFFFFF + 1  # 1 .. 2^32-1; 0 means never
        gen = self._generation
        self._used[slot] = _Entry(offset, n, gen, consumers)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        call("cuMemcpyDtoDAsync", self.base + self.data_offset + offset, src.data_ptr(), n, stream)
        call("cuStreamWriteValue32", stream, self.ready_address(slot), gen, 0)
        if src.data_ptr() != tensor.data_ptr():  # a temporary: keep it until the copy ran
            src.record_stream(torch.cuda.current_stream(self.device))
        return slot, offset, gen

    def forget(self, slot: int) -> None:
        """Free a slot no consumer was told about (a publish that failed midway)."""
        if slot in self._used:
            self._release(slot)

    def reclaim(self) -> int:
        """One batched check of the acks: frees every fully acknowledged slot; how many."""
        if not self._used:
            return 0
        self.reclaims += 1
        acks_at = self.base + 4 * self.slots
        call(
            "cuMemcpyDtoHAsync",
            self._acks.data_ptr(),
            acks_at,
            self._acks.numel() * 4,
            self._stream,
        )
        call("cuStreamSynchronize", self._stream)
        acks = self._acks.numpy().view(np.uint32).reshape(self.slots, self.max_ranks)
        done = [
            slot
            for slot, e in self._used.items()
            if all(r in e.dead or int(acks[slot, r]) == e.generation for r in e.consumers)
        ]
        for slot in done:
            self._release(slot)
        return len(done)

    def rank_gone(self, rank: int) -> None:
        """A consumer died: it will never acknowledge its slots, so stop waiting for it."""
        for e in self._used.values():
            if rank in e.consumers:
                e.dead.add(rank)

    def close(self) -> None:
        """Free the pool (after this process's work on it finished). Idempotent."""
        if self.closed:
            return
        self.closed = True
        _LOCAL.pop(self.id, None)
        call("cuCtxSynchronize")
        call("cuStreamDestroy", self._stream)
        if self._vmm is None:
            call("cuMemFree", self.base)
        else:
            alloc, _ = self._vmm
            call("cuMemUnmap", self.base, self.size)
            call("cuMemAddressFree", self.base, self.size)
            call("cuMemRelease", alloc)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class PoolMapping:
    """A consumer's import of one producer pool, on the consumer's own device.

    In the producer's own process it short-circuits to the pool's pointer (CUDA refuses
    to open an IPC handle in the exporting process).
    """

    def __init__(self, offer: PoolOffer, fd: int | None, device: torch.device) -> None:
        import torch

        drv = driver()
        self.offer = offer
        self.index = context_for(device)
        self.device = torch.device("cuda", self.index)
        self._ipc = False
        self._vmm: tuple[Any, int] | None = None
        self._data: torch.Tensor | None = None
        local = _LOCAL.get(offer.pool_id)
        if local is not None:
            self.base = local.base
            self._local: DevicePool | None = local
            if fd is not None:
                os.close(fd)
            return
        self._local = None
        if offer.kind == "cuda_ipc":
            if offer.handle is None:
                raise BackendUnavailable("a cuda_ipc pool offer came without its handle")
            handle = drv.CUipcMemHandle()
            handle.reserved = offer.handle
            flag = int(drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            self.base = int(call("cuIpcOpenMemHandle", handle, flag))
            self._ipc = True
            return
        types = drv.CUmemAllocationHandleType
        if offer.kind == "posix_fd":
            if fd is None:
                raise BackendUnavailable("a posix_fd pool offer came without its fd")
            try:
                alloc = call(
                    "cuMemImportFromShareableHandle",
                    fd,
                    types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            finally:
                os.close(fd)
            htype = types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        else:
            fabric = drv.CUmemFabricHandle()
            fabric.data = offer.handle
            alloc = call("cuMemImportFromShareableHandle", fabric, types.CU_MEM_HANDLE_TYPE_FABRIC)
            htype = types.CU_MEM_HANDLE_TYPE_FABRIC
        gran = _granularity(_vmm_prop(self.index, htype))
        self.base = _map(alloc, offer.size, self.index, gran)
        self._vmm = (alloc, gran)

    def check(self, slot: int, offset: int, length: int, rank: int, where: str) -> None:
        """Bounds of a reference against the offer; raises ``OffsetError``."""
        o = self.offer
        if not 0 <= slot < o.slots or not 0 <= rank < o.max_ranks:
            raise OffsetError(f"slot {slot} / rank {rank} of {where} is outside the pool table")
        if offset < 0 or length < 1 or offset + length > o.size - o.data_offset:
            raise OffsetError(
                f"range [{offset}, {offset + length}) of {where} is outside the pool's "
                f"{o.size - o.data_offset} data bytes"
            )

    def wait_ready(self, slot: int, generation: int) -> None:
        """Make the current stream wait until the producer's copy for ``generation`` landed."""
        import torch

        geq = int(driver().CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        call("cuStreamWaitValue32", stream, self.base + 4 * slot, generation, geq)

    def acknowledge(self, slot: int, rank: int, generation: int) -> None:
        """After this stream's reads so far, tell the producer the slot is free for ``rank``."""
        import torch

        stream = torch.cuda.current_stream(self.device).cuda_stream
        address = self.base + 4 * (self.offer.slots + slot * self.offer.max_ranks + rank)
        call("cuStreamWriteValue32", stream, address, generation, 0)

    def tensor(
        self, offset: int, length: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """A zero-copy view of bytes ``[offset, offset+length)`` of the data region: a
        slice of one tensor over the whole region, made at the first open (a tensor made
        from a pointer costs tens of µs a time; a slice a few)."""
        import torch

        data = self._data
        if data is None:
            size = self.offer.size - self.offer.data_offset
            data = tensor_at(
                self.base + self.offer.data_offset, size, self, self.device, torch.uint8, (size,)
            )
            self._data = data
        if offset % dtype.itemsize:  # a dtype view needs its alignment
            return tensor_at(
                self.base + self.offer.data_offset + offset, length, self, self.device, dtype, shape
            )
        return data[offset : offset + length].view(dtype).reshape(shape)

    def close(self) -> None:
        """Unmap (idempotent); views made from this mapping must be gone."""
        self._data = None
        if self._ipc:
            self._ipc = False
            call("cuIpcCloseMemHandle", self.base)
        elif self._vmm is not None:
            alloc, _ = self._vmm
            self._vmm = None
            call("cuMemUnmap", self.base, self.offer.size)
            call("cuMemAddressFree", self.base, self.offer.size)
            call("cuMemRelease", alloc)
