"""The GPU side of a producer and of a consumer: device pools behind the cpu backend's API.

A producer made with ``device_pool=`` keeps CUDA tensors on the device: each one is copied
once into its pool (stream-ordered, see ``_device_pool.py``) and its envelope carries a
``CudaIpcRef``/``FabricRef``. Items that cannot go there (a consumer on another host, a
full pool with ``on_pool_full="cpu"``) take the host arena path instead, so the consumer
API is the same either way.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

from ._device_pool import DevicePool, PoolFull, PoolMapping, PoolOffer
from ._schema import DTYPES, CudaIpcRef, FabricRef, FeatureEnvelope
from ._select import BackendChoice, choose_backend
from ._torch import is_cuda_tensor
from .errors import ArenaFull, BackendUnavailable, StaleReference

__all__ = ["ConsumerDevice", "DevicePoolStatistics", "ProducerDevice"]

DevicePoolMode = Literal["none", "cuda_ipc", "fabric", "auto"]


@dataclass(frozen=True)
class DevicePoolStatistics:
    """A snapshot of a producer's device pool."""

    backend: str
    """``cuda_ipc``, ``fabric`` or ``posix_fd`` (a fabric pool whose driver refused FABRIC)."""
    reason: str
    """Why this backend: the ``auto`` rule's reason or the handle type probe's outcome."""
    bytes_in_use: int
    items_in_use: int
    reclaims: int
    """Batched ack checks run so far."""
    host_fallbacks: int
    """CUDA items sent through the host arena because the pool was full."""


class ProducerDevice:
    """The producer's device pool (if any) and its rules."""

    def __init__(
        self,
        mode: DevicePoolMode,
        device: torch.device | None,
        size: int,
        *,
        spans_hosts: bool,
        on_full: Literal["cpu", "wait"],
        full_timeout: float,
    ) -> None:
        self.on_full = on_full
        self.full_timeout = full_timeout
        self.host_fallbacks = 0
        self._warned = False
        self.pool: DevicePool | None = None
        if mode == "none":
            self.choice = BackendChoice("cpu", "no device pool requested")
            return
        if device is None or device.type != "cuda":
            raise BackendUnavailable(f"device_pool={mode!r} needs a CUDA `device`, got {device}")
        if mode == "auto":
            from ._device_pool import fabric_permitted

            self.choice = choose_backend(
                gpu_tensors=True,
                consumers_span_hosts=spans_hosts,
                fabric_permitted=lambda: fabric_permitted(device),
            )
        elif mode == "cuda_ipc":
            self.choice = BackendChoice("cuda_ipc", "cuda_ipc requested")
        else:
            self.choice = BackendChoice("fabric", "fabric requested")
        backend = self.choice.backend
        if backend == "cuda_ipc" or backend == "fabric":
            self.pool = DevicePool(device, size, kind=backend)

    @property
    def offer(self) -> PoolOffer | None:
        return None if self.pool is None else self.pool.offer

    @property
    def fd(self) -> int | None:
        return None if self.pool is None else self.pool.fd

    def place(
        self, data: object, consumers: Collection[int], drain: Callable[[float], None]
    ) -> tuple[CudaIpcRef | FabricRef, tuple[int, ...], str] | None:
        """Put a CUDA tensor in the pool: ``(ref, shape, dtype name)``; ``None`` means: send
        it through the host instead."""
        pool = self.pool
        if pool is None or not is_cuda_tensor(data):
            return None
        dtype = str(data.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise TypeError(f"dtype {data.dtype} cannot travel; allowed: {sorted(DTYPES)}")
        owners = frozenset(consumers)
        deadline = time.monotonic() + self.full_timeout
        while True:
            try:
                slot, offset, gen = pool.place(data, owners)
                break
            except PoolFull as e:
                if self.on_full == "cpu":
                    self._fallback()
                    return None
                if time.monotonic() > deadline:
                    raise ArenaFull(f"{e} after waiting {self.full_timeout} s") from e
                drain(0.01)  # consumer deaths, then the next reclaim
        n = data.numel() * data.element_size()
        ref: CudaIpcRef | FabricRef
        if pool.kind == "cuda_ipc":
            ref = CudaIpcRef(pool_id=pool.id, slot=slot, offset=offset, length=n, generation=gen)
        else:
            ref = FabricRef(
                pool_id=pool.id,
                slot=slot,
                offset=offset,
                length=n,
                generation=gen,
                handle=pool.offer.handle if pool.kind == "fabric" else None,
            )
        return ref, tuple(data.shape), dtype

    def _fallback(self) -> None:
        self.host_fallbacks += 1
        if not self._warned:
            self._warned = True
            warnings.warn(
                "mmwire device pool full: sending CUDA items through the host arena",
                RuntimeWarning,
                stacklevel=4,
            )

    def undo(self, refs: Collection[CudaIpcRef | FabricRef]) -> None:
        """Free the slots of a publish that failed before its envelopes went out."""
        if self.pool is not None:
            for ref in refs:
                self.pool.forget(ref.slot)

    def rank_gone(self, rank: int) -> None:
        if self.pool is not None:
            self.pool.rank_gone(rank)

    def statistics(self) -> DevicePoolStatistics | None:
        pool = self.pool
        if pool is None:
            return None
        return DevicePoolStatistics(
            backend=pool.kind,
            reason=f"{self.choice.reason}; {pool.reason}",
            bytes_in_use=pool.bytes_in_use,
            items_in_use=pool.items_in_use,
            reclaims=pool.reclaims,
            host_fallbacks=self.host_fallbacks,
        )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class ConsumerDevice:
    """A consumer's view of the producer's pool: imported on first use, on its device."""

    def __init__(
        self, offer: PoolOffer | None, fd: int | None, device: torch.device | None
    ) -> None:
        self.offer = offer
        self._fd = fd
        self.device = device
        self.mapping: PoolMapping | None = None

    def _mapped(self, where: str) -> PoolMapping:
        import torch

        if self.mapping is None:
            if self.offer is None:
                raise BackendUnavailable(
                    f"{where} lives in a device pool, and this consumer was given none "
                    "(another host, or a producer without device_pool)"
                )
            device = self.device
            if device is None:
                if not torch.cuda.is_available():
                    raise BackendUnavailable(f"{where} is on a GPU and this process sees none")
                device = torch.device("cuda", torch.cuda.current_device())
            fd, self._fd = self._fd, None
            self.mapping = PoolMapping(self.offer, fd, device)
        return self.mapping

    def check(self, env: FeatureEnvelope, rank: int) -> tuple[PoolMapping, CudaIpcRef | FabricRef]:
        """The mapping and reference of an owned device item, after the reference's checks."""
        ref = env.payload
        where = f"item {env.index.value} of request {env.request_id!r}"
        if not isinstance(ref, (CudaIpcRef, FabricRef)):
            raise TypeError(f"{where} is not in a device pool")
        mapping = self._mapped(where)
        if ref.pool_id != mapping.offer.pool_id:
            raise StaleReference(f"{where} names device pool {ref.pool_id!r}, not the imported one")
        if ref.length != env.tensor.nbytes:
            raise StaleReference(f"{where}: payload length {ref.length} != {env.tensor.nbytes}")
        mapping.check(ref.slot, ref.offset, ref.length, rank, where)
        return mapping, ref

    def close(self) -> None:
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
