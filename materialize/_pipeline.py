"""The pixel pipeline of one checkpoint, exact on the CPU: pixels -> ``(Σ patches, *row)``.

Per image: channel rules (``to_pixels``: Kimi keeps alpha, the transformers families
composite it over white) -> Pillow resize, BICUBIC (BILINEAR for Gemma 3; RGBA
premultiplied, by Pillow itself) -> transparent background (Kimi) -> pad right/bottom with
raw 0 (Kimi) -> normalise through a per-channel 256-entry table in the reference's
arithmetic (``mmwire.kernels.reference.normalise_table``) -> patchify: Kimi's rows
``(3, p, p)`` row-major over the grid; Qwen-VL's ``(3, T, p, p)`` flattened, the plane repeated T
times, ordered by merge window; Gemma 3's whole image as one ``(3, H, W)``, then each
pan-and-scan crop of it resized alike; InternVL's tiles of the resized image, then its
thumbnail (the image resized to one tile), each ``(3, h, w)``.

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
from mmwire.kernels import KERNEL_PROCESSORS
from mmwire.kernels.reference import normalisation_of, resample_filter
from mmwire.kernels.reference import normalise_table as table_of
from mmwire.transport import Background, Grid, PreprocessSpec
from mmwire.transport.errors import MaterializeError
from mmwire.transport.images import to_pixels
from PIL import Image

from ._compute import resolve_compute
from ._families import ModelSpec
from ._kimi import KimiConfig
from ._regions import regions_of, tiled

__all__ = ["preprocess_images"]

_RESAMPLE = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}


def _resize(
    pixels: np.ndarray[Any, Any], new_w: int, new_h: int, resample: Image.Resampling
) -> np.ndarray[Any, Any]:
    h, w, ch = pixels.shape
    if (w, h) == (new_w, new_h):
        return pixels
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[ch]
    im = Image.fromarray(pixels[:, :, 0] if ch == 1 else pixels, mode)
    out = np.asarray(im.resize((new_w, new_h), resample))
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
    resized = _resize(pixels, plan.new_width, plan.new_height, _RESAMPLE[resample_filter(spec)])
    ch = resized.shape[2]
    rgb = _composite(resized, spec.background) if ch == 4 else resized
    canvas = np.zeros((3, plan.padded_height, plan.padded_width), np.uint8)
    src = np.moveaxis(rgb, -1, 0)
    canvas[:, : plan.new_height, : plan.new_width] = src  # 1 channel broadcasts to 3
    return canvas


def patches_of(canvas: np.ndarray[Any, Any], p: int, merge: int) -> np.ndarray[Any, Any]:
    """A uint8 canvas ``(3, H, W)`` as ``(patches, 3, p·p)`` in output order: row-major over
    the grid (``merge`` 0), or by ``merge x merge`` windows (Qwen-VL's order)."""
    _, hh, ww = canvas.shape
    gh, gw = hh // p, ww // p
    if merge:
        m = merge
        windows = canvas.reshape(3, gh // m, m, p, gw // m, m, p)
        ordered = windows.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, 3, p, p)
    else:
        ordered = canvas.reshape(3, gh, p, gw, p).transpose(1, 3, 0, 2, 4)  # (gh, gw, 3, p, p)
    return np.ascontiguousarray(ordered).reshape(gh * gw, 3, p * p)


def patchify_into(
    out: torch.Tensor, canvas: np.ndarray[Any, Any], spec: PreprocessSpec, table: torch.Tensor
) -> None:
    """Write the normalised rows of a uint8 canvas into ``out`` ``(patches, *row_shape)``:
    each channel's plane ``temporal_patch_size`` times a row."""
    rows = patches_of(canvas, spec.patch_size, spec.merge_order)
    _normalise_into(out, rows, spec.temporal_patch_size, table)


def _normalise_into(
    out: torch.Tensor, rows: np.ndarray[Any, Any], t: int, table: torch.Tensor
) -> None:
    """``out`` ``(n, ...)`` from uint8 ``rows`` ``(n, 3, k)``: each value through its
    channel's table, each channel's plane ``t`` times a row."""
    idx = torch.from_numpy(rows).to(torch.int32)
    planes = out.view(idx.shape[0], 3, t, idx.shape[2])
    for c in range(3):
        values = table[c][idx[:, c]]
        for k in range(t):
            planes[:, c, k].copy_(values)


def tiles_of(canvas: np.ndarray[Any, Any], tile: tuple[int, int]) -> np.ndarray[Any, Any]:
    """A uint8 canvas ``(3, H, W)`` of whole ``(h, w)`` tiles as ``(tiles, 3, h·w)``, left
    to right, top to bottom."""
    th, tw = tile
    _, hh, ww = canvas.shape
    grid = canvas.reshape(3, hh // th, th, ww // tw, tw).transpose(1, 3, 0, 2, 4)
    return np.ascontiguousarray(grid).reshape(-1, 3, th * tw)


def _tiles_into(
    pixels: np.ndarray[Any, Any], spec: PreprocessSpec, out: torch.Tensor, table: torch.Tensor
) -> None:
    """The rows of a ``tiled`` spec's image (1 or 3 channels): each of its regions resized
    whole with the family's filter and cut into tiles, one after another."""
    th, tw = spec.row_shape[1:]
    resample = _RESAMPLE[resample_filter(spec)]
    row = 0
    for r in regions_of(spec):
        box = np.ascontiguousarray(pixels[r.y : r.y + r.height, r.x : r.x + r.width])
        canvas = np.empty((3, r.out_height, r.out_width), np.uint8)
        canvas[:] = np.moveaxis(_resize(box, r.out_width, r.out_height, resample), -1, 0)
        n = (r.out_height // th) * (r.out_width // tw)
        _normalise_into(out[row : row + n], tiles_of(canvas, (th, tw)), 1, table)
        row += n


def produce(pixels: np.ndarray[Any, Any], spec: PreprocessSpec, out: torch.Tensor) -> Grid:
    """Run the pipeline for one image into ``out`` (``(patches, *row_shape)``); its grid."""
    if pixels.shape[2] == 4 and spec.alpha == "white":
        raise MaterializeError("an RGBA image for a processor that composites on the producer")
    p = spec.patch_size
    plan = spec.plan
    grid = plan.grid if tiled(spec) else Grid((1, plan.padded_height // p, plan.padded_width // p))
    if out.shape[0] != grid.patches or tuple(out.shape[1:]) != spec.row_shape:
        raise MaterializeError(
            f"output has shape {list(out.shape)}, the image needs {grid.patches} rows of "
            f"{list(spec.row_shape)}"
        )
    table = table_of(normalisation_of(spec), out.dtype)
    if tiled(spec):
        _tiles_into(pixels, spec, out, table)
    else:
        patchify_into(out, canvas_of(pixels, spec), spec, table)
    return grid


def preprocess_images(
    images: Sequence[Any],
    preprocess: ModelSpec | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    compute: Literal["auto", "cpu", "cuda"] = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole pipeline for a list of images: ``(pixel_values, grid_thw)``.

    ``preprocess`` is the family's spec (``spec_for(family, params)``; default Kimi-K2.5).
    ``pixel_values`` is ``(Σ patches, *row_shape)`` in ``dtype`` (``(3, p, p)`` rows for
    Kimi, ``(3·T·p·p,)`` for Qwen-VL, as their reference processors return), allocated
    once, images concatenated in order; ``grid_thw`` is ``(N, 3)`` int64. The producer's
    eager path and the owner's deferred path both run this, so they agree bit for bit. On a
    CUDA ``device``, ``compute="cuda"`` (``"auto"``'s choice when CuPy is installed)
    uploads the uint8 pixels once and runs ``mmwire.kernels``; ``"cpu"`` computes here and
    uploads the result. Both give the same bytes. A family the kernels do not run yet
    (``KERNEL_PROCESSORS``) is computed here and uploaded. An image the family
    refuses (Qwen-VL: an aspect ratio over 200) raises ``MaterializeError``.
    """

    cfg: ModelSpec = preprocess or KimiConfig()
    pixels = [to_pixels(im, max_pixels=cfg.max_input_pixels, alpha=cfg.alpha) for im in images]
    specs = [cfg(px.shape[1], px.shape[0]) for px in pixels]
    on_kernels = all(s.processor in KERNEL_PROCESSORS for s in specs)
    if pixels and on_kernels and resolve_compute(compute, torch.device(device)) == "cuda":
        from mmwire.kernels import preprocess_packed, preprocess_regions, to_device

        flat = np.concatenate([px.reshape(-1) for px in pixels])
        src = torch.from_numpy(flat).to(device)
        shapes = [(px.shape[0], px.shape[1], px.shape[2]) for px in pixels]
        if not tiled(specs[0]):
            return preprocess_packed(src, shapes, specs, dtype)
        rows = sum(s.plan.grid.patches for s in specs)
        out = torch.empty((rows, *cfg.row_shape), dtype=dtype, device=src.device)
        regions = [regions_of(s) for s in specs]
        preprocess_regions(src, shapes, specs, regions, out)
        return out, to_device([s.plan.grid.thw for s in specs], src.device)
    total = sum(s.plan.grid.patches for s in specs)
    out = torch.empty((total, *cfg.row_shape), dtype=dtype)
    grids = torch.empty((len(specs), 3), dtype=torch.int64)
    row = 0
    for i, (px, spec) in enumerate(zip(pixels, specs)):
        n = spec.plan.grid.patches
        grid = produce(px, spec, out[row : row + n])
        grids[i] = torch.tensor(grid.thw)
        row += n
    return out.to(device), grids.to(device)
