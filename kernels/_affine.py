"""The normalise tables as the kernels read them: each table, then a header that may give
an affine form proved equal to it.

The CPU path rounds ``(v/255 - mean) / std``, worked out in float64, once to the output
dtype (``reference.shared_normalise_table``). The kernels copy those bit patterns from a table
in shared memory. For bf16 and fp16 they can instead compute ``fma(v, a, b)`` in fp32 and
round it once to the 16-bit type, which takes fewer instructions and no shared loads; but
that is only the same bytes if it is for every ``v``. So the host tries it on all 768 bytes
of a table, exactly as the GPU rounds, and puts ``a`` and ``b`` in the header only where
every one matches (``AffineNorm`` in ``patches.cuh``). Anything else keeps the table.

The kernels read a byte ``v`` as the fp32 whose bits 16..23 it is, ``v 2^-133`` exactly,
which saves the subtraction that ``2^23 + v`` would need; so the header holds
``a 2^133`` (:data:`BYTE_SCALE`), and a form is claimed only where that is finite.
"""

from __future__ import annotations

import itertools
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from ._abi import NORM_HEADER, NORM_STRIDE, NORM_VALUES
from .reference import Normalisation, normalise_table

__all__ = ["BYTE_SCALE", "NORM_HEADER", "NORM_STRIDE", "NORM_VALUES", "affine_form", "table_rows"]

_MODES = {torch.bfloat16: 1, torch.float16: 2}  # NORM_BF16, NORM_F16; 0 is NORM_TABLE
_BYTES = np.arange(256, dtype=np.float64)
BYTE_SCALE = 2.0**133
"""The header's ``a`` is the form's times this: the kernel's byte is ``v / BYTE_SCALE``."""
_NEIGHBOURS = 2
"""How many fp32 steps either side of the rounded ``1/(255 std)`` and ``-mean/std`` to try."""


def _rounded(values: np.ndarray[Any, Any], dtype: torch.dtype) -> np.ndarray[Any, Any] | None:
    """fp32 values rounded to nearest even in ``dtype``, as int16 bit patterns; None if one
    rounds past the type's range (the GPU's conversion need not agree there)."""
    rounded = torch.from_numpy(values).to(dtype)
    if not bool(torch.isfinite(rounded).all()):
        return None
    return rounded.view(torch.int16).numpy()


def _fma_f32(a: np.float32, b: np.float32) -> np.ndarray[Any, Any] | None:
    """``fma(v, a, b)`` for v = 0 .. 255 in fp32 (one rounding, as the GPU's FFMA), or None
    where float64 cannot hold ``v a + b`` exactly (then nothing is claimed)."""
    product = _BYTES * np.float64(a)  # exact: 8 bits times 24
    total = product + np.float64(b)
    # the sum's rounding error (two-sum); the float64 sum is the exact one where it is 0
    back = total - product
    error = (product - (total - back)) + (np.float64(b) - back)
    if np.any(error != 0) or not np.all(np.isfinite(total)):
        return None
    values: np.ndarray[Any, Any] = total.astype(np.float32)
    # no operand or result may be an fp32 subnormal: NVRTC's build flushes them (FFMA.FTZ);
    # the kernel's own FMA keeps them (fma_subnormal), but the claim stays clear of them
    if any(_subnormal(np.asarray(x, np.float32)) for x in (a, b, values)):
        return None
    return values


def _subnormal(x: np.ndarray[Any, Any]) -> bool:
    tiny = np.finfo(np.float32).tiny
    return bool(np.any((x != 0) & (np.abs(x) < tiny)))


def affine_form(
    mean: float, std: float, table: np.ndarray[Any, Any], dtype: torch.dtype
) -> tuple[float, float] | None:
    """fp32 ``(a, b)`` whose ``fma(v, a, b)``, rounded to ``dtype``, is ``table`` (one
    channel's 256 bit patterns) for every byte v; None if no candidate near ``1/(255 std)``
    and ``-mean/std`` is."""
    if dtype not in _MODES or std == 0:
        return None
    a0 = np.float32(1.0 / (255.0 * std))
    b0 = np.float32(-mean / std)
    if not (np.isfinite(a0) and np.isfinite(b0)):
        return None
    steps = sorted(range(-_NEIGHBOURS, _NEIGHBOURS + 1), key=abs)
    for i, j in itertools.product(steps, steps):
        a = _step(a0, i)
        b = _step(b0, j)
        values = _fma_f32(a, b)
        if values is None:
            continue
        bits = _rounded(values, dtype)
        if bits is not None and np.array_equal(bits, table):
            return float(a), float(b)
    return None


def _step(x: np.float32, n: int) -> np.float32:
    """``x`` moved ``n`` fp32 steps."""
    toward = np.float32(np.inf if n > 0 else -np.inf)
    for _ in range(abs(n)):
        x = np.nextafter(x, toward)
    return x


@lru_cache(maxsize=64)
def _header(norm: Normalisation, dtype: torch.dtype) -> np.ndarray[Any, Any]:
    """The header's 8 words (u32 mode, f32 a[3] times BYTE_SCALE, f32 b[3], 0) for one
    table."""
    words = np.zeros(8, np.uint32)
    if dtype not in _MODES:
        return words
    mean, std = norm.mean, norm.std
    table = normalise_table(norm, dtype).view(torch.int16).numpy()
    forms = [affine_form(mean[c], std[c], table[c], dtype) for c in range(3)]
    found = [f for f in forms if f is not None]
    # a 2^133 is exact where finite (a power of two times a normal fp32); past 2^128 (a of
    # 2^-5 or more: std below about 0.126) the kernel's byte cannot carry the form
    scaled = [np.float64(a) * BYTE_SCALE for a, _ in found]
    if len(found) != 3 or max(abs(x) for x in scaled) > np.finfo(np.float32).max:
        return words
    words[0] = _MODES[dtype]
    for c, (a_scaled, (_, b)) in enumerate(zip(scaled, found, strict=True)):
        words[1 + c] = np.float32(a_scaled).view(np.uint32)
        words[4 + c] = np.float32(b).view(np.uint32)
    return words


def table_rows(
    stats: tuple[Normalisation, ...],
    dtype: torch.dtype,
    affine: bool = True,
) -> torch.Tensor:
    """The launch's tables ``(G, NORM_STRIDE)`` as the output dtype's bit patterns (int32
    for fp32, int16 for the 16-bit types), each with its header; ``affine=False`` keeps
    every header's mode 0 (the table)."""
    storage = torch.int32 if dtype == torch.float32 else torch.int16
    rows = []
    for norm in stats:
        values = normalise_table(norm, dtype).view(storage).reshape(-1)
        words = _header(norm, dtype) if affine else np.zeros(8, np.uint32)
        header = torch.zeros(NORM_HEADER, dtype=storage)
        header.view(torch.uint8)[: words.nbytes] = torch.from_numpy(words.view(np.uint8))
        rows.append(torch.cat([values, header]))
    return torch.stack(rows).contiguous()
