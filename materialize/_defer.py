"""The producer's deferral gate: ship raw uint8 pixels, or preprocess eagerly."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from mmwire.transport import keeps_alpha
from PIL import Image

from ._plan import plan_resize

__all__ = ["should_defer"]


def _raw_geometry(image: Any) -> tuple[int, int, int] | None:
    """``(channels shipped, width, height)`` of a deferrable image, ``None`` if not deferrable."""
    if isinstance(image, Image.Image):
        return (4 if keeps_alpha(image) else 3), image.width, image.height
    if isinstance(image, (torch.Tensor, np.ndarray)):
        if image.dtype not in (torch.uint8, np.uint8):
            return None
        if image.ndim == 2:
            return 3, image.shape[1], image.shape[0]
        if image.ndim == 3 and image.shape[0] in (1, 3, 4):  # CHW
            return (4 if image.shape[0] == 4 else 3), image.shape[2], image.shape[1]
    return None


def should_defer(
    images: Sequence[Any],
    *,
    transport: str,
    consumer_has_gpu: bool,
    patch_size: int = 14,
    merge_kernel_size: int = 2,
    in_patch_limit: int = 16384,
    patch_limit_on_one_side: int = 512,
) -> bool:
    """Whether a request's preprocessing should be left to its owner rank.

    Defer only on the host (``cpu``) transport to consumers with a GPU, for a non-empty
    list of PIL images or uint8 tensors whose raw bytes (channels·W·H, 4 channels when alpha
    is kept) are each no larger than their processed fp32 bytes (3·padded W·padded H·4).
    """
    if transport != "cpu" or not consumer_has_gpu or len(images) == 0:
        return False
    for image in images:
        geo = _raw_geometry(image)
        if geo is None:
            return False
        ch, w, h = geo
        plan = plan_resize(
            w,
            h,
            patch_size=patch_size,
            merge_kernel_size=merge_kernel_size,
            in_patch_limit=in_patch_limit,
            patch_limit_on_one_side=patch_limit_on_one_side,
        )
        if ch * w * h > 3 * plan.padded_width * plan.padded_height * 4:
            return False
    return True
