"""The NaViT resize plan of one image, and the checkpoint config that yields its spec."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mmwire.transport import Background, Grid, PreprocessSpec, ResizePlan

__all__ = ["K3_BACKGROUND", "ProcessorConfig", "expected_plan", "plan_resize", "spec_for"]

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
    max_pixels: int = 178_956_970

    def spec_for(self, width: int, height: int) -> PreprocessSpec:
        """The preprocessing spec of one ``width x height`` image under this config.

        Usable as ``Item(preprocess=config.spec_for)`` on the producer.
        """
        plan = plan_resize(
            width,
            height,
            patch_size=self.patch_size,
            merge_kernel_size=self.merge_kernel_size,
            in_patch_limit=self.in_patch_limit,
            patch_limit_on_one_side=self.patch_limit_on_one_side,
            fixed_output_tokens=self.fixed_output_tokens,
        )
        return PreprocessSpec(
            plan=plan,
            image_mean=self.image_mean,
            image_std=self.image_std,
            background=self.background,
            patch_size=self.patch_size,
            merge_kernel=(self.merge_kernel_size, self.merge_kernel_size),
            in_patch_limit=self.in_patch_limit,
            patch_limit_on_one_side=self.patch_limit_on_one_side,
            fixed_output_tokens=self.fixed_output_tokens,
        )


def expected_plan(spec: PreprocessSpec) -> ResizePlan:
    """The plan a ``plan.width x plan.height`` image gets under the spec's own limits."""
    mh, mw = spec.merge_kernel
    if mh != mw:
        raise ValueError(f"a square merge kernel is needed to plan, got {[mh, mw]}")
    return plan_resize(
        spec.plan.width,
        spec.plan.height,
        patch_size=spec.patch_size,
        merge_kernel_size=mh,
        in_patch_limit=spec.in_patch_limit,
        patch_limit_on_one_side=spec.patch_limit_on_one_side,
        fixed_output_tokens=spec.fixed_output_tokens,
    )


_DEFAULT = ProcessorConfig()


def spec_for(width: int, height: int) -> PreprocessSpec:
    """The spec of one image under the default (K2.5) config: ``Item(preprocess=spec_for)``."""
    return _DEFAULT.spec_for(width, height)
