"""The exact Pillow reference math that the CPU pipeline and the CUDA kernels both keep.

It depends on numpy, torch, Pillow and ``mmwire.transport``'s types only, so
``mmwire.materialize`` (the CPU path) and the kernels' host code share it without importing
each other.

* BICUBIC and BILINEAR: Q22 coefficient tables (what the CUDA kernels upload), the pass
  order of the installed Pillow, and :func:`resize_reference`, an independent vectorised
  re-implementation tested ``==`` against Pillow. The CPU pipeline itself calls Pillow
  (exact by definition, and it releases the GIL).
* Normalise: a per-channel 256-entry table, in the arithmetic of the item's reference
  (:class:`Normalisation`): Kimi's ``(v/255 - mean) / std`` computed in float64 and rounded
  once to the output dtype (:func:`shared_normalise_table`), or transformers' Pillow
  backend's ``float32(v · rescale)`` (the product in float64), then ``(x - mean) / std``
  in float32, then the output dtype.

Facts (Pillow ``Resample.c``): Keys cubic with a = -0.5 and support 2, or the triangle
``1 - |x|`` with support 1 (BILINEAR), the support widened by the downscale factor, taps
outside the image dropped and the rest renormalised by their sequential sum, weights
rounded half away from zero to int32 with 22 fractional bits, ``acc = 2^21 + Σ px·k`` in
int32, ``clamp(acc >> 22, 0, 255)``, a uint8 image between the two passes, and RGBA
through premultiplied alpha. The pass order does not depend on the filter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, NamedTuple

import numpy as np
import PIL
import torch
from mmwire.transport import PreprocessSpec

__all__ = [
    "Coefficients",
    "Filter",
    "Normalisation",
    "bicubic_coefficients",
    "coefficients",
    "normalisation_of",
    "normalise_table",
    "pass_order",
    "resample_filter",
    "resize_reference",
    "rows_are_tiles",
    "shared_normalise_table",
]

PRECISION_BITS = 22

Filter = Literal["bicubic", "bilinear"]
"""Pillow's resampling filters that the tables reproduce (``Image.Resampling``'s names)."""


def _cubic(x: np.ndarray[Any, np.dtype[np.float64]]) -> np.ndarray[Any, np.dtype[np.float64]]:
    """Pillow's ``bicubic_filter`` (a = -0.5), element-wise, each operation in Pillow's order."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _triangle(x: np.ndarray[Any, np.dtype[np.float64]]) -> np.ndarray[Any, np.dtype[np.float64]]:
    """Pillow's ``bilinear_filter``, element-wise."""
    x = np.abs(x)
    return np.where(x < 1.0, 1.0 - x, 0.0)


_FILTERS = {"bicubic": (_cubic, 2.0), "bilinear": (_triangle, 1.0)}


def resample_filter(spec: PreprocessSpec) -> Filter:
    """The filter a spec's processor resizes with: Gemma 3's BILINEAR, the others' BICUBIC."""
    return "bilinear" if spec.processor == "gemma3" else "bicubic"


def rows_are_tiles(spec: PreprocessSpec) -> bool:
    """Whether a spec's rows are whole tiles ``(3, h, w)`` of regions of its image (Gemma 3,
    InternVL) rather than patches."""
    return spec.processor == "gemma3" or (spec.processor == "internvl" and spec.tile is not None)


@dataclass(frozen=True)
class Coefficients:
    """One axis: output ``i`` reads ``n[i]`` inputs from ``xmin[i]``, weights ``k[i, :n[i]]``."""

    xmin: np.ndarray[Any, np.dtype[np.int32]]
    n: np.ndarray[Any, np.dtype[np.int32]]
    k: np.ndarray[Any, np.dtype[np.int32]]

    @property
    def ksize(self) -> int:
        """Row stride of ``k`` (taps are zero beyond ``n``)."""
        return int(self.k.shape[1])


def bicubic_coefficients(in_size: int, out_size: int) -> Coefficients:
    """``coefficients`` of Pillow's BICUBIC."""
    return coefficients(in_size, out_size, "bicubic")


@lru_cache(maxsize=256)
def coefficients(in_size: int, out_size: int, filter: Filter) -> Coefficients:
    """Pillow's ``precompute_coeffs`` for the full box and ``filter``, converted to Q22
    int32 (cached).

    Vectorised over the outputs, every float64 operation as Pillow does it, in its order.
    """
    kernel, filter_support = _FILTERS[filter]
    in0, in1 = 0.0, float(np.float32(in_size))
    scale = float(np.float32(in1 - in0)) / out_size
    filterscale = max(scale, 1.0)
    support = filter_support * filterscale
    ksize = math.ceil(support) * 2 + 1
    inv_fs = 1.0 / filterscale
    center = in0 + (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    lo = np.maximum(0, np.trunc(center - support + 0.5)).astype(np.int64)  # C's (int) casts
    hi = np.minimum(in_size, np.trunc(center + support + 0.5)).astype(np.int64)
    count = hi - lo
    taps = np.arange(ksize)
    live = taps[None, :] < count[:, None]
    w = np.where(
        live, kernel(((taps[None, :] + lo[:, None]) - center[:, None] + 0.5) * inv_fs), 0.0
    )
    # the total one tap at a time, as Pillow: accumulate runs left to right (np.sum would
    # pair-sum and round differently); the 0.0 past a row's taps adds nothing
    ww = np.add.accumulate(w, axis=1)[:, -1]
    w = np.where(ww[:, None] != 0.0, w / np.where(ww != 0.0, ww, 1.0)[:, None], w)
    scaled = w * (1 << PRECISION_BITS)
    k = np.where(live, np.trunc(np.where(w < 0, scaled - 0.5, scaled + 0.5)), 0.0)
    return Coefficients(lo.astype(np.int32), count.astype(np.int32), k.astype(np.int32))


def _pillow_version() -> tuple[int, int]:
    major, minor = PIL.__version__.split(".")[:2]
    return int(major), int(minor)


def pass_order(
    in_w: int, in_h: int, out_w: int, out_h: int, pillow: tuple[int, int] | None = None
) -> Literal["h_first", "v_first"]:
    """Which pass Pillow runs first for this resize, for the installed (or given) version.

    Pillow >= 13.0: vertical first iff the height shrinks by more than twice the width
    does. 12.2–12.3: vertical first for tall images (``H > 100·W``) that shrink in height.
    Earlier: always horizontal first.
    """
    ver = pillow or _pillow_version()
    if ver >= (13, 0):
        dh, dw = in_h - out_h, in_w - out_w
        return "v_first" if (dh > 0 and dh > 2 * dw) else "h_first"
    if (12, 2) <= ver < (13, 0) and in_h > 100 * in_w and out_h < in_h:
        return "v_first"
    return "h_first"


def _pass(src: np.ndarray[Any, Any], c: Coefficients, axis: int) -> np.ndarray[Any, Any]:
    """One 8-bit pass along ``axis`` (1 = horizontal, 0 = vertical) of an (H, W, C) image."""
    size = src.shape[axis]
    acc = np.full(
        (src.shape[0], len(c.n), src.shape[2])
        if axis == 1
        else (len(c.n), src.shape[1], src.shape[2]),
        1 << (PRECISION_BITS - 1),
        np.int32,
    )
    for t in range(c.ksize):
        idx = np.minimum(c.xmin + t, size - 1)
        w = np.where(t < c.n, c.k[:, t], 0).astype(np.int32)
        taps = np.take(src, idx, axis=axis).astype(np.int32)
        acc += taps * (w[None, :, None] if axis == 1 else w[:, None, None])
    return np.clip(acc >> PRECISION_BITS, 0, 255).astype(np.uint8)


def _premultiply(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    out = a.copy()
    alpha = a[..., 3].astype(np.int32)
    for ch in range(3):
        t = a[..., ch].astype(np.int32) * alpha + 128
        out[..., ch] = ((t >> 8) + t) >> 8
    return out


def _unpremultiply(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    out = a.copy()
    alpha = a[..., 3].astype(np.int32)
    partial = (alpha != 0) & (alpha != 255)
    safe = np.where(partial, alpha, 1)
    for ch in range(3):
        c = a[..., ch].astype(np.int32)
        out[..., ch] = np.where(partial, np.minimum(255, (255 * c) // safe), c)
    return out


def resize_reference(
    img: np.ndarray[Any, Any],
    out_w: int,
    out_h: int,
    *,
    pillow: tuple[int, int] | None = None,
    filter: Filter = "bicubic",
) -> np.ndarray[Any, Any]:
    """Pillow resize of uint8 ``(H, W, C)`` (C = 1, 3 or 4 = RGBA) with ``filter``, in numpy.

    Bit-identical to ``Image.resize((out_w, out_h), BICUBIC or BILINEAR)`` of the given
    Pillow version (default: the installed one). Slow; used to check tables and kernels.
    """
    h, w, ch = img.shape
    if (out_w, out_h) == (w, h):
        return img.copy()
    rgba = ch == 4
    src = _premultiply(img) if rgba else img
    cx = coefficients(w, out_w, filter)
    cy = coefficients(h, out_h, filter)
    need_h, need_v = out_w != w, out_h != h
    if pass_order(w, h, out_w, out_h, pillow) == "h_first":
        out = _pass(src, cx, 1) if need_h else src
        out = _pass(out, cy, 0) if need_v else out
    else:
        out = _pass(src, cy, 0) if need_v else src
        out = _pass(out, cx, 1) if need_h else out
    return _unpremultiply(out) if rgba else out


@lru_cache(maxsize=64)
def shared_normalise_table(
    mean: tuple[float, float, float], std: tuple[float, float, float], dtype: torch.dtype
) -> torch.Tensor:
    """``(3, 256)``: ``(v/255 - mean[c]) / std[c]`` in float64, rounded once to ``dtype``.

    Cached and shared between callers: read it, never write it.
    """
    v = np.arange(256, dtype=np.float64)
    table64 = np.stack([(v / 255.0 - mean[c]) / std[c] for c in range(3)])
    return torch.from_numpy(table64).to(dtype)


class Normalisation(NamedTuple):
    """How a byte of channel c becomes a value: the statistics and the reference's arithmetic.

    ``float64``: ``(v/255 - mean[c]) / std[c]`` in float64, rounded once (Kimi);
    ``float32``: ``float32(v · rescale)`` (the product in float64), then
    ``(x - float32(mean[c])) / float32(std[c])`` in float32 (transformers' Pillow backend).
    """

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    arithmetic: Literal["float64", "float32"] = "float64"
    rescale: float = 1 / 255


def normalisation_of(spec: PreprocessSpec) -> Normalisation:
    """The normalisation a raw item's spec asks for."""
    if spec.follows_transformers:
        return Normalisation(spec.image_mean, spec.image_std, "float32", spec.rescale_factor)
    return Normalisation(spec.image_mean, spec.image_std)


@lru_cache(maxsize=64)
def normalise_table(norm: Normalisation, dtype: torch.dtype) -> torch.Tensor:
    """``(3, 256)``: each byte of each channel normalised as ``norm`` says, in ``dtype``.

    Cached and shared between callers: read it, never write it.
    """
    if norm.arithmetic == "float64":
        return shared_normalise_table(norm.mean, norm.std, dtype)
    v = (np.arange(256, dtype=np.float64) * norm.rescale).astype(np.float32)
    mean = np.asarray(norm.mean, dtype=np.float32)
    std = np.asarray(norm.std, dtype=np.float32)
    table32 = np.stack([(v - mean[c]) / std[c] for c in range(3)])
    return torch.from_numpy(table32).to(dtype)
