"""The pixel pipeline of one checkpoint, exact on the CPU: pixels -> ``(Σ patches, 3, p, p)``.

Per image: channel rules -> Pillow BICUBIC resize (RGBA premultiplied, by Pillow itself) ->
transparent background -> pad right/bottom with raw 0 -> normalise through a per-channel
256-entry table computed in float64 and rounded once to the output dtype -> patchify
(patches row-major over the grid, inside a patch channel, row, column).

The background composite is defined here, in float32, with this operation order (the
CUDA kernels reproduce it without FMA contraction)::

    a   = float32(A) / 255            (then clamped to [0, 1])
    out = floor(clamp(a*rgb + (1 - a)*bg, 0, 255))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from mmwire.kernels.reference import shared_normalise_table
from mmwire.transport import Background, Grid, MaterializeError, PreprocessSpec, to_pixels
from PIL import Image

from ._backend import resolve_backend
from ._plan import ProcessorConfig

__all__ = ["normalise_table", "preprocess_images"]


def normalise_table(spec: PreprocessSpec, dtype: torch.dtype) -> torch.Tensor:
    """``(3, 256)`` table of ``(v/255 - mean[c]) / std[c]`` in float64, rounded once to ``dtype``.

    Returns a fresh tensor; the pipeline itself reuses a cached one per (mean, std, dtype).
    """
    return shared_normalise_table(spec.image_mean, spec.image_std, dtype).clone()


def _resize(pixels: np.ndarray[Any, Any], new_w: int, new_h: int) -> np.ndarray[Any, Any]:
    h, w, ch = pixels.shape
    if (w, h) == (new_w, new_h):
        return pixels
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[ch]
    im = Image.fromarray(pixels[:, :, 0] if ch == 1 else pixels, mode)
    out = np.asarray(im.resize((new_w, new_h), Image.Resampling.BICUBIC))
    return out[:, :, None] if out.ndim == 2 else out


def _composite(rgba: np.ndarray[Any, Any], bg: Background | None) -> np.ndarray[Any, Any]:
    """RGBA -> RGB: drop alpha (no background) or composite over the background."""
    rgb = rgba[:, :, :3]
    if bg is None:
        return rgb
    h, w, _ = rgba.shape
    if bg.pattern == "chessboard":
        iy = (np.arange(h) // bg.square)[:, None]
        ix = (np.arange(w) // bg.square)[None, :]
        parity = (iy + ix) % 2
        white_cells = parity == (0 if bg.top_left_white else 1)
        fill = np.where(white_cells, np.float32(bg.white), np.float32(bg.gray))[:, :, None]
    else:
        level = {"white": 255, "gray": 128, "black": 0}[bg.pattern]
        fill = np.full((h, w, 1), level, np.float32)
    a = np.clip(
        rgba[:, :, 3:4].astype(np.float32) / np.float32(255.0), np.float32(0), np.float32(1)
    )
    mixed = a * rgb.astype(np.float32) + (np.float32(1) - a) * fill
    return np.floor(np.clip(mixed, np.float32(0), np.float32(255))).astype(np.uint8)


def canvas_of(pixels: np.ndarray[Any, Any], spec: PreprocessSpec) -> np.ndarray[Any, Any]:
    """Resized, composited, zero-padded uint8 ``(3, H', W')`` canvas of one image."""
    plan = spec.plan
    resized = _resize(pixels, plan.new_width, plan.new_height)
    ch = resized.shape[2]
    rgb = _composite(resized, spec.background) if ch == 4 else resized
    canvas = np.zeros((3, plan.padded_height, plan.padded_width), np.uint8)
    src = np.moveaxis(rgb, -1, 0)
    canvas[:, : plan.new_height, : plan.new_width] = src  # 1 channel broadcasts to 3
    return canvas


def patchify_into(
    out: torch.Tensor, canvas: np.ndarray[Any, Any], spec: PreprocessSpec, table: torch.Tensor
) -> None:
    """Write the normalised patches of a uint8 canvas into ``out`` ``(patches, 3, p, p)``."""
    p = spec.patch_size
    _, hh, ww = canvas.shape
    gh, gw = hh // p, ww // p
    patches = canvas.reshape(3, gh, p, gw, p).transpose(1, 3, 0, 2, 4)  # (gh, gw, 3, p, p) u8
    idx = torch.from_numpy(np.ascontiguousarray(patches).reshape(gh * gw, 3, p * p)).to(torch.int32)
    for c in range(3):
        out[:, c].view(gh * gw, p * p).copy_(table[c][idx[:, c]])


def produce(pixels: np.ndarray[Any, Any], spec: PreprocessSpec, out: torch.Tensor) -> Grid:
    """Run the pipeline for one image into ``out`` (``(patches, 3, p, p)`` rows); its grid."""
    canvas = canvas_of(pixels, spec)
    p = spec.patch_size
    grid = Grid((1, canvas.shape[1] // p, canvas.shape[2] // p))
    if out.shape[0] != grid.patches:
        raise MaterializeError(f"output has {out.shape[0]} rows, the image needs {grid.patches}")
    patchify_into(
        out, canvas, spec, shared_normalise_table(spec.image_mean, spec.image_std, out.dtype)
    )
    return grid


def preprocess_images(
    images: Sequence[Any],
    config: ProcessorConfig | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: Literal["auto", "cpu", "cuda"] = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole pipeline for a list of images: ``(pixel_values, grid_thw)``.

    ``pixel_values`` is ``(Σ patches, 3, p, p)`` in ``dtype``, allocated once, images
    concatenated in order; ``grid_thw`` is ``(N, 3)`` int64. The producer's eager path and
    the owner's deferred path both run this, so they agree bit for bit. On a CUDA
    ``device`` the ``"cuda"`` backend (``"auto"``'s choice when CuPy is installed) uploads
    the uint8 pixels once and runs ``mmwire.kernels``; ``"cpu"`` computes here and uploads
    the result. Both give the same bytes.
    """

    cfg = config or ProcessorConfig()
    pixels = [to_pixels(im, max_pixels=cfg.max_pixels) for im in images]
    specs = [cfg.spec_for(px.shape[1], px.shape[0]) for px in pixels]
    if pixels and resolve_backend(backend, torch.device(device)) == "cuda":
        from mmwire.kernels import preprocess_packed

        flat = np.concatenate([px.reshape(-1) for px in pixels])
        src = torch.from_numpy(flat).to(device)
        shapes = [(px.shape[0], px.shape[1], px.shape[2]) for px in pixels]
        return preprocess_packed(src, shapes, specs, dtype)
    p = cfg.patch_size
    total = sum(s.plan.grid.patches for s in specs)
    out = torch.empty((total, 3, p, p), dtype=dtype)
    grids = torch.empty((len(specs), 3), dtype=torch.int64)
    row = 0
    for i, (px, spec) in enumerate(zip(pixels, specs)):
        n = spec.plan.grid.patches
        grid = produce(px, spec, out[row : row + n])
        grids[i] = torch.tensor(grid.thw)
        row += n
    return out.to(device), grids.to(device)
