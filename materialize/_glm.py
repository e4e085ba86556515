"""GLM-4.1V, 4.5V and 4.6V: transformers' ``Glm4vImageProcessor``. Its pixels and rows are
Qwen-VL's; its plan is GLM's own ``smart_resize``, which enlarges an image with a side
under one merge window first and bounds the area of two frames (``temporal_patch_size``),
not one."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from mmwire.transport import Processor, ResizePlan

from ._params import leftover
from ._qwen import (
    QwenVLConfig,
    check_aspect,
    check_size,
    fit_area,
    windowed_fields,
    windowed_plan,
)

__all__ = ["Glm4vConfig", "glm_config", "glm_smart_resize", "plan_glm_resize"]


def glm_smart_resize(
    height: int,
    width: int,
    *,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    temporal_factor: int = 2,
) -> tuple[int, int]:
    """GLM's target ``(height, width)`` for one image (transformers' ``smart_resize`` of
    ``image_processing_glm4v``, operation for operation, with ``num_frames`` the temporal
    factor as its image processor passes it): a side under ``factor`` first scales the image
    up (truncating), then each side rounds to a multiple of ``factor`` and the area of
    ``temporal_factor`` frames is kept within ``[min_pixels, max_pixels]``. Raises
    ``MaterializeError`` for an aspect ratio over 200."""
    check_size(height, width)
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    check_aspect(height, width)
    # the reference rounds num_frames (the temporal factor) to a multiple of itself
    return fit_area(
        height,
        width,
        factor=factor,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        frames=temporal_factor,
    )


def plan_glm_resize(
    width: int,
    height: int,
    *,
    patch_size: int,
    merge_size: int,
    temporal_patch_size: int,
    min_pixels: int,
    max_pixels: int,
) -> ResizePlan:
    """GLM's plan of a ``width x height`` image: no padding, grid ``(1, H/p, W/p)``,
    ``h·w / m²`` tokens."""
    new_h, new_w = glm_smart_resize(
        height,
        width,
        factor=patch_size * merge_size,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        temporal_factor=temporal_patch_size,
    )
    return windowed_plan(width, height, new_h, new_w, patch_size=patch_size, merge_size=merge_size)


@dataclass(frozen=True)
class Glm4vConfig(QwenVLConfig):
    """A GLM-4.xV checkpoint's image preprocessing (defaults: ``Glm4vImageProcessor``'s own,
    ``size`` 112·112 to 28·28·15000 pixels, patch 14, merge 2, two frames, CLIP mean and
    std). Called with an image's size it gives that image's spec."""

    processor: ClassVar[Processor] = "glm4v"

    family: str = "glm-4v"
    min_pixels: int = 112 * 112
    max_pixels: int = 28 * 28 * 15000

    def plan(self, width: int, height: int) -> ResizePlan:
        """GLM's plan of a ``width x height`` image (``MaterializeError`` past the
        aspect-ratio limit)."""
        return plan_glm_resize(
            width,
            height,
            patch_size=self.patch_size,
            merge_size=self.merge_size,
            temporal_patch_size=self.temporal_patch_size,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )


def glm_config(base: Glm4vConfig, given: dict[str, Any]) -> Glm4vConfig:
    """GLM's keys: Qwen-VL's, with the pixel limits only in ``size`` (its processor reads no
    top-level ``min_pixels``/``max_pixels``)."""
    out = windowed_fields(given)
    leftover(given)
    return replace(base, **out)
