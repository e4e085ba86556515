"""Qwen-VL video frames to ``pixel_values_videos`` on the GPU (``video.cu``), equal to the
CPU reference: torch's antialiased bicubic resize of uint8 frames, as transformers' video
processors run it, then float32 normalisation and rows of temporal patches.

torch resizes uint8 images with integer weights, not Pillow's: each axis's float64 Keys
cubic weights (a = -0.5, widened by the scale when shrinking, normalised to sum 1) are
scaled to int16 with the largest precision that keeps the biggest weight under 2^15, and a
pass sums ``pixel · weight`` from half an output step, shifts by the precision and clamps.
The width goes first into a uint8 intermediate, then the height; an axis whose size does
not change is not resampled. :func:`axis_weights` computes an axis's table the way torch
does, in float64 in torch's order of operations; :func:`resize_reference` is the same
arithmetic in numpy, which the tests hold equal to torch itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._launch import _cupy_stream, import_cupy

__all__ = ["AxisWeights", "axis_weights", "resize_reference", "video_rows"]

SOURCE = Path(__file__).with_name("video.cu")
_THREADS = 256
_KEYS_A = -0.5


@dataclass(frozen=True)
class AxisWeights:
    """One axis of a resize: for each output index, the first input it reads (``lo``), how
    many it reads (``count``), their int16 weights (``weights``, ``taps`` a row) and the
    precision the sums are shifted by."""

    lo: np.ndarray[Any, np.dtype[np.int32]]
    count: np.ndarray[Any, np.dtype[np.int32]]
    weights: np.ndarray[Any, np.dtype[np.int32]]
    precision: int

    @property
    def taps(self) -> int:
        return int(self.weights.shape[1])


def _keys(x: float) -> float:
    """Keys' cubic with a = -0.5, in torch's form (``cubic_convolution1`` and ``2``)."""
    x = abs(x)
    a = _KEYS_A
    if x < 1.0:
        return ((a + 2) * x - (a + 3)) * x * x + 1
    if x < 2.0:
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return 0.0


@lru_cache(maxsize=256)
def axis_weights(in_size: int, out_size: int) -> AxisWeights:
    """The int16 table torch's antialiased bicubic uses to resize an axis of ``in_size``
    to ``out_size`` (uint8 images, ``align_corners=False``, no explicit scale)."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    taps = math.ceil(support) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    lo = np.zeros(out_size, np.int32)
    count = np.zeros(out_size, np.int32)
    rows: list[list[float]] = []
    top = 0.0
    for i in range(out_size):
        center = scale * (i + 0.5)
        first = max(int(center - support + 0.5), 0)
        n = min(max(min(int(center + support + 0.5), in_size) - first, 0), taps)
        w = [_keys((float(j + first) - center + 0.5) * invscale) for j in range(n)]
        total = 0.0
        for v in w:
            total += v
        if total != 0.0:
            w = [v / total for v in w]
            top = max(top, *w)
        lo[i], count[i] = first, n
        rows.append(w)
    precision = 22
    for p in range(22):
        if int(0.5 + top * (1 << (p + 1))) >= 1 << 15:
            precision = p
            break
    weights = np.zeros((out_size, taps), np.int32)
    for i, w in enumerate(rows):
        for j, v in enumerate(w):
            v *= 1 << precision
            weights[i, j] = int(-0.5 + v) if v < 0 else int(0.5 + v)
    return AxisWeights(lo, count, weights, precision)


def _resample(x: np.ndarray[Any, Any], out_size: int, axis: int) -> np.ndarray[Any, Any]:
    a = axis_weights(x.shape[axis], out_size)
    x = np.moveaxis(x.astype(np.int64), axis, 0)
    acc = np.full((out_size, *x.shape[1:]), 1 << (a.precision - 1), np.int64)
    for k in range(a.taps):
        live = a.count > k
        src = np.where(live, a.lo + k, 0)
        acc += x[src] * np.where(live, a.weights[:, k], 0).reshape(-1, *[1] * (x.ndim - 1))
    return np.moveaxis(np.clip(acc >> a.precision, 0, 255).astype(np.uint8), 0, axis)


def resize_reference(
    frames: np.ndarray[Any, Any], height: int, width: int
) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """``(n, H, W, 3)`` uint8 frames resized to ``height x width`` with the kernels'
    arithmetic, in numpy: the width first, then the height, each only if it changes."""
    x = np.asarray(frames)
    if width != x.shape[2]:
        x = _resample(x, width, 2)
    if height != x.shape[1]:
        x = _resample(x, height, 1)
    return x


@cache
def _module(device_index: int) -> Any:
    cupy = import_cupy()
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=SOURCE.read_text(), options=("-std=c++17",))
        module.compile()
    return module


def _table(a: AxisWeights, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(t).to(device) for t in (a.lo, a.count, a.weights))


def video_rows(
    frames: torch.Tensor,
    size: tuple[int, int],
    *,
    patch: int,
    merge: int,
    temporal: int,
    mean: tuple[float, float, float],
    std: tuple[float, float, float],
    out: torch.Tensor,
) -> None:
    """Write one video's rows into ``out`` (``(t·h·w, 3·T·p·p)``, float32 or bfloat16, on
    the frames' device), on torch's current stream: ``frames`` uint8 ``(n, H, W, 3)`` on a
    CUDA device, resized to ``size`` = ``(height, width)``, ``(x - mean) / std`` per
    channel in float32 (``mean`` and ``std`` already in 0-255 units), temporal patches of
    ``temporal`` frames, the last repeated, rows by ``merge`` windows of ``patch`` pixels.
    """
    n, h, w, channels = (int(d) for d in frames.shape)
    h2, w2 = size
    gt, gh, gw = -(-n // temporal), h2 // patch, w2 // patch
    row_len = 3 * temporal * patch * patch
    if (
        frames.dtype != torch.uint8
        or channels != 3
        or not frames.is_contiguous()
        or h2 % (patch * merge)
        or w2 % (patch * merge)
        or tuple(out.shape) != (gt * gh * gw, row_len)
        or out.dtype not in (torch.float32, torch.bfloat16)
        or not out.is_contiguous()
        or out.device != frames.device
    ):
        raise ValueError(
            f"video_rows: frames {frames.dtype}{list(frames.shape)} to {size} into "
            f"{out.dtype}{list(out.shape)}"
        )
    cupy = import_cupy()
    device = frames.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _cupy_stream(torch.cuda.current_stream(device).cuda_stream, index)
    module = _module(index)
    # the intermediate and the tables are allocated on the current stream, so their memory
    # is not reused before the launches on it have read them
    src = frames
    with cupy.cuda.Device(index), stream:
        if w2 != w:
            a = axis_weights(w, w2)
            lo, count, weights = _table(a, device)
            src = torch.empty((n, h, w2, 3), dtype=torch.uint8, device=device)
            pixels = n * h * w2
            module.get_function("video_horizontal")(
                (-(-pixels // _THREADS),),
                (_THREADS,),
                (
                    _ptr(frames),
                    _ptr(src),
                    np.int32(n * h),
                    np.int32(w),
                    np.int32(w2),
                    _ptr(lo),
                    _ptr(count),
                    _ptr(weights),
                    np.int32(a.taps),
                    np.int32(a.precision),
                ),
            )
        vertical = h2 != h
        if vertical:
            b = axis_weights(h, h2)
            lo, count, weights = _table(b, device)
            taps, precision = b.taps, b.precision
        else:
            lo = count = weights = src  # unread
            taps = precision = 0
        values = out.numel()
        name = "video_rows_f32" if out.dtype == torch.float32 else "video_rows_bf16"
        module.get_function(name)(
            (-(-values // _THREADS),),
            (_THREADS,),
            (
                _ptr(src),
                _ptr(out),
                np.int32(n),
                np.int32(h),
                np.int32(h2),
                np.int32(w2),
                np.int32(patch),
                np.int32(merge),
                np.int32(temporal),
                np.int32(gh),
                np.int32(gw),
                np.int64(values),
                np.int32(vertical),
                _ptr(lo),
                _ptr(count),
                _ptr(weights),
                np.int32(taps),
                np.int32(precision),
                *(np.float32(v) for v in mean),
                *(np.float32(v) for v in std),
            ),
        )


def _ptr(t: torch.Tensor) -> Any:
    return np.uint64(t.data_ptr())
