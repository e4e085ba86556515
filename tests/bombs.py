"""Small files that ask a decoder for a lot: the corpus an owner must refuse or survive."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

HUGE = 13_000  # a side no ceiling admits: 169 MP


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def zlib_png(side: int) -> bytes:
    """A gray PNG of ``side`` x ``side`` zeros: a few hundred KB that inflate to side² bytes."""
    z = zlib.compressobj(9)
    row = bytes(side + 1)  # filter byte, then the row
    body = b"".join(z.compress(row) for _ in range(side)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", body)
        + _png_chunk(b"IEND", b"")
    )


def animated_webp(canvas: int = HUGE) -> bytes:
    """A two-frame animated WebP of 16x16 frames whose header declares a huge canvas."""
    frames = [Image.new("RGB", (16, 16), c) for c in ("red", "blue")]
    out = io.BytesIO()
    frames[0].save(out, "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    data = bytearray(out.getvalue())
    at = data.index(b"VP8X") + 8 + 4  # flags and reserved, then width-1 and height-1
    data[at : at + 3] = (canvas - 1).to_bytes(3, "little")
    data[at + 3 : at + 6] = (canvas - 1).to_bytes(3, "little")
    return bytes(data)


def huge_gif() -> bytes:
    """A 1x1 GIF whose logical screen is huge."""
    out = io.BytesIO()
    Image.new("P", (1, 1)).save(out, "GIF")
    data = bytearray(out.getvalue())
    data[6:10] = struct.pack("<HH", HUGE, HUGE)
    return bytes(data)


def _jpeg(size: tuple[int, int], **options: object) -> bytes:
    rng = np.random.default_rng(0)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), np.uint8)).save(
        out, "JPEG", **options
    )
    return out.getvalue()


def truncated_huge_jpeg() -> bytes:
    """631 bytes of a JPEG whose frame header declares HUGE x HUGE."""
    data = bytearray(_jpeg((64, 64)))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", HUGE, HUGE)
    return bytes(data[:631])


def truncated_jpeg() -> bytes:
    """The first half of an ordinary 640x480 JPEG (Pillow decodes it, filling in the rest)."""
    data = _jpeg((640, 480))
    return data[: len(data) // 2]


def many_scans_jpeg(scans: int = 400) -> bytes:
    """A progressive JPEG with its last scan repeated until it has ``scans`` scans."""
    data = _jpeg((256, 256), progressive=True)
    last = data.rindex(b"\xff\xda")
    scan = data[last:-2]  # the last scan's header and entropy-coded data, before EOI
    extra = scans - data.count(b"\xff\xda")
    return data[:-2] + scan * extra + b"\xff\xd9"


def rle_bmp() -> bytes:
    """An 8-bit RLE BMP declaring HUGE x HUGE whose data ends the bitmap at once."""
    palette = bytes(4 * 256)
    pixels = b"\x00\x01"  # end of bitmap
    offset = 14 + 40 + len(palette)
    info = struct.pack("<IiiHHIIiiII", 40, HUGE, HUGE, 1, 8, 1, len(pixels), 2835, 2835, 256, 0)
    head = b"BM" + struct.pack("<IHHI", offset + len(pixels), 0, 0, offset)
    return head + info + palette + pixels


def corpus() -> dict[str, bytes]:
    return {
        "animated webp, huge canvas": animated_webp(),
        "gif, huge screen": huge_gif(),
        "zlib-bomb png over the ceiling": zlib_png(8000),
        "zlib-bomb png under the ceiling": zlib_png(6000),
        "truncated jpeg, huge size": truncated_huge_jpeg(),
        "truncated jpeg": truncated_jpeg(),
        "progressive jpeg, 400 scans": many_scans_jpeg(),
        "rle bmp, huge size": rle_bmp(),
    }
