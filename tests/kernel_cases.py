"""Exactness cases shared by the host build of the kernels (CI) and the GPU (``-m gpu``).

Every case mixes distinct sizes; configs with a small patch limit force resizes so small
images exercise both passes, both pass orders, premultiplied RGBA and the composite.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from mmwire.kernels import Launcher, pack, preprocess_packed
from mmwire.materialize import K3_BACKGROUND, ProcessorConfig, preprocess_images
from mmwire.transport import Background, PreprocessSpec

Image = np.ndarray[Any, Any]
Items = list[tuple[Image, ProcessorConfig]]

SMALL = ProcessorConfig(in_patch_limit=48)
K3_SMALL = ProcessorConfig(in_patch_limit=48, background=K3_BACKGROUND)
WHITE_BG = ProcessorConfig(in_patch_limit=40, background=Background(pattern="white"))
CLIP = ProcessorConfig(
    in_patch_limit=64,
    image_mean=(0.48145466, 0.4578275, 0.40821073),
    image_std=(0.26862954, 0.26130258, 0.27577711),
)
WIDE = ProcessorConfig(in_patch_limit=128)  # 700 x 300 -> 244 x 104: 0.35 of a side
UNRESIZED = ProcessorConfig(in_patch_limit=1024)  # up to 32 x 32 patches stay as they are
ODD_PATCH = ProcessorConfig(patch_size=15, in_patch_limit=40)  # the kernel's pixel-by-pixel path
ODD_PATCH_K3 = ProcessorConfig(patch_size=15, in_patch_limit=40, background=K3_BACKGROUND)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BYTES = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _rgba(rng: np.random.Generator, h: int, w: int) -> Image:
    img = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
    pick = rng.integers(0, 3, (h, w))  # alpha 0, 255 and partial, all present
    img[..., 3] = np.where(pick == 0, 0, np.where(pick == 1, 255, img[..., 3]))
    return img


def case(name: str, rng: np.random.Generator) -> Items:
    """The images and configs of one named case."""
    u8 = lambda *s: rng.integers(0, 256, s, dtype=np.uint8)  # noqa: E731
    if name == "rgb_distinct":
        return [(u8(h, w, 3), SMALL) for h, w in ((130, 170), (97, 211), (160, 160), (71, 75))]
    if name == "rgba_chessboard":
        return [(_rgba(rng, h, w), K3_SMALL) for h, w in ((150, 120), (90, 233), (41, 39))]
    if name == "rgba_drop_and_white":
        return [(_rgba(rng, 140, 101), SMALL), (_rgba(rng, 77, 190), WHITE_BG)]
    if name == "gray":
        return [(u8(h, w, 1), SMALL) for h, w in ((123, 99), (60, 250))]
    if name == "pass_order_flip":  # tall: vertical first under Pillow >= 13
        return [(u8(h, w, c), SMALL) for h, w, c in ((400, 45, 3), (301, 80, 4), (150, 40, 1))]
    if name == "tiny_and_extreme":  # the last two: resized tiles under 4 source columns
        return [
            (u8(h, w, c), SMALL)
            for h, w, c in (
                (1, 1, 3),
                (2, 3, 4),
                (5, 1500, 3),
                (1500, 5, 3),
                (1, 900, 1),
                (5000, 3, 4),
                (4600, 3, 3),
            )
        ]
    if name == "mixed_configs":
        return [
            (u8(120, 90, 3), CLIP),
            (_rgba(rng, 88, 131), K3_SMALL),
            (u8(33, 47, 1), SMALL),
            (u8(200, 61, 3), SMALL),
        ]
    if name == "odd_patch":  # p = 15: no pixel pairs, every store on its own
        return [
            (u8(130, 170, 3), ODD_PATCH),
            (_rgba(rng, 90, 233), ODD_PATCH_K3),
            (u8(61, 47, 1), ODD_PATCH),
            (u8(40, 31, 3), ODD_PATCH),
        ]
    if name == "tensor_core_scales":  # MMA tiles: one and two 32-input steps, 2:1 and wide,
        # rows on a word (staged raw: the first, the gray, 99 x 100 and 300 x 700, whose
        # windows' rows span more granules than a warp has lanes) and off one
        return [
            (u8(h, w, c), WIDE if w == 700 else SMALL)
            for h, w, c in (
                (200, 260, 3),
                (150, 190, 3),
                (210, 172, 1),
                (118, 330, 3),
                (99, 100, 3),
                (300, 700, 3),
                (99, 97, 3),
            )
        ]
    if name == "plain_inside":  # unresized, several tiles each: tiles wholly inside the
        # image (the plain kernel's loop without padding checks) and tiles at its edges
        return [
            (u8(h, w, c), UNRESIZED)
            for h, w, c in ((130, 120, 3), (117, 143, 1), (90, 200, 3), (75, 61, 1), (112, 112, 3))
        ]
    if name == "plain_and_mma":  # unresized RGB and gray (plain tiles, staged in fp32) and
        # RGB resized on both axes (MMA tiles), for the stores' widths (kernels_into)
        return [(u8(h, w, c), SMALL) for h, w, c in ((60, 90, 3), (45, 70, 1), (200, 260, 3))]
    raise KeyError(name)


CASES = (
    "rgb_distinct",
    "rgba_chessboard",
    "rgba_drop_and_white",
    "gray",
    "pass_order_flip",
    "tiny_and_extreme",
    "mixed_configs",
    "odd_patch",
    "tensor_core_scales",
    "plain_inside",
)


def reference(items: Items, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU path (Pillow), image by image, concatenated."""
    outs = [preprocess_images([im], cfg, dtype=dtype) for im, cfg in items]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


Packed = tuple[torch.Tensor, list[tuple[int, int, int]], list[PreprocessSpec]]


def _packed(items: Items, device: str) -> Packed:
    """The images packed on ``device`` (source, shapes) and their specs."""
    src, shapes = pack([torch.from_numpy(im).to(device) for im, _ in items])
    return src, shapes, [cfg.spec_for(im.shape[1], im.shape[0]) for im, cfg in items]


def kernels(
    items: Items, dtype: torch.dtype, device: str, launcher: Launcher | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels over the same images, packed into one launch on ``device``."""
    src, shapes, specs = _packed(items, device)
    return preprocess_packed(src, shapes, specs, dtype, launcher=launcher)


def kernels_into(
    items: Items, dtype: torch.dtype, device: str, skew: int, launcher: Launcher | None = None
) -> torch.Tensor:
    """The kernels' patches written into an ``out`` that starts ``skew`` values past a fresh
    allocation's start: fp32 goes out as 16-byte stores only where ``out`` starts on 16
    bytes, as pairs where it starts on 8 (the least the kernels accept)."""
    src, shapes, specs = _packed(items, device)
    p = specs[0].patch_size
    rows = sum(spec.plan.grid.patches for spec in specs)
    out = torch.empty(rows * 3 * p * p + skew, dtype=dtype, device=device)[skew:]
    pv, _ = preprocess_packed(
        src, shapes, specs, dtype, out=out.view(rows, 3, p, p), launcher=launcher
    )
    assert pv.data_ptr() == out.data_ptr()
    return pv


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements differ bit for bit (shapes must match)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    bits = _BYTES[a.dtype]
    return int((a.cpu().view(bits) != b.cpu().view(bits)).sum())
