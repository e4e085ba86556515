"""Loading ``pixels.cu`` with CuPy and launching it on torch's current stream.

The module is compiled once per process, device, patch size and output layout (CuPy also
caches the binary on disk), with the flags of ``compile_options``: a module for one patch
size has it as a constant (``MMWIRE_PATCH``), so its divisions by it become multiplies; its
layout (``MMWIRE_MERGE``, ``MMWIRE_TEMPORAL``) is constant too, so Kimi's rows cost nothing
for Qwen's. Buffers are torch tensors, passed as raw device pointers, and the launches go on
``torch.cuda.current_stream()`` so they order with the caller's torch work and need no
synchronisation.
"""

from __future__ import annotations

import ctypes
import re
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from mmwire.transport.errors import BackendUnavailable

from ._abi import KIMI_LAYOUT, KINDS, Kind, OutputLayout, compile_options

__all__ = ["SOURCE", "CupyLauncher", "Launcher", "kernel_source"]

SOURCE = Path(__file__).with_name("pixels.cu")
"""The kernels' main file; it includes the ``.cuh`` headers beside it."""
_INCLUDE = re.compile(r'^#include "([\w.]+)"\n', re.M)
_FUSED = {
    (bits, ch, kind): f"fused<{t}, {ch}, {code}>"
    for bits, t in ((32, "unsigned int"), (16, "unsigned short"))
    for ch in (1, 3, 4)
    for kind, code in KINDS.items()
}

Dims = tuple[int, int]


def kernel_source() -> str:
    """``pixels.cu`` with its headers inlined, each once: the one text NVRTC compiles (and
    CuPy's cache keys on, so an edited header compiles anew)."""
    seen: set[str] = set()

    def inline(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (SOURCE.parent / name).read_text().replace("#pragma once\n", "")
        return _INCLUDE.sub(lambda m: inline(m.group(1)), text)

    return inline(SOURCE.name)


class Launcher(Protocol):
    """Runs the kernels of ``pixels.cu`` over flat buffers, on a 2-D grid of 2-D blocks."""

    @property
    def tensor_cores(self) -> bool:
        """Whether the fused kernel's MMA kind runs here (compute capability 8.0 or more)."""

    @property
    def affine_normalise(self) -> bool:
        """Whether bf16 and fp16 launches compute the normalise step where the host proved
        its affine form equal to the table (``_affine``); False: they read the tables."""

    def pass1(
        self,
        grid: Dims,
        block: Dims,
        src: torch.Tensor,
        mid: torch.Tensor,
        desc: torch.Tensor,
        tab: torch.Tensor,
        n_images: int,
    ) -> None:
        """The first of two passes, into the uint8 intermediate."""

    def pass2(
        self,
        grid: Dims,
        block: Dims,
        src: torch.Tensor,
        mid: torch.Tensor,
        desc: torch.Tensor,
        tab: torch.Tensor,
        dst: torch.Tensor,
        n_images: int,
    ) -> None:
        """The last pass into uint8 HWC images (the resize alone)."""

    def fused(
        self,
        bits: int,
        channels: int,
        kind: Kind,
        grid: Dims,
        block: Dims,
        smem: int,
        src: torch.Tensor,
        mid: torch.Tensor,
        desc: torch.Tensor,
        tab: torch.Tensor,
        table: torch.Tensor,
        tiles: torch.Tensor,
        out: torch.Tensor,
        patch: int,
        first_tile: int,
        overlap: bool = False,
        layout: OutputLayout = KIMI_LAYOUT,
    ) -> None:
        """Resize (or its last pass), composite, pad, normalise and patchify, per tile, for
        the tiles ``first_tile ..`` of images with ``channels`` channels and ``kind``
        (``Layout.tile_groups``). ``tiles``: each tile's image (``Layout.tile_image``), or
        for the MMA, plain and mixed kinds this launch's tile records (its rows of
        ``Layout.tile_records``).
        ``overlap``: this launch follows another fused launch of the same call, and may
        start while that one finishes (the kernel orders its end after that one's).
        ``layout``: how the rows are written (a module is compiled for each)."""


ModuleKey = tuple[int, OutputLayout]
"""A module's patch size (0: any) and output layout."""


def import_cupy() -> Any:
    """CuPy, which compiles and launches every kernel module; ``BackendUnavailable`` saying
    which extra installs it where it is missing."""
    try:
        import cupy
    except ImportError as e:
        raise BackendUnavailable(
            "the CUDA kernels need CuPy: install mmwire[cuda12] or mmwire[cuda13]"
        ) from e
    return cupy


@cache
def _module(device_index: int, key: ModuleKey = (0, KIMI_LAYOUT)) -> Any:
    """``pixels.cu`` compiled for one device and output layout; for one patch size, or any
    (patch 0)."""
    cupy = import_cupy()
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(
            code=kernel_source(),
            options=("-std=c++17", *compile_options(*key)),
            name_expressions=tuple(_FUSED.values()),
        )
        module.compile()
    return module


class _StreamRef:
    """A torch stream handle in the CUDA stream protocol (what CuPy >= 14 takes)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def _cupy_stream(handle: int, device_index: int) -> Any:
    import cupy

    if hasattr(cupy.cuda.Stream, "from_external"):
        return cupy.cuda.Stream.from_external(_StreamRef(handle))
    return cupy.cuda.ExternalStream(handle, device_index)  # CuPy 13


class CupyLauncher:
    """Launches on one CUDA device, on torch's current stream for that device.

    Buffers go to the kernels as raw device pointers of torch tensors (no wrapper object
    per call); the CuPy stream wrapping each torch stream is made once and kept. A module
    is compiled for each patch size the fused launches use: those of ``patches`` up front
    (Kimi's 14 by default, so a serving process pays the compile at start, not on its first
    batch), any other at its first launch. The resize-only launches take the first module
    compiled.

    ``patch_modules``: False runs every patch size through one module that takes it as an
    argument (the same bytes; to compare the two). ``affine_normalise``: False makes bf16
    and fp16 launches read the normalise tables as fp32 does (the same bytes). Modules for
    other output layouts (Qwen-VL's rows) compile at their first launch, or up front with
    :meth:`compile`.
    """

    def __init__(
        self,
        device: torch.device,
        patches: tuple[int, ...] = (14,),
        *,
        patch_modules: bool = True,
        affine_normalise: bool = True,
    ) -> None:
        if device.type != "cuda":
            raise BackendUnavailable(f"the CUDA kernels need a CUDA device, got {device}")
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self._index)
        self._functions: dict[tuple[str, ModuleKey], Any] = {}  # (name, module): kernel
        self._patch_modules = patch_modules
        self._affine_normalise = affine_normalise
        self._modules: list[ModuleKey] = []  # compiled here
        for patch in patches or (0,):
            self.compile(patch)
        self._streams: dict[int, Any] = {}
        # what each kernel may take now, once asked
        self._dynamic_smem: dict[tuple[str, ModuleKey], int] = {}
        capability = torch.cuda.get_device_capability(self._index)
        self._tensor_cores = capability >= (8, 0)
        self._overlap = capability >= (9, 0) and _launch_ex() is not None

    def compile(self, patch: int, layout: OutputLayout = KIMI_LAYOUT) -> None:
        """Compile (or load from CuPy's cache) the module for ``patch`` and ``layout`` now,
        rather than at its first launch."""
        key = (patch if self._patch_modules else 0, layout)
        _module(self._index, key)
        if key not in self._modules:
            self._modules.append(key)

    @property
    def tensor_cores(self) -> bool:
        return self._tensor_cores

    @property
    def affine_normalise(self) -> bool:
        return self._affine_normalise

    def _function(self, name: str, module: ModuleKey | None) -> tuple[Any, tuple[str, ModuleKey]]:
        """The kernel ``name`` from the module for ``module`` (None: the first compiled
        here)."""
        if module is None:
            module = self._modules[0]
        elif not self._patch_modules:
            module = (0, module[1])
        key = (name, module)
        fn = self._functions.get(key)
        if fn is None:
            fn = self._functions[key] = _module(self._index, module).get_function(name)
            if module not in self._modules:
                self._modules.append(module)
        return fn, key

    def _launch(
        self,
        name: str,
        grid: Dims,
        block: Dims,
        args: tuple[Any, ...],
        smem: int = 0,
        overlap: bool = False,
        module: ModuleKey | None = None,
    ) -> None:
        if grid[0] <= 0 or grid[1] <= 0:
            return
        for a in args:
            if isinstance(a, torch.Tensor) and a.device != self.device:
                raise ValueError(f"a kernel buffer is on {a.device}, the launcher on {self.device}")
        import cupy

        handle = torch.cuda.current_stream(self.device).cuda_stream
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = _cupy_stream(handle, self._index)
        with cupy.cuda.Device(self._index), stream:
            fn, key = self._function(name, module)
            # opt in past what the kernel may take: 48 KiB less its own static arrays, so
            # a launch can need it with less than 48 KiB of dynamic shared memory
            allowed = self._dynamic_smem.get(key)
            if allowed is None:
                allowed = self._dynamic_smem[key] = fn.max_dynamic_shared_size_bytes
            if smem > allowed:
                fn.max_dynamic_shared_size_bytes = smem
                self._dynamic_smem[key] = smem
            if overlap:
                _launch_overlapping(fn, grid, block, args, smem, handle)
            else:
                fn(grid, block, tuple(_arg(a) for a in args), shared_mem=smem)

    def pass1(
        self,
        grid: Dims,
        block: Dims,
        src: torch.Tensor,
        mid: torch.Tensor,
        desc: torch.Tensor,
        tab: torch.Tensor,
        n_images: int,
    ) -> None:
        self._launch("resize_pass1", grid, block, (src, mid, desc, tab, np.int32(n_images)))

    def pass2(
        self,
        grid: Dims,
        block: Dims,
        src: torch.Tensor,
        mid: torch.Tensor,
        desc: torch.Tensor,
        tab: torch.Tensor,
        dst: torch.Tensor,
        n_images: int,
    ) -> None:
        self._launch("resize_pass2", grid, block, (src, mid, desc, tab, dst, np.int32(n_images)))

    def fused(
        self,
        bits: int,
        channels: int,
        kind: Kind,
        grid: Dims,
        block: Dims,
        smem: int,
        src: torch.Tensor,
        mid: torch.Tensor,
        desc: torch.Tensor,
        tab: torch.Tensor,
        table: torch.Tensor,
        tiles: torch.Tensor,
        out: torch.Tensor,
        patch: int,
        first_tile: int,
        overlap: bool = False,
        layout: OutputLayout = KIMI_LAYOUT,
    ) -> None:
        overlap = overlap and self._overlap
        ints = (np.int32(patch), np.int32(first_tile), np.int32(overlap))
        args = (src, mid, desc, tab, table, tiles, out, *ints)
        name = _FUSED[bits, channels, kind]
        self._launch(name, grid, block, args, smem, overlap, (patch, layout))


@cache
def _launch_ex() -> Any:
    """``cuLaunchKernelEx`` and its types from cuda-bindings, or None without them (CuPy
    launches take no attributes)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    return driver, attr


def _launch_overlapping(
    fn: Any, grid: Dims, block: Dims, args: tuple[Any, ...], smem: int, stream: int
) -> None:
    """Launch ``fn`` with programmatic stream serialization (compute capability 9.0): its
    blocks may start once every block of the launch before it on ``stream`` has started
    and let it (``let_next_launch_start`` in ``pixels.cu``)."""
    driver, attr = _launch_ex()
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid[0], grid[1], 1
    config.blockDimX, config.blockDimY, config.blockDimZ = block[0], block[1], 1
    config.sharedMemBytes = smem
    config.hStream = driver.CUstream(stream)
    config.attrs = [attr]
    config.numAttrs = 1
    values = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else int(a) for a in args)
    types = tuple(ctypes.c_void_p if isinstance(a, torch.Tensor) else ctypes.c_int for a in args)
    (err,) = driver.cuLaunchKernelEx(config, driver.CUfunction(fn.kernel.ptr), (values, types), 0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernelEx failed: {err}")


def _arg(a: Any) -> Any:
    """A tensor's device address as a pointer-sized scalar; numpy scalars as they are."""
    if isinstance(a, torch.Tensor):
        if not a.is_contiguous():  # the kernels index it flat
            raise ValueError("kernel buffers must be contiguous")
        return np.uint64(a.data_ptr())
    return a
