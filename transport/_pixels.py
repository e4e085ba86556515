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

What decoding an untrusted file may cost is bounded before it starts: the size is read from
the header and checked against ``max_pixels`` (default :data:`MAX_IMAGE_PIXELS`, 40 MP: a
photo from any phone or camera fits, a 13000x13000 canvas declared in a 96-byte animated
WebP does not); animated files decode their first frame only, which is what the reference
processors see; a JPEG with more scans than any encoder writes, or whose last scan has no
end, is refused from its bytes (a truncated JPEG otherwise decodes with its missing part
filled in, without an error); other truncated bodies fail in Pillow's decoder. All of them
are :class:`ImageDecodeError`.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from typing import Any, Literal, final

import msgspec
import numpy as np
from PIL import Image

from ._arrow import decode_single_block, pixel_view
from ._schema import ENCODED_FORMATS, EncodedImage
from ._torch import is_tensor
from .errors import ImageDecodeError, MaterializeError

__all__ = [
    "MAX_IMAGE_PIXELS",
    "SUPPORTED_MODES",
    "AlphaRule",
    "ImageHeader",
    "encoded_image",
    "image_size",
    "keeps_alpha",
    "pixel_shape",
    "pixels_into",
    "to_pixels",
]

AlphaRule = Literal["keep", "white"]
Shape = tuple[int, int, int]

SUPPORTED_MODES = frozenset(
    {"1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV"}
)
"""PIL modes an image may have; others (16-bit, float) are refused."""

MAX_IMAGE_PIXELS = 40_000_000
"""The default per-image pixel ceiling (``W·H``) of the producer, the owner and the codec."""

_DEFAULT_MAX_PIXELS = MAX_IMAGE_PIXELS

_MAX_JPEG_SCANS = 100
"""More scans than any encoder writes (libjpeg's progressive mode: about 10). Each scan of a
progressive JPEG walks every block of the image, so scans multiply its decode time."""


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
        with _opened(image) as im:
            out = np.empty(_pil_shape(im, max_pixels, alpha), np.uint8)
            _pil_into(im, out, alpha, decode=True)
            return out
    if isinstance(image, Image.Image):
        out = np.empty(_pil_shape(image, max_pixels, alpha), np.uint8)
        _pil_into(image, out, alpha, decode=False)
        return out
    arr = _array(image)
    _check_size(arr.shape[1], arr.shape[0], max_pixels)
    if alpha == "white" and arr.shape[2] == 4:
        return over_white(arr)
    return np.ascontiguousarray(arr)


def encoded_image(
    data: bytes | bytearray | memoryview,
    *,
    max_pixels: int = _DEFAULT_MAX_PIXELS,
    alpha: AlphaRule = "keep",
) -> EncodedImage | None:
    """What encoded ``data`` holds, from its header alone (no pixel decoded): its container,
    size and the channels decoding gives under ``alpha``; ``None`` for a container outside
    ``ENCODED_FORMATS`` (decode those before shipping). Refuses what :func:`to_pixels`
    would refuse before decoding: bytes that are no image, a mode it does not take, a size
    past ``max_pixels``."""
    return ImageHeader(data).encoded(max_pixels=max_pixels, alpha=alpha)


def pixel_shape(
    image: Any, *, max_pixels: int = _DEFAULT_MAX_PIXELS, alpha: AlphaRule = "keep"
) -> tuple[int, int, int]:
    """The ``(H, W, C)`` :func:`to_pixels` would return, without decoding any pixels
    (encoded bytes: from the header), refusing what it would refuse before decoding."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return ImageHeader(image).shape(max_pixels=max_pixels, alpha=alpha)
    if isinstance(image, Image.Image):
        return _pil_shape(image, max_pixels, alpha)
    arr = _array(image)
    _check_size(arr.shape[1], arr.shape[0], max_pixels)
    return arr.shape[0], arr.shape[1], 3 if alpha == "white" and arr.shape[2] == 4 else arr.shape[2]


def pixels_into(
    image: Any,
    out: np.ndarray[Any, Any],
    *,
    max_pixels: int = _DEFAULT_MAX_PIXELS,
    alpha: AlphaRule = "keep",
) -> None:
    """Write :func:`to_pixels` of ``image`` into ``out`` (uint8, C-contiguous, the shape
    :func:`pixel_shape` gave), decoding straight from Pillow's memory where Pillow exports
    it: one copy. A decoded image whose shape is not ``out``'s is a ``MaterializeError``."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        with _opened(image) as im:
            _expect(out, _pil_shape(im, max_pixels, alpha))
            _pil_into(im, out, alpha, decode=True)
        return
    if isinstance(image, Image.Image):
        _expect(out, _pil_shape(image, max_pixels, alpha))
        _pil_into(image, out, alpha, decode=False)
        return
    arr = to_pixels(image, max_pixels=max_pixels, alpha=alpha)
    _expect(out, arr.shape)
    np.copyto(out, arr)


@final
class ImageHeader:
    """Encoded bytes' header, read once (no pixel decoded): what :func:`image_size`,
    :func:`encoded_image` and :func:`pixel_shape` say of them, without opening the file
    again for each. Opening is most of their cost (Pillow parses a JPEG's markers in
    Python: about 100 µs), and a publish needs all three. Raises as they do when the bytes
    are no image or a JPEG's body is refused."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        with _opened(data) as im:
            # closed when this block ends: its mode, size, info and format stay readable
            self._image = im
        _check_size(im.width, im.height, max_pixels=im.width * im.height)  # empty

    @property
    def size(self) -> tuple[int, int]:
        """``(width, height)``, as the header declares them."""
        return self._image.width, self._image.height

    def shape(self, *, max_pixels: int = _DEFAULT_MAX_PIXELS, alpha: AlphaRule = "keep") -> Shape:
        """:func:`pixel_shape` of these bytes."""
        return _pil_shape(self._image, max_pixels, alpha)

    def encoded(
        self, *, max_pixels: int = _DEFAULT_MAX_PIXELS, alpha: AlphaRule = "keep"
    ) -> EncodedImage | None:
        """:func:`encoded_image` of these bytes."""
        height, width, channels = _pil_shape(self._image, max_pixels, alpha)
        fmt = self._image.format
        if fmt not in ENCODED_FORMATS:
            return None
        return msgspec.convert(
            {"format": fmt, "width": width, "height": height, "channels": channels},
            EncodedImage,
        )


def image_size(image: Any) -> tuple[int, int]:
    """``(width, height)`` of what :func:`to_pixels` takes, without decoding any pixels
    (encoded bytes: from the header). Refuses what it would refuse for its type, shape or
    emptiness."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        width, height = ImageHeader(image).size
    elif isinstance(image, Image.Image):
        width, height = image.width, image.height
    else:
        arr = _array(image)
        width, height = arr.shape[1], arr.shape[0]
    _check_size(width, height, max_pixels=width * height)
    return width, height


def _array(image: Any) -> np.ndarray[Any, Any]:
    """A uint8 ``(H, W, C)`` view of an array or CPU tensor, or a ``MaterializeError``."""
    if is_tensor(image):
        import torch

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


def _expect(out: np.ndarray[Any, Any], shape: tuple[int, ...]) -> None:
    if out.dtype != np.uint8 or tuple(out.shape) != tuple(shape):
        raise MaterializeError(
            f"the image decodes to {list(shape)} uint8, its destination is "
            f"{list(out.shape)} {out.dtype}"
        )


def _pil_shape(image: Image.Image, max_pixels: int, alpha: AlphaRule) -> tuple[int, int, int]:
    """``(H, W, C)`` of an image under the channel rules, from its mode and info alone."""
    if image.mode not in SUPPORTED_MODES:
        raise MaterializeError(
            f"image mode `{image.mode}` is not supported: 8-bit modes only "
            f"({' '.join(sorted(SUPPORTED_MODES))})"
        )
    _check_size(image.width, image.height, max_pixels)
    if alpha == "white":
        channels = 3 if _transparent(image) or image.mode != "L" else 1
    else:
        channels = 4 if keeps_alpha(image) else 1 if image.mode == "L" else 3
    return image.height, image.width, channels


def _transparent(image: Image.Image) -> bool:
    """transformers' test for compositing: an A band or a ``transparency`` entry."""
    return "A" in image.getbands() or image.info.get("transparency") is not None


def _pil_into(
    image: Image.Image, out: np.ndarray[Any, Any], alpha: AlphaRule, decode: bool
) -> None:
    """An image's pixels under the channel rules into ``out`` (its ``_pil_shape``).

    ``decode``: ``image`` is a file opened here, whose pixels go into one block of memory,
    so that they are read in place."""
    try:
        single = decode_single_block(image) if decode else False
        if alpha == "white" and _transparent(image):
            np.copyto(out, over_white(np.asarray(image.convert("RGBA"))))
            return
        channels = out.shape[2]
        want = {1: "L", 3: "RGB", 4: "RGBA"}[channels]
        final = image if image.mode == want else image.convert(want)
        view = pixel_view(final, single_block=single and final is image)
        if view is None:
            np.copyto(out, np.asarray(final).reshape(out.shape))
        elif view.shape[2] == channels:
            np.copyto(out, view)
        else:  # RGB held as RGBX: a strided gather, which torch does faster than numpy
            import torch

            torch.from_numpy(out).copy_(torch.from_numpy(view[:, :, :channels]))
    except (OSError, ValueError, SyntaxError) as e:  # a lazily loaded file that is cut short
        raise ImageDecodeError(f"the image's pixels do not decode: {e}") from e


def _check_jpeg_body(raw: bytes) -> None:
    """``ImageDecodeError`` for a JPEG with more scans than ``_MAX_JPEG_SCANS`` or whose last
    scan never ends. Entropy-coded data never holds ``FF DA`` (start of scan) or ``FF D9``
    (end of image): a 0xFF there is followed by 0x00 or a restart marker.

    The markers are found from the 0xFF bytes, with numpy: ``bytes.count`` and ``find`` of a
    two-byte marker ran at about 1 GB/s or less, 1.1 ms for a 356 KiB JPEG (more than blake3 takes
    to hash it)."""
    body = np.frombuffer(raw, np.uint8)
    at = np.flatnonzero(body[:-1] == 0xFF)
    follows = body[at + 1]
    starts = at[follows == 0xDA]
    if len(starts) > _MAX_JPEG_SCANS:
        raise ImageDecodeError(
            f"the JPEG has {len(starts)} scans, over {_MAX_JPEG_SCANS}: no encoder writes that many"
        )
    last = int(starts[-1]) if len(starts) else 0
    if not np.any(at[follows == 0xD9] >= last):
        raise ImageDecodeError("the JPEG is truncated: its last scan has no end of image")


@contextlib.contextmanager
def _opened(data: bytes | bytearray | memoryview) -> Iterator[Image.Image]:
    """An encoded image opened (header read, no pixels decoded), Pillow's errors typed."""
    raw = data if isinstance(data, bytes) else bytes(data)  # any memoryview, contiguous or not
    try:
        with warnings.catch_warnings():
            # The ceiling is ours (`max_pixels`), checked from the header alone.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(raw)) as im:
                if im.format == "JPEG":
                    _check_jpeg_body(raw)
                yield im
    except MaterializeError:
        raise
    except Image.DecompressionBombError as e:
        raise MaterializeError(f"encoded image is over Pillow's pixel ceiling: {e}") from e
    except Exception as e:  # Pillow raises many types for hostile bytes
        raise ImageDecodeError(
            f"{len(raw)} bytes do not decode as an image: {type(e).__name__}: {e}"
        ) from e
