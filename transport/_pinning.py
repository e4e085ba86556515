"""Page-locking the arena's mappings with ``cudaHostRegister``, once per mapping.

A registered mapping is copied to and from the GPU by DMA at PCIe speed (55 GB/s on an
H200 host); an unregistered one is staged through pageable bounce buffers. The
producer registers its writable mapping for CUDA items that travel through the host; a
consumer registers its read-only mapping for uploads (``Consumer.register_with_cuda``).
"""

from __future__ import annotations

import contextlib

from .errors import BackendUnavailable

__all__ = ["pin_host", "unpin_host"]

_PORTABLE = 0x01  # cudaHostRegisterPortable: pinned for every CUDA context of the process
_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the device only reads it (a PROT_READ mapping)


def pin_host(address: int, size: int, *, read_only: bool) -> None:
    """Register ``size`` bytes at ``address`` with CUDA; ``BackendUnavailable`` without a
    GPU or when the driver refuses."""
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailable("registering host memory needs a CUDA device; none is visible")
    flags = _PORTABLE | (_READ_ONLY if read_only else 0)
    err = torch.cuda.cudart().cudaHostRegister(address, size, flags)  # type: ignore[no-untyped-call]
    if int(err) != 0:
        raise BackendUnavailable(f"cudaHostRegister of the arena failed with error {int(err)}")


def unpin_host(address: int) -> None:
    """Undo :func:`pin_host` (before the mapping is unmapped); errors are ignored, as at
    interpreter exit the CUDA runtime may already be gone."""
    import torch

    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]
