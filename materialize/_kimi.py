"""Kimi (K2.5, K3): the NaViT resize plan, never upscaling, and ``KimiConfig``, the
checkpoint's preprocessing that yields each image's spec."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

from mmwire.transport import Background, Grid, PreprocessSpec, ResizePlan
from mmwire.transport.errors import ConfigurationError
from mmwire.transport.images import MAX_IMAGE_PIXELS

from ._params import leftover, take, triple

__all__ = ["K3_BACKGROUND", "KimiConfig", "kimi_config", "plan_resize"]

K3_BACKGROUND = Background(pattern="chessboard", square=8, top_left_white=True, white=255, gray=180)
"""The K3 checkpoints' transparent background: chessboard, square 8, white 255, gray 180."""


def plan_resize(
    width: int,
    height: int,
    *,
    patch_size: int = 14,
    merge_kernel_size: int = 2,
    in_patch_limit: int = 16384,
    patch_limit_on_one_side: int = 512,
    fixed_output_tokens: int | None = None,
) -> ResizePlan:
    """The checkpoint's resize plan for a ``width x height`` image; never upscales.

    The limit bounds the patch count *before* padding, so the padded count can exceed it;
    an image smaller than one patch still gets a ``merge·patch`` canvas; each side is capped
    at ``patch_limit_on_one_side·patch_size``; ``fixed_output_tokens`` changes the token
    count only. These corners are the checkpoint's and are kept, not fixed.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    p, m, side = patch_size, merge_kernel_size, patch_limit_on_one_side
    s1 = math.sqrt(in_patch_limit / (max(1, width // p) * max(1, height // p)))
    s2 = side * p / width
    s3 = side * p / height
    scale = min(1.0, s1, s2, s3)
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    f = m * p
    pad_w = (f - new_w % f) % f
    pad_h = (f - new_h % f) % f
    tokens = fixed_output_tokens or ((new_h + pad_h) // f) * ((new_w + pad_w) // f)
    grid = Grid((1, (new_h + pad_h) // p, (new_w + pad_w) // p))
    return ResizePlan(
        width=width,
        height=height,
        new_width=new_w,
        new_height=new_h,
        pad_width=pad_w,
        pad_height=pad_h,
        grid=grid,
        tokens=tokens,
    )


@dataclass(frozen=True)
class KimiConfig:
    """A Kimi checkpoint's image preprocessing (defaults: K2.5; K3 sets
    ``in_patch_limit=65536, background=K3_BACKGROUND``). Called with an image's size it
    gives that image's spec, so it is usable as ``Item(preprocess=config)``."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    fixed_output_tokens: int | None = None
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    background: Background | None = None
    max_pixels: int = MAX_IMAGE_PIXELS
    """Ceiling on an input image's ``W·H`` (``mmwire.transport.images.MAX_IMAGE_PIXELS``)."""
    family: str = "kimi-k2.5"

    @property
    def max_input_pixels(self) -> int:
        """Ceiling on an input image's ``W·H`` (``max_pixels``)."""
        return self.max_pixels

    @property
    def alpha(self) -> Literal["keep", "white"]:
        """Transparency is kept for the owner (see ``PreprocessSpec.alpha``)."""
        return "keep"

    @property
    def row_shape(self) -> tuple[int, ...]:
        """One patch's row of ``pixel_values``: ``(3, p, p)``."""
        return (3, self.patch_size, self.patch_size)

    @property
    def merge_kernel(self) -> tuple[int, int]:
        """The merge window ``(mh, mw)`` the LLM tokens pool."""
        return (self.merge_kernel_size, self.merge_kernel_size)

    def tokens(self, width: int, height: int) -> int:
        """LLM tokens of a ``width x height`` image."""
        return self.plan(width, height).tokens

    def plan(self, width: int, height: int) -> ResizePlan:
        """The resize plan of a ``width x height`` image."""
        return plan_resize(
            width,
            height,
            patch_size=self.patch_size,
            merge_kernel_size=self.merge_kernel_size,
            in_patch_limit=self.in_patch_limit,
            patch_limit_on_one_side=self.patch_limit_on_one_side,
            fixed_output_tokens=self.fixed_output_tokens,
        )

    def __call__(self, width: int, height: int) -> PreprocessSpec:
        """The preprocessing spec of one ``width x height`` image under this config."""
        return PreprocessSpec(
            plan=self.plan(width, height),
            image_mean=self.image_mean,
            image_std=self.image_std,
            background=self.background,
            patch_size=self.patch_size,
            merge_kernel=(self.merge_kernel_size, self.merge_kernel_size),
            in_patch_limit=self.in_patch_limit,
            patch_limit_on_one_side=self.patch_limit_on_one_side,
            fixed_output_tokens=self.fixed_output_tokens,
        )


def kimi_config(base: KimiConfig, given: dict[str, Any]) -> KimiConfig:
    """Kimi's keys; ``merge_kernel_size`` may be a pair (square only); ``background`` a
    dict of :class:`Background`'s fields (or ``None``)."""
    out: dict[str, Any] = {}
    if "merge_kernel_size" in given:
        merge = given.pop("merge_kernel_size")
        if isinstance(merge, (list, tuple)):
            if len(set(merge)) != 1:
                raise ConfigurationError(f"a square merge kernel is needed, got {merge}")
            merge = merge[0]
        out["merge_kernel_size"] = int(merge)
    if "background" in given:
        bg = given.pop("background")
        out["background"] = bg if bg is None or isinstance(bg, Background) else Background(**bg)
    take(
        given,
        out,
        {
            "patch_size": int,
            "in_patch_limit": int,
            "patch_limit_on_one_side": int,
            "fixed_output_tokens": lambda v: None if v is None else int(v),
            "image_mean": triple,
            "image_std": triple,
        },
    )
    leftover(given)
    return replace(base, **out)
