"""Loading ``pixels.cu`` with CuPy and launching it on torch's current stream.

The module is compiled once per process and device (CuPy also caches the binary on
disk). Buffers are torch tensors; CuPy sees them through ``__cuda_array_interface__``
without a copy, and the launches go on ``torch.cuda.current_stream()`` so they order with
the caller's torch work and need no synchronisation.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from mmwire.transport import BackendUnavailable

__all__ = ["SOURCE", "CupyLauncher", "Launcher"]

SOURCE = Path(__file__).with_name("pixels.cu")
_FINISH = {32: "finish<unsigned int>", 16: "finish<unsigned short>"}
_BLOCK = 256


class Launcher(Protocol):
    """Runs the three kernels of ``pixels.cu`` over flat buffers (uint8 views of tensors)."""

    def pass1(
        self,
        src: torch.Tensor,
        mid: torch.Tensor,
        desc: torch.Tensor,
        tab: torch.Tensor,
        n_images: int,
        total: int,
    ) -> None:
        """The first of two passes, into the uint8 intermediate."""

    def pass2(
        self,
        src: torch.Tensor,
        mid: torch.Tensor,
        desc: torch.Tensor,
        tab: torch.Tensor,
        dst: torch.Tensor,
        n_images: int,
        total: int,
    ) -> None:
        """The last pass into uint8 HWC images (the resize alone)."""

    def finish(
        self,
        bits: int,
        src: torch.Tensor,
        mid: torch.Tensor,
        desc: torch.Tensor,
        tab: torch.Tensor,
        table: torch.Tensor,
        out: torch.Tensor,
        n_images: int,
        patch: int,
        total: int,
    ) -> None:
        """The last pass fused with composite, pad, normalise and patchify."""


@cache
def _module(device_index: int) -> Any:
    try:
        import cupy
    except ImportError as e:
        raise BackendUnavailable(
            "the CUDA kernels need CuPy: install mmwire[cuda12] or mmwire[cuda13]"
        ) from e
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(
            code=SOURCE.read_text(),
            options=("-std=c++17",),
            name_expressions=tuple(_FINISH.values()),
        )
        module.compile()
    return module


class CupyLauncher:
    """Launches on one CUDA device, on torch's current stream for that device."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise BackendUnavailable(f"the CUDA kernels need a CUDA device, got {device}")
        self.device = torch.device("cuda", device.index or 0)
        self._index = self.device.index if self.device.index is not None else 0
        self._module = _module(self._index)
        props = torch.cuda.get_device_properties(self.device)
        self._max_blocks = props.multi_processor_count * 16

    def _launch(self, name: str, total: int, args: tuple[Any, ...]) -> None:
        if total <= 0:
            return
        import cupy

        blocks = min((total + _BLOCK - 1) // _BLOCK, self._max_blocks)
        stream = torch.cuda.current_stream(self.device)
        with cupy.cuda.Device(self._index), cupy.cuda.ExternalStream(stream.cuda_stream):
            fn = self._module.get_function(name)
            fn((blocks,), (_BLOCK,), tuple(_arg(a) for a in args))

    def pass1(
        self,
        src: torch.Tensor,
        mid: torch.Tensor,
        desc: torch.Tensor,
        tab: torch.Tensor,
        n_images: int,
        total: int,
    ) -> None:
        self._launch(
            "resize_pass1", total, (src, mid, desc, tab, np.int32(n_images), np.int64(total))
        )

    def pass2(
        self,
        src: torch.Tensor,
        mid: torch.Tensor,
        desc: torch.Tensor,
        tab: torch.Tensor,
        dst: torch.Tensor,
        n_images: int,
        total: int,
    ) -> None:
        self._launch(
            "resize_pass2",
            total,
            (src, mid, desc, tab, dst, np.int32(n_images), np.int64(total)),
        )

    def finish(
        self,
        bits: int,
        src: torch.Tensor,
        mid: torch.Tensor,
        desc: torch.Tensor,
        tab: torch.Tensor,
        table: torch.Tensor,
        out: torch.Tensor,
        n_images: int,
        patch: int,
        total: int,
    ) -> None:
        self._launch(
            _FINISH[bits],
            total,
            (src, mid, desc, tab, table, out, np.int32(n_images), np.int32(patch), np.int64(total)),
        )


def _arg(a: Any) -> Any:
    """CuPy's view of a torch tensor (same memory) or the numpy scalar as it is."""
    if isinstance(a, torch.Tensor):
        import cupy

        if not a.is_contiguous():  # reshape would copy and the kernel's writes would be lost
            raise ValueError("kernel buffers must be contiguous")
        flat = a.reshape(-1)
        if flat.dtype not in (torch.uint8, torch.int32, torch.int64):
            flat = flat.view(torch.uint8)
        return cupy.asarray(flat)
    return a
