"""What the CUDA kernels and the host must agree on, set here and only here.

The descriptor rows' and tile records' field orders, the records' flags, the fused kernel's
kinds, the normalise tables' layout and the sizes and launch bounds both sides derive their
arithmetic from. ``compile_options`` hands them to the compiler as ``-D`` flags (NVRTC, the
CI's nvcc and the tests' host build alike); the CUDA sources define none of them and refuse
to compile without them, so the two sides cannot drift apart.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

__all__ = [
    "FIELDS",
    "FUSED_MIN_BLOCKS",
    "FUSED_THREADS",
    "KERNEL_PROCESSORS",
    "KIMI_LAYOUT",
    "KINDS",
    "MMA_GROUP_SHIFT",
    "MMA_KS",
    "MMA_MAX_BLOCKS",
    "NORM_HEADER",
    "NORM_MODES",
    "NORM_STRIDE",
    "NORM_VALUES",
    "RECORD_FIELDS",
    "RECORD_FLAGS",
    "TILE_MMA_KS",
    "UNIT_BYTES",
    "WIDE_UNIT_BYTES",
    "Kind",
    "OutputLayout",
    "compile_options",
    "mma_steps",
]

FIELDS: tuple[str, ...] = (
    "SRC_OFF",  # byte offset of the image (uint8 HWC) in the source buffer
    "IN_W",
    "IN_H",
    "CH",  # 1 (gray), 3 (RGB) or 4 (RGBA)
    "OUT_W",  # resized size (before padding)
    "OUT_H",
    "PASS1",  # 0 none, 1 horizontal, 2 vertical: the pass into the intermediate
    "PASS2",  # 0 none, 1 horizontal, 2 vertical: the pass of the final read
    "MID_OFF",  # byte offset of this image's uint8 intermediate
    "MID_W",
    "MID_H",
    "MID_ROW",  # first row of this image among all intermediate rows of the launch
    "PATCH_START",  # first patch of this image among all patches of the launch
    "GRID_W",  # patches per canvas row
    "PREMUL",  # 1: RGBA through premultiplied alpha (only when resized)
    "BG",  # 0: drop alpha, 1: chessboard, 2: solid fill
    "BG_SQUARE",
    "BG_TOP_LEFT_WHITE",
    "BG_WHITE",  # the white cells' level, or the solid fill level
    "BG_GRAY",
    "X_XMIN",  # int32 offsets into the coefficient buffer (horizontal axis)
    "X_N",
    "X_K",
    "X_KSIZE",
    "Y_XMIN",  # the same for the vertical axis
    "Y_N",
    "Y_K",
    "Y_KSIZE",
    "OUT_ROW",  # first row of this image among all output rows (resize-only launch)
    "OUT_OFF",  # byte offset of this image's uint8 HWC output (resize-only launch)
    "TABLE",  # element offset of this image's normalise table
    "ROW",  # output row of this image's first patch (other items' rows may sit between)
    "GRID_H",  # patch rows of the canvas
    "TILE_START",  # first tile of this image among all tiles of the fused launch
    "TILES_W",  # tiles per canvas row
    "TILED",  # 1: the tile's source window (and intermediate) in shared memory
    "TILE_PH",  # patches per tile, down and across (fused launch)
    "TILE_PW",
    "SRC_PITCH",  # bytes from one source row to the next (a crop's rows lie in a wider image)
)
"""One image's descriptor row (int64 fields, ``enum Field`` in the kernels; ``NF`` long)."""

RECORD_FIELDS: tuple[str, ...] = (
    "R_IMAGE",  # the tile's image (its descriptor row)
    "R_SRC_LO",  # byte offset in the source of the window's first pixel (low, high word)
    "R_SRC_HI",
    "R_ROW_BYTES",  # the image's source row, in bytes
    "R_USED_W",  # the window's columns and rows the taps use
    "R_USED_H",
    "R_X_SPANS",  # int32 offset of the tile column's first M-block span (at, steps)
    "R_Y_SPANS",  # the same, the tile row's
    "R_X_WORDS",  # int32 offset of the tile column's first M-block A fragments
    "R_Y_WORDS",  # the same, the tile row's
    "R_TILE_H",  # the tile's patches down and across (short at the canvas's edges)
    "R_TILE_W",
    "R_GY0",  # its first patch row and column in the canvas
    "R_GX0",
    "R_PATCH",  # its first patch's output row
    "R_GRID_W",  # patches per canvas row
    "R_TABLE",  # element offset of its image's normalise table
    "R_FLAGS",  # RECORD_FLAGS
    "R_PAD0",  # (a record is five 16-byte loads)
    "R_PAD1",
)
"""An MMA or plain tile's record (int32, ``enum Record``; ``NR`` long): what its block would
otherwise work out from the descriptor (and for MMA the spans) before it could stage its
window or read its pixels, so that starts after one load. A plain tile's has no spans or
fragments, and ``R_PLAIN`` its only flag; its ``R_SRC_*`` is its first pixel and
``R_USED_*`` the part of it inside the image."""

RECORD_FLAGS: dict[str, int] = {
    "R_TWO_STEPS": 1,  # some used wide M-block takes more than one 32-input step
    "R_THREE_STEPS": 128,  # some used wide M-block takes three (modules of TILE_MMA_KS only)
    "R_V_FIRST": 2,  # Pillow resizes this image vertically first
    "R_WHOLE": 4,  # the window's rows start on a word and its groups lie in the image
    "R_RAW": 8,  # gray or RGB passed horizontally first, rows on a word: staged as bytes
    "R_PLAIN": 16,  # a plain tile (its only flag), so a mixed launch tells the kinds apart
    "R_X_NARROW": 32,  # the horizontal pass takes narrow blocks of 8 outputs
    "R_Y_NARROW": 64,  # the vertical pass takes narrow blocks
}
"""The bits of a record's ``R_FLAGS``."""

Kind = Literal["general", "plain", "mma", "mixed"]
KINDS: dict[Kind, int] = {"general": 0, "plain": 1, "mma": 2, "mixed": 3}
"""The fused kernel's kinds (its ``KIND`` template argument, ``enum Kind``): the general
kernel; ``plain`` for unresized images whose tiles fit shared memory (no resize code);
``mma`` for images resized on both axes with an even patch (the passes on the int8 tensor
cores); ``mixed``, one launch of a channel count's plain and MMA tiles (their records say
which: ``R_PLAIN``)."""

NORM_VALUES = 3 * 256
"""A normalise table's values: one per channel and byte."""
NORM_HEADER = 16
"""Elements of the output's storage type after each table: ``(u32 mode, f32 a[3], f32
b[3])`` and padding (32 bytes after a 16-bit table, 64 after an fp32 one), the same count
for every type so the descriptors do not depend on it."""
NORM_STRIDE = NORM_VALUES + NORM_HEADER
"""A table's elements with its header: the ``TABLE`` field steps by this."""
NORM_MODES: dict[str, int] = {"NORM_TABLE": 0, "NORM_BF16": 1, "NORM_F16": 2}
"""A header's mode: read the table, or compute its affine form rounded to bf16 or fp16."""

MMA_KS = 2
"""The most 32-input steps one MMA block of 16 outputs may read (downscales to about 0.35
of a side); an image needing more takes the general kernel."""
TILE_MMA_KS = 3
"""``MMA_KS`` of the modules whose rows are whole tiles (``mma_steps``): Gemma 3 and
InternVL bring large photos down to 896 or 448 pixels a side, where a 16-output block reads
about 80 inputs, which two steps cannot reach. Three steps cost those modules more registers; the
others are compiled as before."""
MMA_MAX_BLOCKS = 16
"""The most 16-output blocks along one side of an MMA tile."""
MMA_GROUP_SHIFT = 16
"""How much further on (bytes) each group of 8 rows of an MMA tile's raw window lies, so a
warp's loads of 8 rows fall in distinct shared-memory banks."""

FUSED_THREADS = 256
"""The fused kernel's largest block (its launch bounds)."""
FUSED_MIN_BLOCKS: dict[Kind, int] = {"general": 5, "plain": 8, "mma": 3, "mixed": 3}
"""The resident blocks a multiprocessor each kind's launch bounds ask for, which caps its
registers: the occupancy matters more than the few values then kept in local memory; plain
tiles need fewer registers, so more blocks hide their loads; MMA tiles' shared memory
(``MMA_SMEM_BYTES``) fits three blocks, so they and mixed launches take three's registers."""

UNIT_BYTES = 8
"""The widest store of a patch unit the host guarantees room and alignment for: ``out``
starts on a multiple of it."""
WIDE_UNIT_BYTES = 16
"""fp32 patches go out in 16-byte units where ``out`` happens to start on 16 bytes."""


class OutputLayout(NamedTuple):
    """How a module writes its rows (``PatchOrder`` in ``patches.cuh``): ``merge`` 0 orders
    an image's patches row-major over its grid, ``m`` by ``m x m`` merge windows; each row
    holds every channel's plane ``temporal`` times, ``(3, T, p, p)``. With ``tile_h`` and
    ``tile_w`` a row is instead one ``(3, tile_h, tile_w)`` tile of a canvas of whole tiles,
    tiles row-major (Gemma 3's and InternVL's rows; 4 divides the patch and ``tile_w``)."""

    merge: int = 0
    temporal: int = 1
    tile_h: int = 0
    tile_w: int = 0


KIMI_LAYOUT = OutputLayout()
"""Rows ``(3, p, p)``, row-major over the grid."""

KERNEL_PROCESSORS: frozenset[str] = frozenset(
    ("kimi_vl", "qwen2_vl", "glm4v", "gemma3", "internvl")
)
"""The processors (``PreprocessSpec.processor``) whose pixels the kernels compute (those
whose rows are whole tiles through ``preprocess_regions``)."""


def _enum(names: tuple[str, ...] | list[str]) -> str:
    """An enum's names as ``MMWIRE_ENUM(A)MMWIRE_ENUM(B)...``: no commas, which nvcc would take
    for separators between defines."""
    return "".join(f"MMWIRE_ENUM({name})" for name in names)


def mma_steps(layout: OutputLayout) -> int:
    """The most 32-input steps of one MMA block in a module of ``layout``: ``TILE_MMA_KS``
    where its rows are whole tiles, else ``MMA_KS`` (the fragment tables the host lays out
    for a launch and the module's ``MMA_KS`` must agree)."""
    return TILE_MMA_KS if layout.tile_w else MMA_KS


def compile_options(patch: int = 0, layout: OutputLayout = KIMI_LAYOUT) -> tuple[str, ...]:
    """The ``-D`` flags every build of the kernels takes: the values above, the patch size a
    module is compiled for (0: any, taken as an argument) and its output layout."""
    values = {
        "MMWIRE_FIELDS": _enum(FIELDS),
        "MMWIRE_RECORD_FIELDS": _enum(RECORD_FIELDS),
        "MMWIRE_KINDS": _enum([k.upper() for k in KINDS]),
        **{name: str(bit) for name, bit in RECORD_FLAGS.items()},
        "NORM_VALUES": str(NORM_VALUES),
        "NORM_HEADER": str(NORM_HEADER),
        "NORM_STRIDE": str(NORM_STRIDE),
        **{name: str(mode) for name, mode in NORM_MODES.items()},
        "MMA_KS": str(mma_steps(layout)),
        "MMA_MAX_BLOCKS": str(MMA_MAX_BLOCKS),
        "MMA_GROUP_SHIFT": str(MMA_GROUP_SHIFT),
        "FUSED_THREADS": str(FUSED_THREADS),
        **{f"FUSED_{k.upper()}_MIN_BLOCKS": str(n) for k, n in FUSED_MIN_BLOCKS.items()},
        "UNIT_BYTES": str(UNIT_BYTES),
        "WIDE_UNIT_BYTES": str(WIDE_UNIT_BYTES),
        "MMWIRE_PATCH": str(patch),
        "MMWIRE_MERGE": str(layout.merge),
        "MMWIRE_TEMPORAL": str(layout.temporal),
        "MMWIRE_TILE_H": str(layout.tile_h),
        "MMWIRE_TILE_W": str(layout.tile_w),
    }
    return tuple(f"-D{name}={value}" for name, value in values.items())
