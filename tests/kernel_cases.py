"""Exactness cases shared by the host build of the kernels (CI) and the GPU (``-m gpu``).

Every case mixes distinct sizes; configs with a small patch limit force resizes so small
images exercise both passes, both pass orders, premultiplied RGBA and the composite.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from mmwire.kernels import (
    Launcher,
    OutputLayout,
    pack,
    preprocess_packed,
    preprocess_regions,
    to_device,
)
from mmwire.kernels.reference import rows_are_tiles
from mmwire.materialize import (
    K3_BACKGROUND,
    Gemma3Config,
    Glm4vConfig,
    InternVLConfig,
    KimiConfig,
    ModelSpec,
    QwenVLConfig,
    preprocess_images,
    regions_of,
)
from mmwire.transport import Background, PanAndScan, PreprocessSpec

Image = np.ndarray[Any, Any]
Items = list[tuple[Image, ModelSpec]]

SMALL = KimiConfig(in_patch_limit=48)
K3_SMALL = KimiConfig(in_patch_limit=48, background=K3_BACKGROUND)
WHITE_BG = KimiConfig(in_patch_limit=40, background=Background(pattern="white"))
CLIP = KimiConfig(
    in_patch_limit=64,
    image_mean=(0.48145466, 0.4578275, 0.40821073),
    image_std=(0.26862954, 0.26130258, 0.27577711),
)
WIDE = KimiConfig(in_patch_limit=128)  # 700 x 300 -> 244 x 104: 0.35 of a side
UNRESIZED = KimiConfig(in_patch_limit=1024)  # up to 32 x 32 patches stay as they are
ODD_PATCH = KimiConfig(patch_size=15, in_patch_limit=40)  # the kernel's pixel-by-pixel path
ODD_PATCH_K3 = KimiConfig(patch_size=15, in_patch_limit=40, background=K3_BACKGROUND)
# Qwen-VL (rows (3, 2, p, p) by 2 x 2 merge window): a small max_pixels forces downscales,
# the min_pixels bound upscales the smallest, sides that are multiples of 28 (32) and within
# the bounds stay as they are (plain tiles)
QWEN_SMALL = QwenVLConfig(max_pixels=28 * 28 * 40)
GLM_SMALL = Glm4vConfig(max_pixels=2 * 28 * 28 * 40)
QWEN_LARGE = QwenVLConfig(max_pixels=28 * 28 * 400)
QWEN3_SMALL = QwenVLConfig(
    family="qwen3-vl",
    patch_size=16,
    min_pixels=32 * 32 * 4,
    max_pixels=32 * 32 * 40,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
)
# rows that are whole tiles, through preprocess_regions, BICUBIC (InternVL) and BILINEAR
# (Gemma 3, with pan-and-scan crops read in place): 32 x 48 tiles written as the tiles
# themselves (patch 16, the build for that tile: TILE_LAYOUT), and through Kimi's rows and a
# copy for tiles cut into patches of 6 and of 7 (odd: the general kernel's pixel by pixel)
TILE_LAYOUT = OutputLayout(tile_h=32, tile_w=48)
INTERNVL_SMALL = InternVLConfig(tile_height=32, tile_width=48, max_tiles=6)
INTERNVL_EVEN = InternVLConfig(tile_height=30, tile_width=42, max_tiles=4)
INTERNVL_ODD = InternVLConfig(tile_height=21, tile_width=35, max_tiles=3)
GEMMA_SMALL = Gemma3Config(width=48, height=32, pan_and_scan=PanAndScan(8, 4, 1.2))
GEMMA_ODD = Gemma3Config(width=35, height=49, pan_and_scan=PanAndScan(20, 3, 1.5))
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BYTES = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _rgba(rng: np.random.Generator, h: int, w: int) -> Image:
    img = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
    pick = rng.integers(0, 3, (h, w))  # alpha 0, 255 and partial, all present
    img[..., 3] = np.where(pick == 0, 0, np.where(pick == 1, 255, img[..., 3]))
    return img


class Shot(NamedTuple):
    """One image of a case: its shape, its config, and for RGBA whether its alpha mixes 0,
    255 and partial values (``_rgba``) rather than uniform random bytes."""

    h: int
    w: int
    c: int
    config: ModelSpec
    mixed_alpha: bool = False


def _shots(config: ModelSpec, *shapes: tuple[int, int, int]) -> tuple[Shot, ...]:
    return tuple(Shot(h, w, c, config) for h, w, c in shapes)


_CASES: dict[str, tuple[Shot, ...]] = {
    "rgb_distinct": _shots(SMALL, (130, 170, 3), (97, 211, 3), (160, 160, 3), (71, 75, 3)),
    "rgba_chessboard": tuple(
        Shot(h, w, 4, K3_SMALL, True) for h, w in ((150, 120), (90, 233), (41, 39))
    ),
    "rgba_drop_and_white": (Shot(140, 101, 4, SMALL, True), Shot(77, 190, 4, WHITE_BG, True)),
    "gray": _shots(SMALL, (123, 99, 1), (60, 250, 1)),
    # tall: vertical first under Pillow >= 13
    "pass_order_flip": _shots(SMALL, (400, 45, 3), (301, 80, 4), (150, 40, 1)),
    # the last two: resized tiles under 4 source columns
    "tiny_and_extreme": _shots(
        SMALL,
        (1, 1, 3),
        (2, 3, 4),
        (5, 1500, 3),
        (1500, 5, 3),
        (1, 900, 1),
        (5000, 3, 4),
        (4600, 3, 3),
    ),
    # the gray 150 x 110 under CLIP: an MMA tile's gray with three different tables
    "mixed_configs": (
        Shot(120, 90, 3, CLIP),
        Shot(88, 131, 4, K3_SMALL, True),
        Shot(33, 47, 1, SMALL),
        Shot(200, 61, 3, SMALL),
        Shot(150, 110, 1, CLIP),
    ),
    # p = 15: no pixel pairs, every store on its own
    "odd_patch": (
        Shot(130, 170, 3, ODD_PATCH),
        Shot(90, 233, 4, ODD_PATCH_K3, True),
        Shot(61, 47, 1, ODD_PATCH),
        Shot(40, 31, 3, ODD_PATCH),
    ),
    # MMA tiles: one and two 32-input steps, 2:1 and wide, rows on a word (staged raw: the
    # first, the gray, 99 x 100 and 300 x 700, whose windows' rows span more granules than
    # a warp has lanes) and off one
    "tensor_core_scales": (
        *_shots(
            SMALL,
            (200, 260, 3),
            (150, 190, 3),
            (210, 172, 1),
            (118, 330, 3),
            (99, 100, 3),
        ),
        Shot(300, 700, 3, WIDE),
        Shot(99, 97, 3, SMALL),
    ),
    # narrow blocks (8 outputs, one 32-input step) on both axes: RGBA and gray and RGB
    # passed vertically first (the second pass's lanes store neighbouring pixels as pairs),
    # RGBA and gray (rows off a word) horizontally first; then one axis narrow and the
    # other wide in two steps, both ways round
    "narrow_blocks": (
        Shot(190, 230, 4, K3_SMALL, True),
        Shot(400, 120, 3, SMALL),
        Shot(360, 130, 4, K3_SMALL, True),
        Shot(201, 233, 1, SMALL),
        Shot(420, 131, 1, SMALL),
        Shot(240, 300, 3, SMALL),
        Shot(300, 245, 3, SMALL),
    ),
    # unresized, several tiles each: tiles wholly inside the image (the plain kernel's loop
    # without padding checks) and tiles at its edges
    "plain_inside": _shots(
        UNRESIZED, (130, 120, 3), (117, 143, 1), (90, 200, 3), (75, 61, 1), (112, 112, 3)
    ),
    # unresized RGB and gray (plain tiles, staged in fp32) and RGB resized on both axes (MMA
    # tiles), for the stores' widths (kernels_into); not in CASES
    "plain_and_mma": _shots(SMALL, (60, 90, 3), (45, 70, 1), (200, 260, 3)),
}
CASES = tuple(name for name in _CASES if name != "plain_and_mma")
"""Kimi's cases (rows (3, p, p)); ``QWEN_CASES`` need a build for the Qwen-VL layout."""

_CASES |= {
    # resized both ways (MMA tiles), upscaled from 1 x 1 and 20 x 30 by min_pixels, one axis
    # only (general tiles), unresized (plain), gray, tall (vertical first under Pillow 13)
    "qwen_distinct": _shots(
        QWEN_SMALL,
        (130, 170, 3),
        (97, 211, 3),
        (56, 84, 3),
        (1, 1, 3),
        (20, 30, 3),
        (123, 99, 1),
        (400, 45, 3),
        (140, 83, 3),
    ),
    "qwen_plain_and_mma": (
        *_shots(QWEN_LARGE, (140, 224, 3), (196, 112, 1), (168, 252, 3)),
        *_shots(QWEN_SMALL, (200, 260, 3), (150, 190, 1)),
    ),
    "qwen3": _shots(QWEN3_SMALL, (130, 170, 3), (64, 96, 3), (97, 211, 1), (1, 1, 3), (300, 70, 3)),
    # GLM's plan: sides under 28 enlarged first, two frames' area bounded
    "glm": _shots(GLM_SMALL, (13, 40, 3), (27, 27, 3), (130, 170, 1), (97, 211, 3), (400, 45, 3)),
}
QWEN_CASES = ("qwen_distinct", "qwen_plain_and_mma", "qwen3", "glm")

_CASES |= {
    # several tiles and a thumbnail (first an RGB image whose rows start on a word and whose
    # thumbnail takes blocks of three steps: staged as planes, not raw), one tile (no
    # thumbnail), gray, extreme, odd sizes
    "internvl": _shots(
        INTERNVL_SMALL,
        (132, 172, 3),
        (130, 170, 3),
        (97, 211, 1),
        (40, 300, 3),
        (20, 21, 3),
        (301, 45, 3),
    ),
    "internvl_even": _shots(INTERNVL_EVEN, (61, 177, 3), (99, 30, 1), (1, 1, 3)),
    "internvl_odd": _shots(INTERNVL_ODD, (77, 50, 3), (33, 131, 1)),
    # wide and tall images with crops (off a word, gray), none under the ratio, tiny, extreme
    "gemma": _shots(GEMMA_SMALL, (60, 203, 3), (151, 45, 1), (77, 91, 3), (1, 1, 3), (33, 500, 3)),
    "gemma_odd": _shots(GEMMA_ODD, (41, 97, 3), (130, 61, 1), (50, 50, 3)),
}
TILED_CASES = ("internvl", "internvl_even", "internvl_odd", "gemma", "gemma_odd")
"""Cases whose rows are whole tiles (``preprocess_regions``)."""


def case(name: str, rng: np.random.Generator) -> Items:
    """The images and configs of one named case (KeyError for an unknown name)."""
    return [
        (
            _rgba(rng, s.h, s.w)
            if s.mixed_alpha
            else rng.integers(0, 256, (s.h, s.w, s.c), dtype=np.uint8),
            s.config,
        )
        for s in _CASES[name]
    ]


def reference(items: Items, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU path (Pillow), image by image, concatenated."""
    outs = [preprocess_images([im], cfg, dtype=dtype) for im, cfg in items]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


Packed = tuple[torch.Tensor, list[tuple[int, int, int]], list[PreprocessSpec]]


def _packed(items: Items, device: str) -> Packed:
    """The images packed on ``device`` (source, shapes) and their specs."""
    src, shapes = pack([torch.from_numpy(im).to(device) for im, _ in items])
    return src, shapes, [cfg(im.shape[1], im.shape[0]) for im, cfg in items]


def kernels(
    items: Items, dtype: torch.dtype, device: str, launcher: Launcher | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels over the same images, packed into one launch on ``device``."""
    src, shapes, specs = _packed(items, device)
    if not rows_are_tiles(specs[0]):
        return preprocess_packed(src, shapes, specs, dtype, launcher=launcher)
    rows = sum(spec.plan.grid.patches for spec in specs)
    out = torch.empty((rows, *specs[0].row_shape), dtype=dtype, device=device)
    regions = [regions_of(spec) for spec in specs]
    preprocess_regions(src, shapes, specs, regions, out, launcher=launcher)
    return out, to_device([spec.plan.grid.thw for spec in specs], src.device)


def kernels_into(
    items: Items, dtype: torch.dtype, device: str, skew: int, launcher: Launcher | None = None
) -> torch.Tensor:
    """The kernels' patches written into an ``out`` that starts ``skew`` values past a fresh
    allocation's start: fp32 goes out as 16-byte stores only where ``out`` starts on 16
    bytes, as pairs where it starts on 8 (the least the kernels accept)."""
    src, shapes, specs = _packed(items, device)
    row = specs[0].row_shape
    rows = sum(spec.plan.grid.patches for spec in specs)
    out = torch.empty(rows * int(np.prod(row)) + skew, dtype=dtype, device=device)[skew:]
    pv, _ = preprocess_packed(
        src, shapes, specs, dtype, out=out.view(rows, *row), launcher=launcher
    )
    assert pv.data_ptr() == out.data_ptr()
    return pv


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements differ bit for bit (shapes must match)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    bits = _BYTES[a.dtype]
    return int((a.cpu().view(bits) != b.cpu().view(bits)).sum())
