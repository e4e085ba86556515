"""Approximate JPEG decode on the owner's GPU (``Materializer(gpu_decode=True)``).

torchvision's nvJPEG binding decodes a batch's JPEGs on the device in one call, taking the
decode off the host. It is *not* bit-exact with Pillow: nvJPEG upsamples chroma and rounds
its IDCT differently from libjpeg-turbo, so pixels differ by a few levels (``mmwire-bench
pipeline --device cuda`` reports how many and by how much). It is therefore never chosen
on its own; only JPEGs whose header says RGB or grayscale go this way (CMYK and YCCK stay
with Pillow), and EXIF orientation is ignored on both paths, as the reference processors do.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
from mmwire.transport import EncodedImage
from mmwire.transport.errors import ConfigurationError, GridMismatch
from PIL import Image

__all__ = ["decode_jpegs_on_gpu", "gpu_decodable", "require_gpu_decoder"]

_MODES = {"RGB": 3, "L": 1}


def require_gpu_decoder() -> None:
    """``ConfigurationError`` unless torchvision with its CUDA JPEG decoder is importable."""
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except ImportError as e:
        raise ConfigurationError(
            "`gpu_decode=True` needs torchvision (its nvJPEG decoder) on this rank"
        ) from e


def gpu_decodable(raw: memoryview, encoding: EncodedImage) -> bool:
    """Whether an encoded item (already checked against its envelope) is a JPEG the GPU
    decoder turns into the channels its envelope declares."""
    if encoding.format != "JPEG":
        return False
    with Image.open(io.BytesIO(raw)) as im:  # the header only
        return _MODES.get(im.mode) == encoding.channels


def decode_jpegs_on_gpu(
    raws: list[memoryview], encodings: list[EncodedImage], wheres: list[str], device: torch.device
) -> list[torch.Tensor | None]:
    """The JPEGs' ``(H, W, C)`` uint8 pixels on ``device``, decoded in one batched call per
    channel count; ``None`` for a JPEG the decoder refuses (Pillow then decodes it, and
    reports it if it is broken). Pixels of another size than the envelope declared are a
    ``GridMismatch``."""
    from torchvision.io import ImageReadMode, decode_jpeg

    got: list[torch.Tensor | None] = [None] * len(raws)
    for channels, mode in ((3, ImageReadMode.RGB), (1, ImageReadMode.GRAY)):
        picked = [k for k, e in enumerate(encodings) if e.channels == channels]
        # the decoder reads host tensors; the arena is read-only, so each JPEG's few
        # compressed bytes are copied out
        data = [torch.from_numpy(np.frombuffer(raws[k], np.uint8).copy()) for k in picked]
        try:
            images: list[Any] = decode_jpeg(data, mode=mode, device=device) if data else []
        except RuntimeError:  # one JPEG it cannot take fails the batch: try each alone
            images = [_one(d, mode, device) for d in data]
        for k, chw in zip(picked, images):
            if chw is None:
                continue
            enc = encodings[k]
            if tuple(chw.shape) != (channels, enc.height, enc.width):
                raise GridMismatch(
                    f"encoded {wheres[k]}: decoded to {list(chw.shape)} (C, H, W), its envelope "
                    f"declared {enc.width}x{enc.height} of {channels} channels"
                )
            got[k] = chw.permute(1, 2, 0)
    # the decoder runs on streams of its own: its pixels are complete before any stream
    # of the caller's reads them
    torch.cuda.synchronize(device)
    return got


def _one(data: torch.Tensor, mode: Any, device: torch.device) -> torch.Tensor | None:
    from torchvision.io import decode_jpeg

    try:
        out: torch.Tensor = decode_jpeg(data, mode=mode, device=device)
        return out
    except RuntimeError:
        return None
