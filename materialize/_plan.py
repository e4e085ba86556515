"""Resize plans of one image: Kimi's NaViT plan and Qwen-VL's ``smart_resize``, and Kimi's
checkpoint config (``ProcessorConfig``) that yields its spec."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from mmwire.transport import (
    MAX_IMAGE_PIXELS,
    Background,
    Grid,
    MaterializeError,
    PreprocessSpec,
    ResizePlan,
)

__all__ = [
    "K3_BACKGROUND",
    "MAX_ASPECT_RATIO",
    "ProcessorConfig",
    "expected_plan",
    "plan_resize",
    "plan_smart_resize",
    "smart_resize",
]

MAX_ASPECT_RATIO = 200
"""``smart_resize`` refuses images whose long side is more than this times the short one."""

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
class ProcessorConfig:
    """A checkpoint's preprocessing configuration (defaults: K2.5; K3 sets
    ``in_patch_limit=65536, background=K3_BACKGROUND``)."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    fixed_output_tokens: int | None = None
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    background: Background | None = None
    max_pixels: int = MAX_IMAGE_PIXELS
    """Ceiling on an input image's ``W·H`` (``mmwire.transport.MAX_IMAGE_PIXELS``)."""
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
        """``spec_for``: a config is usable as ``Item(preprocess=config)``."""
        return self.spec_for(width, height)

    def spec_for(self, width: int, height: int) -> PreprocessSpec:
        """The preprocessing spec of one ``width x height`` image under this config.

        Usable as ``Item(preprocess=config.spec_for)`` on the producer.
        """
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


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen-VL's target ``(height, width)``: each side a multiple of ``factor``, the area
    within ``[min_pixels, max_pixels]`` where it can be, the aspect ratio kept as closely as
    that allows (transformers' ``smart_resize``, operation for operation: Python's ``round``
    takes halves to even). Raises ``MaterializeError`` for an aspect ratio over 200."""
    if width <= 0 or height <= 0:
        raise MaterializeError(f"image size must be positive, got {width}x{height}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MaterializeError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got "
            f"{max(height, width) / min(height, width)} ({width}x{height})"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def plan_smart_resize(
    width: int,
    height: int,
    *,
    patch_size: int,
    merge_size: int,
    min_pixels: int,
    max_pixels: int,
) -> ResizePlan:
    """Qwen-VL's plan of a ``width x height`` image: ``smart_resize`` with factor
    ``patch_size · merge_size``, no padding, grid ``(1, H/p, W/p)``, ``h·w / m²`` tokens."""
    f = patch_size * merge_size
    new_h, new_w = smart_resize(
        height, width, factor=f, min_pixels=min_pixels, max_pixels=max_pixels
    )
    gh, gw = new_h // patch_size, new_w // patch_size
    return ResizePlan(
        width=width,
        height=height,
        new_width=new_w,
        new_height=new_h,
        pad_width=0,
        pad_height=0,
        grid=Grid((1, gh, gw)),
        tokens=gh * gw // (merge_size * merge_size),
    )


def expected_plan(spec: PreprocessSpec) -> ResizePlan:
    """The plan a ``plan.width x plan.height`` image gets under the spec's own limits."""
    mh, mw = spec.merge_kernel
    if mh != mw:
        raise ValueError(f"a square merge kernel is needed to plan, got {[mh, mw]}")
    if spec.processor == "qwen2_vl":
        if spec.min_pixels is None or spec.max_pixels is None:  # the schema refuses these
            raise ValueError("a qwen2_vl spec needs min_pixels and max_pixels")
        return plan_smart_resize(
            spec.plan.width,
            spec.plan.height,
            patch_size=spec.patch_size,
            merge_size=mh,
            min_pixels=spec.min_pixels,
            max_pixels=spec.max_pixels,
        )
    return plan_resize(
        spec.plan.width,
        spec.plan.height,
        patch_size=spec.patch_size,
        merge_kernel_size=mh,
        in_patch_limit=spec.in_patch_limit,
        patch_limit_on_one_side=spec.patch_limit_on_one_side,
        fixed_output_tokens=spec.fixed_output_tokens,
    )
