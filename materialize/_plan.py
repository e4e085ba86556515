"""The plan a spec's own limits give its image: how the owner checks a spec it received."""

from __future__ import annotations

from mmwire.transport import PreprocessSpec, ResizePlan

from ._gemma import plan_whole_resize
from ._glm import plan_glm_resize
from ._internvl import plan_tiles
from ._kimi import plan_resize
from ._qwen import plan_smart_resize

__all__ = ["expected_plan"]


def expected_plan(spec: PreprocessSpec) -> ResizePlan:
    """The plan a ``plan.width x plan.height`` image gets under the spec's own limits."""
    if spec.processor == "gemma3":  # its limit is the target size itself (bounded by the schema)
        plan = spec.plan
        return plan_whole_resize(
            plan.width,
            plan.height,
            new_width=plan.new_width,
            new_height=plan.new_height,
            tokens=max(1, plan.tokens // plan.grid.patches),
            pan=spec.pan_and_scan,
        )
    if spec.processor == "internvl" and spec.tile is not None:
        n = spec.plan.grid.patches  # tokens: the spec's own count a row, checked positive
        return plan_tiles(
            spec.plan.width,
            spec.plan.height,
            tile=spec.tile,
            tiles=spec.tiles,
            tokens_per_tile=max(1, spec.plan.tokens // n),
        )
    mh, mw = spec.merge_kernel
    if mh != mw:
        raise ValueError(f"a square merge kernel is needed to plan, got {[mh, mw]}")
    if spec.windowed:
        lo, hi = spec.min_pixels, spec.max_pixels
        if lo is None or hi is None:  # the schema refuses these
            raise ValueError(f"a {spec.processor} spec needs min_pixels and max_pixels")
        if spec.processor == "glm4v":
            return plan_glm_resize(
                spec.plan.width,
                spec.plan.height,
                patch_size=spec.patch_size,
                merge_size=mh,
                temporal_patch_size=spec.temporal_patch_size,
                min_pixels=lo,
                max_pixels=hi,
            )
        return plan_smart_resize(
            spec.plan.width,
            spec.plan.height,
            patch_size=spec.patch_size,
            merge_size=mh,
            min_pixels=lo,
            max_pixels=hi,
        )
    return plan_resize(
        spec.plan.width,
        spec.plan.height,
        patch_size=spec.patch_size,
        merge_kernel_size=mh,
        in_patch_limit=spec.in_patch_limit,
        patch_limit_on_one_side=spec.patch_limit_on_one_side,
        fixed_output_tokens=spec.fixed_output_tokens,
    )
