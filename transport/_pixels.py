"""The one input contract for images, shared by the producer and the materializer.

``publish`` (for raw items) and ``preprocess_images`` both turn what the caller gives into
uint8 ``(H, W, C)`` pixels here, so they accept, convert and refuse the same inputs with the
same errors:

* encoded bytes (``bytes``, ``bytearray``, ``memoryview``): decoded by Pillow; the size is
  checked from the header before any pixel is decoded; anything Pillow cannot decode is an
  :class:`ImageDecodeError` with Pillow's error as ``__cause__``.
* PIL images of 8-bit modes (``1 L LA La P PA RGB RGBA RGBa RGBX CMYK YCbCr LAB HSV``): the
  checkpoint's channel rule: RGBA iff the mode is not RGB and has an A band or a
  ``transparency`` entry, else RGB; ``L`` stays one channel. 16-bit and float modes
  (``I;16``, ``I``, ``F``) are refused: the processor's ``convert`` would clamp them to
  0..255 and the model would see a different image.
* uint8 arrays or CPU tensors: ``(H, W)``, ``(H, W, C)`` or ``(C, H, W)`` with C in 1/3/4
  (HWC when the last axis is 1, 3 or 4). Float pixels are refused: normalisation folds in
  1/255, so they are always a caller bug.

Transparency follows the item's processor (``PreprocessSpec.alpha``): ``keep`` is the rule
above (Kimi: the owner resizes RGBA and applies its background); ``white`` is transformers'
``convert_to_rgb`` (Qwen-VL): an image with an A band or a ``transparency`` entry, or a
4-channel array, is composited over white, ``round(a/255·c + (1 - a/255)·255)``, which is
Pillow's ``alpha_composite`` over opaque white for every byte pair too; the result is RGB
(gray stays one channel either way: converting it to RGB repeats it).

Every refusal is a :class:`MaterializeError`; empty images and images over ``max_pixels``
are refused too.
"""

from __future__ import annotations

import io
import warnings
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from ._errors import ImageDecodeError, MaterializeError

__all__ = ["SUPPORTED_MODES", "AlphaRule", "image_size", "keeps_alpha", "to_pixels"]

AlphaRule = Literal["keep", "white"]

SUPPORTED_MODES = frozenset(
    {"1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV"}
)
"""PIL modes an image may have; others (16-bit, float) are refused."""

_DEFAULT_MAX_PIXELS = 178_956_970  # Pillow's DecompressionBombError threshold


def keeps_alpha(image: Image.Image) -> bool:
    """An image keeps alpha (becomes RGBA) iff its mode is not RGB and it has an A band or a
    ``transparency`` entry; otherwise it becomes RGB (L is shipped as one channel)."""
    return image.mode != "RGB" and ("A" in image.getbands() or "transparency" in image.info)


def _over_white_table() -> np.ndarray[Any, Any]:
    a = np.arange(256, dtype=np.float64)[:, None] / 255
    c = np.arange(256, dtype=np.float64)[None, :]
    return np.round(a * c + (1 - a) * 255).astype(np.uint8)  # [alpha, channel]


_OVER_WHITE = _over_white_table()


def over_white(rgba: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``(H, W, 4)`` uint8 composited over opaque white: ``(H, W, 3)``."""
    out: np.ndarray[Any, Any] = _OVER_WHITE[rgba[:, :, 3:4], rgba[:, :, :3]]
    return out


def to_pixels(
    image: Any, *, max_pixels: int = _DEFAULT_MAX_PIXELS, alpha: AlphaRule = "keep"
) -> np.ndarray[Any, Any]:
    """uint8 ``(H, W, C)`` pixels, C = 3 (RGB), 4 (RGBA: alpha kept) or 1 (gray).

    Takes encoded bytes, a PIL image, or a uint8 array/CPU tensor (see the module's
    contract); ``alpha="white"`` composites transparency over white (never C = 4). Raises
    :class:`MaterializeError` (:class:`ImageDecodeError` for bytes that do not decode) for
    anything else.
    """
    if isinstance(image, (bytes, bytearray, memoryview)):
        return _decode(image, max_pixels, alpha)
    if isinstance(image, Image.Image):
        return _from_pil(image, max_pixels, alpha)
    arr = _array(image)
    _check_size(arr.shape[1], arr.shape[0], max_pixels)
    if alpha == "white" and arr.shape[2] == 4:
        return over_white(arr)
    return np.ascontiguousarray(arr)


def image_size(image: Any) -> tuple[int, int]:
    """``(width, height)`` of what :func:`to_pixels` takes, without decoding any pixels
    (encoded bytes: from the header). Refuses what it would refuse for its type, shape or
    emptiness."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        try:
            with Image.open(io.BytesIO(bytes(image))) as im:
                width, height = im.width, im.height
        except Exception as e:  # Pillow raises many types for hostile bytes
            raise ImageDecodeError(f"{len(image)} bytes are not an image: {e}") from e
    elif isinstance(image, Image.Image):
        width, height = image.width, image.height
    else:
        arr = _array(image)
        width, height = arr.shape[1], arr.shape[0]
    _check_size(width, height, max_pixels=width * height)
    return width, height


def _array(image: Any) -> np.ndarray[Any, Any]:
    """A uint8 ``(H, W, C)`` view of an array or CPU tensor, or a ``MaterializeError``."""
    if isinstance(image, torch.Tensor):
        if image.dtype != torch.uint8:
            raise MaterializeError(
                f"pixels must be uint8, got a {image.dtype} tensor (normalisation folds in "
                "1/255, so float pixels are a caller bug)"
            )
        if image.device.type != "cpu":
            raise MaterializeError(f"pixels must be on the CPU here, not on {image.device}")
        image = image.detach().numpy()
    if not isinstance(image, np.ndarray):
        raise MaterializeError(
            f"cannot take {type(image).__name__} as an image: give encoded bytes, a PIL image "
            "or uint8 pixels"
        )
    if image.dtype != np.uint8:
        raise MaterializeError(f"pixels must be uint8, got {image.dtype}")
    if image.ndim == 2:
        arr = image[:, :, None]
    elif image.ndim == 3 and image.shape[0] in (1, 3, 4) and image.shape[2] not in (1, 3, 4):
        arr = np.moveaxis(image, 0, -1)
    elif image.ndim == 3 and image.shape[2] in (1, 3, 4):
        arr = image
    else:
        raise MaterializeError(
            f"pixels must be HW, CHW or HWC with 1/3/4 channels, got {list(image.shape)}"
        )
    return arr


def _check_size(width: int, height: int, max_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise MaterializeError(f"image {width}x{height} is empty")
    if width * height > max_pixels:
        raise MaterializeError(
            f"image {width}x{height} is over the pixel ceiling {max_pixels} (`max_pixels`)"
        )


def _from_pil(image: Image.Image, max_pixels: int, alpha: AlphaRule) -> np.ndarray[Any, Any]:
    if image.mode not in SUPPORTED_MODES:
        raise MaterializeError(
            f"image mode `{image.mode}` is not supported: 8-bit modes only "
            f"({' '.join(sorted(SUPPORTED_MODES))})"
        )
    _check_size(image.width, image.height, max_pixels)
    try:
        transparent = "A" in image.getbands() or image.info.get("transparency") is not None
        if alpha == "white" and transparent:
            return over_white(np.asarray(image.convert("RGBA")))
        if alpha == "keep" and keeps_alpha(image):
            image = image.convert("RGBA")
        elif image.mode != "L":
            image = image.convert("RGB")
        arr = np.asarray(image)
    except (OSError, ValueError, SyntaxError) as e:  # a lazily loaded file that is cut short
        raise ImageDecodeError(f"the image's pixels do not decode: {e}") from e
    return arr[:, :, None] if arr.ndim == 2 else arr


def _decode(
    data: bytes | bytearray | memoryview, max_pixels: int, alpha: AlphaRule
) -> np.ndarray[Any, Any]:
    raw = data if isinstance(data, bytes) else bytes(data)  # any memoryview, contiguous or not
    try:
        with warnings.catch_warnings():
            # The ceiling is ours (`max_pixels`), checked below from the header alone.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(raw)) as im:
                _check_size(im.width, im.height, max_pixels)
                if im.mode not in SUPPORTED_MODES:
                    return _from_pil(im, max_pixels, alpha)  # refuses it
                im.load()
                return _from_pil(im, max_pixels, alpha)
    except MaterializeError:
        raise
    except Image.DecompressionBombError as e:
        raise MaterializeError(f"encoded image is over Pillow's pixel ceiling: {e}") from e
    except Exception as e:  # Pillow raises many types for hostile bytes
        raise ImageDecodeError(
            f"{len(raw)} bytes do not decode as an image: {type(e).__name__}: {e}"
        ) from e
