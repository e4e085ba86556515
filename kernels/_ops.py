"""The kernels' public operations: Pillow-exact resize and the whole pixel pipeline.

Images are uint8 ``(H, W, C)`` (C = 1, 3 or 4 = RGBA) or ``(H, W)`` CUDA tensors, or CuPy
arrays (taken through ``__cuda_array_interface__``, no copy). Many images of different
sizes share each launch on torch's current stream: one fused launch per channel count and
kind (unresized images go to a kernel without the resize code; on devices of compute
capability 8.0+, images resized on both axes to one whose passes run on the int8 tensor
cores, and a channel count's unresized and tensor-core tiles share one launch),
plus pass 1 for images too large to tile in shared memory; results are torch tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

import numpy as np
import torch
from mmwire.transport import PreprocessSpec

from ._abi import FUSED_THREADS, KERNEL_PROCESSORS, UNIT_BYTES, OutputLayout
from ._affine import table_rows
from ._descriptors import (
    MMA_SMEM_BYTES,
    RECORD_FIELDS,
    TILE_SMEM_BYTES,
    ImageJob,
    Kind,
    Layout,
    layout_of,
)
from ._launch import CupyLauncher, Dims, Launcher
from .reference import Normalisation, normalisation_of, rows_are_tiles

__all__ = ["output_layout", "pack", "preprocess", "preprocess_packed", "resize", "resize_packed"]

_BITS = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16}
_STORAGE = {32: torch.int32, 16: torch.int16}
_ROW_BLOCK = 128  # threads per block along an image row in the resize passes
_MAX_GRID_X = 2**31 - 1
_MMA_BLOCK = (32, FUSED_THREADS // 32)  # the MMA kind's blocks are whole warps


def _row_grid(rows: int, width: int) -> tuple[Dims, Dims]:
    """One block row per image row, column blocks across the widest image."""
    if rows > _MAX_GRID_X:
        raise ValueError(f"{rows} image rows in one launch; split the batch")
    return (rows, -(-width // _ROW_BLOCK)), (_ROW_BLOCK, 1)


Shape = tuple[int, int, int]


def _pixels(image: Any) -> torch.Tensor:
    """A uint8 ``(H, W, C)`` view of one device image (CuPy arrays are wrapped, not copied)."""
    t = image if isinstance(image, torch.Tensor) else torch.as_tensor(image)
    if t.dtype != torch.uint8:
        raise ValueError(f"pixels must be uint8, got {t.dtype}")
    if t.ndim == 2:
        t = t.unsqueeze(-1)
    if t.ndim != 3 or t.shape[2] not in (1, 3, 4) or t.shape[0] < 1 or t.shape[1] < 1:
        raise ValueError(f"pixels must be (H, W) or (H, W, C) with C in 1/3/4, got {list(t.shape)}")
    return t


def pack(images: Sequence[Any]) -> tuple[torch.Tensor, list[Shape]]:
    """Concatenate device images into one flat uint8 buffer (one copy each) and their shapes."""
    pixels = [_pixels(im) for im in images]
    if not pixels:
        raise ValueError("no images")
    device = pixels[0].device
    if any(p.device != device for p in pixels):
        raise ValueError("all images of one launch must be on the same device")
    shapes = [(int(p.shape[0]), int(p.shape[1]), int(p.shape[2])) for p in pixels]
    src = torch.empty(sum(h * w * c for h, w, c in shapes), dtype=torch.uint8, device=device)
    at = 0
    for p, (h, w, c) in zip(pixels, shapes):
        src[at : at + h * w * c].view(h, w, c).copy_(p)
        at += h * w * c
    return src, shapes


_Views = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@lru_cache(maxsize=64)
def _uploaded(layout: Layout, device: torch.device) -> tuple[_Views, Any]:
    """A layout's ``(desc, tables, grids, tile_image, tile_records)`` on ``device``: one
    pinned, stream-ordered copy of one buffer, and the event that marks it done (``None`` on
    the CPU)."""
    parts = (layout.desc, layout.grids, layout.tables, layout.tile_image, layout.tile_records)
    # each part from a multiple of 16 bytes: the MMA kernel loads its fragments and tile
    # records 16 at a time
    raw = [a.reshape(-1).view(np.uint8) for a in parts]
    starts = np.cumsum([0] + [-(-r.size // 16) * 16 for r in raw]).tolist()
    flat = np.zeros(starts[-1], np.uint8)
    for r, at in zip(raw, starts):
        flat[at : at + r.size] = r
    host = torch.from_numpy(flat)
    done = None
    if device.type != "cuda":
        buf = host.to(device)
    else:
        buf = host.pin_memory().to(device, non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(torch.cuda.current_stream(device))
    dtypes = (torch.int64, torch.int64, torch.int32, torch.int32, torch.int32)
    desc, grids, tab, tiles, records = (
        buf[at : at + r.size].view(dtype) for r, at, dtype in zip(raw, starts, dtypes)
    )
    return (desc, tab, grids.view(-1, 3), tiles, records.view(-1, len(RECORD_FIELDS))), done


def _device_layout(layout: Layout, device: torch.device) -> _Views:
    """``(desc, tables, grids, tile_image, tile_records)`` views on ``device``, ordered
    before the current stream's work."""
    views, done = _uploaded(layout, device)
    if done is not None:
        torch.cuda.current_stream(device).wait_event(done)  # on the GPU; no host wait
    return views


@lru_cache(maxsize=16)
def _default_launcher(device: torch.device) -> CupyLauncher:
    return CupyLauncher(device)


@lru_cache(maxsize=64)
def _device_tables(
    stats: tuple[Normalisation, ...],
    dtype: torch.dtype,
    device: torch.device,
    affine: bool,
) -> torch.Tensor:
    """The launch's normalise tables ``(G, NORM_STRIDE)`` as the output dtype's bit patterns,
    each with its header (``_affine.table_rows``)."""
    return table_rows(stats, dtype, affine).to(device)


def _launcher_for(device: torch.device, launcher: Launcher | None) -> Launcher:
    return launcher if launcher is not None else _default_launcher(device)


def tensor_cores(device: torch.device, launcher: Launcher | None) -> bool:
    """Whether the launches may use the MMA kind (without making the default launcher yet,
    so bad input is refused before a missing CUDA is)."""
    if launcher is not None:
        return launcher.tensor_cores
    return device.type == "cuda" and _cuda_limits(_index(device))[0]


def mma_smem(device: torch.device) -> int:
    """The MMA tiles' shared memory budget: ``MMA_SMEM_BYTES``, or less where the device
    lets a block opt in to less (the kernel's own arrays take about 4 KiB)."""
    if device.type != "cuda":
        return MMA_SMEM_BYTES
    return min(MMA_SMEM_BYTES, _cuda_limits(_index(device))[1] - 8 * 1024)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@cache
def _cuda_limits(index: int) -> tuple[bool, int]:
    """A device's tensor cores (compute capability 8.0+) and the shared memory a block may
    opt in to, asked once per process."""
    props = torch.cuda.get_device_properties(index)
    optin = int(getattr(props, "shared_memory_per_block_optin", 48 * 1024))
    return (props.major, props.minor) >= (8, 0), optin


@dataclass(frozen=True)
class _Plan:
    """What a launch over given images and specs needs from the host (cached)."""

    layout: Layout
    jobs: tuple[ImageJob, ...]
    stats: tuple[Normalisation, ...]
    """The launch's distinct normalisations: one normalise table each."""
    patch: int
    output: OutputLayout
    row_shape: tuple[int, ...]


@lru_cache(maxsize=256)
def _plan(
    shapes: tuple[Shape, ...],
    specs: tuple[PreprocessSpec, ...],
    rows: tuple[int, ...] | None,
    pillow: tuple[int, int] | None,
    tile_smem: int,
    tensor_cores: bool,
    mma_smem: int,
) -> _Plan:
    """Checks the images against their specs and lays out the launch (cached by value, so
    a repeated batch shape costs one lookup; refusals raise and are not cached)."""
    if len(shapes) != len(specs) or not specs:
        raise ValueError(f"{len(shapes)} images but {len(specs)} specs")
    sizes = {s.patch_size for s in specs}
    if len(sizes) != 1:
        raise ValueError(f"images of one launch use different patch sizes {sorted(sizes)}")
    p = sizes.pop()
    outputs = {output_layout(s) for s in specs}
    if len(outputs) != 1:
        raise ValueError(f"images of one launch use different output layouts {sorted(outputs)}")
    output = outputs.pop()
    if rows is not None and len(rows) != len(specs):
        raise ValueError(f"{len(rows)} rows for {len(specs)} images")
    stats: dict[Normalisation, int] = {}
    jobs = []
    for i, ((h, w, c), spec) in enumerate(zip(shapes, specs)):
        plan = spec.plan
        if (plan.width, plan.height) != (w, h):
            raise ValueError(f"image is {w}x{h} but its plan says {plan.width}x{plan.height}")
        key = normalisation_of(spec)
        jobs.append(
            ImageJob(
                in_w=w,
                in_h=h,
                ch=c,
                out_w=plan.new_width,
                out_h=plan.new_height,
                background=spec.background,
                grid_w=plan.grid.w,
                patches=plan.grid.patches,
                table=stats.setdefault(key, len(stats)),
                row=None if rows is None else rows[i],
            )
        )
    layout = layout_of(
        tuple(jobs), pillow, p, tile_smem, tensor_cores, mma_smem, mixed=True, merge=output.merge
    )
    return _Plan(layout, tuple(jobs), tuple(stats), p, output, specs[0].row_shape)


def output_layout(spec: PreprocessSpec) -> OutputLayout:
    """How the kernels write a spec's rows (a module is compiled for each layout)."""
    if spec.windowed:
        return OutputLayout(spec.merge_order, spec.temporal_patch_size)
    return OutputLayout()


def preprocess_packed(
    src: torch.Tensor,
    shapes: Sequence[Shape],
    specs: Sequence[PreprocessSpec],
    dtype: torch.dtype = torch.float32,
    *,
    out: torch.Tensor | None = None,
    rows: Sequence[int] | None = None,
    pillow: tuple[int, int] | None = None,
    launcher: Launcher | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pixel pipeline over images already packed in ``src`` (see :func:`pack`).

    Returns ``(pixel_values, grid_thw)``: ``(Σ patches, *row_shape)`` in ``dtype`` (the
    specs' ``row_shape``: ``(3, p, p)`` for Kimi, ``(3·T·p·p,)`` for Qwen-VL; one per
    launch) and ``(N, 3)`` int64, on ``src``'s device, equal byte for byte to the CPU path
    (``mmwire.materialize.preprocess_images``) under the same Pillow version. With ``out``
    (and optionally ``rows``, each image's first output row) the patches are written into
    ``out`` instead, so other items' rows can sit between them; ``out`` is returned.
    """
    if dtype not in _BITS:
        raise ValueError(f"output dtype must be float32, bfloat16 or float16, got {dtype}")
    if any(spec.processor not in KERNEL_PROCESSORS for spec in specs):
        raise ValueError(
            f"the kernels run the {sorted(KERNEL_PROCESSORS)} processors; "
            "materialize others on the CPU path"
        )
    if any(rows_are_tiles(spec) for spec in specs):
        raise ValueError("rows that are whole tiles (Gemma 3, InternVL): use preprocess_regions")
    plan = _plan(
        tuple((int(h), int(w), int(c)) for h, w, c in shapes),
        tuple(specs),
        None if rows is None else tuple(int(r) for r in rows),
        pillow,
        TILE_SMEM_BYTES,
        tensor_cores(src.device, launcher),
        mma_smem(src.device),
    )
    layout, jobs, p, row_shape = plan.layout, plan.jobs, plan.patch, plan.row_shape
    check_launch(src, layout, p)
    if out is None:
        out = torch.empty((layout.patches, *row_shape), dtype=dtype, device=src.device)
    else:
        _check_out(out, jobs, row_shape, dtype, src.device)  # all checked before any launch
    fuse(layout, plan.stats, p, plan.output, src, out, dtype, launcher)
    return out, grids_of(layout, src.device)


def check_launch(src: torch.Tensor, layout: Layout, p: int) -> None:
    """Refuse a source too small for ``layout`` and a launch too large for one grid."""
    _check_source(src, layout)
    if layout.tiles > _MAX_GRID_X or p > FUSED_THREADS:
        raise ValueError(f"{layout.patches} patches of {p}x{p} do not fit one launch")


def grids_of(layout: Layout, device: torch.device) -> torch.Tensor:
    """The launch's ``grid_thw`` on ``device``, the caller's own copy."""
    return _device_layout(layout, device)[2].clone()


def fuse(
    layout: Layout,
    stats: tuple[Normalisation, ...],
    p: int,
    output: OutputLayout,
    src: torch.Tensor,
    out: torch.Tensor,
    dtype: torch.dtype,
    launcher: Launcher | None,
) -> None:
    """The launches of a checked ``layout``: pass 1 where an image needs the global
    intermediate, then the fused kernel per channel count and kind, writing ``out``."""
    if src.data_ptr() % 4:  # raw MMA windows (R_RAW) read the source's rows as words
        src = src.clone()
    device = src.device
    run = _launcher_for(device, launcher)
    desc, tab, _, tiles, records = _device_layout(layout, device)
    table = _device_tables(stats, dtype, device, run.affine_normalise)
    # the global intermediate, when some image needs it (else the kernels never read it)
    mid = (
        torch.empty(layout.mid_bytes, dtype=torch.uint8, device=device) if layout.mid_bytes else src
    )
    # pass 1 only for two-pass images whose tiles do not keep the intermediate on chip
    run.pass1(*_row_grid(layout.mid_rows, layout.mid_width), src, mid, desc, tab, len(layout.desc))
    bits = _BITS[dtype]
    # per channel count and kind: the MMA (and mixed) launches first, each launch after the
    # first free to start as the one before it finishes (overlap), so the others' blocks
    # fill the multiprocessors the MMA launches' last tiles leave. An MMA, plain or mixed
    # launch reads its own tile records from its first (in the layout's group order, the
    # general tiles' left out)
    record_at, at = {}, 0
    for _, kind, first, count in layout.tile_groups:
        if kind != "general":
            record_at[first], at = at, at + count
    groups = sorted(layout.tile_groups, key=lambda g: g[1] not in ("mma", "mixed"))
    for i, (channels, kind, first, count) in enumerate(groups):
        per_tile = tiles
        if kind != "general":
            per_tile = records[record_at[first] : record_at[first] + count]
        run.fused(
            bits,
            channels,
            kind,
            (count, 1),
            _MMA_BLOCK if kind in ("mma", "mixed") else _fused_block(p),
            _smem(layout, kind, bits, channels),
            src,
            mid,
            desc,
            tab,
            table,
            per_tile,
            out.view(_STORAGE[bits]),
            p,
            first,
            overlap=i > 0,
            layout=output,
        )


def _smem(layout: Layout, kind: Kind, bits: int, channels: int) -> int:
    """A fused launch's dynamic shared memory: a mixed launch's blocks take the larger of its
    two kinds' (its gray and RGB plain tiles stage in every type)."""
    plain = layout.plain_smem_bytes if _plain_stages(bits, channels, kind) else 0
    return {
        "general": layout.smem_bytes,
        "plain": plain,
        "mma": layout.mma_smem_bytes,
        "mixed": max(layout.mma_smem_bytes, plain),
    }[kind]


def _plain_stages(bits: int, channels: int, kind: Kind) -> bool:
    """Whether a launch's plain tiles stage their pixels in shared memory (``STAGE`` in
    ``plain_tile``, ``tiles.cuh``: gray and RGB, in fp32 in a plain launch and in every type
    in a mixed one). The others read the source, so their launches ask for none."""
    return channels != 4 and (bits == 32 or kind == "mixed")


def _fused_block(p: int) -> tuple[int, int]:
    """The fused kernel's block: a thread a pixel pair of a patch row (p even), else a pixel."""
    across = p // 2 if p % 2 == 0 else p
    return across, FUSED_THREADS // across


def to_device(rows: Sequence[tuple[int, ...]], device: torch.device) -> torch.Tensor:
    """A small int64 table on ``device`` without a host sync (pinned, stream-ordered copy);
    no rows make a ``(0, 3)`` table, as a batch without images has no grids."""
    if not rows:
        return torch.empty((0, 3), dtype=torch.int64, device=device)
    t = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), -1)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def preprocess(
    images: Sequence[Any],
    specs: Sequence[PreprocessSpec],
    dtype: torch.dtype = torch.float32,
    *,
    pillow: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`preprocess_packed` for separate device images (packs them first: one copy each)."""
    src, shapes = pack(images)
    return preprocess_packed(src, shapes, specs, dtype, pillow=pillow)


def resize_packed(
    src: torch.Tensor,
    shapes: Sequence[Shape],
    sizes: Sequence[tuple[int, int]],
    *,
    pillow: tuple[int, int] | None = None,
    launcher: Launcher | None = None,
) -> list[torch.Tensor]:
    """Pillow BICUBIC resize of packed images to ``sizes`` ``(width, height)``: uint8 HWC views."""
    if len(shapes) != len(sizes) or not sizes:
        raise ValueError(f"{len(shapes)} images but {len(sizes)} sizes")
    jobs = tuple(
        ImageJob(in_w=w, in_h=h, ch=c, out_w=ow, out_h=oh)
        for (h, w, c), (ow, oh) in zip(shapes, sizes)
    )
    layout = layout_of(jobs, pillow)
    _check_source(src, layout)
    device = src.device
    run = _launcher_for(device, launcher)
    desc, tab, *_ = _device_layout(layout, device)
    mid = torch.empty(max(layout.mid_bytes, 1), dtype=torch.uint8, device=device)
    dst = torch.empty(max(layout.out_bytes, 1), dtype=torch.uint8, device=device)
    run.pass1(*_row_grid(layout.mid_rows, layout.mid_width), src, mid, desc, tab, len(layout.desc))
    run.pass2(*_row_grid(layout.out_rows, layout.out_width), src, mid, desc, tab, dst, len(jobs))
    return [
        dst[off : off + oh * ow * job.ch].view(oh, ow, job.ch)
        for off, job, (ow, oh) in zip(layout.out_offsets, jobs, sizes)
    ]


def resize(
    images: Sequence[Any],
    sizes: Sequence[tuple[int, int]],
    *,
    pillow: tuple[int, int] | None = None,
) -> list[torch.Tensor]:
    """``Image.resize(size, BICUBIC)`` of each device image, exactly, in two launches."""
    src, shapes = pack(images)
    return resize_packed(src, shapes, sizes, pillow=pillow)


def _check_out(
    out: torch.Tensor,
    jobs: Sequence[ImageJob],
    row_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    if out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(f"`out` must be a contiguous {dtype} tensor on {device}")
    if tuple(out.shape[1:]) != row_shape:
        raise ValueError(
            f"`out` must be (rows, {', '.join(map(str, row_shape))}), got {list(out.shape)}"
        )
    if out.data_ptr() % UNIT_BYTES:  # the kernels store 8 bytes at a time
        raise ValueError(f"`out` must start at a multiple of {UNIT_BYTES} bytes")
    spans, packed = [], 0
    for job in jobs:
        start = packed if job.row is None else job.row  # as layout_of places it
        packed += job.patches
        spans.append((start, start + job.patches))
    check_rows(spans, int(out.shape[0]))


def check_rows(spans: Sequence[tuple[int, int]], rows: int) -> None:
    """Refuse images' output rows ``[start, end)`` that fall outside ``rows`` or overlap."""
    for start, end in spans:
        if start < 0 or end > rows:
            raise ValueError(f"rows {start}..{end} do not fit in `out`")
    ordered = sorted(spans)
    if any(a[1] > b[0] for a, b in itertools.pairwise(ordered)):
        raise ValueError("images' output rows overlap")


def _check_source(src: torch.Tensor, layout: Layout) -> None:
    if src.dtype != torch.uint8 or src.ndim != 1 or not src.is_contiguous():
        raise ValueError("the packed source must be a flat contiguous uint8 tensor")
    if src.numel() < layout.src_bytes:
        raise ValueError(
            f"the packed source has {src.numel()} bytes, the images need {layout.src_bytes}"
        )
