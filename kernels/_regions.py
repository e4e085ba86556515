"""Families whose rows are whole tiles, ``(3, h, w)``: regions of one upload, resized and
cut into tiles (InternVL's tiles and thumbnail, Gemma 3's image and pan-and-scan crops).

Each region is one job of an ordinary launch: a box of an uploaded image (read in place,
its rows ``src_pitch`` apart), resized with the family's filter to a whole number of tiles,
cut into patches of a ``p`` that divides the tile. Where 4 divides ``p`` and the tile's
width (InternVL's 448, Gemma's 896: ``p`` 16), the module compiled for the tile writes each
patch's lines straight into the tiles' ``(3, h, w)`` rows (``OutputLayout.tile_h``,
``tile_w``). Otherwise the launch writes Kimi's rows ``(3, p, p)`` into scratch and one
strided copy per region puts them in place. Either way the values are the CPU path's, byte
for byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from mmwire.transport import PreprocessSpec

from ._abi import KIMI_LAYOUT, UNIT_BYTES, OutputLayout
from ._descriptors import TILE_SMEM_BYTES, ImageJob, Layout, layout_of
from ._launch import Launcher
from ._ops import _BITS, Shape, check_launch, check_rows, fuse, mma_smem, tensor_cores
from .reference import Normalisation, normalisation_of, resample_filter

__all__ = ["Region", "preprocess_regions", "region_layout", "region_patch"]


@dataclass(frozen=True)
class Region:
    """A box of an image (``x``, ``y``, ``width``, ``height`` in its pixels), resized whole
    to ``out_width x out_height``, a whole number of tiles."""

    x: int
    y: int
    width: int
    height: int
    out_width: int
    out_height: int


def region_patch(tile: tuple[int, ...]) -> int:
    """The patch the kernels cut a ``(h, w)`` tile into: the largest of 16 down to 1 that
    divides both sides, an even one first (even patches let the resize run on the tensor
    cores)."""
    fits = [q for q in range(16, 0, -1) if tile[0] % q == 0 and tile[1] % q == 0]
    return min(fits, key=lambda q: (q % 2, -q))


def region_layout(tile: tuple[int, ...]) -> OutputLayout:
    """The output layout the kernels write ``(h, w)`` tiles' rows in: the tiles themselves
    where 4 divides the patch and the width, else Kimi's patch rows (then copied in place)."""
    p = region_patch(tile)
    if p % 4 == 0 and tile[1] % 4 == 0:
        return OutputLayout(tile_h=tile[0], tile_w=tile[1])
    return KIMI_LAYOUT


@dataclass(frozen=True)
class _RegionPlan:
    layout: Layout
    stats: tuple[Normalisation, ...]
    patch: int
    tile: tuple[int, int]
    output: OutputLayout
    placed: tuple[tuple[int, int, int, int], ...]
    """Per job: its first scratch row, its first output row, and its tiles down and across."""


@lru_cache(maxsize=256)
def _plan(
    shapes: tuple[Shape, ...],
    specs: tuple[PreprocessSpec, ...],
    regions: tuple[tuple[Region, ...], ...],
    rows: tuple[int, ...] | None,
    pillow: tuple[int, int] | None,
    tensor_cores: bool,
    mma_smem: int,
) -> _RegionPlan:
    """Checks the regions against their images and tiles and lays out the launch (cached
    by value)."""
    if not (len(shapes) == len(specs) == len(regions)) or not specs:
        raise ValueError(f"{len(shapes)} images, {len(specs)} specs, {len(regions)} region lists")
    tiles = {s.row_shape[1:] for s in specs}
    if len(tiles) != 1 or any(len(t) != 2 for t in tiles):
        raise ValueError(f"images of one launch have rows of different shapes {sorted(tiles)}")
    shape = tiles.pop()
    th, tw = tile = (shape[0], shape[1])
    p = region_patch((th, tw))
    output = region_layout(tile)
    direct = output.tile_w > 0  # the launch writes the rows themselves
    if rows is not None and len(rows) != len(specs):
        raise ValueError(f"{len(rows)} rows for {len(specs)} images")
    stats: dict[Normalisation, int] = {}
    jobs: list[ImageJob] = []
    placed: list[tuple[int, int, int, int]] = []
    image_at = scratch = row = 0
    for i, ((h, w, c), spec, boxes) in enumerate(zip(shapes, specs, regions)):
        if (spec.plan.width, spec.plan.height) != (w, h):
            raise ValueError(
                f"image is {w}x{h} but its plan says {spec.plan.width}x{spec.plan.height}"
            )
        if c == 4 and spec.alpha == "white":  # as the CPU path: composited on the producer
            raise ValueError("an RGBA image for a processor that composites on the producer")
        table = stats.setdefault(normalisation_of(spec), len(stats))
        row = row if rows is None else rows[i]
        for r in boxes:
            inside = 0 <= r.x < r.x + r.width <= w and 0 <= r.y < r.y + r.height <= h
            if (
                not inside
                or r.out_width % tw
                or r.out_height % th
                or min(r.out_width, r.out_height) < 1
            ):
                raise ValueError(
                    f"region {r} is not a box of the {w}x{h} image resized to whole {tw}x{th} tiles"
                )
            gw, gh = r.out_width // p, r.out_height // p
            jobs.append(
                ImageJob(
                    in_w=r.width,
                    in_h=r.height,
                    ch=c,
                    out_w=r.out_width,
                    out_h=r.out_height,
                    grid_w=gw,
                    patches=gw * gh,
                    table=table,
                    filter=resample_filter(spec),
                    src_at=image_at + (r.y * w + r.x) * c,
                    src_pitch=w * c,
                    row=row if direct else scratch,
                )
            )
            down, across = r.out_height // th, r.out_width // tw
            placed.append((scratch, row, down, across))
            scratch += gw * gh
            row += down * across
        image_at += h * w * c
    layout = layout_of(
        tuple(jobs),
        pillow,
        p,
        TILE_SMEM_BYTES,
        tensor_cores,
        mma_smem,
        mixed=True,
        tile=(output.tile_h, output.tile_w),
    )
    return _RegionPlan(layout, tuple(stats), p, tile, output, tuple(placed))


def preprocess_regions(
    src: torch.Tensor,
    shapes: Sequence[Shape],
    specs: Sequence[PreprocessSpec],
    regions: Sequence[Sequence[Region]],
    out: torch.Tensor,
    *,
    rows: Sequence[int] | None = None,
    pillow: tuple[int, int] | None = None,
    launcher: Launcher | None = None,
) -> torch.Tensor:
    """The rows of images packed in ``src`` (see ``pack``) whose families cut them into
    tiles: each image's ``regions``, in order, each resized with its spec's filter and cut
    into ``(3, h, w)`` rows of ``out`` (``(rows, 3, h, w)``, the specs' ``row_shape``), left
    to right and top to bottom, from row ``rows[i]`` for image ``i`` (default: one after
    another). Equal byte for byte to the CPU path under the same Pillow version."""
    plan = _plan(
        tuple((int(h), int(w), int(c)) for h, w, c in shapes),
        tuple(specs),
        tuple(tuple(r) for r in regions),
        None if rows is None else tuple(int(r) for r in rows),
        pillow,
        tensor_cores(src.device, launcher),
        mma_smem(src.device),
    )
    th, tw = plan.tile
    p = plan.patch
    if out.ndim != 4 or tuple(out.shape[1:]) != (3, th, tw) or not out.is_contiguous():
        raise ValueError(f"`out` must be a contiguous (rows, 3, {th}, {tw}) tensor")
    if out.device != src.device or out.dtype not in _BITS:
        raise ValueError(f"`out` must be float32, bfloat16 or float16 on {src.device}")
    check_rows([(row, row + d * a) for _, row, d, a in plan.placed], int(out.shape[0]))
    check_launch(src, plan.layout, p)
    if plan.output.tile_w:
        if out.data_ptr() % UNIT_BYTES:  # the kernels store 8 bytes at a time
            raise ValueError(f"`out` must start at a multiple of {UNIT_BYTES} bytes")
        fuse(plan.layout, plan.stats, p, plan.output, src, out, out.dtype, launcher)
        return out
    scratch = torch.empty((plan.layout.patches, 3, p, p), dtype=out.dtype, device=out.device)
    fuse(plan.layout, plan.stats, p, KIMI_LAYOUT, src, scratch, out.dtype, launcher)
    for first, row, down, across in plan.placed:
        n = down * across * (th // p) * (tw // p)
        patches = scratch[first : first + n].view(down, th // p, across, tw // p, 3, p, p)
        dst = out[row : row + down * across].view(down, across, 3, th // p, p, tw // p, p)
        dst.copy_(patches.permute(0, 2, 4, 1, 5, 3, 6))
    return out
