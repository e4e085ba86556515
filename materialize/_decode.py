"""The owner's decode of an encoded item: the same Pillow as the producer would have run,
checked against what the producer read from the header."""

from __future__ import annotations

from typing import Any

import numpy as np
from mmwire.transport import EncodedImage
from mmwire.transport.errors import GridMismatch, MaterializeError
from mmwire.transport.images import AlphaRule, encoded_image, pixels_into

__all__ = ["check_encoded", "decode_encoded"]


def check_encoded(
    data: np.ndarray[Any, Any],
    encoding: EncodedImage,
    alpha: AlphaRule,
    where: str,
    *,
    max_pixels: int,
) -> memoryview:
    """An encoded item's bytes, after checking that their own header says what the envelope
    says (container, size, channels under the item's alpha rule): ``GridMismatch`` if not.
    Reads the header only, so nothing is allocated for a lie."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    try:
        header = encoded_image(raw, max_pixels=max_pixels, alpha=alpha)
    except MaterializeError as e:
        raise type(e)(f"encoded {where}: {e}") from e.__cause__
    if header != encoding:
        raise GridMismatch(
            f"encoded {where}: its bytes hold {_describe(header)}, its envelope declared "
            f"{_describe(encoding)}"
        )
    return raw


def decode_encoded(
    raw: memoryview, alpha: AlphaRule, out: np.ndarray[Any, Any], where: str, *, max_pixels: int
) -> None:
    """Decode checked bytes (:func:`check_encoded`) into ``out`` (``(H, W, C)`` of their
    encoding); bytes that do not decode, or decode to other pixels than their header
    promised, are a ``MaterializeError`` naming the item."""
    try:
        pixels_into(raw, out, max_pixels=max_pixels, alpha=alpha)
    except MaterializeError as e:
        raise type(e)(f"encoded {where}: {e}") from e.__cause__


def _describe(e: EncodedImage | None) -> str:
    if e is None:
        return "no image mmwire ships encoded"
    return f"a {e.width}x{e.height} {e.format} of {e.channels} channels"
