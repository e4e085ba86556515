"""A zero-copy numpy view of a Pillow image's own memory, through its Arrow C data export.

``np.asarray(image)`` goes through ``tobytes`` (the image encoded into chunks, then joined):
two copies before the arena's. Pillow (11.2+) exports an image held in one block of memory
as an Arrow array instead: one byte a pixel for 8-bit single-band modes, four for the
others (RGB as RGBX). Reading that buffer in place leaves one copy, into the arena.

An image Pillow keeps in several blocks (large images: 16 MiB blocks by default) does not
export; :func:`decode_single_block` decodes a file into one block so that it does. With a
Pillow older than 13 the views are not used (12.3 crashed exporting), and decoding keeps
``np.asarray``'s copies.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import PIL
from PIL import Image, ImageFile

__all__ = ["decode_single_block", "pixel_view"]


class _ArrowArray(ctypes.Structure):
    pass


_ArrowArray._fields_ = [
    ("length", ctypes.c_int64),
    ("null_count", ctypes.c_int64),
    ("offset", ctypes.c_int64),
    ("n_buffers", ctypes.c_int64),
    ("n_children", ctypes.c_int64),
    ("buffers", ctypes.POINTER(ctypes.c_void_p)),
    ("children", ctypes.POINTER(ctypes.POINTER(_ArrowArray))),
    ("dictionary", ctypes.c_void_p),
    ("release", ctypes.c_void_p),
    ("private_data", ctypes.c_void_p),
]

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


_core: Any = getattr(Image, "core")  # noqa: B009  (Pillow's C module; typed as private)
_EXPORTS = int(PIL.__version__.split(".")[0]) >= 13
"""Pillow 12.3 crashed exporting images that 13.0 exports; older ones keep two copies."""


def pixel_view(image: Image.Image, single_block: bool = False) -> np.ndarray[Any, Any] | None:
    """``(H, W, 1)`` or ``(H, W, 4)`` uint8 view of ``image``'s memory, or ``None`` where Pillow
    does not export it. Asked only of an image known to sit in one block (``single_block``:
    decoded by :func:`decode_single_block`; or small enough for one): some Pillow versions
    crash exporting one in several blocks instead of refusing. Read-only by convention: it
    is the image's own memory, valid while the view lives."""
    if not _EXPORTS or image.mode not in ("L", "RGB", "RGBA"):
        return None
    if not (single_block or _fits_one_block(image)):
        return None
    try:
        schema, array = image.__arrow_c_array__()
    except (NotImplementedError, ValueError, OSError):
        return None
    arr = _ArrowArray.from_address(_capsule_pointer(array, b"arrow_array"))
    if arr.offset != 0 or arr.null_count > 0:
        return None
    if arr.n_children == 1:  # a fixed-size list of 4 bytes a pixel
        data = arr.children[0].contents
        channels = 4
    elif arr.n_children == 0 and image.mode == "L":
        data, channels = arr, 1
    else:
        return None
    h, w = image.height, image.width
    if arr.length != h * w or data.n_buffers < 2 or not data.buffers[1]:
        return None
    raw: Any = (ctypes.c_uint8 * (h * w * channels)).from_address(data.buffers[1])
    raw.keep = (schema, array, image)  # the view's base holds the export, and so the memory
    view: np.ndarray[Any, Any] = np.frombuffer(raw, np.uint8).reshape(h, w, channels)
    return view


def _fits_one_block(image: Image.Image) -> bool:
    """Whether Pillow's allocator gives ``image`` one block: its rows (4 bytes a pixel but for
    8-bit single-band modes) within the block size."""
    try:
        block = int(_core.get_block_size())
    except AttributeError:
        return False
    per_pixel = 1 if image.mode == "L" else 4
    return image.height * image.width * per_pixel <= block


def decode_single_block(image: Image.Image) -> bool:
    """Decode an opened file's pixels into one block of memory (so :func:`pixel_view` can
    export them), where its format decodes into memory Pillow prepares; otherwise, or if
    that is refused, a plain ``load``. Whether the pixels are in the block made here."""
    block = None
    if _EXPORTS and isinstance(image, ImageFile.ImageFile) and image._im is None:
        try:
            block = image.im = _core.new_block(image.mode, image.size)
        except (ValueError, MemoryError, AttributeError):
            block = None
    image.load()
    return block is not None and image._im is block
