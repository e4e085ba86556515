"""The producer's deferral gate: ship the image (encoded or raw), or preprocess eagerly."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from mmwire.transport.errors import MaterializeError
from mmwire.transport.images import encoded_image, keeps_alpha, pixel_shape
from PIL import Image

from ._families import ModelSpec
from ._kimi import KimiConfig

__all__ = ["should_defer"]


def _shipped(image: Any, spec: ModelSpec) -> tuple[int, int, int] | None:
    """``(bytes shipped, width, height)`` of a deferrable image, ``None`` if not deferrable:
    encoded bytes as they are (from their header), else its uint8 pixels (4 channels where
    the family keeps alpha for the owner)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        try:
            enc = encoded_image(image, alpha=spec.alpha)
            if enc is not None:
                return len(image), enc.width, enc.height
            h, w, c = pixel_shape(image, alpha=spec.alpha)
        except MaterializeError:
            return None
        return c * w * h, w, h
    if isinstance(image, Image.Image):
        alpha = spec.alpha == "keep" and keeps_alpha(image)
        return (4 if alpha else 3) * image.width * image.height, image.width, image.height
    if isinstance(image, (torch.Tensor, np.ndarray)):
        if image.dtype not in (torch.uint8, np.uint8):
            return None
        if image.ndim == 2:
            return 3 * image.shape[0] * image.shape[1], image.shape[1], image.shape[0]
        if image.ndim == 3 and image.shape[0] in (1, 3, 4):  # CHW
            alpha = spec.alpha == "keep" and image.shape[0] == 4
            w, h = image.shape[2], image.shape[1]
            return (4 if alpha else 3) * w * h, w, h
    return None


def should_defer(
    images: Sequence[Any],
    *,
    transport: str,
    consumer_has_gpu: bool,
    preprocess: ModelSpec | None = None,
) -> bool:
    """Whether a request's preprocessing should be left to its owner rank.

    Defer only on the host (``cpu``) transport to consumers with a GPU, for a non-empty
    list of encoded bytes, PIL images or uint8 tensors whose shipped bytes (encoded: as they
    are; else channels·W·H, 4 channels where the family keeps alpha for the owner) are each
    no larger than their processed fp32 bytes (rows · the family's row values · 4).
    ``preprocess``: the family's spec (``spec_for``; default Kimi-K2.5). An image the family or the
    decoder refuses (Qwen-VL: aspect ratio over 200; bytes that are no image) is not
    deferred: the eager path reports it.
    """
    model: ModelSpec = preprocess or KimiConfig()
    if transport != "cpu" or not consumer_has_gpu or len(images) == 0:
        return False
    row_values = math.prod(model.row_shape)
    for image in images:
        shipped = _shipped(image, model)
        if shipped is None:
            return False
        nbytes, w, h = shipped
        try:
            plan = model.plan(w, h)
        except MaterializeError:
            return False
        if nbytes > plan.grid.patches * row_values * 4:
            return False
    return True
