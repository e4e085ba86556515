"""The checkpoint's channel rule for PIL images, shared by the producer and the materializer."""

from __future__ import annotations

from PIL import Image

__all__ = ["keeps_alpha"]


def keeps_alpha(image: Image.Image) -> bool:
    """An image keeps alpha (becomes RGBA) iff its mode is not RGB and it has an A band or a
    ``transparency`` entry; otherwise it becomes RGB (L is shipped as one channel)."""
    return image.mode != "RGB" and ("A" in image.getbands() or "transparency" in image.info)
