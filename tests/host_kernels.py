"""The kernels of ``kernels/pixels.cu`` built as plain C++ and run on the CPU (see
``kernel_host/shim.h``): CI checks the kernels' own index and rounding logic with ``==``
without a GPU; ``pytest -m gpu`` then checks the same cases on the device."""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from mmwire.kernels import SOURCE, compile_options
from mmwire.kernels._abi import KIMI_LAYOUT, KINDS, Kind, OutputLayout

HERE = Path(__file__).resolve().parent / "kernel_host"


def _command(patch: int, layout: OutputLayout) -> list[str]:
    """The compiler's arguments for one build, without its output."""
    return [
        "-Og",
        "-U_FORTIFY_SOURCE",  # its longjmp check refuses the fibers' jumps between stacks
        "-std=c++20",
        "-pthread",
        "-ffp-contract=off",
        "-fno-strict-aliasing",  # store_run writes two 16-bit values as one word
        "-Wall",
        "-Wno-unknown-pragmas",
        "-Werror",
        "-shared",
        "-fPIC",
        f'-DPIXELS_CU="{SOURCE}"',
        *compile_options(patch, layout),
        "-I",
        str(HERE),
        str(HERE / "driver.cpp"),
    ]


def _compiler() -> str:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("a C++ compiler is needed to run the kernels on the CPU")
    return cxx


def build(out_dir: Path, patch: int = 0, layout: OutputLayout = KIMI_LAYOUT) -> Path:
    """Compile the host build of ``pixels.cu`` into ``out_dir``, for one patch size or any
    (0) and one output layout, with the flags the library compiles the kernels with;
    returns the library path."""
    shape = f"{layout.merge}_{layout.temporal}_{layout.tile_h}x{layout.tile_w}"
    lib = out_dir / f"pixels_host_{patch}_{shape}.so"
    partial = lib.with_suffix(".partial")
    subprocess.run([_compiler(), *_command(patch, layout), "-o", str(partial)], check=True)
    partial.rename(lib)  # whole or absent, should a build be interrupted
    return lib


def shared_build(root: Path, patch: int = 0, layout: OutputLayout = KIMI_LAYOUT) -> Path:
    """``build``, once per sources, flags and compiler under ``root`` however many test
    processes ask (pytest-xdist's workers share it): a build takes 25-40 s on two cores.
    ``root`` is pytest's cache, so a later run of an unchanged tree reuses the build."""
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(f"{version}{_command(patch, layout)}".encode())
    kernels = Path(SOURCE).parent
    for source in sorted([*kernels.glob("*.cu"), *kernels.glob("*.cuh"), *HERE.iterdir()]):
        key.update(source.name.encode() + source.read_bytes())
    out = root / f"host-kernels-{key.hexdigest()[:16]}"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first asker builds; the rest wait for it
        done = next((p for p in out.iterdir() if p.suffix == ".so"), None)
        return done if done is not None else build(out, patch, layout)


def build_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the host builds live: pytest's cache, or this session's temporary root when
    the cache is off (``-p no:cacheprovider``)."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("mmwire-host-kernels"))
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _p(t: torch.Tensor) -> ctypes.c_void_p:
    assert t.device.type == "cpu" and t.is_contiguous()
    return ctypes.c_void_p(t.data_ptr())


def _dims(d: tuple[int, int]) -> ctypes.Array[ctypes.c_uint]:
    return (ctypes.c_uint * 2)(*d)


class HostLauncher:
    """A ``mmwire.kernels.Launcher`` that runs the C++ build on CPU tensors."""

    def __init__(
        self,
        lib: Path,
        block: tuple[int, int] = (5, 3),
        tensor_cores: bool = True,
        affine_normalise: bool = True,
        layout: OutputLayout = KIMI_LAYOUT,
    ) -> None:
        self._lib = ctypes.CDLL(str(lib))
        self.layout = layout
        """The output layout ``lib`` was built for: launches must ask for it."""
        self._lib.host_smem_overflows.restype = ctypes.c_ulong
        self._lib.host_misaligned_stores.restype = ctypes.c_ulong
        self.block = block
        """The fused kernel's threads per block here (whatever the caller asks)."""
        self._tensor_cores = tensor_cores
        self._affine_normalise = affine_normalise
        self.mma_block = (32, 2)
        """The MMA kind's block here: whole warps (the GPU runs eight)."""

    @property
    def tensor_cores(self) -> bool:
        return self._tensor_cores

    @property
    def affine_normalise(self) -> bool:
        return self._affine_normalise

    def pass1(
        self,
        grid: tuple[int, int],
        block: tuple[int, int],
        src: torch.Tensor,
        mid: torch.Tensor,
        desc: torch.Tensor,
        tab: torch.Tensor,
        n_images: int,
    ) -> None:
        self._lib.host_pass1(
            _dims(grid), _dims(block), _p(src), _p(mid), _p(desc), _p(tab), ctypes.c_int(n_images)
        )

    def pass2(
        self,
        grid: tuple[int, int],
        block: tuple[int, int],
        src: torch.Tensor,
        mid: torch.Tensor,
        desc: torch.Tensor,
        tab: torch.Tensor,
        dst: torch.Tensor,
        n_images: int,
    ) -> None:
        self._lib.host_pass2(
            _dims(grid),
            _dims(block),
            _p(src),
            _p(mid),
            _p(desc),
            _p(tab),
            _p(dst),
            ctypes.c_int(n_images),
        )

    def fused(
        self,
        bits: int,
        channels: int,
        kind: Kind,
        grid: tuple[int, int],
        block: tuple[int, int],
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
        assert layout == self.layout, f"a {layout} launch on a build for {self.layout}"
        # launches run one after the other here, whatever `overlap` allows (the kernel's
        # wait for the launch before is a no-op);
        # the block's threads are real threads here: a few, in a shape that does not divide
        # the patch, so every block-stride loop wraps (the GPU runs (p / 2, 256 / (p / 2)));
        # the MMA kind's warps take turns over its tasks as the GPU's eight do
        assert smem <= 160 * 1024, smem  # the shim's arena
        fn = self._lib.host_fused_u32 if bits == 32 else self._lib.host_fused_u16
        overflows = self._lib.host_smem_overflows()
        misaligned = self._lib.host_misaligned_stores()
        fn(
            _dims(grid),
            _dims(self.mma_block if kind in ("mma", "mixed") else self.block),
            _p(src),
            _p(mid),
            _p(desc),
            _p(tab),
            _p(table),
            _p(tiles),
            _p(out),
            ctypes.c_int(patch),
            ctypes.c_int(first_tile),
            ctypes.c_int(overlap),
            ctypes.c_int(channels),
            ctypes.c_int(KINDS[kind]),
            ctypes.c_uint(smem),
        )
        assert self._lib.host_smem_overflows() == overflows, "a tile outgrew its shared memory"
        assert self._lib.host_misaligned_stores() == misaligned, "a wide store off its alignment"
