"""The regions of an image whose family's rows are whole tiles: what the CPU path and the
kernels both resize and cut (``mmwire.kernels.Region``).

* InternVL: the image resized to its grid of tiles, then, with more than one tile, the
  image resized to one tile (the thumbnail).
* Gemma 3: the image resized to the target, then each pan-and-scan crop resized alike.
"""

from __future__ import annotations

from mmwire.kernels import Region
from mmwire.kernels.reference import rows_are_tiles as tiled
from mmwire.transport import PreprocessSpec
from mmwire.transport.errors import MaterializeError

from ._gemma import pan_and_scan_crops

__all__ = ["regions_of", "tiled"]


def regions_of(spec: PreprocessSpec) -> list[Region]:
    """The regions of a ``tiled`` spec's image, in row order; together they make the plan's
    rows (``MaterializeError`` where they do not)."""
    plan = spec.plan
    w, h = plan.width, plan.height
    whole = Region(0, 0, w, h, plan.new_width, plan.new_height)
    th, tw = spec.row_shape[1:]
    if spec.processor == "gemma3":
        crops = pan_and_scan_crops(w, h, spec.pan_and_scan)
        size = (plan.new_width, plan.new_height)
        regions = [whole] + [Region(x, y, cw, ch, *size) for x, y, cw, ch in crops]
    elif spec.processor == "internvl":
        tiles = (plan.new_width // tw) * (plan.new_height // th)
        regions = [whole] + ([Region(0, 0, w, h, tw, th)] if tiles > 1 else [])
    else:
        raise MaterializeError(f"the {spec.processor} processor's rows are patches, not tiles")
    rows = sum((r.out_width // tw) * (r.out_height // th) for r in regions)
    if rows != plan.grid.patches:
        raise MaterializeError(f"the image makes {rows} rows, its plan {plan.grid.patches}")
    return regions
