"""Host side of one kernel launch: the per-image descriptor rows and the Q22 tables.

Pure numpy, so CI checks it without a GPU. The rows' and records' field orders are
``_abi``'s, which the kernels are compiled with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from mmwire.transport import Background

from ._abi import (
    FIELDS,
    KINDS,
    MMA_GROUP_SHIFT,
    MMA_KS,
    MMA_MAX_BLOCKS,
    NORM_STRIDE,
    RECORD_FIELDS,
    RECORD_FLAGS,
    Kind,
    OutputLayout,
    mma_steps,
)
from .reference import Filter, coefficients, pass_order

__all__ = [
    "FIELDS",
    "KINDS",
    "MIXED_PLAIN_GAMMA",
    "MIXED_PLAIN_TILE",
    "MIXED_TAIL",
    "MMA_SMEM_BYTES",
    "RECORD_FIELDS",
    "TILE_PIXELS",
    "TILE_SMEM_BYTES",
    "ImageJob",
    "Kind",
    "Layout",
    "layout_of",
]

_F = {name: i for i, name in enumerate(FIELDS)}
_R = {name: i for i, name in enumerate(RECORD_FIELDS)}
_TWO_STEPS, _THREE_STEPS, _V_FIRST, _WHOLE, _RAW, _PLAIN, _X_NARROW, _Y_NARROW = (
    RECORD_FLAGS[f"R_{name}"]
    for name in (
        "TWO_STEPS",
        "THREE_STEPS",
        "V_FIRST",
        "WHOLE",
        "RAW",
        "PLAIN",
        "X_NARROW",
        "Y_NARROW",
    )
)
_NONE, _HORIZONTAL, _VERTICAL = 0, 1, 2
_SOLID = {"white": 255, "gray": 128, "black": 0}

MIXED_TAIL = 0.25
"""Where a mixed launch's MMA tiles end among its plain tiles: the MMA tiles' sort keys
spread over ``[0, 1 - MIXED_TAIL)``, so the plain tiles whose keys (``MIXED_PLAIN_GAMMA``)
are past that come after every MMA tile and fill the multiprocessors the MMA tiles' last
wave leaves idle."""
MIXED_PLAIN_GAMMA = 1.4
"""Plain tile ``j`` of ``n`` of a mixed launch sorts at ``((j + 1/2) / n) ** MIXED_PLAIN_GAMMA``:
above 1 the plain tiles come earlier among the MMA tiles, and with ``MIXED_TAIL`` 0.25
(1 - 0.75 ** (1 / 1.4)), about 19 % come after the last MMA tile."""
MIXED_PLAIN_TILE = (8, 4)
"""The plain tiles' shape (patches down, across) in a mixed launch (``TILE_PIXELS``' 4 x 4
in a plain launch): beside MMA tiles, fewer and larger plain tiles keep the launch's tail
short."""
MMA_TILE_OVERHEAD = 240
"""A tile's fixed cost (its record, staging latency, pass set-up, barriers) in the MMA
measure's units, products of 128 outputs (all channels'): ``_mma_tile_for`` minimises the
tiles' products plus this a tile. It is fitted to the H200's times of forced tile shapes:
about 7 µs a thousand tiles against 9-11 µs a million IMMAs (three a product)."""
MMA_TILE_SIDE = 128
"""The most canvas pixels along an MMA tile's side: larger tiles have less estimated work
but stage wider windows, which the measure does not see."""
MMA_TILE_TALL, MMA_TILE_WIDE = 2, 4.5
"""How much taller than wide, and wider than tall, an MMA tile may be (in patches): of a
shape and its transpose the taller is slower (its window has more, shorter rows to stage),
and 4.5 lets in 2 x 8 for a 4000 x 3000 photo."""
MMA_SMEM_BYTES = 143 * 512
"""The most shared memory one MMA tile's window planes (or output planes, which reuse them)
and intermediate may take (more than 48 KiB makes the launcher opt in): 71.5 KiB, so three
blocks a multiprocessor of 228 KiB (H100, H200; ``FUSED_MIN_BLOCKS``) with the blocks'
static 3.4 KiB (an fp32 table with its header, and the descriptor row) and the 1 KiB the
driver reserves for each. 71.5 rather than 71 KiB lets a 4000 x 3000 photo take 2 x 8
tiles."""
MMA_NARROW = True
"""Whether an MMA axis whose 16-output blocks take two 32-input steps takes blocks of 8
outputs instead where each of those fits one step (``NarrowWeights`` in ``mma.cuh``: the
pixels become the A operand, so a product covers 8 outputs of 16 lines): half the products
and a quarter of the weight registers, for downscales of about 1.5 to 2.6."""

TILE_PIXELS = (64, 64)
"""About how many canvas rows and columns one block of the fused launch covers: a whole
number of patches, at least one (an image whose window would not fit takes smaller tiles)."""
TILE_SMEM_BYTES = 40 * 1024
"""The most shared memory one tile's source window and intermediate may take (4 bytes a
pixel); an image needing more even with one-patch tiles reads global memory instead. With
the block's own 3.3 KiB this stays under the 48 KiB a launch gets without opting in."""


@dataclass(frozen=True)
class ImageJob:
    """One image of a launch: its uint8 HWC shape, resize target, background and grid.

    A job may read a region of another job's pixels instead of its own (a crop, or the
    whole image resized again as a thumbnail): ``src_at`` is the byte offset of its first
    pixel in the launch's source and ``src_pitch`` the bytes from one of its rows to the
    next. Without ``src_at`` a job's pixels follow the previous job's own, packed.
    """

    in_w: int
    in_h: int
    ch: int
    out_w: int
    out_h: int
    background: Background | None = None
    grid_w: int = 0
    patches: int = 0
    table: int = 0
    """Which (3, 256) normalise table of the launch this image uses."""
    row: int | None = None
    """Output row of the first patch (default: right after the previous image's)."""
    filter: Filter = "bicubic"
    """Pillow's resampling filter."""
    src_at: int | None = None
    src_pitch: int = 0
    """Bytes from one source row to the next (0: ``in_w * ch``, packed)."""

    @property
    def pitch(self) -> int:
        return self.src_pitch or self.in_w * self.ch


@dataclass(frozen=True, eq=False)
class Layout:
    """Everything a launch needs, on the host: offsets are in bytes, starts in elements.

    Compared and hashed by identity: :func:`layout_of` returns the same object for the
    same jobs, so device copies can be cached per layout.
    """

    desc: np.ndarray[Any, np.dtype[np.int64]]
    tables: np.ndarray[Any, np.dtype[np.int32]]
    grids: np.ndarray[Any, np.dtype[np.int64]]
    """``(N, 3)`` grid_thw of the images (zeros for resize-only jobs)."""
    src_offsets: tuple[int, ...]
    src_bytes: int
    mid_bytes: int
    mid_rows: int
    mid_width: int
    """The widest intermediate (columns of the pass-1 grid)."""
    patches: int
    out_offsets: tuple[int, ...]
    out_bytes: int
    out_rows: int
    out_width: int
    tile_image: np.ndarray[Any, np.dtype[np.int32]]
    """The image of each tile of the fused launches (tiles of one image are consecutive)."""
    tile_records: np.ndarray[Any, np.dtype[np.int32]]
    """``(MMA and plain tiles, len(RECORD_FIELDS))``: the MMA, plain and mixed launches' tile
    records, in tile order but for a mixed launch's, whose two kinds interleave (a launch
    reads its own from its first)."""
    tile_groups: tuple[tuple[int, Kind, int, int], ...]
    """One fused launch per channel count and kind: ``(channels, kind, first tile, tiles)``
    (a mixed launch: its plain tiles' first, and both kinds' tiles)."""
    smem_bytes: int
    """Dynamic shared memory of the general kernel's launches: the largest TILED window +
    intermediate (an upper bound; plain launches ask for none)."""
    mma_smem_bytes: int = 0
    """Dynamic shared memory of the MMA launches: their largest window (or output) planes
    and intermediate."""
    plain_smem_bytes: int = 0
    """Dynamic shared memory of the plain launches that stage their tiles' pixels as they
    are (``_plain_pitch``): their largest tile's. Only fp32 gray and RGB stage and ask for
    it (``_ops._plain_stages``)."""

    @property
    def tiles(self) -> int:
        return int(self.tile_image.size)


def _spans(c: Any, size: int, step: int) -> int:
    """The most input rows (or columns) one pass reads for ``step`` consecutive outputs."""
    first = np.arange(0, size, step)
    last = np.minimum(first + step, size) - 1
    return int((c.xmin[last] + c.n[last] - c.xmin[first]).max())


def _tile_window(
    job: ImageJob, passes: tuple[int, int], tile: tuple[int, int], patch: int
) -> tuple[int, int, int, int]:
    """The largest tile's output rows and columns and the source rows and columns it reads."""
    rows, cols = min(tile[0] * patch, job.out_h), min(tile[1] * patch, job.out_w)
    win_rows = win_cols = 0
    if _VERTICAL in passes:
        win_rows = _spans(coefficients(job.in_h, job.out_h, job.filter), job.out_h, rows)
    if _HORIZONTAL in passes:
        win_cols = _spans(coefficients(job.in_w, job.out_w, job.filter), job.out_w, cols)
    return rows, cols, win_rows or rows, win_cols or cols


def _tile_bytes(window: tuple[int, int, int, int], passes: tuple[int, int]) -> int:
    """Shared memory of the largest tile (its ``_tile_window``): source window and
    intermediate."""
    rows, cols, win_rows, win_cols = window
    inter = {_HORIZONTAL: win_rows * cols, _VERTICAL: rows * win_cols}.get(passes[0], 0)
    return 4 * (win_rows * win_cols + inter)


_TAP_PASS_COST = 8
"""About how many staged pixels one resized pixel of a pass costs (its taps' multiply-adds)."""


def _tile_cost(window: tuple[int, int, int, int], passes: tuple[int, int]) -> float:
    """Work per output pixel of a tile (its ``_tile_window``): its pass outputs (the first
    pass also makes the halo rows or columns the last one reads) and its staged window."""
    rows, cols, win_rows, win_cols = window
    first = {_HORIZONTAL: win_rows * cols, _VERTICAL: rows * win_cols}.get(passes[0], 0)
    last = rows * cols if passes[1] != _NONE else 0
    return (_TAP_PASS_COST * (first + last) + win_rows * win_cols) / (rows * cols)


def _tile_shapes(most: int) -> list[list[tuple[int, int]]]:
    """Tile shapes (patches down, across) by area, largest first, from ``most`` patches down
    to one, each no more than 2:1 (8 x 2 tiles are slower than 4 x 4)."""
    levels = []
    area = 1 << (max(most, 1).bit_length() - 1)
    while area >= 1:
        shapes = [(a, area // a) for a in range(1, area + 1) if area % a == 0]
        levels.append([(a, b) for a, b in shapes if max(a, b) <= 2 * min(a, b)])
        area //= 2
    return levels


Measure = Callable[[tuple[int, int]], tuple[int, float] | None]
"""A tile shape's shared memory and work per output pixel (None: the shape cannot work)."""


def _tile_for(
    job: ImageJob,
    patch: int,
    budget: int,
    measure: Measure,
    pixels: tuple[int, int] = TILE_PIXELS,
) -> tuple[int, int, int] | None:
    """The tile (patches down, across) whose shared memory fits: of the largest area that
    fits, the shape with the least work per pixel (an image resized rows first gets taller
    tiles, so its first pass makes fewer halo rows); and its bytes. Areas are powers of
    two."""
    th, tw = max(1, pixels[0] // patch), max(1, pixels[1] // patch)
    for shapes in _tile_shapes(th * tw):
        fits = []  # (larger area first, work per pixel, not the configured shape, ...)
        for tile in shapes:
            m = measure(tile)
            if m is not None and m[0] <= budget:
                fits.append((-tile[0] * tile[1], m[1], tile != (th, tw), tile, m[0]))
        if fits:
            *_, tile, need = min(fits, key=lambda f: f[:3])  # the first of equals
            return (*tile, need)
    return None


def _mma_tile_for(
    job: ImageJob, patch: int, budget: int, measure: Measure
) -> tuple[int, int, int] | None:
    """An MMA image's tile (patches down, across) and its bytes: of the shapes whose shared
    memory fits ``budget``, no more than ``MMA_TILE_TALL`` times taller than wide nor
    ``MMA_TILE_WIDE`` times wider than tall, nor larger than the grid or ``MMA_TILE_SIDE``,
    the one with the least estimated work: its tiles' products (``measure`` counts a
    channel's) plus ``MMA_TILE_OVERHEAD`` a tile; among equals the wider, then the shorter.
    A wider (or taller) tile needs more shared memory, so a row of shapes stops at the first
    that does not fit, and the search at a height whose narrowest shape does not."""
    grid_h = job.patches // job.grid_w
    most = max(1, MMA_TILE_SIDE // patch)  # patches along a side
    best: tuple[tuple[float, int, int], tuple[int, int, int]] | None = None
    for a in range(1, min(grid_h, most) + 1):
        narrowest = -(-a // MMA_TILE_TALL)
        for b in range(narrowest, min(job.grid_w, int(MMA_TILE_WIDE * a), most) + 1):
            m = measure((a, b))
            if m is None:  # a block past the module's steps: another width may fit
                continue
            if m[0] > budget:
                break
            tiles = -(-grid_h // a) * -(-job.grid_w // b)
            products = job.ch * m[1] * a * b * patch * patch / 128
            work = tiles * (products + MMA_TILE_OVERHEAD)
            key = (work, -b, a)
            if best is None or key < best[0]:
                best = (key, (a, b, m[0]))
        else:
            continue
        if b == narrowest:
            break
    return None if best is None else best[1]


def _general_measure(job: ImageJob, passes: tuple[int, int], patch: int) -> Measure:
    def measure(tile: tuple[int, int]) -> tuple[int, float]:
        window = _tile_window(job, passes, tile, patch)
        return _tile_bytes(window, passes), _tile_cost(window, passes)

    return measure


def _plain_pitch(n: int) -> int:
    """``plain_pitch`` in ``tiles.cuh``: the row pitch of an unresized tile's pixels staged
    as they are, for rows of ``n`` bytes (a skew of up to 15, whole 16-byte granules), 80 or
    112 past a multiple of 128 (the write-out's loads meet fewer bank conflicts)."""
    need = ((n + 30) >> 4) << 4
    r = need & 127
    return need + (80 - r if r <= 80 else 112 - r)


def _mma_pitch(n: int) -> int:
    """``mma_pitch`` in ``mma.cuh``: the least row pitch >= n that is 16 past a multiple of 32."""
    return ((n + 15) & ~31) + 16


def _block_spans(c: Any, size: int, o0: Any, tile: int, block: int = 16) -> tuple[Any, Any, Any]:
    """For tiles of ``tile`` outputs whose M-blocks of ``block`` outputs start at ``o0``
    (tiles, blocks), clipped to the tile and the axis (a block's outputs past them get no weights,
    so their taps are not the tile's): each block's first tap aligned down to 4 and its
    32-input steps (the spans ``mma_pass`` in ``mma.cuh`` reads), and per tile the inputs
    its blocks use from its first block's tap."""
    end = o0[:, :1] + tile - 1  # each tile's last output (its first block starts it)
    first = np.minimum(o0, size - 1)
    last = np.minimum(np.minimum(o0 + block - 1, end), size - 1)
    at = c.xmin[first] & ~3
    steps = (c.xmin[last] + c.n[last] - at + 31) >> 5
    used = c.xmin[last[:, -1]] + c.n[last[:, -1]] - at[:, 0]
    return at, steps, used


def _mma_reach(c: Any, size: int, starts: Any, tile: int, block: int = 16) -> tuple[int, int]:
    """For tiles of ``tile`` outputs starting at ``starts``: the most inputs their M-blocks
    of ``block`` outputs use and the most 32-input steps of one block (``_block_spans``)."""
    o0 = np.asarray(starts)[:, None] + block * np.arange(-(-tile // block))[None, :]
    _, steps, used = _block_spans(c, size, o0, tile, block)
    return int(used.max()), int(steps.max())


@lru_cache(maxsize=1024)
def _axis_reach(
    in_size: int, out_size: int, tile: int, tiles: int, block: int = 16, filter: Filter = "bicubic"
) -> tuple[int, int]:
    """``_mma_reach`` of an axis cut into ``tiles`` tiles of ``tile`` outputs (cached: the
    tile search measures each shape's axes, and the narrow rule asks for the same reach)."""
    c = coefficients(in_size, out_size, filter)
    return _mma_reach(c, out_size, np.arange(tiles) * tile, tile, block)


def _narrow_fits(
    in_size: int, out_size: int, tile: int, tiles: int, filter: Filter = "bicubic"
) -> bool:
    """Whether an MMA axis cut into ``tiles`` tiles of ``tile`` outputs has 16-output blocks
    of two 32-input steps and 8-output blocks of one step each (``MMA_NARROW``)."""
    return _axis_reach(in_size, out_size, tile, tiles, filter=filter)[1] > 1 and (
        _axis_reach(in_size, out_size, tile, tiles, 8, filter)[1] == 1
    )


def _narrow(in_size: int, out_size: int, tile: int, tiles: int, filter: Filter = "bicubic") -> bool:
    """Whether an MMA axis takes narrow blocks (``MMA_NARROW`` and ``_narrow_fits``)."""
    return MMA_NARROW and _narrow_fits(in_size, out_size, tile, tiles, filter)


@lru_cache(maxsize=1024)
def _block_steps_bound(in_size: int, out_size: int, filter: Filter) -> int:
    """The most 32-input steps of any 16 consecutive outputs of an axis: at least those of
    every M-block of any tiling (a tile's blocks are 16 consecutive outputs, or fewer)."""
    c = coefficients(in_size, out_size, filter)
    return _mma_reach(c, out_size, np.arange(out_size), 16)[1]  # a "tile" from every output


def _mma_raw(job: ImageJob, v_first: bool, src_offset: int, most_steps: int = MMA_KS) -> bool:
    """Whether an MMA image's windows may be staged raw (``R_RAW``: the source's bytes as
    they are, each row from its first byte's 16-byte granule): gray or RGB passed
    horizontally first, whose rows start on a word in the source (``preprocess_packed``
    copies a source that does not itself start on one); in a module of three steps
    (``most_steps``), RGB only where no block takes three (the raw RGB pass does not: its
    three channels' products would spill registers)."""
    return (
        job.ch in (1, 3)
        and not v_first
        and (src_offset | job.pitch) % 4 == 0
        and (
            job.ch == 1
            or most_steps <= 2
            or max(
                _block_steps_bound(job.in_w, job.out_w, job.filter),
                _block_steps_bound(job.in_h, job.out_h, job.filter),
            )
            <= 2
        )
    )


def _mma_measure(
    job: ImageJob, patch: int, v_first: bool, raw: bool = False, most_steps: int = MMA_KS
) -> Measure:
    """An MMA image's tile measure: a tile's shared memory and work (None: too large, or a
    block of more than ``most_steps`` 32-input steps, the module's ``MMA_KS``)."""
    grid_h = job.patches // job.grid_w

    def measure(tile: tuple[int, int]) -> tuple[int, float] | None:
        th, tw = tile[0] * patch, tile[1] * patch
        my, mx = -(-th // 16), -(-tw // 16)
        if max(my, mx) > MMA_MAX_BLOCKS:
            return None
        tiles_h, tiles_w = -(-grid_h // tile[0]), -(-job.grid_w // tile[1])
        ur, sy = _axis_reach(job.in_h, job.out_h, th, tiles_h, filter=job.filter)
        uc, sx = _axis_reach(job.in_w, job.out_w, tw, tiles_w, filter=job.filter)
        nx = _narrow(job.in_w, job.out_w, tw, tiles_w, job.filter)
        ny = _narrow(job.in_h, job.out_h, th, tiles_h, job.filter)
        sx, sy = (1 if nx else sx), (1 if ny else sy)  # narrow blocks take one step
        ks = max(sx, sy)  # the tile's most steps: its slack (R_TWO_STEPS, R_THREE_STEPS)
        if ks > most_steps:
            return None
        # the first pass's lines (window rows, or columns when vertical first; a multiple of
        # its N-blocks': 16 narrow, 8 wide), its inputs a line and outputs; the second
        # pass's lines are the first's outputs in the tile
        n1, n2 = (ny, nx) if v_first else (nx, ny)
        align = 16 if n1 else 8
        lines = -(-(uc if v_first else ur) // align) * align
        inputs, m1 = (ur, my) if v_first else (uc, mx)
        # a plane of the window (later the second pass's bytes) and of the intermediate,
        # and the slack after each (mma_tile in tiles.cuh)
        out, mid = 16 * my * _mma_pitch(tw), 16 * m1 * _mma_pitch(lines)
        need = job.ch * (max(lines * _mma_pitch(inputs), out) + mid) + 2 * 32 * ks
        if raw:  # or staged raw (one plane of rows, the lanes' reads reaching further; each
            # group of 8 rows MMA_GROUP_SHIFT further on): the larger of the two, so the
            # tile fits either way its window is staged
            window = lines * _mma_pitch(job.ch * uc + 12) + lines // 8 * MMA_GROUP_SHIFT
            raw_need = max(window, job.ch * out) + job.ch * (mid + 32 * ks) + 16 + 32 * ks
            need = max(need, raw_need)
        first, second = (sy, sx) if v_first else (sx, sy)
        out1, out2 = (th, tw) if v_first else (tw, th)
        # per channel, in products of 128 outputs (3 IMMAs each a step)
        products = (-(-out1 // 8) * (lines // 16) if n1 else m1 * (lines // 8) * first) + (
            -(-out2 // 8) * -(-out1 // 16) if n2 else -(-out2 // 16) * -(-out1 // 8) * second
        )
        return need, 128 * products / (th * tw)

    return measure


@lru_cache(maxsize=256)
def _weight_words(
    in_size: int, out_size: int, filter: Filter = "bicubic"
) -> np.ndarray[Any, np.dtype[np.int32]]:
    """An axis's Q22 weights as the MMA passes' A words (cached, as the coefficients):
    ``(outputs, 3, m)``, word ``w`` of byte plane ``q`` of output ``o`` holds byte ``q`` of
    the weights of inputs ``(xmin[o] & ~3) + 4 w + 0..3`` (0 outside the taps),
    ``m = (ksize + 6) // 4``: what ``_mma_axis`` picks each fragment word from."""
    c = coefficients(in_size, out_size, filter)
    outputs, ksize = c.k.shape
    m = (ksize + 6) // 4
    taps = np.arange(ksize)
    w = np.where(taps[None, :] < c.n[:, None], c.k, 0).astype(np.int64) & 0xFFFFFF
    row = np.zeros((outputs, 4 * m), np.int64)
    row[np.arange(outputs)[:, None], (c.xmin & 3)[:, None] + taps[None, :]] = w
    planes = (row[:, None, :] >> (8 * np.arange(3))[None, :, None]) & 255  # (o, 3, 4 m)
    words = (planes.reshape(outputs, 3, m, 4) << (8 * np.arange(4))).sum(axis=3)
    out: np.ndarray[Any, np.dtype[np.int32]] = words.astype(np.uint32).view(np.int32)
    out.setflags(write=False)
    return out


@lru_cache(maxsize=256)
def _mma_axis(
    in_size: int,
    out_size: int,
    tile: int,
    tiles: int,
    narrow: bool = False,
    rgb: bool = False,
    filter: Filter = "bicubic",
    most_steps: int = MMA_KS,
) -> tuple[np.ndarray[Any, np.dtype[np.int32]], np.ndarray[Any, np.dtype[np.int32]]]:
    """One axis of an MMA image, cut into ``tiles`` tiles of ``tile`` outputs: what each
    tile's M-blocks of 16 outputs (``narrow``: 8) need, so a tile reads it instead of working it out
    (cached, as the coefficients). The last tile may be cut short by the canvas; its blocks
    are the same. Outputs past the axis, and those of a tile's last block past the tile
    (the next tile's), have no weights: they come out 0 and are never written, and the
    window holds only the inputs of the tile's own outputs.

    Returns ``(spans, fragments)``. ``spans``: per tile ``1 + 2 mb`` int32 (``mb`` M-blocks
    of a whole tile): the inputs the tile's taps use from its first block's span, then each
    block's span ``(at, steps)``: its first tap aligned down to 4 and its 32-input steps
    (what ``mma_pass`` in ``mma.cuh`` reads). ``fragments``: per block
    ``(3, most_steps, 32, 4)`` (``most_steps``: the module's ``MMA_KS``), lane ``(g, t)``'s
    A words for byte plane ``q`` and step ``s`` in the PTX order of mma m16n8k32: word
    ``r`` holds output ``o0 + g + 8 (r & 1)``, inputs ``at + 32 s + 16 (r >> 1) + 4 t +
    0..3`` (0 outside the taps, past the tile and past the axis), one 16-byte load a plane
    and step. Narrow: per block ``(3, 32, 2)``,
    lane ``(g, t)``'s B words for byte plane ``q``: word ``r`` holds output ``o0 + g``, inputs
    ``at + 16 r + 4 t + 0..3`` (every narrow block takes one step), one 8-byte load a plane.
    ``rgb``: the first pass of an RGB image staged raw (``split_rgb8`` in ``mma.cuh``), whose
    two words of a row's 32-input step (``at + 32 s + 4 t + 0..3``, ``16 +`` those) hold
    inputs ``4 t + (0, 1, 16, 17)`` and ``4 t + (2, 3, 18, 19)`` instead: the halves of
    each pair of words swapped across.
    """
    c = coefficients(in_size, out_size, filter)
    words = _weight_words(in_size, out_size, filter)  # (outputs, 3, m)
    m = words.shape[2]
    block = 8 if narrow else 16
    mb = -(-tile // block)
    # (tiles, mb): each block's first output (int32, as everything below: a third less time)
    o0 = np.arange(tiles, dtype=np.int32)[:, None] * tile + block * np.arange(mb, dtype=np.int32)
    at, steps, used = _block_spans(c, out_size, o0, tile, block)  # (a short last tile's: the axis)
    spans = np.concatenate([used[:, None], np.stack([at, steps], axis=2).reshape(tiles, -1)], 1)
    lane = np.arange(32, dtype=np.int32)
    i32 = np.int32
    if narrow:  # (tiles, mb, plane, lane, r)
        r = np.arange(2, dtype=i32)
        o = o0[:, :, None, None, None] + (lane >> 2)[:, None]  # (r: through first)
        first = at[:, :, None, None, None] + 16 * r + 4 * (lane & 3)[:, None]
    else:  # (tiles, mb, plane, step, lane, r)
        r = np.arange(4, dtype=i32)
        o = o0[:, :, None, None, None, None] + (lane >> 2)[:, None] + 8 * (r & 1)
        step = 32 * np.arange(most_steps, dtype=i32)[:, None, None]
        first = at[:, :, None, None, None, None] + step + 16 * (r >> 1) + 4 * (lane & 3)[:, None]
    # the output and the word of it each fragment word holds, as an index into the flat words
    tile0 = o0[(slice(None), slice(0, 1)) + (None,) * (o.ndim - 2)]  # each tile's first output
    live = (o < out_size) & (o < tile0 + tile)
    o = np.minimum(o, out_size - 1)
    w = (first - (c.xmin[o] & ~3)) >> 2
    ok = live & (w >= 0) & (w < m)
    plane = np.arange(3, dtype=i32).reshape((3,) + (1,) * (o.ndim - 3))
    at_word = (o * 3 + plane) * m + np.clip(w, 0, m - 1)
    frags = np.where(ok, words.reshape(-1)[at_word], 0).astype(np.uint32)
    if rgb:  # word r's low half and word r + half's low half, then both high halves
        half = 1 if narrow else 2
        lo, hi = frags[..., :half].copy(), frags[..., half:].copy()
        frags[..., :half] = (lo & 0xFFFF) | (hi << 16)
        frags[..., half:] = (lo >> 16) | (hi & 0xFFFF0000)
    out = (spans.astype(np.int32), frags.view(np.int32))
    for a in out:
        a.setflags(write=False)
    return out


def _mma_records(
    job: ImageJob,
    image: int,
    row: np.ndarray[Any, np.dtype[np.int64]],
    patch: int,
    axes: tuple[tuple[int, int, bool], tuple[int, int, bool]],
    merge: int,
    tile: tuple[int, int] = (0, 0),
    most_steps: int = MMA_KS,
) -> np.ndarray[Any, np.dtype[np.int32]]:
    """An MMA image's tile records (``RECORD_FIELDS``), in tile order, from its descriptor
    ``row`` and where its axes' fragments and spans are in the tables (``axes``: x then y,
    each ``(fragments, spans, narrow)``): where each tile's window starts in the source and
    what of it the taps use, its spans and fragments, its patches and its flags
    (``_TWO_STEPS``: a used wide M-block takes more than one 32-input step;
    ``_THREE_STEPS``: three; ``_X_NARROW``, ``_Y_NARROW``: the axis takes narrow blocks
    (``_narrow``); ``_V_FIRST``; ``_WHOLE``: the window's rows start on a word and its
    groups of four pixels lie inside the image, so staging takes plain word loads; ``_RAW``:
    ``_mma_raw``). ``most_steps``: the module's ``MMA_KS``, which the fragments were laid
    out for."""

    def f(name: str) -> int:
        return int(row[_F[name]])

    tph, tpw, tiles_w, grid_h, grid_w = (
        f(n) for n in ("TILE_PH", "TILE_PW", "TILES_W", "GRID_H", "GRID_W")
    )
    tiles_h = -(-grid_h // tph)
    nx, ny = axes[0][2], axes[1][2]
    # the spans, and the fragments' words a tile (as laid out for the module's most steps)
    xs, xf = _mma_axis(job.in_w, job.out_w, tpw * patch, tiles_w, nx, False, job.filter, most_steps)
    ys, yf = _mma_axis(job.in_h, job.out_h, tph * patch, tiles_h, ny, False, job.filter, most_steps)
    gy0, gx0, nph, npw = _tiles(row)
    trow, tcol = gy0 // tph, gx0 // tpw

    def tile_steps(spans: np.ndarray[Any, Any], index: Any, patches: Any) -> Any:
        steps = spans[index, 2::2]  # each block's, of the tile's column (row)
        used = np.arange(steps.shape[1])[None, :] < ((patches * patch + 15) // 16)[:, None]
        return np.where(used, steps, 0).max(axis=1)

    wx, wy = xs[tcol, 1].astype(np.int64), ys[trow, 1].astype(np.int64)
    uc, ur = xs[tcol, 0], ys[trow, 0]
    row_bytes = job.pitch
    src = f("SRC_OFF") + wy * row_bytes + wx * job.ch
    whole = (((src | row_bytes) & 3) == 0) & (wx + 4 * ((uc + 3) >> 2) <= job.in_w)
    v_first = f("PASS1") == _VERTICAL
    steps = np.maximum(tile_steps(xs, tcol, npw), tile_steps(ys, trow, nph))
    flags = (
        (steps > 1) * _TWO_STEPS
        + (steps > 2) * _THREE_STEPS
        + v_first * _V_FIRST
        + whole * _WHOLE
        + _mma_raw(job, v_first, f("SRC_OFF"), most_steps) * _RAW
        + nx * _X_NARROW
        + ny * _Y_NARROW
    )
    values = {
        "R_IMAGE": image,
        "R_SRC_LO": src & 0xFFFFFFFF,
        "R_SRC_HI": src >> 32,
        "R_ROW_BYTES": row_bytes,
        "R_USED_W": uc,
        "R_USED_H": ur,
        "R_X_SPANS": axes[0][1] + tcol * xs.shape[1] + 1,  # the first block's span
        "R_Y_SPANS": axes[1][1] + trow * ys.shape[1] + 1,
        "R_X_WORDS": axes[0][0] + tcol * (xf.size // tiles_w),  # the first block's
        "R_Y_WORDS": axes[1][0] + trow * (yf.size // tiles_h),
        "R_TILE_H": nph,
        "R_TILE_W": npw,
        "R_GY0": gy0,
        "R_GX0": gx0,
        "R_PATCH": f("ROW") + patch_index(gy0, gx0, grid_w, merge, tile),
        "R_GRID_W": grid_w,
        "R_TABLE": f("TABLE"),
        "R_FLAGS": flags,
    }
    return _records(values, gy0.size, job)


def patch_index(
    gy: Any, gx: Any, grid_w: int, merge: int = 0, tile: tuple[int, int] = (0, 0)
) -> Any:
    """The row of an image's patch ``(gy, gx)`` among its rows (``PatchOrder::index``):
    row-major over the grid, or by ``merge x merge`` windows (``merge`` > 0); with ``tile``
    (patches down and across a row that is a whole tile) the row of the tile holding it."""
    if tile[1]:
        return (gy // tile[0]) * (grid_w // tile[1]) + gx // tile[1]
    if not merge:
        return gy * grid_w + gx
    m = merge
    return ((gy // m) * (grid_w // m) + gx // m) * (m * m) + (gy % m) * m + gx % m


def _tiles(row: np.ndarray[Any, np.dtype[np.int64]]) -> tuple[Any, Any, Any, Any]:
    """A TILED image's tiles in tile order, from its descriptor ``row``: each one's first
    patch row and column and its patches down and across (short at the canvas's edges)."""
    tph, tpw, tiles_w, grid_h, grid_w = (
        int(row[_F[n]]) for n in ("TILE_PH", "TILE_PW", "TILES_W", "GRID_H", "GRID_W")
    )
    k = np.arange(tiles_w * -(-grid_h // tph), dtype=np.int64)
    gy0, gx0 = k // tiles_w * tph, k % tiles_w * tpw
    return gy0, gx0, np.minimum(tph, grid_h - gy0), np.minimum(tpw, grid_w - gx0)


def _records(
    values: dict[str, Any], tiles: int, job: ImageJob
) -> np.ndarray[Any, np.dtype[np.int32]]:
    """Tile records (``RECORD_FIELDS``; the rest 0) from their fields' values, as int32 (the
    source offset's low word unsigned); refused where an offset does not fit 32 bits."""
    rec = np.zeros((tiles, len(RECORD_FIELDS)), np.int64)
    for name, value in values.items():
        rec[:, _R[name]] = value
    signed = np.delete(rec, _R["R_SRC_LO"], axis=1)  # the low word is unsigned
    span = rec[:, _R["R_USED_H"]] * rec[:, _R["R_ROW_BYTES"]]  # copy_rows' 32-bit offsets
    if (
        rec.min(initial=0) < 0
        or signed.max(initial=0) >= 2**31
        or span.max(initial=0) >= 2**32 - 16
    ):
        raise ValueError(f"cannot plan {job}: its tiles' offsets do not fit 32 bits")
    out: np.ndarray[Any, np.dtype[np.int32]] = rec.astype(np.uint32).view(np.int32)
    return out


def _plain_records(
    job: ImageJob,
    image: int,
    row: np.ndarray[Any, np.dtype[np.int64]],
    patch: int,
    merge: int,
    tile: tuple[int, int] = (0, 0),
) -> np.ndarray[Any, np.dtype[np.int32]]:
    """An unresized (plain) image's tile records, in tile order, from its descriptor
    ``row``: each tile's first pixel in the source, the part of it inside the image
    (``R_USED_W`` x ``R_USED_H``; none of it where the tile is all padding) and its
    patches; no spans or fragments, and the flag ``R_PLAIN`` (a mixed launch's kinds)."""
    gy0, gx0, nph, npw = _tiles(row)
    y0, x0 = gy0 * patch, gx0 * patch
    vh = np.clip(job.out_h - y0, 0, nph * patch)
    vw = np.clip(job.out_w - x0, 0, npw * patch)
    inside = (vh > 0) & (vw > 0)
    grid_w = int(row[_F["GRID_W"]])
    src = (  # (kept inside the image for a tile all padding, which reads nothing)
        int(row[_F["SRC_OFF"]])
        + np.minimum(y0, job.in_h - 1) * job.pitch
        + np.minimum(x0, job.in_w - 1) * job.ch
    )
    values = {
        "R_IMAGE": image,
        "R_SRC_LO": src & 0xFFFFFFFF,
        "R_SRC_HI": src >> 32,
        "R_ROW_BYTES": job.pitch,
        "R_USED_W": vw * inside,
        "R_USED_H": vh * inside,
        "R_TILE_H": nph,
        "R_TILE_W": npw,
        "R_GY0": gy0,
        "R_GX0": gx0,
        "R_PATCH": int(row[_F["ROW"]]) + patch_index(gy0, gx0, grid_w, merge, tile),
        "R_GRID_W": grid_w,
        "R_TABLE": int(row[_F["TABLE"]]),
        "R_FLAGS": _PLAIN,
    }
    return _records(values, gy0.size, job)


def _mixed(
    groups: list[tuple[int, Kind, int, int]], records: np.ndarray[Any, np.dtype[np.int32]]
) -> tuple[list[tuple[int, Kind, int, int]], np.ndarray[Any, np.dtype[np.int32]]]:
    """``groups`` and ``records`` (in tile order) with each channel count's plain and MMA
    groups (consecutive in tile order) merged into one ``mixed`` group, whose records
    interleave the two kinds' (each kind's in its own order): MMA tile ``i`` of ``m`` at
    ``(i + 1/2) / m * (1 - MIXED_TAIL)``, plain tile ``j`` of ``n`` at
    ``((j + 1/2) / n) ** MIXED_PLAIN_GAMMA``, so the plain tiles lean to the launch's start
    and those past ``1 - MIXED_TAIL`` come after every MMA tile."""
    merged: list[tuple[int, Kind, int, int]] = []
    parts = []
    at = i = 0  # the group's first record; the group
    while i < len(groups):
        ch, kind, first, count = groups[i]
        after = groups[i + 1] if i + 1 < len(groups) else None
        if kind == "plain" and after is not None and after[:2] == (ch, "mma"):
            mma = after[3]
            keys = np.concatenate(
                [
                    ((np.arange(count) + 0.5) / count) ** MIXED_PLAIN_GAMMA,
                    (np.arange(mma) + 0.5) / mma * (1 - MIXED_TAIL),
                ]
            )
            parts.append(records[at : at + count + mma][np.argsort(keys, kind="stable")])
            merged.append((ch, "mixed", first, count + mma))
            at, i = at + count + mma, i + 2
            continue
        if kind != "general":
            parts.append(records[at : at + count])
            at += count
        merged.append(groups[i])
        i += 1
    return merged, np.concatenate(parts) if parts else records


def _bg_fields(bg: Background | None) -> tuple[int, int, int, int, int]:
    if bg is None:
        return 0, 1, 1, 0, 0
    if bg.pattern == "chessboard":
        return 1, bg.square, int(bg.top_left_white), bg.white, bg.gray
    return 2, 1, 1, _SOLID[bg.pattern], 0


def _passes(job: ImageJob, pillow: tuple[int, int] | None) -> tuple[int, int]:
    """An image's two passes (``_NONE`` where one is skipped): with both axes resized, in the
    installed (or given) Pillow's order; with one, its pass second (it reads the source)."""
    need_h, need_v = job.out_w != job.in_w, job.out_h != job.in_h
    if need_h and need_v:
        h_first = pass_order(job.in_w, job.in_h, job.out_w, job.out_h, pillow) == "h_first"
        return (_HORIZONTAL, _VERTICAL) if h_first else (_VERTICAL, _HORIZONTAL)
    return _NONE, (_HORIZONTAL if need_h else _VERTICAL if need_v else _NONE)


@lru_cache(maxsize=128)
def layout_of(
    jobs: tuple[ImageJob, ...],
    pillow: tuple[int, int] | None = None,
    patch: int = 0,
    tile_smem: int = TILE_SMEM_BYTES,
    tensor_cores: bool = False,
    mma_smem: int = MMA_SMEM_BYTES,
    mixed: bool = False,
    merge: int = 0,
    tile: tuple[int, int] = (0, 0),
) -> Layout:
    """Descriptor rows and coefficient tables for ``jobs`` (a tuple; cached by value).

    Pass planning follows Pillow: a pass whose size does not change is skipped; with two
    passes the first makes the uint8 intermediate, in the installed (or given) Pillow's
    order; with one pass it reads the source directly; RGBA goes through premultiplied
    alpha only when something is resized (Pillow copies an unresized image).

    With ``patch`` (the patch size of a fused launch) the canvases are cut into tiles of
    whole patches; an image whose tile window and intermediate fit ``tile_smem`` bytes works
    in shared memory (TILED); the others read global memory, with a global intermediate
    from pass 1 when they need two passes (as every image of a resize-only launch,
    ``patch=0``). With ``tensor_cores`` (a device of compute capability 8.0 or more), images
    resized on both axes (gray, RGB or RGBA) take the MMA kernel when ``patch`` is even and
    their tiles fit ``mma_smem`` bytes; with ``mixed`` a channel count's plain and MMA tiles
    then share one launch (``_mixed``), its plain tiles of ``MIXED_PLAIN_TILE``. ``merge``:
    the launch's patch order (``OutputLayout.merge``), which its tiles' first rows follow;
    ``tile``: its rows' tile (``OutputLayout.tile_h``, ``tile_w``), a row a whole tile of
    the canvas (a job's ``row`` then counts tiles; its module's MMA blocks may take
    ``TILE_MMA_KS`` steps, ``mma_steps``).
    """
    if tile[1] and (not patch or tile[0] % patch or tile[1] % patch):
        raise ValueError(f"rows of {tile[0]}x{tile[1]} tiles need a patch that divides them")
    in_patches = (tile[0] // patch, tile[1] // patch) if tile[1] else (0, 0)
    desc = np.zeros((len(jobs), len(FIELDS)), np.int64)
    chunks: list[np.ndarray[Any, np.dtype[np.int32]]] = []
    table_at: dict[tuple[int, int, Filter], tuple[int, int, int, int]] = {}
    axis_at: dict[tuple[int, int, int, int, bool, bool, Filter, int], tuple[int, int, bool]] = {}
    steps = mma_steps(OutputLayout(tile_h=tile[0], tile_w=tile[1]))  # the module's MMA_KS
    used = 0
    tiles_of: list[int] = []

    def place(*arrays: np.ndarray[Any, Any]) -> int:
        """Appends ``arrays`` (flattened) to the tables; the element offset of the first."""
        nonlocal used
        at = used
        for a in arrays:
            chunks.append(a.reshape(-1))
            used += a.size
        return at

    def table(in_size: int, out_size: int, filter: Filter) -> tuple[int, int, int, int]:
        key = (in_size, out_size, filter)
        if key not in table_at:
            c = coefficients(in_size, out_size, filter)
            at = place(c.xmin, c.n, c.k)
            table_at[key] = (at, at + c.n.size, at + 2 * c.n.size, c.ksize)
        return table_at[key]

    def mma_axis(
        in_size: int, out_size: int, tile: int, tiles: int, filter: Filter, rgb: bool = False
    ) -> tuple[int, int, bool]:
        """Where one MMA axis's fragments and spans are (``_mma_axis``, ``rgb`` for an RGB
        image's raw first pass), and whether it takes narrow blocks (``_narrow``): the
        fragments at a multiple of 4 elements, so each lane's are 16-byte loads."""
        narrow = _narrow(in_size, out_size, tile, tiles, filter)
        key = (in_size, out_size, tile, tiles, narrow, rgb, filter, steps)
        if key not in axis_at:
            spans, frags = _mma_axis(*key)
            place(np.zeros(-used % 4, np.int32))
            axis_at[key] = place(frags), place(spans), key[4]
        return axis_at[key]

    def tiles(
        job: ImageJob, src: int, passes: tuple[int, int], pixels: tuple[int, int] = TILE_PIXELS
    ) -> tuple[Kind, tuple[int, int, int] | None]:
        """An image's kind and its tile (patches down, across, and bytes; None: untiled)."""
        p1, p2 = passes
        if not (patch and job.patches):
            return "general", None
        if tensor_cores and patch % 2 == 0 and p1 != _NONE:
            v_first = p1 == _VERTICAL
            raw = _mma_raw(job, v_first, src, steps)
            measure = _mma_measure(job, patch, v_first, raw, steps)
            fit = _mma_tile_for(job, patch, mma_smem, measure)
            if fit is not None:
                return "mma", fit
        fit = _tile_for(job, patch, tile_smem, _general_measure(job, (p1, p2), patch), pixels)
        return ("plain" if fit is not None and p2 == _NONE else "general"), fit

    for job in jobs:
        if job.ch not in (1, 3, 4) or min(job.in_w, job.in_h, job.out_w, job.out_h) < 1:
            raise ValueError(f"cannot plan {job}: sizes must be positive and ch 1, 3 or 4")
        if job.pitch < job.in_w * job.ch or (job.src_at is not None and job.src_at < 0):
            raise ValueError(f"cannot plan {job}: its rows overlap or it starts before 0")
    passes = [_passes(job, pillow) for job in jobs]
    own = np.cumsum([0] + [job.in_w * job.in_h * job.ch for job in jobs if job.src_at is None])
    packed = iter(own.tolist())
    starts = [next(packed) if job.src_at is None else job.src_at for job in jobs]
    src_end = max(
        [int(own[-1])] + [s + (j.in_h - 1) * j.pitch + j.in_w * j.ch for s, j in zip(starts, jobs)]
    )
    planned = [tiles(*a) for a in zip(jobs, starts, passes)]
    if mixed:  # a channel count's plain tiles beside its MMA tiles take MIXED_PLAIN_TILE
        beside = {job.ch for job, (kind, _) in zip(jobs, planned) if kind == "mma"}
        wide = (MIXED_PLAIN_TILE[0] * patch, MIXED_PLAIN_TILE[1] * patch)
        planned = [
            tiles(job, at, ps, wide) if kind == "plain" and job.ch in beside else (kind, fit)
            for job, at, ps, (kind, fit) in zip(jobs, starts, passes, planned)
        ]

    mid = mid_rows = mid_width = patches = out = out_rows = out_width = 0
    smem = mma_need = plain_need = 0
    kinds: list[Kind] = []
    axes: dict[int, tuple[tuple[int, int, bool], tuple[int, int, bool]]] = {}  # per MMA image
    src_offsets: list[int] = []
    out_offsets: list[int] = []
    for image, (row, job, (p1, p2), (kind, fit)) in enumerate(zip(desc, jobs, passes, planned)):
        need_h, need_v = job.out_w != job.in_w, job.out_h != job.in_h
        grid_h = job.patches // max(job.grid_w, 1)
        tile_h, tile_w, need = fit if fit is not None else (1, 1, 0)
        if kind == "plain":  # its tile's rows as they are (plain_tile in tiles.cuh)
            plain_need = max(plain_need, tile_h * patch * _plain_pitch(tile_w * patch * job.ch))
        elif kind == "mma":
            mma_need = max(mma_need, need)
        else:
            smem = max(smem, need)
        kinds.append(kind)
        tiles_w, tiles_h = -(-job.grid_w // tile_w), -(-grid_h // tile_h)
        if kind == "mma":  # where its axes' fragments and spans are, for its tile records
            raw_rgb = job.ch == 3 and _mma_raw(job, p1 == _VERTICAL, starts[image], steps)
            axes[image] = (
                mma_axis(job.in_w, job.out_w, tile_w * patch, tiles_w, job.filter, raw_rgb),
                mma_axis(job.in_h, job.out_h, tile_h * patch, tiles_h, job.filter),
            )
        mid_w, mid_h = 0, 0
        if p1 != _NONE and fit is None:
            mid_w, mid_h = (job.out_w, job.in_h) if p1 == _HORIZONTAL else (job.in_w, job.out_h)
        x = table(job.in_w, job.out_w, job.filter) if need_h else (0, 0, 0, 0)
        y = table(job.in_h, job.out_h, job.filter) if need_v else (0, 0, 0, 0)
        bg, square, tlw, white, gray = _bg_fields(job.background)
        values = {
            "SRC_OFF": starts[image],
            "SRC_PITCH": job.pitch,
            "IN_W": job.in_w,
            "IN_H": job.in_h,
            "CH": job.ch,
            "OUT_W": job.out_w,
            "OUT_H": job.out_h,
            "PASS1": p1,
            "PASS2": p2,
            "MID_OFF": mid,
            "MID_W": mid_w,
            "MID_H": mid_h,
            "MID_ROW": mid_rows,
            "PATCH_START": patches,
            "GRID_W": max(job.grid_w, 1),
            "PREMUL": int(job.ch == 4 and (need_h or need_v)),
            "BG": bg,
            "BG_SQUARE": square,
            "BG_TOP_LEFT_WHITE": tlw,
            "BG_WHITE": white,
            "BG_GRAY": gray,
            "X_XMIN": x[0],
            "X_N": x[1],
            "X_K": x[2],
            "X_KSIZE": x[3],
            "Y_XMIN": y[0],
            "Y_N": y[1],
            "Y_K": y[2],
            "Y_KSIZE": y[3],
            "OUT_ROW": out_rows,
            "OUT_OFF": out,
            "TABLE": job.table * NORM_STRIDE,
            "ROW": patches if job.row is None else job.row,
            "GRID_H": grid_h,
            "TILE_START": 0,  # set below, once the tiles are grouped by channels
            "TILES_W": max(tiles_w, 1),
            "TILED": int(fit is not None),
            "TILE_PH": tile_h,
            "TILE_PW": tile_w,
        }
        for name, value in values.items():
            row[_F[name]] = value
        src_offsets.append(starts[image])
        out_offsets.append(out)
        mid += mid_w * mid_h * job.ch
        mid_rows += mid_h
        mid_width = max(mid_width, mid_w)
        patches += job.patches
        out += job.out_w * job.out_h * job.ch
        out_rows += job.out_h
        out_width = max(out_width, job.out_w)
        tiles_of.append(tiles_w * tiles_h if patch else 0)
    tables = np.concatenate(chunks).astype(np.int32) if chunks else np.zeros(1, np.int32)
    grids = np.array(
        [(1, j.patches // j.grid_w, j.grid_w) if j.patches else (0, 0, 0) for j in jobs],
        np.int64,
    ).reshape(len(jobs), 3)
    # the fused kernel is compiled per channel count and kind: one launch per group of images
    # with the same channels and kind, so a group's tiles are consecutive
    order: list[int] = []
    groups: list[tuple[int, Kind, int, int]] = []
    at = 0
    for ch in sorted({job.ch for job in jobs}):
        for kind in KINDS:
            first = at
            for i, job in enumerate(jobs):
                if job.ch == ch and kinds[i] == kind:
                    order.append(i)
                    desc[i, _F["TILE_START"]] = at
                    at += tiles_of[i]
            if at > first:
                groups.append((ch, kind, first, at - first))
    tile_image = np.repeat(np.array(order, dtype=np.int32), [tiles_of[i] for i in order])
    records = np.zeros((0, len(RECORD_FIELDS)), np.int32)
    recorded = [i for i in order if kinds[i] != "general" and tiles_of[i]]
    if recorded:
        records = np.concatenate(
            [
                _mma_records(jobs[i], i, desc[i], patch, axes[i], merge, in_patches, steps)
                if kinds[i] == "mma"
                else _plain_records(jobs[i], i, desc[i], patch, merge, in_patches)
                for i in recorded
            ]
        )
    if mixed:
        groups, records = _mixed(groups, records)
    for a in (desc, tables, grids, tile_image, records):
        a.setflags(write=False)
    return Layout(
        desc=desc,
        tables=tables,
        grids=grids,
        src_offsets=tuple(src_offsets),
        src_bytes=src_end,
        mid_bytes=mid,
        mid_rows=mid_rows,
        mid_width=mid_width,
        patches=patches,
        out_offsets=tuple(out_offsets),
        out_bytes=out,
        out_rows=out_rows,
        out_width=out_width,
        tile_image=tile_image,
        tile_records=records,
        tile_groups=tuple(groups),
        smem_bytes=smem,
        mma_smem_bytes=mma_need,
        plain_smem_bytes=plain_need,
    )
